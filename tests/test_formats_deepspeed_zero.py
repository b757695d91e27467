"""DeepSpeed ZeRO checkpoints (stages 1-3, fp32 and bf16, dp 2 and 3): inventory, bit-exact
masters and moments, convert, completeness, precedence over the pipeline reader, bad input.

Fixtures: ``fixtures/deepspeed_zero/ws<N>/zero<S>_<dtype>`` written by DeepSpeed 0.19.8's own
``engine.save_checkpoint`` on CPU/gloo; the manifest hashes what DeepSpeed's own
``get_fp32_state_dict_from_zero_checkpoint`` returns for each, and each parameter's master and
Adam moments gathered from the live engine (see the fixture's README).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from ckptshim.cli import main
from ckptshim.errors import CorruptCheckpointError, UnsafeCheckpointError
from ckptshim.formats import deepspeed_pipeline, deepspeed_zero, torch_pickle
from ckptshim.formats.detect import FORMATS, detect, open_checkpoint
from ckptshim.inventory import join_key
from support.fixtures import FIXTURES, array_sha256, copy_fixture

ZERO = FIXTURES / "deepspeed_zero"
MANIFEST = json.loads((ZERO / "manifest.json").read_text())
VARIANTS = tuple(MANIFEST["layout"])
REFERENCE = {row["key"]: row for row in MANIFEST["keys"]}
TAG = "global_step2"


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_parameter_is_deepspeeds_own_fp32_state_dict(variant: str) -> None:
    """Names, order, dtypes, shapes and every value as ``get_fp32_state_dict_from_zero_checkpoint``."""
    layout = MANIFEST["layout"][variant]
    assert detect(ZERO / variant) is deepspeed_zero
    checkpoint = open_checkpoint(ZERO / variant)
    assert checkpoint.complete, checkpoint.all_problems()
    assert [join_key(key) for key in checkpoint.inventory] == layout["fp32_order"]
    for key, entry in checkpoint.inventory.items():
        expected = REFERENCE[f"{variant}/fp32/{join_key(key)}"]
        value = checkpoint.read(entry)
        assert (entry.dtype, list(entry.shape), list(value.shape)) == (expected["dtype"], expected["shape"],
                                                                        expected["shape"]), key
        assert array_sha256(value) == expected["sha256"], key
    assert f"ZeRO-{layout['zero_stage']}" in checkpoint.version and f"dp={layout['dp_world_size']}" in checkpoint.version
    checkpoint.close()


def _assert_masters_and_moments_are_the_engines(checkpoint: deepspeed_zero.ZeroCheckpoint, variant: str) -> None:
    """Every trainable parameter's master and Adam moments as the live engine gathered them."""
    for name in checkpoint.slots:
        assert array_sha256(checkpoint.read(checkpoint.inventory[tuple(name.split("."))])) == \
            REFERENCE[f"{variant}/master/{name}"]["sha256"]
        for state in deepspeed_zero.MOMENTS:
            assert array_sha256(checkpoint.read_optimizer_state(name, state)) == \
                REFERENCE[f"{variant}/{state}/{name}"]["sha256"], (name, state)


@pytest.mark.parametrize("variant", VARIANTS)
def test_masters_and_adam_moments_are_the_engines(variant: str) -> None:
    """Each trainable parameter's master and moments, assembled from the partitions, equal what
    DeepSpeed's ``safe_get_full_fp32_param``/``safe_get_full_optimizer_state`` gathered."""
    checkpoint = open_checkpoint(ZERO / variant)
    assert set(checkpoint.slots) == {"embed.weight", "proj.weight", "proj.bias", "norm.weight", "norm.bias",
                                     "out.weight", "out.bias"}
    _assert_masters_and_moments_are_the_engines(checkpoint, variant)
    assert {float(rank.step.storage.numel) for rank in checkpoint.ranks.values()} == {1.0}  # a 0-d tensor


@pytest.mark.parametrize("variant", ["ws2/zero3_fp32", "ws3/zero2_bf16", "ws3/zero1_fp32"])
def test_masters_and_moments_are_read_without_mapping_the_files(variant: str, monkeypatch) -> None:
    """Masters and moments are read from the partitions into their places (``pread``), never
    through a memory map of the rank files, whose touched pages would stay resident beside the
    destination (``bench/bench_zero.py``: a load's peak is the model's bytes, not twice them)."""
    checkpoint = open_checkpoint(ZERO / variant)

    def mapped(self, entry):
        raise AssertionError(f"{self.path} was memory-mapped")
    monkeypatch.setattr(torch_pickle.TorchPickleCheckpoint, "read", mapped)
    _assert_masters_and_moments_are_the_engines(checkpoint, variant)


@pytest.mark.parametrize("variant", VARIANTS)
def test_any_element_range_reads_as_the_whole_parameter_cut(variant: str, monkeypatch) -> None:
    """``read_elements`` (what a resume at another world size re-cuts with) gives any range of a
    parameter's master or moment as the assembled parameter has it, zeros past its end, and
    reads only the partitions holding the range."""
    checkpoint = open_checkpoint(ZERO / variant)
    for name, slot in checkpoint.slots.items():
        for state in (None, *deepspeed_zero.MOMENTS):
            whole = (checkpoint.read(checkpoint.inventory[tuple(name.split("."))]) if state is None else
                     checkpoint.read_optimizer_state(name, state)).reshape(-1)
            padded = np.concatenate([whole, np.zeros(7, np.float32)])
            for start, stop in ((0, slot.numel), (1, slot.numel - 1), (slot.numel // 2, slot.numel + 7),
                                (slot.numel - 1, slot.numel), (slot.numel, slot.numel + 3), (3, 3)):
                assert checkpoint.read_elements(name, state, start, stop).tobytes() == \
                    padded[start:stop].tobytes(), (name, state, start, stop)
    files: list[str] = []
    copy = deepspeed_zero.Flat.copy
    monkeypatch.setattr(deepspeed_zero.Flat, "copy", lambda self, *a: files.append(self.part.path) or copy(self, *a))
    name, slot = next(iter(checkpoint.slots.items()))
    first = -(-slot.numel // checkpoint.world) if checkpoint.stage == 3 else \
        min(slot.numel, checkpoint.ranks[0].fp32[slot.group].numel - slot.offset)
    checkpoint.read_elements(name, "exp_avg", 0, first)  # rank 0's part of the parameter
    assert {Path(file).name for file in files} == {checkpoint.ranks[0].file.name}


@pytest.mark.parametrize("variant", VARIANTS)
def test_engine_module_is_the_masters_rounded_as_torch_rounds(variant: str) -> None:
    """The engine's own (16-bit under bf16) module weights are the masters cast by torch's ``.to()``:
    what a 16-bit destination gets from the masters."""
    checkpoint = open_checkpoint(ZERO / variant)
    for name in checkpoint.slots:
        module = REFERENCE[f"{variant}/module/{name}"]
        master = torch.from_numpy(np.array(checkpoint.read(checkpoint.inventory[tuple(name.split("."))])))
        cast = master.to(getattr(torch, module["dtype"]))
        assert array_sha256((cast.view(torch.uint16) if cast.dtype == torch.bfloat16 else cast).numpy()) == \
            module["sha256"], name


def test_tied_frozen_and_buffers_as_deepspeed_gives_them() -> None:
    checkpoint = open_checkpoint(ZERO / "ws3" / "zero3_bf16")
    inventory = checkpoint.inventory
    head, embed = inventory[("head", "weight")], inventory[("embed", "weight")]
    assert head.location == embed.location  # the tied name reads its partner's master
    assert inventory[("frozen", "weight")].dtype == "bfloat16"  # as zero_to_fp32 returns it
    assert inventory[("scale",)].dtype == "float32" and inventory[("seen",)].dtype == "int64"
    assert ("scratch",) not in inventory  # non-persistent: never saved
    stage1 = open_checkpoint(ZERO / "ws2" / "zero1_fp32").inventory
    assert ("frozen", "weight") not in stage1  # ZeRO-1 saves no frozen fragments; nor does zero_to_fp32 give them


def test_save_dir_and_tag_folder_read_the_same(tmp_path: Path) -> None:
    save_dir, tag = ZERO / "ws2" / "zero2_fp32", ZERO / "ws2" / "zero2_fp32" / TAG
    assert deepspeed_zero.sniff(save_dir) and deepspeed_zero.sniff(tag)
    a, b = open_checkpoint(save_dir), open_checkpoint(tag)
    assert list(a.inventory.values()) == list(b.inventory.values())


def test_inspect_lists_logical_parameters(capsys) -> None:
    assert main(["inspect", str(ZERO / "ws3" / "zero3_fp32")]) == 0
    out = capsys.readouterr().out
    assert "deepspeed-zero" in out and "ZeRO-3, dp=3" in out and "12 arrays" in out
    assert "head.weight" in out and "(11, 7)" in out and "frozen.bias" in out
    assert "(0,)" not in out  # no ZeRO-3 placeholders
    assert "piece 2 of 3" in out  # what each rank's file holds
    assert "complete" in out.splitlines()[-1]


@pytest.mark.parametrize("variant", ["ws3/zero2_bf16", "ws2/zero3_bf16", "ws3/zero1_fp32"])
def test_convert_to_safetensors_is_zero_to_fp32_bit_for_bit(variant: str, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    assert main(["convert", str(ZERO / variant), str(tmp_path / "out"), "--to", "safetensors",
                 "--no-progress"]) == 0
    written = {}
    for file in sorted((tmp_path / "out").glob("*.safetensors")):
        written.update(load_file(file))
    assert sorted(written) == sorted(MANIFEST["layout"][variant]["fp32_order"])
    for name, value in written.items():
        expected = REFERENCE[f"{variant}/fp32/{name}"]
        raw = value.view(torch.uint16) if value.dtype == torch.bfloat16 else value
        assert (str(value.dtype), list(value.shape), array_sha256(raw.numpy())) == \
            (f"torch.{expected['dtype']}", expected["shape"], expected["sha256"]), name


# -- completeness: named before anything is read ----------------------------------------------------

def _copy(variant: str, tmp_path: Path) -> Path:
    return copy_fixture(f"deepspeed_zero/{variant}", tmp_path, variant.replace("/", "_"))


@pytest.mark.parametrize("variant", ["ws3/zero2_fp32", "ws3/zero3_bf16"])
def test_missing_rank_file_is_named_and_nothing_is_written(variant: str, tmp_path: Path, capsys) -> None:
    root = _copy(variant, tmp_path)
    prefix = "bf16_" if variant.endswith("bf16") else ""
    (root / TAG / f"{prefix}zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    checkpoint = open_checkpoint(root)
    problems = checkpoint.all_problems()
    assert problems == [f"{prefix}zero_pp_rank_1_mp_rank_00_optim_states.pt: missing"], problems
    with pytest.raises(CorruptCheckpointError, match="zero_pp_rank_1_mp_rank_00_optim_states.pt: missing"):
        checkpoint.require_complete()
    with pytest.raises(CorruptCheckpointError, match="rank"):
        checkpoint.read(checkpoint.inventory[("embed", "weight")])
    assert main(["inspect", str(root)]) == 1
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt: missing; costs" in capsys.readouterr().out
    assert main(["convert", str(root), str(tmp_path / "out"), "--to", "safetensors", "--no-progress"]) == 1
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt: missing" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_truncated_rank_file_is_named(tmp_path: Path, capsys) -> None:
    root = _copy("ws2/zero2_bf16", tmp_path)
    file = root / TAG / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    file.write_bytes(file.read_bytes()[:3000])
    problems = open_checkpoint(root).all_problems()
    assert any("bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt" in p and "truncated" in p for p in problems), problems
    assert main(["inspect", str(root)]) == 1
    assert "bf16_zero_pp_rank_0" in capsys.readouterr().out


def test_rank_files_are_checked_against_dp_world_size(tmp_path: Path) -> None:
    """A rank beyond dp_world_size (another run's file), and ZeRO-3 model states of a lost rank."""
    root = _copy("ws2/zero3_fp32", tmp_path)
    shutil.copy(root / TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt",
                root / TAG / "zero_pp_rank_2_mp_rank_00_optim_states.pt")
    (root / TAG / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
    problems = open_checkpoint(root).all_problems()
    assert any("zero_pp_rank_2_mp_rank_00_optim_states.pt: data-parallel rank 2" in p and "2 ranks" in p
               for p in problems), problems
    assert "zero_pp_rank_1_mp_rank_00_model_states.pt: missing" in problems  # its frozen pieces are lost


def test_partitions_of_other_shapes_are_refused(tmp_path: Path) -> None:
    """Model states of another run beside these partitions: sizes disagree, from metadata alone."""
    root = _copy("ws2/zero2_fp32", tmp_path)
    state = torch.load(root / TAG / "mp_rank_00_model_states.pt", weights_only=False)
    state["param_shapes"][0]["out.weight"] = torch.Size([7, 15])
    torch.save(state, root / TAG / "mp_rank_00_model_states.pt")
    problems = open_checkpoint(root).all_problems()
    assert any("group 0: its parameters need 319 elements" in p for p in problems), problems


# -- precedence over the GPT-NeoX pipeline reader --------------------------------------------------

def test_zero_wins_over_the_pipeline_reader_for_mp_rank_files() -> None:
    """Both recognise a ZeRO-1/2 folder (its ``mp_rank_00_model_states.pt``); ZeRO is tried first,
    since that file's module holds the 16-bit weights and the masters are in the partitions."""
    folder = ZERO / "ws2" / "zero2_bf16"
    assert deepspeed_pipeline.sniff(folder) and deepspeed_zero.sniff(folder)
    assert FORMATS.index(deepspeed_zero) < FORMATS.index(deepspeed_pipeline)
    assert detect(folder) is deepspeed_zero and detect(folder, backend="torch") is deepspeed_zero
    assert open_checkpoint(folder).inventory[("proj", "weight")].dtype == "float32"


def test_pipeline_layer_files_stay_the_pipeline_readers(tmp_path: Path) -> None:
    """A pipeline engine's folder (layer files) with ZeRO partitions beside them is NeoX's."""
    root = copy_fixture("neox_deepspeed/pp1_mp1/checkpoint", tmp_path, "neox")
    shutil.copy(ZERO / "ws2" / "zero1_fp32" / TAG / "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                root / "global_step0" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    assert not deepspeed_zero.sniff(root)
    assert detect(root) is deepspeed_pipeline


def test_several_model_parallel_ranks_are_not_read_as_one(tmp_path: Path) -> None:
    """Partitions of two model-parallel ranks are tensor-parallel shards: not this reader's."""
    root = _copy("ws2/zero1_fp32", tmp_path)
    for rank in range(2):
        shutil.copy(root / TAG / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
                    root / TAG / f"zero_pp_rank_{rank}_mp_rank_01_optim_states.pt")
    assert not deepspeed_zero.sniff(root)


# -- the allow-list: DeepSpeed's objects, for these files only -------------------------------------

def _optimizer_file(root: Path) -> Path:
    return root / TAG / "zero_pp_rank_0_mp_rank_00_optim_states.pt"


def test_deepspeed_globals_are_inert_data() -> None:
    with open(_optimizer_file(ZERO / "ws2" / "zero2_fp32"), "rb") as raw:
        tree = torch_pickle.read_archive(raw, "rank 0", deepspeed_zero.ZERO_GLOBALS).tree
    optimizer = tree["optimizer_state_dict"]
    assert optimizer["zero_stage"] == 2 and type(optimizer["zero_stage"]) is int
    assert optimizer["loss_scaler"] == {"cur_scale": 1.0, "dynamic": False}
    assert optimizer["param_slice_mappings"][0]["embed.weight"] == {"numel": 77, "start": 0}


def test_other_deepspeed_global_is_refused_by_name(tmp_path: Path) -> None:
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    root = _copy("ws2/zero2_fp32", tmp_path)
    state = torch.load(_optimizer_file(root), weights_only=False)
    state["optimizer_state_dict"]["offload"] = OffloadDeviceEnum.cpu
    torch.save(state, _optimizer_file(root))
    with pytest.raises(UnsafeCheckpointError, match="needs deepspeed.runtime.zero.offload_config.OffloadDeviceEnum to"):
        open_checkpoint(root)  # a refusal is final: not a problem to list and read around


def test_model_states_needing_more_are_refused(tmp_path: Path) -> None:
    """A global neither torch's weights_only list nor the DeepSpeed extras admit is refused by name."""
    import fractions

    root = _copy("ws2/zero2_fp32", tmp_path)
    state = torch.load(root / TAG / "mp_rank_00_model_states.pt", weights_only=False)
    state["client_state"] = fractions.Fraction(1, 3)
    torch.save(state, root / TAG / "mp_rank_00_model_states.pt")
    with pytest.raises(UnsafeCheckpointError, match="fractions.Fraction"):
        open_checkpoint(root)


class _Reduced:
    """Pickles as ``callable(*args)``: a DeepSpeed global given arguments DeepSpeed never writes."""

    def __init__(self, callable_, args) -> None:
        self.callable, self.args = callable_, args

    def __reduce__(self):
        return self.callable, self.args


def test_allowed_globals_refuse_what_deepspeed_never_writes(tmp_path: Path) -> None:
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    for bad, why in ((_Reduced(ZeroStageEnum, (7,)), "ZeroStageEnum"), (_Reduced(LossScaler, (1.0,)), "argument"),
                     (_Reduced(torch.Size, ([3, -1],)), "torch.Size")):
        file = tmp_path / "rank.pt"
        torch.save({"optimizer_state_dict": {"x": bad}}, file)
        with pytest.raises(CorruptCheckpointError, match=why), open(file, "rb") as raw:
            torch_pickle.read_archive(raw, str(file), deepspeed_zero.ZERO_GLOBALS)


def test_zero_globals_are_allowed_in_zero_files_only(tmp_path: Path) -> None:
    """A plain torch.save file naming ZeroStageEnum is refused as torch.load(weights_only=True) refuses it."""
    from deepspeed.runtime.zero.config import ZeroStageEnum

    torch.save({"w": torch.ones(2), "stage": ZeroStageEnum.weights}, tmp_path / "plain.pt")
    with pytest.raises(UnsafeCheckpointError, match="ZeroStageEnum"):
        torch_pickle.open_checkpoint(tmp_path / "plain.pt")


def test_two_files_for_one_rank_are_named(tmp_path: Path) -> None:
    root = _copy("ws2/zero1_bf16", tmp_path)
    shutil.copy(root / TAG / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
                root / TAG / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    problems = open_checkpoint(root).all_problems()
    assert any("mix bf16_zero_pp_rank_* and zero_pp_rank_*" in p for p in problems), problems
    assert any("bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt and zero_pp_rank_0_mp_rank_00_optim_states.pt "
               "all hold data-parallel rank 0" in p for p in problems), problems


def test_latest_naming_a_folder_outside_is_not_followed(tmp_path: Path) -> None:
    root = _copy("ws2/zero2_fp32", tmp_path)
    (root / "latest").write_text("../elsewhere")
    shutil.copytree(root / TAG, tmp_path / "elsewhere")
    assert not deepspeed_zero.sniff(root)
    with pytest.raises(CorruptCheckpointError, match="not a folder inside"):
        open_checkpoint(root)


def test_rank_file_that_is_not_a_regular_file_is_refused_by_name_and_not_opened(tmp_path: Path) -> None:
    import os

    root = _copy("ws2/zero3_fp32", tmp_path)
    file = _optimizer_file(root).with_name("zero_pp_rank_1_mp_rank_00_optim_states.pt")
    file.unlink()
    os.mkfifo(file)  # opening it would block
    with pytest.raises(UnsafeCheckpointError, match=r"zero_pp_rank_1_mp_rank_00_optim_states\.pt is a named pipe"):
        open_checkpoint(root)  # the walk at open refuses it (Location.refuse_links_leaving)


@pytest.mark.parametrize("variant", ["ws2/zero2_fp32", "ws3/zero3_fp32"])
def test_dcp_load_of_the_save_dir_gets_the_masters(variant: str) -> None:
    """A torch format like any other: ``dcp.load`` of the save dir into the plain model's state
    dict (DCP alone fails: no .metadata) fills every tensor with DeepSpeed's own fp32 state dict."""
    import torch.distributed.checkpoint as dcp

    import ckptshim  # noqa: F401  (attaches the hooks)
    from support.fixtures import fixture_module

    state = fixture_module("deepspeed_zero/produce.py").build_model().state_dict()
    dcp.load(state, checkpoint_id=str(ZERO / variant))
    for name, tensor in state.items():
        assert array_sha256(tensor.numpy()) == REFERENCE[f"{variant}/fp32/{name}"]["sha256"], name
