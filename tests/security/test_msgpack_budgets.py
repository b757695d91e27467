"""Flax/Orbax/T5X msgpack files built to exhaust memory or time, through ``inspect`` and through
``flax.training.checkpoints.restore_checkpoint`` (the hook): refused within a memory bound.

Before the budget, 38 MB of empty maps took 14.8 GB and 194 s to inspect (3.2 GB through the
restore hook, where Flax alone takes 0.8 GB), and 40 MB of small integers more than 300 s and
9 GB. Each case runs in a confined child (an address-space cap and a time limit), so that a
regression fails instead of taking the machine down.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from ckptshim.formats import detect
from hostile import confined
from support.fixtures import FIXTURES

#: Peak resident memory allowed to a child that imports jax and refuses the file (the budget
#: allows 256 MiB of parsed structure; jax, tensorstore and numpy take about 250 MB).
PEAK_MB = 1000


def _empty_maps(path: Path, count: int) -> Path:
    """``{"00000000": {}, "00000001": {}, ...}``: ten bytes per key, no arrays at all."""
    body = b"".join(b"\xa8" + b"%08d" % i + b"\x80" for i in range(count))
    path.write_bytes(b"\xdf" + struct.pack(">I", count) + body)
    return path


def _small_ints(path: Path, count: int) -> Path:
    """``{"a": [1, 1, 1, ...]}``: one byte per integer, each an entry of the inventory."""
    path.write_bytes(b"\x81\xa1a\xdd" + struct.pack(">I", count) + b"\x01" * count)
    return path


@pytest.mark.parametrize("build, count", [(_empty_maps, 3_800_000), (_small_ints, 40_000_000)],
                         ids=["38MB-of-empty-maps", "40MB-of-small-ints"])
def test_inspect_refuses_within_the_budget(tmp_path, build, count):
    path = build(tmp_path / "checkpoint_1", count)
    assert path.stat().st_size > 37_000_000
    outcome = confined(f"""
        import sys
        from ckptshim.cli import main
        sys.exit(main(["inspect", {str(path)!r}]))
        """, memory_mb=3000, seconds=120)
    assert not outcome.timed_out, "inspect did not finish"
    assert outcome.returncode == 1 and "Traceback" not in outcome.stderr, outcome.stderr[-2000:]
    assert "more structure than" in outcome.stderr and str(path) in outcome.stderr
    assert outcome.peak_rss_mb < PEAK_MB, f"{outcome.peak_rss_mb:.0f} MB"


def test_flax_restore_hook_refuses_within_the_budget(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    _empty_maps(folder / "checkpoint_1", 3_800_000)
    outcome = confined(f"""
        import ckptshim, jax.numpy as jnp
        from flax.training import checkpoints
        try:
            checkpoints.restore_checkpoint({str(folder)!r}, target={{"w": jnp.zeros(2)}})
        except ckptshim.ShimError as error:
            print("REFUSED", str(error)[:300])
        """, memory_mb=4000, seconds=180)
    assert not outcome.timed_out and "REFUSED" in outcome.stdout, outcome.stdout + outcome.stderr[-2000:]
    assert "more structure than" in outcome.stdout
    assert outcome.peak_rss_mb < PEAK_MB, f"{outcome.peak_rss_mb:.0f} MB"


def test_control_real_flax_checkpoint_is_within_budget():
    checkpoint = detect.open_checkpoint(FIXTURES / "flax_0.6.11_legacy_msgpack/legacy_msgpack/checkpoint_1")
    assert checkpoint.complete and len(checkpoint.inventory) > 0
