"""The Orbax v1 seams: ``PyTreeHandler._background_load``, where every v1 load of a PyTree
arrives, and ``load``/``load_checkpointables`` for the layouts v1 refuses before that.

``orbax.checkpoint.v1`` does not restore through ``Checkpointer.restore``: ``load``
(``load_pytree``), ``load_checkpointables``, their ``_async`` forms and v1's
``training.Checkpointer`` resolve the checkpoint's layout (v1's own, or a v0 step such as a
MaxText ``items`` folder), check that nothing is being deleted, pick a handler from the step's
metadata and validate the abstract leaves; a PyTree then reaches ``PyTreeHandler.load``, which
hands ``_background_load`` the item's folder and the abstract tree. That is the v1 counterpart of
``Checkpointer._restore``, and the hook sits there, after v1's own refusals: what it sees is a
load Orbax is about to carry out.

The abstract tree is a ``StandardRestore`` target to ckptshim's planner (:mod:`ckptshim.loading.orbax`
decides, exactly as for the v0 seam): where names and shapes fit, or where ckptshim has no plan,
Orbax's own coroutine runs untouched -- its reading, its value, its errors, with ckptshim's
reading as a note on what it raises; where a rule mends the difference (MaxText's
``scan_layers`` either way, Linen/NNX names, the old layouts ckptshim reads), ckptshim restores
the item into the abstract tree's structure. A load without an abstract tree (``load(path)``:
as stored) is always Orbax's there.

v1 refuses layouts older than Orbax's ``_METADATA`` (the aggregate msgpack with ``PLACEHOLDER://``
leaves, per-leaf folders of Orbax < 0.5) while it resolves the layout, with an
``InvalidLayoutError``, before any handler runs. So ``load`` and ``load_checkpointables`` are
patched too, for that one error: Orbax's call runs first, untouched; where it raises
``InvalidLayoutError`` and ckptshim reads the item, ckptshim restores it (into the abstract tree,
or as stored); otherwise Orbax's error stands, with ckptshim's reading as a note.
(``load_async`` serves only safetensors layouts, which v1 reads itself.)
"""

from __future__ import annotations

import inspect
from functools import partial
from typing import Any, NoReturn

from ckptshim.errors import NoPlan
from ckptshim.hooks.seam import Patches, Seam, bind, framework_call, guarded
from ckptshim.loading import orbax as loading
from ckptshim.loading.paths import item_location

SEAM = Seam("orbax-v1", "orbax v1", falls_back=True)
_patches = Patches()


def install() -> None:
    if _patches.active:
        return
    import orbax.checkpoint.experimental.v1 as v1
    from orbax.checkpoint.experimental.v1._src.handlers import pytree_handler
    from orbax.checkpoint.experimental.v1._src.loading import loading as v1_loading

    _patches.wrap(pytree_handler.PyTreeHandler, "_background_load", _background_load)
    for name, shim in (("load", _refused_pytree), ("load_checkpointables", _refused_checkpointables)):
        for owner in (v1_loading, v1):  # ``load_pytree`` calls the first; users, the second
            _patches.wrap(owner, name, partial(_after_layout_refusal, shim))


def uninstall() -> None:
    _patches.restore()


def _background_load(wrapped, instance, args, kwargs):
    """A coroutine, as Orbax's own: v1 awaits it in its background load."""
    return _load(wrapped, args, kwargs)


async def _load(wrapped, args: tuple, kwargs: dict) -> Any:
    outcome = guarded(SEAM, lambda: _shim(wrapped, args, kwargs), lambda: wrapped(*args, **kwargs))
    return await outcome if inspect.isawaitable(outcome) else outcome


def _shim(wrapped, args: tuple, kwargs: dict) -> Any:
    """ckptshim's restore of the item, or Orbax's own coroutine (not yet awaited) where it steps aside."""
    def native():
        return wrapped(*args, **kwargs)

    call = bind(wrapped, args, kwargs)
    found = None if call is None else item_location(call["directory"])
    abstract = None if call is None else call["abstract_checkpointable"]
    if found is None or abstract is None:  # a URL Orbax reads itself, or a load as stored
        return native()
    return loading.restore_item(found, loading.Request("standard", abstract), f"orbax v1 load({found})", native)


# -- load / load_checkpointables of a layout v1 refuses ----------------------------------------------


def _after_layout_refusal(shim, wrapped, instance, args, kwargs) -> Any:
    """Orbax's call; where it refuses the checkpoint's layout, ``shim(call, error)`` may load it."""
    from orbax.checkpoint.experimental.v1.errors import InvalidLayoutError

    try:
        return wrapped(*args, **kwargs)
    except InvalidLayoutError as error:
        refused = error
    call = bind(wrapped, args, kwargs)
    if call is None:
        _raise(refused)
    return guarded(SEAM, lambda: shim(call, refused), partial(_raise, refused), call.get("path"))


def _refused_pytree(call: dict[str, Any], refused: Exception) -> Any:
    """``load(path, abstract_state, checkpointable_name=...)`` of an item in an old layout."""
    from orbax.checkpoint.experimental.v1._src.layout.checkpoint_layout import AUTO_CHECKPOINTABLE_KEY

    path, name = _local_or_bucket(call["path"]), call["checkpointable_name"]
    if name == AUTO_CHECKPOINTABLE_KEY:  # v1's AUTO: the step's one array item, else the folder itself
        items = loading.array_items(path)
        found = next(iter(items.values())) if len(items) == 1 else path
    else:
        found = path if name is None else path / name
    return loading.restore_item(found, loading.Request("standard", call["abstract_state"]),
                                f"orbax v1 load({found})", framework_call(partial(_raise, refused)))


def _refused_checkpointables(call: dict[str, Any], refused: Exception) -> Any:
    """``load_checkpointables(path, {name: abstract tree})`` of a step whose items are in an old layout."""
    step, asked = _local_or_bucket(call["path"]), call["abstract_checkpointables"]
    if not isinstance(asked, dict) or not asked:
        raise NoPlan("ckptshim restores the items of an old layout only when they are named: pass "
                     "load_checkpointables(path, {item name: abstract tree})")
    requests = {name: loading.Request("standard", abstract) for name, abstract in asked.items()}
    done = loading.restore_items(step, requests, f"orbax v1 load_checkpointables({step})",
                                 framework_call(lambda names: _raise(refused)), force=True)
    if done is None:
        raise NoPlan(f"ckptshim cannot reach {step}")
    return done


def _local_or_bucket(where: Any):
    found = item_location(where)
    if found is None:
        raise NoPlan(f"{where} is in a place ckptshim does not read")
    return found


def _raise(error: BaseException) -> NoReturn:
    raise error
