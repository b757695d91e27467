"""Story: a legacy T5X checkpoint (msgpack ``checkpoint`` + tensorstore zarr arrays) with today's Orbax.

T5X wrote its checkpoints itself before it moved to Orbax (``checkpoint_<step>/state/``). Today's
Orbax cannot read the old layout: it looks for ``_METADATA`` and finds none. With ckptshim,
``StandardCheckpointer().restore`` reads the legacy step into today's T5X train state, bit for
bit what T5X's Orbax path saved for the same state; ``ckptshim plan`` shows the two line up, and
``ckptshim convert --to orbax`` rewrites the old step once for good, which today's Orbax then
restores with no help.

t5x is not on PyPI (it installs only from its repository), so this example copies a
real T5X run's two steps from ``tests/fixtures/t5x_tiny_decoder`` (the same train state saved by
T5X's legacy checkpointer and by its Orbax path) into a temporary folder instead of writing
them. The other direction -- an Orbax-era step through T5X's own ``load_t5x_checkpoint`` and
``Checkpointer.restore`` -- needs t5x itself; ``tests/test_t5x.py`` runs it against a stand-in
of ``t5x.checkpoints`` (see docs/t5x.md).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import ckptshim

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "t5x_tiny_decoder"


def restore(path: Path, target=None):
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(path, target)


def same(a, b) -> bool:
    """Every leaf of two trees equal in structure, dtype and bytes."""
    import jax
    import numpy as np

    flat_a, flat_b = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b)
    return [p for p, _ in flat_a] == [p for p, _ in flat_b] and all(
        np.asarray(x).dtype == np.asarray(y).dtype and np.asarray(x).tobytes() == np.asarray(y).tobytes()
        for (_, x), (_, y) in zip(flat_a, flat_b))


def shim_cli(*args: str) -> list[str]:
    result = subprocess.run([sys.executable, "-m", "ckptshim", *args], capture_output=True, text=True, check=True)
    return result.stdout.splitlines()


def main() -> int:
    import jax

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", force=True)  # not absl's
    logging.getLogger("absl").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory() as tmp:
        copy = lambda name: Path(shutil.copytree(FIXTURE / name, Path(tmp) / name,  # noqa: E731
                                                 copy_function=shutil.copyfile))
        legacy = copy("legacy_checkpointer") / "checkpoint_0"
        today = copy("orbax_checkpoint_manager") / "checkpoint_0" / "state"
        saved_by_orbax = restore(today)  # what today's T5X restores, natively
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), saved_by_orbax)

        ckptshim.uninstall()
        try:
            restore(legacy, abstract)
            print("without ckptshim: restored?!")
            return 1
        except FileNotFoundError as error:
            print("without ckptshim:", str(error).splitlines()[0][:110])
        ckptshim.install()
        restored = restore(legacy, abstract)  # logs: read by ckptshim as t5x (legacy msgpack v3)
        assert same(restored, saved_by_orbax)
        print(f"with ckptshim: {len(jax.tree.leaves(restored))} arrays of the legacy step, "
              "bit-exact with the Orbax-era step")

        print("ckptshim plan legacy --like orbax-era:", shim_cli("plan", str(legacy), "--like", str(today))[0])
        converted = Path(tmp) / "converted"
        print(shim_cli("convert", str(legacy), str(converted), "--to", "orbax", "--no-progress")[-1])
        ckptshim.uninstall()  # the converted step needs no shim
        assert same(restore(converted, abstract), saved_by_orbax)
        print("today's Orbax alone restores the converted step, bit-exact")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.exit(main())
