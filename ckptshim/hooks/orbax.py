"""Orbax restore seams: ``Checkpointer.restore`` and ``CheckpointManager.restore``.

``StandardCheckpointer``, ``PyTreeCheckpointer`` and ``AsyncCheckpointer`` all restore through
``Checkpointer.restore`` (the first two via ``super()``), so patching it once covers them without
intercepting one call twice; ``CheckpointManager.restore`` is patched for what it decides before
reaching its checkpointer (which step folder, which item names, single or composite result).

The hook reads the call's args into :class:`~ckptshim.loading.orbax.Request`\\ s and leaves every
decision to :mod:`ckptshim.loading.orbax`. Calls it does not understand (other handlers,
``transforms``, ``StandardRestore(strict=False)``, the deprecated ``items=`` manager API) go to
Orbax unchanged.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ckptshim.hooks.seam import FrameworkRaised, Patches, Seam, bind, framework_call, guarded
from ckptshim.loading import orbax as loading
from ckptshim.log import logger

SEAM = Seam("orbax", "orbax", falls_back=True)
_patches = Patches()
_inside = threading.local()  # set while an original runs, so nested restores pass straight through


def install() -> None:
    if _patches.active:
        return
    import orbax.checkpoint as ocp

    _patches.wrap(ocp.Checkpointer, "restore", _checkpointer_restore)
    _patches.wrap(ocp.CheckpointManager, "restore", _manager_restore)


def uninstall() -> None:
    _patches.restore()


@contextmanager
def original():
    """Run Orbax's own code without intercepting the restores it makes internally."""
    previous = getattr(_inside, "active", False)
    _inside.active = True
    try:
        yield
    finally:
        _inside.active = previous


@framework_call
def _passthrough(wrapped, args, kwargs) -> Any:
    """Orbax's own restore, with nested restores passing straight through (what it raises is
    the caller's error: see :func:`~ckptshim.hooks.seam.framework_call`)."""
    with original():
        return wrapped(*args, **kwargs)


def request_of(args: Any) -> loading.Request | None:
    """The request behind ``StandardRestore``/``PyTreeRestore``/no args; ``None`` for others."""
    import orbax.checkpoint as ocp

    if args is None:
        return loading.Request("standard")
    if isinstance(args, ocp.args.StandardRestore):
        if not args.strict:
            return None  # Orbax pads and truncates mismatched shapes then; ckptshim never does
        return loading.Request("standard", args.item)
    if isinstance(args, ocp.args.PyTreeRestore):
        if args.transforms or args.legacy_transform_fn is not None:
            return None  # Orbax's own tree transformations: leave them to Orbax
        return loading.Request("pytree", args.item, args.restore_args, args.partial_restore)
    return None


def _requests(items: dict[str, Any]) -> dict[str, loading.Request | None]:
    return {name: request_of(args) for name, args in items.items()}


# -- Checkpointer.restore -----------------------------------------------------------------------


def _checkpointer_restore(wrapped, instance, args, kwargs):
    if getattr(_inside, "active", False):
        return wrapped(*args, **kwargs)
    return guarded(SEAM, lambda: _shim_checkpointer(wrapped, instance, args, kwargs),
                   lambda: _passthrough(wrapped, args, kwargs))


def _shim_checkpointer(wrapped, instance, args, kwargs) -> Any:
    import orbax.checkpoint as ocp
    from orbax.checkpoint._src.checkpointers.checkpointer import construct_checkpoint_args

    call = bind(wrapped, args, kwargs)
    if call is None:
        return _passthrough(wrapped, args, kwargs)
    directory = call["directory"]
    # Orbax's own translation of the legacy ``item=``/``restore_args=`` keywords into args objects
    ckpt_args = construct_checkpoint_args(instance._handler, False, *call["args"], **call["kwargs"])
    where = f"orbax {type(instance).__name__}.restore({directory})"
    if isinstance(ckpt_args, ocp.args.Composite):
        requested = dict(ckpt_args.items())

        @framework_call
        def native(names: list[str]) -> dict[str, Any]:
            with original():
                return wrapped(directory, args=ocp.args.Composite(**{n: requested[n] for n in names}))

        done = loading.restore_items(Path(directory), _requests(requested), where, native)
        return _passthrough(wrapped, args, kwargs) if done is None else ocp.args.Composite(**done)
    return loading.restore_item(Path(directory), request_of(ckpt_args), where,
                                lambda: _passthrough(wrapped, args, kwargs))


# -- CheckpointManager.restore --------------------------------------------------------------------


def _manager_restore(wrapped, instance, args, kwargs):
    if getattr(_inside, "active", False):
        return wrapped(*args, **kwargs)
    return guarded(SEAM, lambda: _shim_manager(wrapped, instance, args, kwargs),
                   lambda: _passthrough(wrapped, args, kwargs))


def _shim_manager(wrapped, instance, args, kwargs) -> Any:
    import orbax.checkpoint as ocp
    from etils import epath

    call = bind(wrapped, args, kwargs)
    if call is None or call["items"] is not None or call["restore_kwargs"] is not None:
        return _passthrough(wrapped, args, kwargs)  # a bad call, or the deprecated items= API
    root = Path(call["directory"] or instance.directory)
    step = call["step"] if call["step"] is not None else loading.latest_step(root)
    if step is None:
        return _passthrough(wrapped, args, kwargs)
    step_dir = Path(instance._get_read_step_directory(step, epath.Path(root)))
    ckpt_args = call["args"]
    if isinstance(ckpt_args, ocp.args.Composite):
        requested, single = dict(ckpt_args.items()), False
    elif ckpt_args is not None:
        requested, single = {"default": ckpt_args}, True
    else:  # as Orbax decides between a single-item and a composite manager
        mode = instance._default_item.get()
        single = (step_dir / "default").exists() if mode is None else mode
        requested = {"default": None} if single else dict.fromkeys(loading.items_on_disk(step_dir))
    where = f"orbax CheckpointManager.restore(step {step} of {root})"

    @framework_call
    def native(names: list[str]) -> dict[str, Any]:
        with original():
            if single:
                return {"default": wrapped(step, directory=call["directory"], args=requested["default"])}
            return wrapped(step, directory=call["directory"],
                           args=ocp.args.Composite(**{n: requested[n] for n in names}))

    done = loading.restore_items(step_dir, _requests(requested), where, native)
    if done is None:
        if ckpt_args is not None:
            return _passthrough(wrapped, args, kwargs)
        try:  # with no args, Orbax needs a handler registered for each item it finds
            return _passthrough(wrapped, args, kwargs)
        except FrameworkRaised as raised:
            if not isinstance(raised.error, (ValueError, KeyError)):
                raise
            error = raised.error
            logger.info("%s: Orbax could not restore it without args (%s); ckptshim restores the "
                        "items as stored", where, error)
            done = loading.restore_items(step_dir, _requests(requested), where, native, force=True)
    return done["default"] if single else ocp.args.Composite(**done)
