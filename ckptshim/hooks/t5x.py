"""The T5X seams: ``t5x.checkpoints.load_t5x_checkpoint`` and ``Checkpointer.restore`` (Orbax-era
steps; :mod:`ckptshim.loading.t5x` decides, legacy steps go to T5X unchanged)."""

from __future__ import annotations

from ckptshim.hooks.seam import Patches, Seam, bind, framework_call, guarded
from ckptshim.loading import t5x as loading

SEAM = Seam("t5x", "t5x", falls_back=True)
_patches = Patches()


def install() -> None:
    if _patches.active:
        return
    from t5x import checkpoints

    _patches.wrap(checkpoints, "load_t5x_checkpoint", _load_t5x_checkpoint)
    _patches.wrap(checkpoints.Checkpointer, "restore", _checkpointer_restore)


def uninstall() -> None:
    _patches.restore()


def _load_t5x_checkpoint(wrapped, instance, args, kwargs):
    def native():
        return wrapped(*args, **kwargs)

    call = bind(wrapped, args, kwargs)
    return native() if call is None else guarded(SEAM, lambda: loading.load_t5x_checkpoint(call, framework_call(native)), native)


def _checkpointer_restore(wrapped, instance, args, kwargs):
    def native():
        return wrapped(*args, **kwargs)

    call = bind(wrapped, args, kwargs)
    return native() if call is None else guarded(SEAM, lambda: loading.restore(instance, call, framework_call(native)), native)
