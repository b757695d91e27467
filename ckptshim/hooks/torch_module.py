"""The ``torch.nn.Module.load_state_dict`` hook.

``model.load_state_dict(sd)`` is patched so that a state dict saved from another wrapping of
the same model (``torch.compile``'s ``_orig_mod.``, DDP's ``module.``, activation
checkpointing's ``_checkpoint_wrapped_module.``, at any depth), from an older version of its
code (buffers that became non-persistent or persistent), with layers stacked the other way, or
under names the model's framework renames on load, loads as if it had been saved from this
model. How is :func:`ckptshim.loading.torch.prepare_module_load`'s business; only calls that
need help are planned: when the state dict's keys, shapes and dtypes already are the module's,
the original runs at once. Where ckptshim has no plan that makes the state dict fit (a shape that
differs, a key no rule accounts for in a strict load, a non-tensor value torch refuses), torch's
own call runs untouched -- its error, its partial writes, its return value -- with what ckptshim
found added to torch's error as a note (:func:`ckptshim.hooks.seam.step_aside`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from ckptshim.hooks.seam import Patches, Seam, bind, framework_call, guarded
from ckptshim.loading.torch_layout import fits, module_layout
from ckptshim.log import logger

SEAM = Seam("torch", "torch.nn.Module.load_state_dict", falls_back=True)
_patches = Patches()


def install() -> None:
    """Patch ``torch.nn.Module.load_state_dict`` (again a no-op when already patched)."""
    if not _patches.active:
        _patches.wrap(nn.Module, "load_state_dict", _load_state_dict)


def uninstall() -> None:
    """Put torch's own ``load_state_dict`` back."""
    _patches.restore()


def _load_state_dict(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """The wrapper: the original at once when nothing needs remapping, else plan and load."""
    def native() -> Any:
        return wrapped(*args, **kwargs)

    call = bind(wrapped, args, kwargs)
    if call is None or not isinstance(instance, nn.Module) or not isinstance(call["state_dict"], Mapping):
        return native()  # a bad call (torch reports it), or nothing ckptshim can plan
    layout = module_layout(instance)
    if fits(call["state_dict"], layout.tensors):
        return native()
    if layout.unsupported is not None:
        logger.debug("%s: %s; leaving the load to torch", SEAM.call, layout.unsupported)
        return native()

    def shimmed() -> Any:
        # the planner, rules and executors, imported by the first load that needs them: a
        # process whose loads already fit (every torchrun worker of most jobs) never pays for them
        from ckptshim.loading.torch import prepare_module_load

        load = prepare_module_load(framework_call(wrapped), framework_call(native), instance, layout,
                                   call["state_dict"], call["strict"], call["assign"])
        return load()

    return guarded(SEAM, shimmed, native)
