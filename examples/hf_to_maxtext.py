"""Story: a Hugging Face Llama 3 folder restored straight into MaxText params, no ``to_maxtext``.

The folder is the tiny Llama 3 in ``tests/fixtures/hf_to_maxtext/llama3/hf`` (written by
transformers 5.23's ``save_pretrained``; copied to a temporary folder first). The target is
MaxText's scanned parameter tree for the same model, as abstract shapes (layers stacked on
``param_scan_axis`` 1, query/key/value kernels ``[embed, heads, head_dim]``), read here off the
arrays MaxText 0.2.5's own converter wrote for it (``maxtext_scanned.safetensors``). Today's
Orbax cannot read a Hugging Face folder at all; with ckptshim the restore transposes, splits the
heads, interleaves the rotary halves and scales the query exactly as ``to_maxtext`` does, and the
result equals the converter's bit for bit. ``docs/maxtext.md`` lists every row.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

import ckptshim

HERE = Path(__file__).resolve().parent.parent / "tests/fixtures/hf_to_maxtext/llama3"


def main() -> int:
    import jax
    import ml_dtypes  # noqa: F401  (safetensors.numpy reads bfloat16 through it)
    import numpy as np
    import orbax.checkpoint as ocp
    from safetensors.numpy import load_file

    from ckptshim.inventory import flatten, unflatten

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", force=True)  # not absl's
    logging.getLogger("absl").setLevel(logging.ERROR)
    converted = {("params",) + tuple(key.split("/")): value
                 for key, value in load_file(str(HERE / "maxtext_scanned.safetensors")).items()}
    target = unflatten({key: jax.ShapeDtypeStruct(value.shape, value.dtype) for key, value in converted.items()})
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(shutil.copytree(HERE / "hf", Path(tmp) / "llama3"))
        ckptshim.uninstall()
        try:
            ocp.StandardCheckpointer().restore(folder, target)
            print("without ckptshim: restored?!")
            return 1
        except (ValueError, FileNotFoundError) as error:
            print("without ckptshim:", str(error).splitlines()[0][:110])
        ckptshim.install()
        restored = flatten(ocp.StandardCheckpointer().restore(folder, target))
    same = all(np.asarray(restored[key]).tobytes() == value.tobytes() for key, value in converted.items())
    assert same and restored.keys() == converted.keys()
    print(f"with ckptshim: all {len(converted)} arrays equal MaxText's to_maxtext output, bit-exact")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.exit(main())
