"""T5X loads of Orbax-era steps: what ``load_t5x_checkpoint`` and ``Checkpointer.restore`` return.

T5X's own readers parse the legacy msgpack only. A checkpoint written through T5X's Orbax path
(``checkpoint_<step>/state/``, no ``checkpoint`` file, or an aggregate full of
``PLACEHOLDER://`` strings) fails there: ``Path is not a valid checkpoint``, ``Checkpoint
versions earlier than 2 are not supported``, or ``'str' object has no attribute 'dtype'``.
For such a step the T5X hook returns, through this module, what T5X returns for a legacy one:

- ``load_t5x_checkpoint``: the optimizer state dict ``{'target': ..., 'state': ...}`` of numpy
  arrays, or of T5X's own ``LazyAwaitableArray`` with ``lazy_parameters=True``;
  ``state_transformation_fns`` applied only with ``remap=True`` (as T5X does for version >= 2);
  ``restore_dtype`` casts ``target`` only.
- ``Checkpointer.restore``: the train state rebuilt with ``_restore_train_state``. Without
  transformation functions or a fallback state, arrays are planned against the train state's
  own ``state_dict()`` and built in its shardings by ckptshim's JAX executor; otherwise they are
  read as stored, transformed, and merged with ``fallback_state`` as T5X does.

Steps in a bucket (``gs://``) are read there, as from a local copy. Legacy steps go to T5X
unchanged (T5X reads them through ``gfile``, in buckets too). t5x is not on PyPI; the names and signatures used here are
those of ``t5x/checkpoints.py`` (google-research/t5x, 2026-04).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from ckptshim.formats import t5x as t5x_format
from ckptshim.formats.base import Checkpoint, numpy_dtype
from ckptshim.inventory import flatten, unflatten
from ckptshim.loading import agreement, jax as jax_loading
from ckptshim.loading.paths import item_location
from ckptshim.storage import Location
from ckptshim.loading.report import report_read_as_stored


def orbax_era_step(path: Any, step: int | None = None) -> Path | Location | None:
    """The Orbax-era step folder a T5X call names (model dir + step, step dir, ``state/`` item or
    its aggregate file), locally or in a bucket; ``None`` for anything else (a legacy step, a URL
    of another scheme or one the client cannot reach), which T5X handles itself."""
    path = None if path is None else item_location(path)
    if path is None or (isinstance(path, Location) and not jax_loading.reachable(path)):
        return None
    if path.is_dir() and step is not None:
        path = path / f"checkpoint_{step}"
    candidates = [path, path.parent, path.parent.parent]
    found = next((c for c in candidates if t5x_format.is_orbax_step(c)), None)
    if found is None and path.is_dir() and step is None:
        latest = t5x_format.steps(path)
        found = latest[max(latest)] if latest else None
        return found if found is not None and t5x_format.is_orbax_step(found) else None
    return found


# -- reading the Orbax-era item as T5X leaves ------------------------------------------------


def _value(checkpoint: Checkpoint, entry) -> Any:
    return checkpoint.read(entry).view(numpy_dtype(entry.dtype))


def _lazy_tree(checkpoint: Checkpoint, lazy_type) -> dict:
    """``{'target': ..., 'state': ...}`` of T5X lazy arrays reading from ``checkpoint``."""

    def lazy(entry):
        async def get():
            return await asyncio.to_thread(_value, checkpoint, entry)

        return lazy_type(entry.shape, numpy_dtype(entry.dtype), get)

    return unflatten({key: lazy(entry) for key, entry in checkpoint.inventory.items()})


def _materialise(tree: Any) -> Any:
    """Read every lazy array of ``tree`` concurrently, as T5X's ``_run_future_tree`` does."""
    flat = flatten(tree, is_leaf=lambda leaf: hasattr(leaf, "get_async"))
    lazy = [key for key, leaf in flat.items() if hasattr(leaf, "get_async")]

    async def run():
        return await asyncio.gather(*(flat[key].get_async() for key in lazy))

    flat.update(zip(lazy, asyncio.run(run())))
    return unflatten(flat)


def _read_as(checkpoint: Checkpoint) -> str:
    return f"{checkpoint.format} ({checkpoint.version})"


def _cast_target(state_dict: dict, dtype: Any) -> dict:
    if dtype is None or "target" not in state_dict:
        return state_dict

    def cast(node):
        if isinstance(node, dict):
            return {key: cast(value) for key, value in node.items()}
        return node.astype(dtype) if hasattr(node, "astype") else node

    return {**state_dict, "target": cast(state_dict["target"])}


def _merge(checkpoint: Any, fallback: Any) -> Any:
    """T5X's ``state_utils.merge_state``: the checkpoint's values, the fallback's for the rest."""
    if isinstance(checkpoint, dict) and isinstance(fallback, dict):
        return {key: _merge(checkpoint[key], fallback.get(key)) if key in checkpoint else fallback[key]
                for key in {**fallback, **checkpoint}}
    return checkpoint


# -- load_t5x_checkpoint ----------------------------------------------------------------------


def load_t5x_checkpoint(call: dict[str, Any], native: Callable[[], Any]) -> Any:
    """``load_t5x_checkpoint(**call)`` for an Orbax-era step; ``native()`` for anything else."""
    from t5x import checkpoints

    step_dir = orbax_era_step(call["path"], call["step"])
    if step_dir is None:
        return native()
    checkpoint = t5x_format.open_checkpoint(step_dir)
    try:
        checkpoint.require_complete()
        report_read_as_stored(f"t5x load_t5x_checkpoint({step_dir})", _read_as(checkpoint))
        state_dict = _lazy_tree(checkpoint, checkpoints.LazyAwaitableArray)
        if call["remap"]:
            for fn in call["state_transformation_fns"]:
                state_dict = fn(state_dict, {})
        if not call["lazy_parameters"]:
            state_dict = _materialise(state_dict)
    finally:
        if not call["lazy_parameters"]:  # lazy arrays read later, through the open checkpoint
            checkpoint.close()
    return _cast_target(state_dict, call["restore_dtype"])


# -- Checkpointer.restore ---------------------------------------------------------------------


def restore(instance: Any, call: dict[str, Any], native: Callable[[], Any]) -> Any:
    """``instance.restore(**call)`` (a T5X ``Checkpointer``) for an Orbax-era step; ``native()``
    for anything else."""
    from t5x import checkpoints

    path = call["path"]
    if path is None:
        path = item_location(instance.checkpoints_dir)
        if path is not None and call["step"] is not None:
            path = path / f"checkpoint_{call['step']}"
    step_dir = orbax_era_step(path)
    if step_dir is None:
        return native()
    where = f"t5x Checkpointer.restore({step_dir})"
    fns, fallback = call["state_transformation_fns"], call["fallback_state"]
    with ExitStack() as stack:
        checkpoint = t5x_format.open_checkpoint(step_dir)
        if fns or fallback is not None or call["lazy_parameters"]:
            checkpoint.require_complete()
            report_read_as_stored(where, _read_as(checkpoint))
            state_dict = _lazy_tree(checkpoint, checkpoints.LazyAwaitableArray)
            for fn in fns:
                state_dict = fn(state_dict, instance._train_state.state_dict())
            if not call["lazy_parameters"]:
                state_dict = _materialise(state_dict)
                checkpoint.close()
            if fallback is not None:
                state_dict = _merge(state_dict, fallback)
        else:
            stack.callback(checkpoint.close)
            with agreement.agreeing(where, "planning"):
                prepared = jax_loading.prepare(checkpoint, instance._train_state.state_dict(), where)
            state_dict = prepared.run()
        state_dict = _cast_target(state_dict, getattr(instance, "restore_dtype", None))
    return instance._restore_train_state(state_dict)
