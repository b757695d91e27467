"""Orbax restore seams: ``Checkpointer._restore`` (``restore`` for a file) and ``CheckpointManager.restore``.

Every Orbax checkpointer (``Checkpointer``, ``AsyncCheckpointer``, ``StandardCheckpointer``,
``PyTreeCheckpointer``) restores through ``Checkpointer.restore``, which first does what Orbax
itself checks -- the path exists (``FileNotFoundError``), the step is finalized ("Found
incomplete checkpoint"), the legacy ``item=``/``restore_args=`` keywords make valid args -- and
only then calls ``self._restore(directory, args=...)``. The hook sits there, after Orbax's own
refusals: what it sees is a restore Orbax is about to carry out, with the args Orbax built.
Orbax refuses every file there (a checkpoint is a folder to it), so ``restore`` itself is
patched for one case: a file ckptshim reads, such as a ``model.safetensors``.

``CheckpointManager.restore`` is patched for the one thing decided before its checkpointer runs
that ckptshim mends: a manager that has not settled on single or composite items reads that from
the step (a ``default`` folder means one unnamed item), and refuses args of the other kind. Where
the step holds one item under another name (``state``, MaxText's ``items``) or the caller names
one item of a single-item step, the hook renames the item in the args and Orbax's manager runs
with them. Everything else -- step choice, args validation, side effects -- is Orbax's; the
items its checkpointer restores come through the first seam.

The hook reads the call's args into :class:`~ckptshim.loading.orbax.Request`\\ s and leaves every
decision to :mod:`ckptshim.loading.orbax`. Args it does not understand (other handlers,
``transforms``, ``StandardRestore(strict=False)``) go to Orbax unchanged. A ``gs://`` item, or
the named items of a ``gs://`` step, are read by ckptshim where it has a plan (tensorstore's
``gcs`` kvstore under the same readers); a restore of every item of a ``gs://`` step without
args, the manager's own item renames there, and URLs of other schemes are Orbax's, which reads
them through its own file systems.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any

from ckptshim.errors import NoPlan, ShimError, add_diagnosis
from ckptshim.hooks.seam import FrameworkRaised, Patches, Seam, bind, framework_call, guarded
from ckptshim.keytext import shown_lines
from ckptshim.loading import orbax as loading
from ckptshim.loading.paths import item_location, local_path
from ckptshim.log import logger

SEAM = Seam("orbax", "orbax", falls_back=True)
_patches = Patches()
_inside = threading.local()  # set while an original runs, so nested restores pass straight through


def install() -> None:
    if _patches.active:
        return
    import orbax.checkpoint as ocp

    _patches.wrap(ocp.Checkpointer, "restore", _file_patch)
    _patches.wrap(ocp.Checkpointer, "_restore", _restore_patch)
    _patches.wrap(ocp.CheckpointManager, "restore", _manager_patch)


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


def _orbax_own(wrapped, args, kwargs) -> Any:
    """Orbax's own restore, with nested restores passing straight through."""
    with original():
        return wrapped(*args, **kwargs)


#: :func:`_orbax_own` inside a shimmed path: what it raises is the caller's error (see
#: :func:`~ckptshim.hooks.seam.framework_call`).
_passthrough = framework_call(_orbax_own)


def request_of(args: Any) -> loading.Request | None:
    """The request behind ``StandardRestore``/``PyTreeRestore``; ``None`` for others."""
    import orbax.checkpoint as ocp

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


def _patch(shim):
    """The wrapper for one seam: ``shim(wrapped, instance, args, kwargs)`` under
    :func:`~ckptshim.hooks.seam.guarded`, Orbax's own call where it steps aside (or inside a
    restore ckptshim handed to Orbax)."""
    def patched(wrapped, instance, args, kwargs):
        if getattr(_inside, "active", False):
            return wrapped(*args, **kwargs)
        return guarded(SEAM, lambda: shim(wrapped, instance, args, kwargs), lambda: _orbax_own(wrapped, args, kwargs))
    return patched


# -- Checkpointer._restore ----------------------------------------------------------------------


def _shim_restore(wrapped, instance, args, kwargs) -> Any:
    import orbax.checkpoint as ocp

    call = bind(wrapped, args, kwargs)
    found = None if call is None else item_location(call["directory"])
    if found is None:  # a URL ckptshim does not read: Orbax reads it through its own file systems
        return _passthrough(wrapped, args, kwargs)
    ckpt_args = call["args"]
    where = f"orbax {type(instance).__name__}.restore({found})"
    if not isinstance(ckpt_args, ocp.args.Composite):
        return loading.restore_item(found, request_of(ckpt_args), where,
                                    lambda: _passthrough(wrapped, args, kwargs))
    requested = dict(ckpt_args.items())

    @framework_call
    def native(names: list[str]) -> dict[str, Any]:
        with original():
            return wrapped(call["directory"], args=ocp.args.Composite(**{n: requested.get(n) for n in names}))

    if not requested:
        return _restore_every_item(found, where, native, lambda: _passthrough(wrapped, args, kwargs))
    done = loading.restore_items(found, _requests(requested), where, native)
    return _passthrough(wrapped, args, kwargs) if done is None else ocp.args.Composite(**done)


def _restore_every_item(step_dir, where: str, native, orbax_all) -> Any:
    """A composite restore without args (every item of the step): Orbax's own. Where Orbax
    fails -- it finds no handler registered or recorded for an item, as for MaxText's ``items``
    or a step written before Orbax recorded handlers -- ckptshim restores the array items as
    stored, and Orbax the others; if that fails too, Orbax's first error stands, with the reason
    as a note."""
    import orbax.checkpoint as ocp
    from orbax.checkpoint._src.handlers.composite_checkpoint_handler import RESERVED_ITEM_NAMES

    try:
        return orbax_all()
    except FrameworkRaised as raised:
        arrays = set(loading.items_on_disk(step_dir))
        if not isinstance(raised.error, (KeyError, ValueError)) or not arrays:
            raise
        every = {name: loading.Request("standard") if name in arrays else None
                 for name in loading.item_folders(step_dir) if name not in RESERVED_ITEM_NAMES}
        try:
            done = loading.restore_items(step_dir, every, where, native, force=True)
        except FrameworkRaised as failed:
            add_diagnosis(raised.error, shown_lines(
                f"ckptshim reads item(s) {', '.join(sorted(arrays))} as stored, but Orbax cannot restore the "
                f"other items ({type(failed.error).__name__}: {failed.error})"))
            raise raised from None
        except ShimError as failed:
            add_diagnosis(raised.error, shown_lines(str(failed)))
            raise raised from None
        logger.info("%s: Orbax could not restore it without args (%s); ckptshim restored the items as stored",
                    where, raised.error)
    return ocp.args.Composite(**done)


# -- Checkpointer.restore of a file ---------------------------------------------------------------


def _shim_file(wrapped, instance, args, kwargs) -> Any:
    """Two things Orbax refuses as an incomplete checkpoint before reading them, which ckptshim
    restores itself: a file in a format ckptshim reads (a ``model.safetensors``, say: Orbax
    restores folders only), and a legacy T5X step or Flax msgpack checkpoint in ``gs://``, which
    has no commit file (:func:`~ckptshim.loading.orbax.uncommitted_foreign_step`). Any other
    path goes on to Orbax's restore, and through it to :func:`_shim_restore`; the T5X step and
    the Flax checkpoint only once Orbax refused them, so that every other restore pays nothing
    for the check."""
    call = bind(wrapped, args, kwargs)
    path = None if call is None else local_path(call["directory"])
    if path is not None and path.is_file():
        return _restore_refused(wrapped, instance, call, path, args, kwargs)
    try:
        return framework_call(wrapped)(*args, **kwargs)
    except FrameworkRaised as refused:
        found = None if call is None else item_location(call["directory"])
        if not isinstance(refused.error, ValueError) or not loading.uncommitted_foreign_step(found):
            raise
        logger.info("orbax %s.restore(%s): a checkpoint Orbax did not write, which has no %s; ckptshim "
                    "checks it by its writer's own rule and restores it", type(instance).__name__, found,
                    "commit_success.txt")
        return _restore_refused(wrapped, instance, call, found, args, kwargs)


def _restore_refused(wrapped, instance, call, where, args, kwargs) -> Any:
    """:func:`_shim_file`'s restore of ``where``, with the args Orbax would have built."""
    import orbax.checkpoint as ocp
    from orbax.checkpoint._src.checkpointers.checkpointer import construct_checkpoint_args

    try:  # Orbax's own translation of the legacy ``item=``/``restore_args=`` keywords into args
        ckpt_args = construct_checkpoint_args(instance._handler, False, *call["args"], **call["kwargs"])
    except Exception:  # noqa: BLE001 - args Orbax cannot read: its restore answers the call
        ckpt_args = None
    request = None if isinstance(ckpt_args, ocp.args.Composite) else request_of(ckpt_args)
    return loading.restore_item(where, request, f"orbax {type(instance).__name__}.restore({where})",
                                lambda: _passthrough(wrapped, args, kwargs))


# -- CheckpointManager.restore --------------------------------------------------------------------


def _shim_manager(wrapped, instance, args, kwargs) -> Any:
    import orbax.checkpoint as ocp

    orbax = framework_call(wrapped)
    call = bind(wrapped, args, kwargs)
    if (call is None or call["args"] is None or call["items"] is not None or call["restore_kwargs"] is not None
            or _settled_kind(instance) is not None):
        return orbax(*args, **kwargs)  # Orbax's manager takes the call; its checkpointer's restores are hooked
    step, step_dir = _step_of(instance, call)
    if step_dir is None:
        return orbax(*args, **kwargs)
    ckpt_args = call["args"]
    single = not isinstance(ckpt_args, ocp.args.Composite)
    rename = loading.manager_rename(step_dir, single, [] if single else list(ckpt_args.keys()))
    if rename is None:
        return orbax(*args, **kwargs)
    where = f"orbax CheckpointManager.restore(step {step} of {step_dir.parent})"
    logger.info("%s: %s", where, rename.explain())
    try:
        if single:
            return orbax(step, directory=call["directory"],
                         args=ocp.args.Composite(**{rename.stored: ckpt_args}))[rename.stored]
        return ocp.args.Composite(**{rename.asked: orbax(step, directory=call["directory"],
                                                         args=ckpt_args[rename.asked])})
    except FrameworkRaised as failed:  # the renamed restore failed too: Orbax's answer to the call stands
        raise NoPlan(f"{where}: {rename.explain()}, which failed: "
                     f"{type(failed.error).__name__}: {failed.error}") from None


def _settled_kind(instance) -> bool | None:
    """Whether the manager has settled on one unnamed item (``True``), named items (``False``), or
    not yet (``None``): told by ``item_names``/handlers, by a save, or by a restore's step folder.
    (A plain attribute before Orbax 0.11.7 made it a thread-safe holder.)"""
    kind = instance._default_item
    return kind.get() if hasattr(kind, "get") else kind


def _step_of(instance, call: dict[str, Any]) -> tuple[int | None, Any]:
    """The step the manager restores and its folder (local, or in a bucket ckptshim reads), as
    Orbax picks them; ``(step, None)`` where there is none, or it is in a place ckptshim does not
    read (Orbax then answers the call itself)."""
    import orbax.checkpoint as ocp
    from etils import epath

    root = call["directory"] or instance.directory
    if item_location(root) is None:
        return None, None
    step = call["step"]
    try:
        if step is None:
            step = instance.latest_step() if call["directory"] is None else \
                max(ocp.utils.checkpoint_steps(root), default=None)
        step_dir = None if step is None else item_location(instance._get_read_step_directory(step, epath.Path(root)))
    except Exception:  # noqa: BLE001 - what Orbax's own lookup raises, its restore raises to the caller
        return step, None
    return step, step_dir if step_dir is not None and step_dir.is_dir() else None


_file_patch = _patch(_shim_file)
_restore_patch = _patch(_shim_restore)
_manager_patch = _patch(_shim_manager)
