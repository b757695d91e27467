"""STAND-IN for ``t5x.checkpoints`` (t5x is not on PyPI and cannot be installed here).

The tests copy this file to ``<tmp>/t5x/checkpoints.py``. It keeps the real module's public
names, signatures and return structures (google-research/t5x ``t5x/checkpoints.py`` and
``t5x/checkpoint_importer.py``, read 2026-04) and re-implements only the legacy read path:
``find_checkpoint`` -> ``serialization.msgpack_restore`` of the ``checkpoint`` file -> gcs specs
rewritten to ``file`` -> ``_get_optimizer_state_dict`` (version >= 2, else the real error) ->
each tensorstore spec read relative to the msgpack's folder. Partitioning, gfile, TF datasets
and saving are left out. Like the real thing, it cannot read Orbax-era checkpoints.
"""

from __future__ import annotations

import asyncio
import os
import re
from typing import Any, Callable, Mapping, Optional, Sequence

import jax
import numpy as np
import tensorstore as ts
from flax import serialization, traverse_util

VERSION = 3


class LazyArray:
    """checkpoint_importer.LazyArray: shape/dtype now, data on ``get``."""

    def __init__(self, shape: Sequence[int], dtype, get_fn: Callable[[], Any]):
        self._shape = tuple(shape) if shape is not None else shape
        self._dtype = np.dtype(dtype) if dtype is not None else dtype
        self._get_fn = get_fn

    @property
    def shape(self):
        return self._shape

    @property
    def dtype(self):
        return self._dtype

    def astype(self, dtype) -> "LazyArray":
        return type(self)(self._shape, dtype, self._get_fn)


class LazyAwaitableArray(LazyArray):
    """checkpoint_importer.LazyAwaitableArray: ``get_fn`` is async."""

    async def get_async(self):
        arr = await self._get_fn()
        if arr.dtype != self.dtype:
            arr = arr.astype(self.dtype)
        return arr

    def get(self):
        return asyncio.run(self.get_async())

    @classmethod
    def from_tensor_store_spec_or_array(cls, maybe_ts_spec, get_fn, dtype=None):
        if isinstance(maybe_ts_spec, ts.Spec):
            spec = maybe_ts_spec.to_json()
            dtype = np.dtype(spec["dtype"]) if dtype is None else np.dtype(dtype)
            return cls(spec["metadata"]["shape"], dtype, get_fn)
        array = np.asarray(maybe_ts_spec)
        return cls(array.shape, array.dtype if dtype is None else dtype, get_fn)


def _run_future_tree(future_tree):
    leaves, treedef = jax.tree_util.tree_flatten(future_tree)

    async def run():
        return await asyncio.gather(*leaves)

    return jax.tree_util.tree_unflatten(treedef, asyncio.run(run()))


def _is_spec(value):
    return isinstance(value, dict) and set(value) >= {"driver", "kvstore", "metadata"}


def _maybe_update_ts_from_gcs_to_file(ckpt_contents):
    def convert(node):
        if _is_spec(node):
            if node["kvstore"]["driver"] == "gcs":
                node["kvstore"] = {"driver": "file", "path": node["kvstore"]["path"]}
            return node
        if isinstance(node, dict):
            return {k: convert(v) for k, v in node.items()}
        return node

    return convert(ckpt_contents)


def _get_optimizer_state_dict(ckpt_contents, optimizer_state, state_transformation_fns,
                              use_orbax_format: bool = False):
    version = ckpt_contents.get("version", 0)
    ckpt_optimizer_state = ckpt_contents if (use_orbax_format or version == 0) else ckpt_contents["optimizer"]
    if use_orbax_format or version >= 2:
        for fn in state_transformation_fns:
            ckpt_optimizer_state = fn(ckpt_optimizer_state, optimizer_state)
        return ckpt_optimizer_state
    raise ValueError("Checkpoint versions earlier than 2 are not supported. "
                     f"Got version: {version}")


async def _read_ts(maybe_tspec, ckpt_path, restore_dtype=None):
    if not isinstance(maybe_tspec, ts.Spec):
        return maybe_tspec
    spec = maybe_tspec.to_json()
    del spec["metadata"]["chunks"]
    del spec["metadata"]["compressor"]
    spec["kvstore"]["path"] = os.path.join(os.path.dirname(ckpt_path), spec["kvstore"]["path"])
    t = await ts.open(spec, open=True)
    arr = await t.read()
    return arr if restore_dtype is None else arr.astype(restore_dtype)


def latest_step(checkpoints_dir) -> Optional[int]:
    steps = [int(m.group(1)) for name in os.listdir(checkpoints_dir)
             if (m := re.fullmatch(r"checkpoint_(\d+)", name))
             and os.path.exists(os.path.join(checkpoints_dir, name, "checkpoint"))]
    return max(steps) if steps else None


def get_checkpoint_dir(checkpoints_dir, step: int) -> str:
    return os.path.join(checkpoints_dir, f"checkpoint_{step}")


def find_checkpoint(path, step: Optional[int] = None):
    if os.path.isdir(path):
        step = latest_step(path) if step is None else step
        path = get_checkpoint_dir(path, step) if step is not None else path
        path = os.path.join(path, "checkpoint")
    if not os.path.exists(path) or os.path.isdir(path):
        raise ValueError(f"Path is not a valid checkpoint: {path}")
    return path


def _read_legacy(path, state_transformation_fns, remap, restore_dtype, lazy_parameters,
                 optimizer_state=None):
    with open(path, "rb") as fp:
        ckpt_contents = serialization.msgpack_restore(fp.read())
    ckpt_contents = _maybe_update_ts_from_gcs_to_file(ckpt_contents)
    if remap:
        state = _get_optimizer_state_dict(ckpt_contents, optimizer_state or {}, state_transformation_fns)
    else:
        state = ckpt_contents if ckpt_contents.get("version", 0) == 0 else ckpt_contents["optimizer"]
    flat = traverse_util.flatten_dict(state, is_leaf=lambda k, v: _is_spec(v), sep="/")
    flat = {k: ts.Spec(v) if isinstance(v, dict) else v for k, v in flat.items()}
    lazy = {k: LazyAwaitableArray.from_tensor_store_spec_or_array(
        v, lambda v=v: _read_ts(v, path, restore_dtype), dtype=None) for k, v in flat.items()}
    state_dict = traverse_util.unflatten_dict(lazy, sep="/")
    if not lazy_parameters:
        state_dict = _run_future_tree(jax.tree_util.tree_map(
            lambda x: x.get_async(), state_dict, is_leaf=lambda x: isinstance(x, LazyArray)))
    if restore_dtype is not None:
        state_dict["target"] = jax.tree_util.tree_map(
            lambda x: x.astype(restore_dtype), state_dict["target"],
            is_leaf=lambda x: isinstance(x, LazyArray))
    return state_dict


def load_t5x_checkpoint(
    path: str,
    step: Optional[int] = None,
    state_transformation_fns: Sequence[Callable] = (),
    remap: bool = True,
    restore_dtype=None,
    lazy_parameters: bool = False,
):
    """Real signature; reads legacy checkpoints only (as the real function does)."""
    return _read_legacy(find_checkpoint(path, step), state_transformation_fns, remap,
                        restore_dtype, lazy_parameters)


class Checkpointer:
    """Real constructor and ``restore`` signatures; ``restore`` reads legacy steps only."""

    def __init__(self, train_state, partitioner, checkpoints_dir, dataset_iterator=None, *,
                 keep=None, save_dtype=np.float32, restore_dtype=None, keep_dataset_checkpoints=None):
        self._train_state = train_state
        self._partitioner = partitioner
        self.checkpoints_dir = checkpoints_dir
        self.restore_dtype = restore_dtype

    def latest_step(self):
        return latest_step(self.checkpoints_dir)

    def _get_checkpoint_dir(self, step: int):
        return get_checkpoint_dir(self.checkpoints_dir, step)

    def restore(self, step: Optional[int] = None, path: Optional[str] = None,
                state_transformation_fns: Sequence[Callable] = (),
                fallback_state: Optional[Mapping[str, Any]] = None,
                lazy_parameters: bool = False):
        if step is not None and path is not None:
            raise ValueError("At most one of `step` or `path` may be provided.")
        if path:
            ckpt_path = path
        else:
            if step is None:
                step = self.latest_step()
                if not step:  # (sic) the real code treats a latest step 0 as none
                    raise ValueError(f"No checkpoints found in {self.checkpoints_dir}.")
            ckpt_path = self._get_checkpoint_dir(step)
        if os.path.isdir(ckpt_path):
            state_item = os.path.join(ckpt_path, "state")
            ckpt_path = os.path.join(state_item if os.path.isdir(state_item) else ckpt_path, "checkpoint")
        if not os.path.exists(ckpt_path) or os.path.isdir(ckpt_path):
            raise ValueError(f"Path is not a valid T5X checkpoint: {ckpt_path}")
        state_dict = _read_legacy(ckpt_path, state_transformation_fns, True, self.restore_dtype,
                                  lazy_parameters, self._train_state.state_dict())
        if fallback_state is not None:
            state_dict = {**fallback_state, **state_dict}
        return self._restore_train_state(state_dict)

    def _restore_train_state(self, state_dict):
        return self._train_state.restore_state(state_dict)
