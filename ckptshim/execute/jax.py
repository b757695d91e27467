"""Build JAX target arrays from a checkpoint by a plan, each device reading only its slice.

Every array is made with ``jax.make_array_from_callback`` in the target's sharding. The
callback for a device gets the device's index range and fills exactly that block from the
checkpoint through :mod:`ckptshim.execute.blocks` (the bytes that block needs, straight into an
aligned buffer that JAX's CPU backend adopts without a copy); a shard that several devices hold
(replication) is read once. So no step holds the source tree, and host memory peaks near the
size of the restored arrays.

It runs every layout kind (through its geometry, by block reads), ``Synthesize`` (the caller's
own value), ``Drop``/``Cast`` (nothing to do: a checkpoint's ``read_into`` casts) and ``Scale``
(each block multiplied once filled, before JAX sees it); a plan with any other kind is refused
before anything is read.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ckptshim import progress
from ckptshim.errors import PlanError, ShimError
from ckptshim.execute import blocks
from ckptshim.targets.jax_tree import TargetLeaf
from ckptshim.inventory import KeyPath, join_key
from ckptshim.ops import Cast, Drop, Scale, Synthesize, require_kinds
from ckptshim.planner import Plan

#: The kinds this executor runs besides the layout kinds.
KINDS = frozenset({Synthesize.kind, Drop.kind, Cast.kind, Scale.kind})


def build(source: blocks.SliceSource, plan: Plan, targets: Mapping[KeyPath, TargetLeaf],
          sep: str = "/") -> dict[KeyPath, Any]:
    """Restored values for every target key the plan produces (all of them, or an exception)."""
    require_kinds(plan.ops, KINDS, "JAX executor", sep=sep)
    scales = blocks.scales(plan)
    workers = getattr(source, "target_workers", 1)
    if workers <= 1 or len(targets) <= 1:
        return {key: _build(source, plan, target, sep, scales.get(key)) for key, target in targets.items()}
    # a source whose every read is a round trip (a bucket): a few targets built at once, each
    # still bounded by blocks.IN_FLIGHT_BYTES; the first error, in target order, is raised
    with ThreadPoolExecutor(min(workers, len(targets)), thread_name_prefix="ckptshim-restore") as pool:
        futures = {key: pool.submit(_build, source, plan, target, sep, scales.get(key))
                   for key, target in targets.items()}
        return {key: future.result() for key, future in futures.items()}


def _build(source: blocks.SliceSource, plan: Plan, target: TargetLeaf, sep: str, scale: Scale | None) -> Any:
    import jax

    producer = plan.producer(target.key)
    if producer is None:
        raise PlanError(f"{join_key(target.key, sep)}: nothing in the plan produces it")
    if producer.kind == Synthesize.kind:  # the caller's own (concrete) value, checked when planned
        return target.value
    read = blocks.filler(source, plan, producer, target.key, target.shape, target.dtype, sep, scale)

    def fill(index: tuple) -> np.ndarray:
        block = read(index)
        progress.advance(block.nbytes)
        return block

    if target.kind == "numpy":
        out = fill(blocks.whole(target.shape))
        return out[()] if isinstance(target.value, np.generic) else out
    if target.kind == "python":
        return type(target.value)(fill(())[()])
    shards: dict[tuple, np.ndarray] = {}
    lock = threading.Lock()
    box = _tiled_box(_blocks_here(target))
    together: list[np.ndarray] = []  # this process's blocks, read in one go (see _tiled_box)

    def callback(index: tuple) -> np.ndarray:
        bounds = _bounds(index, target.shape)
        with lock:
            if box is not None:
                if not together:
                    together.append(fill(tuple(slice(a, b) for a, b in box)))
                return together[0][tuple(slice(a - low, b - low) for (a, b), (low, _) in zip(bounds, box))]
            shard = shards.get(bounds)
            if shard is None:
                shard = shards[bounds] = fill(tuple(slice(a, b) for a, b in bounds))
        return shard

    # a typed key array's sharding also fits its key data: the extra trailing axis is unsharded
    array = jax.make_array_from_callback(target.shape, target.sharding, callback)
    if target.key_impl is not None:
        array = jax.random.wrap_key_data(array, impl=target.key_impl)
    return array


def local_bytes(plan: Plan, targets: Mapping[KeyPath, TargetLeaf]) -> int:
    """Bytes :func:`build` reads on this process: every numpy or Python target, and of each JAX
    target the distinct blocks of this process's devices (a replicated block is read once);
    targets that keep the caller's own value read nothing."""
    total = 0
    for target in targets.values():
        producer = plan.producer(target.key)
        if producer is None or producer.kind == Synthesize.kind:
            continue
        itemsize = np.dtype(target.dtype).itemsize
        if target.kind != "jax":
            total += int(np.prod(target.shape, dtype=np.int64)) * itemsize
            continue
        total += sum(int(np.prod([b - a for a, b in bounds], dtype=np.int64)) * itemsize
                     for bounds in _blocks_here(target))
    return total


def _blocks_here(target: TargetLeaf) -> set[tuple[tuple[int, int], ...]]:
    """The distinct blocks of ``target`` this process's devices hold (a replicated one once)."""
    return {_bounds(index, target.shape)
            for index in target.sharding.addressable_devices_indices_map(target.shape).values()}


def _tiled_box(blocks_here: set[tuple[tuple[int, int], ...]]) -> tuple[tuple[int, int], ...] | None:
    """The box this process's distinct device blocks of one array tile exactly, when there are
    several and each is a contiguous run of that box (they differ along one axis only, every
    axis before it of extent one); else ``None``.

    Such blocks are read as that one box: a stored chunk that several of them overlap (an array
    written by one process is often one chunk) is then fetched and decompressed once per
    process, not once per device, and the process reads exactly the bytes its devices hold. Each
    device then takes a contiguous slice of the box, which JAX can use in place; a slice across
    the box's rows would be copied, holding the box and the copies at once, so such blocks are
    read one by one instead.
    """
    if len(blocks_here) < 2:
        return None
    rank = len(next(iter(blocks_here)))
    box = tuple((min(b[axis][0] for b in blocks_here), max(b[axis][1] for b in blocks_here)) for axis in range(rank))
    varying = [axis for axis in range(rank) if len({b[axis] for b in blocks_here}) > 1]
    if len(varying) != 1 or any(box[axis][1] - box[axis][0] != 1 for axis in range(varying[0])):
        return None
    volume = sum(int(np.prod([b - a for a, b in block], dtype=np.int64)) for block in blocks_here)
    return box if volume == int(np.prod([b - a for a, b in box], dtype=np.int64)) else None


def _bounds(index: tuple, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    out = []
    for part, size in zip(index, shape):
        start, stop, step = part.indices(size)
        if step != 1:
            raise ShimError(f"JAX asked for a strided shard ({part}); ckptshim reads contiguous ranges only")
        out.append((start, stop))
    return tuple(out)
