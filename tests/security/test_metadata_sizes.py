"""Metadata files capped by a bound their format justifies, refused beyond it naming the file,
before a byte of them is read.

Before: a Megatron-Core zarr array's ``.zarray`` of 1.6 GB was read whole (3.2 GB at its peak),
and so was a T5X step's; a DeepSpeed ``latest`` of 640 MiB was read whole by the engine's resume
hook, and what followed (a ``MemoryError`` under a memory cap, or a tag of NUL bytes) came out as
an ``InternalError``, "a bug in ckptshim". The files here are sparse: the attack costs no disk.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from hostile import confined
from support.fixtures import FIXTURES

torch = pytest.importorskip("torch")

ZARR = FIXTURES / "megatron_core/zarr/tp1_pp1"
ZERO = FIXTURES / "deepspeed_zero/ws2/zero1_fp32"


def _huge(file: Path, size: int) -> None:
    """``file`` as it is, then zeros up to ``size`` bytes (a hole: nothing is written)."""
    os.truncate(file, size)


def _inspect(path: Path):
    return confined(f"""
        import sys
        from ckptshim.cli import main
        sys.exit(main(["inspect", {str(path)!r}]))
        """, memory_mb=1500, seconds=120)


def test_a_huge_zarray_of_megatron_cores_zarr_backend_is_refused_unread(tmp_path: Path) -> None:
    folder = tmp_path / "megatron"
    shutil.copytree(ZARR, folder)
    zarray = folder / "decoder.final_layernorm.weight" / ".zarray"
    _huge(zarray, 1_600_000_000)
    outcome = _inspect(folder)
    assert not outcome.timed_out and not outcome.signalled, outcome
    assert outcome.returncode == 1, outcome.stderr[-2000:]
    assert f"{zarray} is 1,600,000,000 bytes" in outcome.stderr
    assert "Traceback" not in outcome.stderr and outcome.peak_rss_mb < 800


def test_a_huge_zarray_of_a_t5x_step_is_refused_unread(tmp_path: Path) -> None:
    from support.fixtures import writable_copy

    step = writable_copy(FIXTURES / "t5x_tiny_decoder", tmp_path / "t5x")
    zarray = next(step.rglob(".zarray"))
    _huge(zarray, 1_600_000_000)
    outcome = _inspect(zarray.parent.parent)
    assert not outcome.timed_out and not outcome.signalled, outcome
    assert outcome.returncode == 1, outcome.stderr[-2000:]
    assert f"{zarray} is 1,600,000,000 bytes" in outcome.stderr
    assert "Traceback" not in outcome.stderr and outcome.peak_rss_mb < 800


def test_a_huge_latest_is_refused_by_the_engines_resume_naming_it(tmp_path: Path) -> None:
    """The real ``DeepSpeedEngine.load_checkpoint`` in a worker, on DeepSpeed's own save whose
    ``latest`` grew to 640 MiB: ckptshim's refusal naming the file, not an internal error."""
    pytest.importorskip("deepspeed")
    from support.processes import run_ranks

    source = tmp_path / "zero1_fp32"
    shutil.copytree(ZERO, source)
    _huge(source / "latest", 640 * 2**20)
    jobs = [{"mode": "load", "stage": 1, "dtype": "fp32", "dir": str(source), "out": str(tmp_path / "out")}]
    (result,), = run_ranks("deepspeed_engine_worker.py", jobs, 1, tmp_path / "work", {"DS_ACCELERATOR": "cpu"})
    assert result.get("error") == "CorruptCheckpointError", result
    assert f"{source / 'latest'} is 671,088,640 bytes, more than the 4,096" in result["message"]


def test_a_latest_that_names_a_tag_still_reads(tmp_path: Path) -> None:
    """The control: DeepSpeed's own ``latest`` (a line) still leads ``inspect`` to its step."""
    outcome = _inspect(ZERO)
    assert outcome.returncode == 0, outcome.stderr[-2000:]
    assert "deepspeed-zero (version deepspeed 0.19.8, ZeRO-1, dp=2" in outcome.stdout and "complete" in outcome.stdout
