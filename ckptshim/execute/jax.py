"""Build JAX target arrays from a checkpoint by a plan, each device reading only its slice.

Every array is made with ``jax.make_array_from_callback`` in the target's sharding. The
callback for a device gets the device's index range and reads exactly that range from the
checkpoint: for a ``Rename`` the same range of the source; for an ``Unstack`` (``Split``) the range
at one layer (one index of the split axes) of the stacked source; for a ``Stack`` (``Join``) the
matching range of each per-layer source that falls in the device's layer range, each written into
its place in the shard; for a ``Transpose`` (and the permutation of a ``Split``/``Join``) the
source range the permutation maps the device's range to, read into a transposed view of the shard. Reads go straight
into a 64-byte aligned host buffer that JAX's CPU backend then adopts without a copy, and a
shard that several devices hold (replication) is read once. So no step holds the source tree,
and host memory peaks near the size of the restored arrays.

The checkpoint must offer ``read_into(entry, index, out)`` (see :class:`SliceSource`): copy
``entry[index]`` into ``out``, casting to ``out.dtype`` as Orbax would, and return either
``None`` (done) or a future whose ``result()`` waits for it.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Mapping
from itertools import product
from typing import Any, Protocol

import numpy as np

from ckptshim.errors import CorruptCheckpointError, PlanError, ShimError
from ckptshim.execute.jax_tree import TargetLeaf
from ckptshim.inventory import Entry, KeyPath, join_key
from ckptshim.planner import Join, Plan, Rename, Split, Stack, Synthesize, Transpose, Unstack
from ckptshim.planner.ops import inverse_perm

_ALIGN = 64  # XLA's CPU client adopts host buffers aligned to this without copying them
#: Reads started but not finished, in bytes of their destination. Each holds its chunks'
#: compressed and decompressed bytes until it completes, so this bounds the transient memory
#: (a stacked target would otherwise start one read per layer at once) while keeping a few
#: reads going in parallel. On the 1 GiB bench (8 MiB chunks), 16 MiB keeps peak RSS near
#: 1.08x the restored bytes and is faster than more parallel reads on 2 cores.
IN_FLIGHT_BYTES = 16 * 2**20


class SliceSource(Protocol):
    path: Any

    def read_into(self, entry: Entry, index: tuple, out: np.ndarray) -> Any: ...


def build(source: SliceSource, plan: Plan, targets: Mapping[KeyPath, TargetLeaf],
          sep: str = "/") -> dict[KeyPath, Any]:
    """Restored values for every target key the plan produces (all of them, or an exception)."""
    return {key: _build(source, plan, target, sep) for key, target in targets.items()}


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on a 64-byte boundary."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + _ALIGN, dtype=np.uint8)
    start = (-raw.ctypes.data) % _ALIGN
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def _build(source: SliceSource, plan: Plan, target: TargetLeaf, sep: str) -> Any:
    import jax

    producer = plan.producer(target.key)
    if isinstance(producer, Synthesize):  # the caller's own (concrete) value, checked when planned
        return target.value
    if producer is None:
        raise PlanError(f"{join_key(target.key, sep)}: nothing in the plan produces it")
    fill = _filler(source, plan, producer, target, sep)
    if target.kind == "numpy":
        out = fill(tuple(slice(0, n) for n in target.shape))
        return out[()] if isinstance(target.value, np.generic) else out
    if target.kind == "python":
        return type(target.value)(fill(())[()])
    shards: dict[tuple, np.ndarray] = {}
    lock = threading.Lock()

    def callback(index: tuple) -> np.ndarray:
        bounds = _bounds(index, target.shape)
        with lock:
            shard = shards.get(bounds)
            if shard is None:
                shard = shards[bounds] = fill(tuple(slice(a, b) for a, b in bounds))
        return shard

    # a typed key array's sharding also fits its key data: the extra trailing axis is unsharded
    array = jax.make_array_from_callback(target.shape, target.sharding, callback)
    if target.key_impl is not None:
        array = jax.random.wrap_key_data(array, impl=target.key_impl)
    return array


def _bounds(index: tuple, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    out = []
    for part, size in zip(index, shape):
        start, stop, step = part.indices(size)
        if step != 1:
            raise ShimError(f"JAX asked for a strided shard ({part}); ckptshim reads contiguous ranges only")
        out.append((start, stop))
    return tuple(out)


def _filler(source: SliceSource, plan: Plan, producer, target: TargetLeaf, sep: str):
    """A function from an index range of the target to a freshly read buffer holding it."""
    if isinstance(producer, (Rename, Transpose)):
        reads = _moved(plan.source[producer.source], getattr(producer, "perm", None))
    elif isinstance(producer, (Unstack, Split)):
        entry = plan.source[producer.source]
        at = np.unravel_index(producer.targets.index(target.key), [entry.shape[a] for a in producer.axes])
        reads = _split(entry, producer.axes, tuple(map(int, at)), producer.perm)
    elif isinstance(producer, (Stack, Join)):
        reads = _join([plan.source[k] for k in producer.sources], producer.axes, producer.perm, target.shape)
    else:
        raise PlanError(f"{join_key(target.key, sep)}: the JAX executor cannot run {type(producer).__name__}")

    def fill(index: tuple) -> np.ndarray:
        shape = tuple(s.stop - s.start for s in index)
        out = aligned_empty(shape, target.dtype)
        started: deque[tuple[Entry, Any, int]] = deque()
        in_flight = 0
        for entry, sub, view in reads(index, out):
            while started and in_flight + view.nbytes > IN_FLIGHT_BYTES:
                done, pending, size = started.popleft()
                _wait(pending, source, done, sep)
                in_flight -= size
            pending = source.read_into(entry, sub, view)
            if pending is not None:
                started.append((entry, pending, view.nbytes))
                in_flight += view.nbytes
        for entry, pending, _ in started:
            _wait(pending, source, entry, sep)
        return out

    return fill


# Each read list below is ``[(source entry, index into it, destination view)]`` for one block of
# the target. Where a permutation is involved the destination is a transposed *view* of the
# block's buffer, so the checkpoint reader writes every element straight into its final place:
# no full source array and no second copy of the block.


def _moved(entry: Entry, perm: tuple[int, ...] | None):
    """Reads for ``target = source.transpose(perm)`` (a plain rename when ``perm`` is None)."""
    def reads(index, out):
        return [(entry, _source_order(index, perm), _source_view(out, perm))]
    return reads


def _split(entry: Entry, axes: tuple[int, ...], at: tuple[int, ...], perm: tuple[int, ...] | None):
    """Reads for ``target = source[at along axes].transpose(perm)`` (Unstack, Split)."""
    def reads(index, out):
        full = list(_source_order(index, perm))
        for axis, i in zip(axes, at):  # ascending axes: each insert lands at its full position
            full.insert(axis, i)
        return [(entry, tuple(full), _source_view(out, perm))]
    return reads


def _join(entries: list[Entry], axes: tuple[int, ...], perm: tuple[int, ...] | None, shape: tuple[int, ...]):
    """Reads for ``target[index_k] = sources[k].transpose(perm)`` (Stack, Join): each source
    whose index falls in the block fills its place there."""
    sizes = [shape[a] for a in axes]

    def reads(index, out):
        spans = [range(*index[a].indices(shape[a])[:2]) for a in axes]
        inner = _source_order(tuple(part for a, part in enumerate(index) if a not in axes), perm)
        found = []
        for at in product(*spans):
            place = list((slice(None),) * len(shape))
            for axis, i, span in zip(axes, at, spans):
                place[axis] = i - span.start
            found.append((entries[int(np.ravel_multi_index(at, sizes))], inner,
                          _source_view(out[tuple(place)], perm)))
        return found
    return reads


def _source_order(index: tuple, perm: tuple[int, ...] | None) -> tuple:
    """A target block's index ranges rearranged into the source's axis order."""
    if perm is None:
        return index
    out = [slice(None)] * len(perm)
    for axis, part in zip(perm, index):
        out[axis] = part
    return tuple(out)


def _source_view(out: np.ndarray, perm: tuple[int, ...] | None) -> np.ndarray:
    """``out`` seen with the source's axis order (a view: writes land in ``out``)."""
    return out if perm is None else out.transpose(inverse_perm(perm))


def _wait(pending: Any, source: SliceSource, entry: Entry, sep: str) -> None:
    try:
        pending.result()
    except ShimError:
        raise
    except (ValueError, OSError) as error:  # tensorstore reports missing or corrupt data so
        raise CorruptCheckpointError(
            f"{source.path}: reading {join_key(entry.key, sep)!r} failed ({error}); the checkpoint "
            "is incomplete or corrupt. Run `ckptshim inspect` on it to see what is missing.") from None
