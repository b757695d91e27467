"""The Flax seam: ``flax.training.checkpoints.restore_checkpoint``.

For an Orbax-backed checkpoint Flax calls an Orbax checkpointer, which the Orbax hook already
covers. This hook handles the legacy single-file msgpack checkpoints (``checkpoint_<step>``):
when the file's state dict does not match the target's (``serialization.to_state_dict``) --
scanned vs unscanned layers, Linen vs NNX names -- it restores the arrays into the target's
layout and shardings and hands them to ``serialization.from_state_dict`` as Flax does; when it
matches, or there is no target, Flax's own code runs untouched.
"""

from __future__ import annotations

import os
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from ckptshim.execute import jax_restore
from ckptshim.formats import flax_msgpack
from ckptshim.hooks.seam import Patches, Seam, guarded

HOOK = "flax"
SEAM = Seam("flax", HOOK, falls_back=True)
_patches = Patches()
_PARAMETERS = ("ckpt_dir", "target", "step", "prefix")


def install() -> None:
    if _patches.active:
        return
    from flax.training import checkpoints

    _patches.wrap(checkpoints, "restore_checkpoint", _restore_checkpoint)


def uninstall() -> None:
    _patches.restore()


def _restore_checkpoint(wrapped, instance, args, kwargs):
    return guarded(SEAM, lambda: _shim(wrapped, args, kwargs), lambda: wrapped(*args, **kwargs))


def legacy_file(ckpt_dir: str | os.PathLike, step: Any, prefix: str) -> Path | None:
    """The legacy msgpack file ``restore_checkpoint`` would read, as Flax picks it; else ``None``."""
    from flax.training import checkpoints

    path = Path(ckpt_dir)
    if step is not None:
        path = path / f"{prefix}{step}"
    elif path.is_dir():
        latest = checkpoints.latest_checkpoint(path, prefix)
        path = Path(latest) if latest else path
    return path if flax_msgpack.sniff(path) and path.is_file() else None


def _shim(wrapped, args, kwargs) -> Any:
    from flax import serialization

    call = dict(zip(_PARAMETERS, args), **kwargs)
    target = call.get("target")
    path = None if target is None else legacy_file(call["ckpt_dir"], call.get("step"),
                                                    call.get("prefix", "checkpoint_"))
    if path is None:
        return wrapped(*args, **kwargs)
    with ExitStack() as stack:
        checkpoint = flax_msgpack.open_checkpoint(path)
        stack.callback(checkpoint.close)
        prepared = jax_restore.prepare(checkpoint, serialization.to_state_dict(target),
                                       f"flax restore_checkpoint({path})")
        if jax_restore.native_fits(prepared, readable=True, partial=False):
            return wrapped(*args, **kwargs)
        state_dict = prepared.run()
    return serialization.from_state_dict(target, state_dict)
