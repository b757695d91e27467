"""The DeepSpeed hooks: ``PipelineModule.load_state_dir`` (GPT-NeoX pipeline loads;
:func:`ckptshim.loading.deepspeed.load_stage` decides) and ``DeepSpeedEngine.load_checkpoint``
(ZeRO resumes at another data-parallel size; :func:`ckptshim.loading.deepspeed_engine.load_checkpoint`).

DeepSpeed's own loaders unpickle their files without limits, so a bug inside ckptshim here is
raised (an ``InternalError`` naming ``CKPTSHIM_DISABLE_HOOKS=deepspeed``), never handed to them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ckptshim.hooks.seam import Patches, Seam, bind, framework_call, guarded
from ckptshim.loading import deepspeed as loading
from ckptshim.loading import deepspeed_engine

SEAM = Seam("deepspeed", "deepspeed PipelineModule.load_state_dir", falls_back=False)
ENGINE_SEAM = Seam("deepspeed", deepspeed_engine.HOOK, falls_back=False)
_patches = Patches()

#: A loading function: (the patched object, the call's arguments by name, DeepSpeed's own call).
Load = Callable[[Any, dict, Callable[[], Any]], Any]


def install() -> None:
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.pipe.module import PipelineModule

    if not _patches.active:
        _patches.wrap(PipelineModule, "load_state_dir", _hook(SEAM, lambda module, call, native: loading.load_stage(
            module, Path(call["load_dir"]), call["strict"], native)))
        _patches.wrap(DeepSpeedEngine, "load_checkpoint", _hook(ENGINE_SEAM, deepspeed_engine.load_checkpoint))


def uninstall() -> None:
    _patches.restore()


def _hook(seam: Seam, load: Load) -> Callable[[Callable[..., Any], Any, tuple, dict], Any]:
    """The wrapt wrapper of one DeepSpeed loader whose first argument is ``load_dir``."""
    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        def native() -> Any:
            return wrapped(*args, **kwargs)

        call = bind(wrapped, args, kwargs)
        if call is None:
            return native()  # a bad call: DeepSpeed reports it
        return guarded(seam, lambda: load(instance, call, framework_call(native)), native, call["load_dir"])
    return wrapper
