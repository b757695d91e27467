"""The Flax seam: ``flax.training.checkpoints.restore_checkpoint`` (legacy msgpack files;
:mod:`ckptshim.loading.flax` decides)."""

from __future__ import annotations

from ckptshim.hooks.seam import Patches, Seam, bind, framework_call, guarded
from ckptshim.loading import flax as loading

SEAM = Seam("flax", "flax", falls_back=True)
_patches = Patches()


def install() -> None:
    if _patches.active:
        return
    from flax.training import checkpoints

    _patches.wrap(checkpoints, "restore_checkpoint", _restore_checkpoint)


def uninstall() -> None:
    _patches.restore()


def _restore_checkpoint(wrapped, instance, args, kwargs):
    def native():
        return wrapped(*args, **kwargs)

    call = bind(wrapped, args, kwargs)
    if call is None:
        return native()
    return guarded(SEAM, lambda: loading.restore_checkpoint(call["ckpt_dir"], call["target"], call["step"],
                                                            call["prefix"], framework_call(native)), native)
