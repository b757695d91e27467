"""One rank of the multi-process DCP test (run by tests/test_dcp_multirank.py under torchrun).

``python -m torch.distributed.run --nproc_per_node=2 tests/workers/dcp_worker.py OUT`` runs every case
on two gloo/CPU ranks and writes ``OUT/rank<N>.json``: case -> "ok" or what went wrong. Cases
load the single-process fixture (saved on one rank) into sharded, compiled models, save a
two-rank checkpoint for the test to read back in one process, and check that bad input fails
on every rank, before any rank's tensors change.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path

warnings.simplefilter("ignore")

import ckptshim  # noqa: E402,F401  (the hooks attach when torch.distributed.checkpoint is imported)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint import CheckpointException  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor, distribute_tensor  # noqa: E402
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: E402

from ckptshim.errors import ShimError  # noqa: E402
from support.fixtures import FIXTURES, fixture_module, writable_copy  # noqa: E402
from support.processes import run_rank_cases  # noqa: E402

FIXTURE = FIXTURES / "torch_dcp_single"
build = fixture_module("torch_dcp_single/dcp_tiny_model.py").build

REFERENCE = torch.load(FIXTURE / "torch_save" / "model.pt", weights_only=True)


def plain_key(key: str) -> str:
    return ".".join(part for part in key.split(".") if part != "_orig_mod")


def check_shards(state_dict: dict, mesh) -> None:
    """Each rank's local shard is exactly its slice of the reference value."""
    for key, value in state_dict.items():
        expected = REFERENCE[plain_key(key)]
        if isinstance(value, DTensor):
            local, expected = value.to_local(), distribute_tensor(expected, mesh, value.placements).to_local()
        else:
            local = value
        assert torch.equal(local, expected), f"{key}: local shard differs from its slice"


def fsdp2(seed: int, mesh):
    model = build(seed=seed)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def tensor_parallel(seed: int, mesh):
    model = build(seed=seed)
    plan = {}
    for i in range(len(model.layers)):
        plan.update({f"layers.{i}.qkv": ColwiseParallel(), f"layers.{i}.proj": RowwiseParallel(),
                     f"layers.{i}.fc1": ColwiseParallel(), f"layers.{i}.fc2": RowwiseParallel()})
    return parallelize_module(model, mesh, plan)


def case_fsdp2_compiled(mesh, out: Path) -> None:
    state_dict = torch.compile(fsdp2(11, mesh)).state_dict()
    assert any(isinstance(v, DTensor) for v in state_dict.values())
    dcp.load({"model": state_dict}, checkpoint_id=FIXTURE / "dcp_plain")
    check_shards(state_dict, mesh)


def case_tensor_parallel_compiled(mesh, out: Path) -> None:
    state_dict = torch.compile(tensor_parallel(12, mesh)).state_dict()
    assert isinstance(state_dict["_orig_mod.layers.0.qkv.weight"], DTensor)
    dcp.load({"model": state_dict}, checkpoint_id=FIXTURE / "dcp_compiled")
    check_shards(state_dict, mesh)


def case_save_two_ranks(mesh, out: Path) -> None:
    """A plain FSDP2 model's checkpoint, one file per rank, for the test to read in one process."""
    dcp.save({"model": fsdp2(0, mesh).state_dict()}, checkpoint_id=out / "fsdp2_plain")


def _copy(out: Path, name: str, source: Path) -> Path:
    """Rank 0 copies ``source`` to ``out/name``; every rank waits for the copy."""
    if dist.get_rank() == 0:
        writable_copy(source, out / name)
    dist.barrier()
    return out / name


def _expect_refusal(checkpoint: Path, mesh, model_seed: int = 13, build_model=fsdp2) -> list[str]:
    """Load, expect every rank's failure to be a ShimError and nothing changed; their messages."""
    state_dict = torch.compile(build_model(model_seed, mesh)).state_dict()
    before = {k: (v.to_local() if isinstance(v, DTensor) else v).clone() for k, v in state_dict.items()}
    try:
        dcp.load({"model": state_dict}, checkpoint_id=checkpoint)
    except CheckpointException as error:
        failures = list(error.failures.values())
        assert failures and all(isinstance(exc, ShimError) for exc, _ in failures), error
    else:
        raise AssertionError("the load did not fail")
    for key, value in state_dict.items():
        local = value.to_local() if isinstance(value, DTensor) else value
        assert torch.equal(local, before[key]), f"{key} changed although the load failed"
    return [str(exc) for exc, _ in failures]


def case_missing_file_of_one_rank(mesh, out: Path) -> None:
    """Only rank 1 reads ``__1_0.distcp``; rank 0 must fail too, and change nothing. How long
    the refusal took and what it said go to ``missing_rank1_rank<N>.json`` for the test to
    compare across ranks (a hang would take the process group's 60 s timeout)."""
    copy = _copy(out, "missing_rank1", out / "fsdp2_plain")
    if dist.get_rank() == 0:
        (copy / "__1_0.distcp").unlink()
    dist.barrier()
    start = time.monotonic()
    messages = _expect_refusal(copy, mesh)
    (out / f"missing_rank1_rank{dist.get_rank()}.json").write_text(
        json.dumps({"seconds": time.monotonic() - start, "messages": messages}))


def case_truncated_file(mesh, out: Path) -> None:
    copy = _copy(out, "truncated", FIXTURE / "dcp_plain")
    if dist.get_rank() == 0:
        data = (copy / "__0_0.distcp").read_bytes()
        (copy / "__0_0.distcp").write_bytes(data[: len(data) // 2])
    dist.barrier()
    _expect_refusal(copy, mesh, build_model=tensor_parallel)


class _Marker:
    """Pickles as a call that would create a folder; ckptshim must never make that call."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return os.mkdir, (str(self.path),)


def case_tampered_metadata(mesh, out: Path) -> None:
    copy = _copy(out, "tampered", FIXTURE / "dcp_plain")
    if dist.get_rank() == 0:
        metadata = dcp.FileSystemReader(FIXTURE / "dcp_plain").read_metadata()  # the trusted original
        metadata.planner_data["model.pos_emb"] = _Marker(out / "pwned")
        (copy / ".metadata").write_bytes(pickle.dumps(metadata))
    dist.barrier()
    _expect_refusal(copy, mesh)
    assert not (out / "pwned").exists(), "the tampered metadata ran code"


def case_shape_mismatch(mesh, out: Path) -> None:
    """No plan mends a shape: on every rank, DCP's own planner decides on the stored metadata --
    its own "missing key" (the compiled names are not stored), with ckptshim's diagnosis of the
    shape as a note -- and nothing is written."""
    model = torch.compile(fsdp2(13, mesh))
    model._orig_mod.lm_head.weight = torch.nn.Parameter(torch.zeros(300, 64))
    state_dict = model.state_dict()
    before = {k: (v.to_local() if isinstance(v, DTensor) else v).clone() for k, v in state_dict.items()}
    try:
        dcp.load({"model": state_dict}, checkpoint_id=FIXTURE / "dcp_plain")
    except CheckpointException as error:
        failures = [exc for exc, _ in error.failures.values()]
        assert len(failures) == dist.get_world_size(), error
        for exc in failures:
            assert type(exc) is RuntimeError and str(exc).startswith("Missing key in checkpoint state_dict"), exc
            assert any("lm_head.weight: target shape (300, 64)" in note for note in exc.__notes__), exc.__notes__
    else:
        raise AssertionError("the load did not fail")
    for key, value in state_dict.items():
        local = value.to_local() if isinstance(value, DTensor) else value
        assert torch.equal(local, before[key]), f"{key} changed although the load failed"


def case_zero3_into_fsdp2(mesh, out: Path) -> None:
    """A DeepSpeed ZeRO-3 save dir (3 data-parallel ranks) into an FSDP2 model on these 2 ranks:
    each rank's rows of every fp32 master, gathered from the partitions; whole, each tensor is
    DeepSpeed's own ``get_fp32_state_dict_from_zero_checkpoint`` value, bit for bit."""
    from support.fixtures import array_sha256, expected_arrays

    model = fixture_module("deepspeed_zero/produce.py").build_model()
    fully_shard(model, mesh=mesh)
    state_dict = model.state_dict()
    assert isinstance(state_dict["proj.weight"], DTensor)
    dcp.load(state_dict, checkpoint_id=FIXTURES / "deepspeed_zero" / "ws3" / "zero3_fp32")
    reference = expected_arrays("deepspeed_zero")
    for key, value in state_dict.items():
        whole = value.full_tensor() if isinstance(value, DTensor) else value
        expected = reference[f"ws3/zero3_fp32/fp32/{key}"]
        assert array_sha256(whole.to(getattr(torch, expected["dtype"])).view(
            torch.uint16 if expected["dtype"] == "bfloat16" else whole.dtype).numpy()) == expected["sha256"], key


def case_megatron_tp2_pp2_into_fsdp2(mesh, out: Path) -> None:
    """A Megatron-Core torch_dist folder (TP2 x PP2) into an FSDP2 model of GPTModel.state_dict()
    names on these 2 ranks: each rank its rows of each layer; whole, Megatron-Core's own load."""
    from support.fixtures import array_sha256, expected_arrays
    from test_megatron_core_profile import _plain_model

    variant = "torch_dist/tp2_pp2"
    model = _plain_model(variant)
    fully_shard(model, mesh=mesh)
    state_dict = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    assert isinstance(state_dict["decoder.layers.1.self_attention.linear_qkv.weight"], DTensor)
    dcp.load(state_dict, checkpoint_id=FIXTURES / "megatron_core" / variant)
    reference = expected_arrays("megatron_core")
    for key, value in state_dict.items():
        whole = value.full_tensor() if isinstance(value, DTensor) else value
        assert array_sha256(whole.numpy()) == reference[f"{variant}/{key}"]["sha256"], key


CASES = [case_fsdp2_compiled, case_tensor_parallel_compiled, case_save_two_ranks,
         case_missing_file_of_one_rank, case_truncated_file, case_tampered_metadata, case_shape_mismatch,
         case_zero3_into_fsdp2, case_megatron_tp2_pp2_into_fsdp2]


def main(out: Path) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    run_rank_cases(CASES, mesh, out, report=out / f"rank{dist.get_rank()}.json")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
