"""One rank of the 4-rank DCP launch (run by tests/test_dcp_multirank.py under torchrun).

``python -m torch.distributed.run --nproc_per_node=4 tests/workers/dcp_four_ranks_worker.py OUT CKPT``
loads ``CKPT`` -- the checkpoint the 2-rank launch saved (a plain FSDP2 model, one file per
rank) -- into models laid out on a 2 x 2 mesh (FSDP2 over ``dp``, tensor parallel over ``tp``),
through ckptshim's remapping, and writes ``OUT/four_rank<N>.json``: case -> "ok" or what went
wrong. Every local shard is compared with its slice of the saved model's values.
"""

from __future__ import annotations

import shutil
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
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor  # noqa: E402
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: E402

from ckptshim.errors import ShimError  # noqa: E402
from support.fixtures import fixture_module  # noqa: E402
from support.processes import run_rank_cases  # noqa: E402

build = fixture_module("torch_dcp_single/dcp_tiny_model.py").build
SAVED = {key: value for key, value in build(seed=0).state_dict().items()}  # what the 2 ranks saved


def two_d(seed: int, mesh):
    """The tiny model, tensor parallel over ``tp`` and FSDP2 over ``dp``: 2-D DTensors."""
    model = build(seed=seed)
    plan = {}
    for i in range(len(model.layers)):
        plan.update({f"layers.{i}.qkv": ColwiseParallel(), f"layers.{i}.proj": RowwiseParallel(),
                     f"layers.{i}.fc1": ColwiseParallel(), f"layers.{i}.fc2": RowwiseParallel()})
    parallelize_module(model, mesh["tp"], plan)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def plain_key(key: str) -> str:
    return ".".join(part for part in key.split(".") if part not in ("_orig_mod", "model"))


def check_shards(state_dict: dict, expected_of) -> int:
    """Each rank's local shard is exactly its slice of the expected value; how many were DTensors."""
    sharded = 0
    for key, value in state_dict.items():
        expected = expected_of(key)
        if isinstance(value, DTensor):
            sharded += 1
            local = value.to_local()
            expected = distribute_tensor(expected, value.device_mesh, value.placements).to_local()
        else:
            local = value
        assert torch.equal(local, expected), f"{key}: local shard differs from its slice"
    return sharded


def case_compiled_2d(mesh, out: Path, saved: Path) -> None:
    state_dict = torch.compile(two_d(11, mesh)).state_dict()
    assert any(isinstance(v, DTensor) and v.device_mesh.ndim == 2 for v in state_dict.values())
    dcp.load({"model": state_dict}, checkpoint_id=saved)
    assert check_shards(state_dict, lambda key: SAVED[plain_key(key)]) > 0


def stacked_saved() -> dict[str, torch.Tensor]:
    out = {key: value for key, value in SAVED.items() if not key.startswith("layers.")}
    for key in SAVED:
        if key.startswith("layers.0."):
            leaf = key[len("layers.0."):]
            out[f"layers.{leaf}"] = torch.stack([SAVED[f"layers.{i}.{leaf}"] for i in range(2)])
    return out


def case_stacked_2d(mesh, out: Path, saved: Path) -> None:
    """Per-layer keys into stacked ``[layers, ...]`` DTensors sharded on both mesh axes."""
    def placed(value: torch.Tensor) -> torch.Tensor:
        if not value.is_floating_point() or value.ndim == 0:
            return torch.zeros_like(value)
        placements = [Shard(0) if value.shape[0] % 2 == 0 else Replicate(),
                      Shard(value.ndim - 1) if value.ndim > 1 and value.shape[-1] % 2 == 0 else Replicate()]
        return distribute_tensor(torch.zeros_like(value), mesh, placements)

    expected = stacked_saved()
    state_dict = {key: placed(value) for key, value in expected.items()}
    dcp.load({"model": state_dict}, checkpoint_id=saved)
    assert check_shards(state_dict, lambda key: expected[key]) > 0


def case_set_model_state_dict_2d(mesh, out: Path, saved: Path) -> None:
    """A plain 2-D model's state dict (read natively from the 2-rank checkpoint) set into the
    compiled twin: every key gains ``_orig_mod.``, every shard exact."""
    plain = two_d(21, mesh)
    source = get_model_state_dict(plain)
    dcp.load({"model": source}, checkpoint_id=saved)
    compiled = torch.compile(two_d(22, mesh))
    set_model_state_dict(compiled, source)
    assert check_shards(compiled.state_dict(), lambda key: SAVED[plain_key(key)]) > 0


def case_missing_rank_file(mesh, out: Path, saved: Path) -> None:
    """The 2-rank checkpoint without rank 1's file: all four ranks refuse quickly, none changes."""
    copy = out / "missing_at_four"
    if dist.get_rank() == 0:
        shutil.copytree(saved, copy)
        (copy / "__1_0.distcp").unlink()
    dist.barrier()
    state_dict = torch.compile(two_d(31, mesh)).state_dict()
    before = {k: (v.to_local() if isinstance(v, DTensor) else v).clone() for k, v in state_dict.items()}
    start = time.monotonic()
    try:
        dcp.load({"model": state_dict}, checkpoint_id=copy)
    except CheckpointException as error:
        failures = [exc for exc, _ in error.failures.values()]
        assert failures and all(isinstance(exc, ShimError) and "__1_0.distcp" in str(exc) for exc in failures), error
    else:
        raise AssertionError("the load did not fail")
    assert time.monotonic() - start < 20, "the refusal took the process group's timeout"
    for key, value in state_dict.items():
        local = value.to_local() if isinstance(value, DTensor) else value
        assert torch.equal(local, before[key]), f"{key} changed although the load failed"


CASES = [case_compiled_2d, case_stacked_2d, case_set_model_state_dict_2d, case_missing_rank_file]


def main(out: Path, saved: Path) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    run_rank_cases(CASES, mesh, out, saved, report=out / f"four_rank{dist.get_rank()}.json")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
