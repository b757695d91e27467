"""Orbax restore seams: ``Checkpointer.restore`` and ``CheckpointManager.restore``.

``StandardCheckpointer``, ``PyTreeCheckpointer`` and ``AsyncCheckpointer`` all restore through
``Checkpointer.restore`` (the first two via ``super()``), so patching it once covers them without
intercepting one call twice; ``CheckpointManager.restore`` is patched for what it decides before
reaching its checkpointer (which step folder, which item names, single or composite result).

Each call is analysed from metadata: the checkpoint's inventory against the caller's target
(``StandardRestore``/``PyTreeRestore`` items, ``Composite`` of them, or no target). When the
on-disk layout is one today's Orbax reads and its keys match the target one to one, the
original function runs untouched. Otherwise -- layers stacked differently, Linen vs NNX names,
item ``state`` vs ``default``, pre-``_METADATA`` layouts, legacy Flax msgpack files, an
incomplete checkpoint -- ckptshim restores it, or refuses with a :class:`ShimError` that says
what does not fit. Calls it does not understand (other handlers, ``transforms``,
``StandardRestore(strict=False)``, the deprecated ``items=`` manager API, paths that are not
local folders) go to Orbax unchanged.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptshim.errors import PlanError, UnknownFormatError
from ckptshim.execute import jax_restore
from ckptshim.formats import orbax_manager
from ckptshim.formats.base import Checkpoint
from ckptshim.formats.detect import open_checkpoint
from ckptshim.hooks.seam import Patches, Seam, guarded
from ckptshim.log import logger

HOOK = "orbax"
SEAM = Seam("orbax", HOOK, falls_back=True)
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


@dataclass(frozen=True)
class Request:
    """What one item's restore args ask for, in the terms ckptshim plans with.

    ``reader`` is the Orbax handler the args select ("standard" also stands for no args, which
    needs the ``_METADATA`` Orbax records handlers in).
    """

    reader: str
    item: Any = None
    restore_args: Any = None
    partial: bool = False


def request_of(args: Any) -> Request | None:
    """The request behind ``StandardRestore``/``PyTreeRestore``/no args; ``None`` for others."""
    import orbax.checkpoint as ocp

    if args is None:
        return Request("standard")
    if isinstance(args, ocp.args.StandardRestore):
        if not args.strict:
            return None  # Orbax pads and truncates mismatched shapes then; ckptshim never does
        return Request("standard", args.item)
    if isinstance(args, ocp.args.PyTreeRestore):
        if args.transforms or args.legacy_transform_fn is not None:
            return None  # Orbax's own tree transformations: leave them to Orbax
        return Request("pytree", args.item, args.restore_args, args.partial_restore)
    return None


def open_item(path: Path) -> Checkpoint | None:
    """The checkpoint at an item path, if it is in a layout ckptshim reads (metadata only)."""
    try:
        return open_checkpoint(path, backend="jax")
    except UnknownFormatError:
        return None


@contextmanager
def original():
    """Run the framework's own code without intercepting the restores it makes internally."""
    previous = getattr(_inside, "active", False)
    _inside.active = True
    try:
        yield
    finally:
        _inside.active = previous


def _passthrough(wrapped, args, kwargs) -> Any:
    with original():
        return wrapped(*args, **kwargs)


# -- Checkpointer.restore -----------------------------------------------------------------------


def _checkpointer_restore(wrapped, instance, args, kwargs):
    if getattr(_inside, "active", False):
        return wrapped(*args, **kwargs)
    return guarded(SEAM, lambda: _shim_checkpointer(wrapped, instance, args, kwargs),
                   lambda: _passthrough(wrapped, args, kwargs))


def _shim_checkpointer(wrapped, instance, args, kwargs) -> Any:
    import orbax.checkpoint as ocp
    from orbax.checkpoint._src.checkpointers.checkpointer import construct_checkpoint_args

    rest = dict(kwargs)
    directory = args[0] if args else rest.pop("directory")
    ckpt_args = construct_checkpoint_args(instance._handler, False, *args[1:], **rest)
    where = f"orbax {type(instance).__name__}.restore({directory})"
    if isinstance(ckpt_args, ocp.args.Composite):
        requested = dict(ckpt_args.items())
        done = restore_items(Path(directory), requested, where, lambda subset: wrapped(
            directory, args=ocp.args.Composite(**subset)))
        return _passthrough(wrapped, args, kwargs) if done is None else ocp.args.Composite(**done)
    request = request_of(ckpt_args)
    with ExitStack() as stack:
        prepared = None if request is None else prepare_item(Path(directory), request, where, stack)
        if prepared is None or fits(prepared, request):
            return _passthrough(wrapped, args, kwargs)
        return prepared.run()


def prepare_item(path: Path, request: Request, where: str,
                 stack: ExitStack) -> jax_restore.Prepared | None:
    """Open and plan one item (closed when ``stack`` exits); ``None`` if ckptshim cannot read it."""
    checkpoint = open_item(path)
    if checkpoint is None:
        return None
    stack.callback(checkpoint.close)
    return jax_restore.prepare(checkpoint, request.item, where, request.restore_args)


def fits(prepared: jax_restore.Prepared, request: Request) -> bool:
    """Whether Orbax itself restores this: a layout it reads, keys matching the target's."""
    readable = request.reader in prepared.checkpoint.orbax_readers
    return jax_restore.native_fits(prepared, readable=readable, partial=request.partial)


# -- items of a step: Composite args and CheckpointManager --------------------------------------


def restore_items(step_dir: Path, requested: Mapping[str, Any], where: str,
                  native: Callable[[dict[str, Any]], Mapping[str, Any]],
                  *, force: bool = False) -> dict[str, Any] | None:
    """Restore the named items of ``step_dir``, or ``None`` when the original call can do it all.

    ``requested`` maps item names to restore args (``None``: as stored). Names the step lacks are
    matched to the one array item the step holds that nobody else asked for (``state`` vs
    ``default`` vs ``items``). Items that are not array trees (JSON metadata, ...) are left to
    ``native``, which gets the subset of ``requested`` it should restore. ``force``: restore the
    array items here even where Orbax could (used after Orbax failed to).
    """
    folders = match_items(step_dir, requested)
    with ExitStack() as stack:
        prepared: dict[str, jax_restore.Prepared] = {}
        shim = force or any(folder.name != name for name, folder in folders.items())
        for name, folder in folders.items():
            request = request_of(requested[name])
            item = None if request is None else prepare_item(folder, request, f"{where} item {name!r}", stack)
            if item is not None:
                prepared[name] = item
                shim = shim or not fits(item, request)
        if not shim:
            return None
        results = {name: item.run() for name, item in prepared.items()}
    rest = {name: args for name, args in requested.items() if name not in results}
    if rest:
        with original():
            results.update(native(rest))
    return results


def match_items(step_dir: Path, requested: Mapping[str, Any]) -> dict[str, Path]:
    """Requested item name -> array item folder on disk (only for names that have one)."""
    on_disk = orbax_manager.items(step_dir)
    spare = [name for name in on_disk if name not in requested]
    out: dict[str, Path] = {}
    for name in requested:
        if name in on_disk:
            out[name] = on_disk[name]
        elif (step_dir / name).exists():
            continue  # an item Orbax keeps in its own format (JSON metadata, ...)
        elif len(spare) == 1:
            out[name] = on_disk[spare.pop()]
        else:
            raise PlanError(
                f"the target asks for item {name!r}, but checkpoint step {step_dir} holds "
                f"{', '.join(repr(n) for n in on_disk) or 'no array items'}"
                + (f" and {len(spare)} of them could be it" if spare else "")
                + f". Name the item the checkpoint uses (e.g. args=ocp.args.Composite("
                f"{next(iter(on_disk), 'state')}=...)).")
    return out


def _manager_restore(wrapped, instance, args, kwargs):
    if getattr(_inside, "active", False):
        return wrapped(*args, **kwargs)
    return guarded(SEAM, lambda: _shim_manager(wrapped, instance, args, kwargs),
                   lambda: _passthrough(wrapped, args, kwargs))


_MANAGER_PARAMETERS = ("step", "items", "restore_kwargs", "directory", "args")


def _shim_manager(wrapped, instance, args, kwargs) -> Any:
    import orbax.checkpoint as ocp
    from etils import epath

    call = dict(zip(_MANAGER_PARAMETERS, args), **kwargs)
    if call.get("items") is not None or call.get("restore_kwargs") is not None:
        return _passthrough(wrapped, args, kwargs)  # the deprecated items= API: Orbax's own
    root = Path(call.get("directory") or instance.directory)
    step = call.get("step")
    if step is None:
        step = max(orbax_manager.steps(root), default=None)
    if step is None:
        return _passthrough(wrapped, args, kwargs)
    step_dir = Path(instance._get_read_step_directory(step, epath.Path(root)))
    on_disk = orbax_manager.items(step_dir)
    ckpt_args = call.get("args")
    if isinstance(ckpt_args, ocp.args.Composite):
        requested, single = dict(ckpt_args.items()), False
    elif ckpt_args is not None:
        requested, single = {"default": ckpt_args}, True
    else:
        mode = instance._default_item.get()
        single = (step_dir / "default").exists() if mode is None else mode
        requested = {"default": None} if single else {name: None for name in on_disk}
    where = f"orbax CheckpointManager.restore(step {step} of {root})"

    def native(subset: dict[str, Any]) -> Mapping[str, Any]:
        if single:
            return {"default": wrapped(step, directory=call.get("directory"), args=subset["default"])}
        return wrapped(step, directory=call.get("directory"), args=ocp.args.Composite(**subset))

    done = restore_items(step_dir, requested, where, native)
    if done is None:
        if ckpt_args is not None:
            return _passthrough(wrapped, args, kwargs)
        try:  # with no args, Orbax needs a handler registered for each item it finds
            return _passthrough(wrapped, args, kwargs)
        except (ValueError, KeyError) as error:
            logger.info("%s: Orbax could not restore it without args (%s); ckptshim restores the "
                        "items as stored", where, error)
            done = restore_items(step_dir, requested, where, native, force=True)
    return done["default"] if single else ocp.args.Composite(**done)
