"""One rank of the multi-process float8 test (run by tests/test_float8.py under torchrun).

``python -m torch.distributed.run --nproc_per_node=2 tests/workers/float8_worker.py OUT COMPILED``
runs every two-rank case of the torchtitan story on two gloo/CPU ranks -- torchao float8
training (FSDP2 float8 all-gather on), FSDP2, ``torch.compile`` -- and writes
``OUT/rank<N>.json``: case -> "ok" or what went wrong. ``COMPILED`` is a single-process DCP
checkpoint of the compiled float8 model; the first case saves the two-rank FSDP2 float8
checkpoint ``OUT/fsdp2_float8`` (seed 0, uncompiled) that the others, and the test afterwards,
load. Every load is checked bit for bit, shard by shard, against the saved values.
"""

from __future__ import annotations

import sys
import warnings
from datetime import timedelta
from pathlib import Path

warnings.simplefilter("ignore")

import ckptshim  # noqa: E402  (the hooks attach when torch.distributed.checkpoint is imported)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint import CheckpointException  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor  # noqa: E402

from support.float8 import build, float8, mismatches, reference  # noqa: E402
from support.processes import run_rank_cases  # noqa: E402

REFERENCE = reference()


def fsdp2_float8(seed: int, mesh):
    """The fixture's model, float8-converted, then sharded with FSDP2 (torchtitan's order)."""
    model = float8(build(seed=seed))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def load_and_check(state_dict: dict, checkpoint: Path) -> None:
    dcp.load({"model": state_dict}, checkpoint_id=checkpoint)
    wrong = mismatches(state_dict, REFERENCE)
    assert not wrong, f"shards differ from the saved values: {wrong}"


def case_save_fsdp2_float8(mesh, out: Path, compiled: Path) -> None:
    state_dict = fsdp2_float8(0, mesh).state_dict()
    weight = state_dict["layers.0.qkv.weight"]
    assert isinstance(weight, DTensor) and isinstance(weight.to_local(), WeightWithDynamicFloat8CastTensor)
    dcp.save({"model": state_dict}, checkpoint_id=out / "fsdp2_float8")


def case_fsdp2_float8_into_fsdp2_float8(mesh, out: Path, compiled: Path) -> None:
    """Same names on both sides: torch loads it alone, and ckptshim loads the same values."""
    ckptshim.uninstall()
    try:
        load_and_check(fsdp2_float8(11, mesh).state_dict(), out / "fsdp2_float8")
    finally:
        ckptshim.install()
    load_and_check(fsdp2_float8(11, mesh).state_dict(), out / "fsdp2_float8")


def case_compiled_fsdp2_float8_resumes_uncompiled_checkpoint(mesh, out: Path, compiled: Path) -> None:
    """torchtitan resuming, with compile turned on, a run saved before it was."""
    state_dict = torch.compile(fsdp2_float8(12, mesh)).state_dict()
    ckptshim.uninstall()
    try:
        dcp.load({"model": state_dict}, checkpoint_id=out / "fsdp2_float8")
    except CheckpointException as error:
        assert "Missing key in checkpoint state_dict: model._orig_mod" in str(error), error
    else:
        raise AssertionError("torch alone loaded a compiled model from an uncompiled checkpoint")
    finally:
        ckptshim.install()
    load_and_check(state_dict, out / "fsdp2_float8")


def case_compiled_single_process_float8_into_fsdp2_float8(mesh, out: Path, compiled: Path) -> None:
    """A compiled one-process float8 checkpoint, resharded into two ranks' FSDP2 float8 shards."""
    load_and_check(fsdp2_float8(13, mesh).state_dict(), compiled)


CASES = [case_save_fsdp2_float8, case_fsdp2_float8_into_fsdp2_float8,
         case_compiled_fsdp2_float8_resumes_uncompiled_checkpoint,
         case_compiled_single_process_float8_into_fsdp2_float8]


def main(out: Path, compiled: Path) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    run_rank_cases(CASES, mesh, out, compiled, report=out / f"rank{dist.get_rank()}.json")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
