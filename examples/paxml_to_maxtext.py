"""Story: a PaxML run restored straight into a MaxText GPT-3 train state, no conversion step.

The checkpoint is the real PaxML 1.4 run in ``tests/fixtures/paxml_runs/TinySpmdRepeat`` (copied to
a temporary folder first: nothing writes into a source checkpoint). The target is what MaxText's
GPT-3 (``layers/gpt3.py``, ``fused_qkv=False``, ``scan_layers=True``) builds for the same
dimensions, as abstract shapes: layers stacked on ``param_scan_axis`` 1, separate
query/key/value kernels, the output kernel ``[heads, head_dim, embed]``, Adam's ``mu``/``nu``.
Today's Orbax cannot read the PaxML ``state/`` folder at all; with ckptshim the restore moves each
layer axis, splits the fused ``combined_qkv`` and transposes the embedding, each device reading
only its slice. ``docs/paxml-gpt3.md`` lists every row and where it comes from.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

import ckptshim

RUN = Path(__file__).resolve().parent.parent / "tests/fixtures/paxml_runs/TinySpmdRepeat/checkpoints/checkpoint_00000001"
EMBED, HEADS, HEAD_DIM, MLP, VOCAB, LAYERS = 32, 4, 8, 64, 256, 2


def maxtext_params() -> dict:
    """MaxText GPT-3's parameter shapes for this model (without the attention biases and position
    embedding this PaxML run was trained without)."""
    stacked = lambda *shape: shape[:1] + (LAYERS,) + shape[1:]  # noqa: E731  (param_scan_axis=1)
    norm = {"scale": stacked(EMBED), "bias": stacked(EMBED)}
    attention = {name: {"kernel": stacked(EMBED, HEADS, HEAD_DIM)} for name in ("query", "key", "value")}
    attention["out"] = {"kernel": stacked(HEADS, HEAD_DIM, EMBED)}
    mlp = {"mlp_layer_norm": norm, "wi": {"kernel": stacked(EMBED, MLP), "bias": stacked(MLP)},
           "wo": {"kernel": stacked(MLP, EMBED), "bias": stacked(EMBED)}}
    layers = {"pre_self_attention_norm": norm, "self_attention": attention, "mlp": mlp}
    return {"token_embedder": {"embedding": (VOCAB, EMBED)},
            "decoder": {"layers": layers, "decoder_norm": {"scale": (EMBED,), "bias": (EMBED,)}}}


def main() -> int:
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", force=True)  # not absl's
    logging.getLogger("absl").setLevel(logging.ERROR)
    shape = lambda s, dtype=np.float32: jax.ShapeDtypeStruct(s, dtype)  # noqa: E731
    params = jax.tree_util.tree_map(shape, {"params": maxtext_params()}, is_leaf=lambda x: isinstance(x, tuple))
    target = {"params": params, "opt_state": {"mu": params, "nu": params, "count": shape((), np.int32)},
              "step": shape((), np.int32)}
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(shutil.copytree(RUN, Path(tmp) / RUN.name)) / "state"
        ckptshim.uninstall()
        try:
            ocp.StandardCheckpointer().restore(state, target)
            print("without ckptshim: restored?!")
            return 1
        except (ValueError, FileNotFoundError) as error:
            print("without ckptshim:", str(error).splitlines()[0][:110])
        ckptshim.install()
        restored = ocp.StandardCheckpointer().restore(state, target)
        pax = ckptshim.inspect(state)
        try:  # spot-check against PaxML's own arrays, read natively
            qkv = pax.read(pax.inventory[tuple("mdl_vars/params/lm/transformer/repeat/sub/x_layers_0/"
                                               "self_attention/combined_qkv/w".split("/"))])
        finally:
            pax.close()
        key = np.asarray(restored["params"]["params"]["decoder"]["layers"]["self_attention"]["key"]["kernel"])
        assert key.tobytes() == np.moveaxis(qkv[:, 1], 0, 1).tobytes()
        print("with ckptshim: key kernel == moveaxis(combined_qkv[:, 1], 0, 1), bit-exact")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.exit(main())
