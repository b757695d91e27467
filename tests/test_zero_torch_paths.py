"""DeepSpeed ZeRO checkpoints through every torch path: ``dcp.load`` of the save dir or the tag
folder (fp32 and bf16 destinations), ``convert --to dcp``, a damaged rank named before anything is
written, and block reads that gather only the rows asked for.

Fixtures and references: ``fixtures/deepspeed_zero`` (DeepSpeed 0.19.8's own ``save_checkpoint``;
``fp32`` is its own ``get_fp32_state_dict_from_zero_checkpoint``, ``module`` the engine's 16-bit
weights, which are the masters rounded by torch's ``.to()``). The same under several ranks
(FSDP2, each rank its rows) is ``case_zero3_into_fsdp2`` of ``tests/workers/dcp_worker.py``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptshim  # noqa: F401  (attaches the hooks)
from ckptshim.cli import main
from ckptshim.errors import CorruptCheckpointError
from ckptshim.formats.detect import open_checkpoint
from support.fixtures import FIXTURES, array_sha256, copy_fixture, fixture_module

ZERO = FIXTURES / "deepspeed_zero"
MANIFEST = json.loads((ZERO / "manifest.json").read_text())
REFERENCE = {row["key"]: row for row in MANIFEST["keys"]}
TAG = "global_step2"
build_model = fixture_module("deepspeed_zero/produce.py").build_model


def _sha(tensor: torch.Tensor) -> str:
    tensor = tensor.detach()
    return array_sha256((tensor.view(torch.uint16) if tensor.dtype == torch.bfloat16 else tensor).numpy())


def _assert_fp32_reference(state: dict[str, torch.Tensor], variant: str) -> None:
    """Each tensor is DeepSpeed's value (a frozen bf16 one widened into a float32 destination)."""
    for name, tensor in state.items():
        expected = REFERENCE[f"{variant}/fp32/{name}"]
        stored = getattr(torch, expected["dtype"])
        assert torch.equal(tensor.to(stored).to(tensor.dtype), tensor), name  # nothing lost by the widening
        assert (list(tensor.shape), _sha(tensor.to(stored))) == (expected["shape"], expected["sha256"]), name


@pytest.mark.parametrize("variant", ["ws3/zero2_bf16", "ws2/zero3_bf16", "ws3/zero3_fp32"])
def test_dcp_load_of_the_tag_folder_gets_deepspeeds_fp32_state_dict(variant: str) -> None:
    state = build_model().state_dict()
    dcp.load(state, checkpoint_id=ZERO / variant / TAG)
    _assert_fp32_reference(state, variant)


@pytest.mark.parametrize("variant", ["ws3/zero2_bf16", "ws2/zero3_bf16", "ws2/zero1_bf16"])
def test_bf16_destination_gets_the_masters_rounded_as_torch_rounds(variant: str) -> None:
    """Each trainable parameter equals DeepSpeed's own bf16 training weight (the engine's module,
    which is its master rounded by ``.to()``); the rest the fp32 state dict cast by ``.to()``."""
    model = build_model().to(torch.bfloat16)
    if variant.endswith("zero1_bf16"):  # ZeRO-1 saves no frozen fragments (nor does zero_to_fp32 give them)
        model.frozen = torch.nn.Identity()
    state = model.state_dict()
    dcp.load(state, checkpoint_id=ZERO / variant)
    stored = _read_all(variant)
    trainable = {"embed.weight", "head.weight", "proj.weight", "proj.bias", "norm.weight", "norm.bias",
                 "out.weight", "out.bias"}
    for name, tensor in state.items():
        assert tensor.dtype == (torch.int64 if name == "seen" else torch.bfloat16), name
        if name in trainable:
            assert _sha(tensor) == REFERENCE[f"{variant}/module/{name}"]["sha256"], name
        else:
            assert torch.equal(tensor, stored[name].to(tensor.dtype)), name


def _read_all(variant: str) -> dict[str, torch.Tensor]:
    """The reader's state dict (DeepSpeed's own, bit for bit: test_formats_deepspeed_zero), as tensors."""
    checkpoint = open_checkpoint(ZERO / variant)
    try:
        return {".".join(key): torch.from_numpy(np.array(checkpoint.read(entry))).view(getattr(torch, entry.dtype))
                for key, entry in checkpoint.inventory.items()}
    finally:
        checkpoint.close()


def test_zero2_summary_says_the_masters_were_read_not_the_bf16_module(caplog) -> None:
    state = build_model().state_dict()
    with caplog.at_level(logging.INFO, logger="ckptshim"):
        dcp.load(state, checkpoint_id=ZERO / "ws2" / "zero2_bf16")
    said = [r.getMessage() for r in caplog.records if "deepspeed-zero checkpoint" in r.getMessage()]
    assert len(said) == 1, said
    assert ("ZeRO-2, dp=2, bf16 training; 7 trainable parameters as fp32 masters from the optimizer partitions, "
            "not the bf16 module weights also in mp_rank_00_model_states.pt") in said[0]
    assert "which DCP cannot read; ckptshim reads it" in said[0]


@pytest.mark.parametrize("variant", ["ws3/zero2_fp32", "ws2/zero3_bf16"])
def test_missing_rank_file_is_named_and_the_destination_is_untouched(variant: str, tmp_path: Path) -> None:
    root = copy_fixture(f"deepspeed_zero/{variant}", tmp_path, "ckpt")
    name = ("bf16_" if variant.endswith("bf16") else "") + "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    (root / TAG / name).unlink()
    state = build_model().state_dict()
    before = {key: value.clone() for key, value in state.items()}
    with pytest.raises(BaseException, match=f"{name}: missing") as raised:
        dcp.load(state, checkpoint_id=root)
    assert isinstance(raised.value, (CorruptCheckpointError, dcp.api.CheckpointException)), raised.value
    assert all(torch.equal(state[key], before[key]) for key in state)


def test_short_rank_file_is_named_and_the_destination_is_untouched(tmp_path: Path) -> None:
    root = copy_fixture("deepspeed_zero/ws3/zero3_fp32", tmp_path, "ckpt")
    file = root / TAG / "zero_pp_rank_2_mp_rank_00_optim_states.pt"
    file.write_bytes(file.read_bytes()[:-700])
    state = build_model().state_dict()
    before = {key: value.clone() for key, value in state.items()}
    with pytest.raises(BaseException, match="zero_pp_rank_2_mp_rank_00_optim_states.pt"):
        dcp.load(state, checkpoint_id=root)
    assert all(torch.equal(state[key], before[key]) for key in state)


@pytest.mark.parametrize("variant", ["ws2/zero2_bf16", "ws3/zero3_fp32"])
def test_convert_to_dcp_is_zero_to_fp32_bit_for_bit(variant: str, tmp_path: Path) -> None:
    """The safe zero_to_fp32.py: a DCP folder that DCP itself reads (ckptshim steps aside: names fit)."""
    assert main(["convert", str(ZERO / variant), str(tmp_path / "out"), "--to", "dcp", "--no-progress"]) == 0
    assert (tmp_path / "out" / ".metadata").is_file()
    state = {name: torch.empty(row["shape"], dtype=getattr(torch, row["dtype"]))
             for name in MANIFEST["layout"][variant]["fp32_order"]
             for row in (REFERENCE[f"{variant}/fp32/{name}"],)}
    dcp.load(state, checkpoint_id=tmp_path / "out")
    _assert_fp32_reference(state, variant)


@pytest.mark.parametrize("variant", ["ws3/zero2_fp32", "ws3/zero3_bf16", "ws2/zero1_fp32"])
def test_blocks_of_rows_gather_only_those_rows(variant: str) -> None:
    """Every row range of every master read alone is that range of the whole master, and the
    partitions touched are only those holding its elements."""
    checkpoint = open_checkpoint(ZERO / variant)
    touched: list[tuple[int, int]] = []
    for name, slot in checkpoint.slots.items():
        entry = checkpoint.inventory[tuple(name.split("."))]
        whole = np.array(checkpoint.read(entry))
        rows = slot.shape[0]
        for first in range(rows):
            for last in range(first + 1, rows + 1):
                out = np.empty((last - first, *slot.shape[1:]), np.float32)
                checkpoint.read_into(entry, (slice(first, last), *(slice(0, n) for n in slot.shape[1:])), out)
                assert out.tobytes() == whole[first:last].tobytes(), (name, first, last)
        if len(slot.shape) == 2:  # a block of columns too (a tensor-parallel shard's)
            out = np.empty((rows, 2), np.float32)
            checkpoint.read_into(entry, (slice(0, rows), slice(1, 3)), out)
            assert out.tobytes() == np.ascontiguousarray(whole[:, 1:3]).tobytes(), name
    original = type(checkpoint.ranks[0].fp32[0]).copy

    def spy(flat, start, stop, out):
        touched.append((id(flat), stop - start))
        return original(flat, start, stop, out)

    slot = checkpoint.slots["out.weight"]  # [7, 13]: its first row alone
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(checkpoint.ranks[0].fp32[0]), "copy", spy)
        out = np.empty((1, 13), np.float32)
        checkpoint.read_into(checkpoint.inventory[("out", "weight")], (slice(0, 1), slice(0, 13)), out)
    assert sum(n for _, n in touched) == 13 < slot.numel  # 13 elements copied, not the parameter's 91
    checkpoint.close()
