"""Story: MaxText ``scan_layers`` flipped between runs; Orbax restores either way with ckptshim.

A checkpoint with per-layer subtrees (``decoder/layers_0 .. layers_3``, ``scan_layers=False``)
restores into a model whose layers are stacked on axis 1 (``scan_layers=True``), and back.
Without ckptshim, Orbax refuses the structure; with it, every device reads only its slice.
``ckptshim plan`` shows the same mapping without reading a byte.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import ckptshim

LAYERS = 4


def unscanned_params():
    import numpy as np

    rng = np.random.default_rng(0)
    layer = lambda: {"mlp": {"wi": {"kernel": rng.standard_normal((8, 16), np.float32)}},  # noqa: E731
                     "pre_norm": {"scale": rng.standard_normal((8,), np.float32)}}
    return {"params": {"decoder": {**{f"layers_{i}": layer() for i in range(LAYERS)},
                                   "decoder_norm": {"scale": np.ones((8,), np.float32)}}}}


def as_scanned(tree):
    """The same model with scan_layers=True: MaxText stacks layer params on axis 1."""
    import numpy as np

    decoder = tree["params"]["decoder"]
    stack = lambda *leaves: np.stack(leaves, axis=1)  # noqa: E731  (param_scan_axis=1, scales too)
    import jax

    layers = jax.tree_util.tree_map(stack, *[decoder[f"layers_{i}"] for i in range(LAYERS)])
    return {"params": {"decoder": {"layers": layers, "decoder_norm": decoder["decoder_norm"]}}}


def restore(path: Path, target):
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(path, target)


def main() -> int:
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", force=True)  # not absl's
    logging.getLogger("absl").setLevel(logging.ERROR)
    unscanned = unscanned_params()
    scanned = as_scanned(unscanned)
    abstract = lambda tree: jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)  # noqa: E731
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "unscanned"
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(old, unscanned)
        ckptshim.uninstall()
        try:
            restore(old, abstract(scanned))
            print("without ckptshim: restored?!")
            return 1
        except ValueError as error:
            print("without ckptshim:", str(error).splitlines()[0][:110])
        ckptshim.install()
        restored = restore(old, abstract(scanned))
        same = jax.tree_util.tree_map(lambda a, b: np.array_equal(np.asarray(a), b), restored, scanned)
        assert all(jax.tree_util.tree_leaves(same))
        print("with ckptshim: unscanned -> scanned, bit-exact")

        new = Path(tmp) / "scanned"
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(new, scanned)
        back = restore(new, abstract(unscanned))
        same = jax.tree_util.tree_map(lambda a, b: np.array_equal(np.asarray(a), b), back, unscanned)
        assert all(jax.tree_util.tree_leaves(same))
        print("with ckptshim: scanned -> unscanned, bit-exact")

        plan = subprocess.run([sys.executable, "-m", "ckptshim", "plan", str(old), "--like", str(new),
                               "--sep", "/"], capture_output=True, text=True, check=False)
        print("ckptshim plan:", *plan.stdout.splitlines()[:2], sep="\n  ")
        return plan.returncode


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.exit(main())
