"""The DeepSpeed hooks: ``PipelineModule.load_state_dir`` (GPT-NeoX pipeline loads;
:func:`ckptshim.loading.deepspeed.load_stage` decides) and ``DeepSpeedEngine.load_checkpoint``
(ZeRO resumes at another data-parallel size; :func:`ckptshim.loading.deepspeed_engine.load_checkpoint`).

DeepSpeed's own loaders unpickles layer files without limits, so a bug inside ckptshim here is
raised (an ``InternalError`` naming ``CKPTSHIM_DISABLE_HOOKS=deepspeed``), never handed to it.
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


def install() -> None:
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.pipe.module import PipelineModule

    if not _patches.active:
        _patches.wrap(PipelineModule, "load_state_dir", _load_state_dir)
        _patches.wrap(DeepSpeedEngine, "load_checkpoint", _load_checkpoint)


def uninstall() -> None:
    _patches.restore()


def _load_state_dir(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    def native() -> Any:
        return wrapped(*args, **kwargs)

    call = bind(wrapped, args, kwargs)
    if call is None:
        return native()  # a bad call: DeepSpeed reports it
    load_dir = call["load_dir"]
    return guarded(SEAM, lambda: loading.load_stage(instance, Path(load_dir), call["strict"], framework_call(native)),
                   native, load_dir)


def _load_checkpoint(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    def native() -> Any:
        return wrapped(*args, **kwargs)

    call = bind(wrapped, args, kwargs)
    if call is None:
        return native()  # a bad call: DeepSpeed reports it
    return guarded(ENGINE_SEAM, lambda: deepspeed_engine.load_checkpoint(instance, call, framework_call(native)),
                   native, call["load_dir"])
