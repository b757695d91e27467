"""Block reads: fill any index range of a planned array from exactly the checkpoint bytes it needs.

This is the array executor behind both the JAX executor (each device's shard is one block) and
``ckptshim convert`` (an output array is one block). For a target block it lists the reads that
fill it -- for a ``Rename`` (``Transpose``) the same range of the source (the range the
permutation maps it to); for an ``Unstack`` (``Split``) the range at one layer (one index of the
split axes) of the stacked source; for a ``Stack`` (``Join``) the matching range of each
per-layer source that falls in the block; for a ``Concat`` the part of each source whose slot
of the fused array falls in the block; for a ``Chunk`` the range of its part of the fused
source; for a ``Reorder`` each run of rows whose source rows are consecutive; for a ``Reshape``
each box of the block in the factored coordinates, one read per source array -- and hands each
to the checkpoint's ``read_into(entry, index, out)``, which copies ``entry[index]`` into ``out``
(cast to its dtype). A ``Reshape`` read indexes the source in its factors (``[heads, half,
head_dim / 2, emb]`` for ``[heads * head_dim, emb]``): a checkpoint that stores each array as
one row-major run (``row_major``: safetensors) reads that shape of the same bytes as it is;
any other reads the needed range of the unsplit axes (the whole of each split one) and copies
the box out of it. A ``Scale`` of the target then multiplies the filled block, as its op says.
Where a permutation is involved, ``out`` is a transposed *view* of the block's buffer, so every
element lands straight in its final place: no full source array, no second copy of the block.

Reads go into a 64-byte aligned buffer (which JAX's CPU backend adopts without a copy); at most
:data:`IN_FLIGHT_BYTES` of reads are pending at once, bounding the transient memory of formats
that decompress chunks while keeping a few reads going in parallel.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping
from itertools import product
from typing import Any, Protocol

import numpy as np

from ckptshim.errors import CorruptCheckpointError, ShimError
from ckptshim.inventory import Entry, KeyPath, join_key
from ckptshim.formats.base import numpy_dtype
from ckptshim.ops import (Chunk, Concat, Join, Op, Rename, Reorder, Reshape, Scale, Split, Stack, Transpose, Unstack,
                          axis_groups, inverse_perm)
from ckptshim.planner import Plan

_ALIGN = 64  # XLA's CPU client adopts host buffers aligned to this without copying them
#: Reads started but not finished, in bytes of their destination. Each holds its chunks'
#: compressed and decompressed bytes until it completes, so this bounds the transient memory
#: (a stacked target would otherwise start one read per layer at once) while keeping a few
#: reads going in parallel. On the 1 GiB bench (8 MiB chunks), 16 MiB keeps peak RSS near
#: 1.08x the restored bytes and is faster than more parallel reads on 2 cores.
IN_FLIGHT_BYTES = 16 * 2**20


class SliceSource(Protocol):
    """What block reads need of a checkpoint (every :class:`~ckptshim.formats.base.Checkpoint`)."""

    path: Any

    def read_into(self, entry: Entry, index: tuple, out: np.ndarray) -> Any: ...


#: For a block (an index range of the target) and its buffer: ``[(source entry, index into it,
#: destination view)]``, the reads that fill the buffer.
Reads = Callable[[tuple, np.ndarray], list[tuple[Entry, tuple, np.ndarray]]]
Fill = Callable[[tuple], np.ndarray]


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on a 64-byte boundary."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + _ALIGN, dtype=np.uint8)
    start = (-raw.ctypes.data) % _ALIGN
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def filler(source: SliceSource, plan: Plan, producer: Op, key: KeyPath, shape: tuple[int, ...],
           dtype: np.dtype, sep: str = "/", scale: Scale | None = None) -> Fill:
    """A function from an index range of target ``key`` (made by ``producer``, then multiplied by
    ``scale``) to a freshly read ``dtype`` buffer holding it. ``producer``'s kind must be one of
    :data:`READS`."""
    reads = READS[producer.kind](plan, producer, key, shape)
    row_major = getattr(source, "row_major", False)

    def fill(index: tuple) -> np.ndarray:
        out = aligned_empty(tuple(s.stop - s.start for s in index), dtype)
        started: deque[tuple[Entry, Any, int]] = deque()
        in_flight = 0
        for entry, sub, view in reads(index, out):
            while started and in_flight + view.nbytes > IN_FLIGHT_BYTES:
                done, pending, size = started.popleft()
                _wait(pending, source, done, sep)
                in_flight -= size
            stored = plan.source[entry.key]
            if entry.shape != stored.shape and not row_major:  # a factored read of a chunked format
                _read_box(source, stored, entry.shape, sub, view, sep)
                continue
            pending = source.read_into(entry, sub, view)
            if pending is not None:
                started.append((entry, pending, view.nbytes))
                in_flight += view.nbytes
        for entry, pending, _ in started:
            _wait(pending, source, entry, sep)
        if scale is not None:
            apply_scale(scale, out)
        return out

    return fill


def scales(plan: Plan) -> dict[KeyPath, Scale]:
    """Target key -> the ``Scale`` of its value, for the plan's scaled targets."""
    return {key: op for op in plan.ops if op.kind == Scale.kind for key in op.targets}


def apply_scale(op: Scale, out: np.ndarray) -> None:
    """``out`` multiplied in place as ``op`` says: in its compute dtype, rounded to its dtype."""
    compute = numpy_dtype(op.compute_dtype)
    product = np.multiply(out.astype(compute), compute.type(op.factor))
    out[...] = product.astype(numpy_dtype(op.dtype)).astype(out.dtype)


def _read_box(source: SliceSource, stored: Entry, factors: tuple[int, ...], index: tuple, out: np.ndarray,
              sep: str) -> None:
    """``stored`` read as ``factors``, ``[index]`` into ``out``, for a format that cannot read a
    factored shape itself: the index range of each unsplit axis, the whole of each split one."""
    groups = axis_groups(factors, stored.shape)
    covering, inner = [], []
    for group in groups:
        if len(group) == 1:
            part = index[group[0]]
            covering.append(part)
            inner.append(slice(0, part.stop - part.start))
        else:
            covering.append(slice(None))
            inner += [index[f] for f in group]
    region = aligned_empty(tuple(len(range(*c.indices(n))) for c, n in zip(covering, stored.shape)), out.dtype)
    pending = source.read_into(stored, tuple(covering), region)
    if pending is not None:
        _wait(pending, source, stored, sep)
    factored = [region.shape[g[0]] if len(g) == 1 else factors[f] for g in groups for f in g]
    np.copyto(out, region.reshape(factored)[tuple(inner)])


def whole(shape: tuple[int, ...]) -> tuple[slice, ...]:
    """The index range of a whole array."""
    return tuple(slice(0, n) for n in shape)


# -- the reads of each op kind -------------------------------------------------------------------


def _moved(plan: Plan, op: Rename | Transpose, key: KeyPath, shape: tuple[int, ...]) -> Reads:
    """``target = source.transpose(perm)`` (a plain rename has no ``perm``)."""
    entry, perm = plan.source[op.source], getattr(op, "perm", None)

    def reads(index, out):
        return [(entry, _source_order(index, perm), _source_view(out, perm))]
    return reads


def _split(plan: Plan, op: Unstack | Split, key: KeyPath, shape: tuple[int, ...]) -> Reads:
    """``target = source[at along axes].transpose(perm)``, ``at`` being ``key``'s place."""
    entry = plan.source[op.source]
    at = tuple(map(int, np.unravel_index(op.targets.index(key), [entry.shape[a] for a in op.axes])))

    def reads(index, out):
        full = list(_source_order(index, op.perm))
        for axis, i in zip(op.axes, at):  # ascending axes: each insert lands at its full position
            full.insert(axis, i)
        return [(entry, tuple(full), _source_view(out, op.perm))]
    return reads


def _join(plan: Plan, op: Stack | Join, key: KeyPath, shape: tuple[int, ...]) -> Reads:
    """``target[index_k] = sources[k].transpose(perm)``: each source whose index falls in the
    block fills its place there."""
    entries = [plan.source[k] for k in op.sources]
    sizes = [shape[a] for a in op.axes]

    def reads(index, out):
        spans = [range(*index[a].indices(shape[a])[:2]) for a in op.axes]
        inner = _source_order(tuple(part for a, part in enumerate(index) if a not in op.axes), op.perm)
        found = []
        for at in product(*spans):
            place = list((slice(None),) * len(shape))
            for axis, i, span in zip(op.axes, at, spans):
                place[axis] = i - span.start
            found.append((entries[int(np.ravel_multi_index(at, sizes))], inner,
                          _source_view(out[tuple(place)], op.perm)))
        return found
    return reads


def _concat(plan: Plan, op: Concat, key: KeyPath, shape: tuple[int, ...]) -> Reads:
    """``target = cat(parts, axis)``: each source whose slot overlaps the block fills the overlap."""
    count = len(op.sources)
    slots = [(plan.source[source], *op.slot(k, count)) for k, source in enumerate(op.sources)]

    def reads(index, out):
        index = _concrete(index, shape)
        found = []
        for entry, member, start, size in slots:
            if member is not None and not index[op.stack_axis].start <= member < index[op.stack_axis].stop:
                continue
            low, high = max(index[op.axis].start, start), min(index[op.axis].stop, start + size)
            if low >= high:
                continue
            place = list(slice(0, part.stop - part.start) for part in index)
            place[op.axis] = slice(low - index[op.axis].start, high - index[op.axis].start)
            inner = list(index)
            inner[op.axis] = slice(low - start, high - start)
            if member is not None:
                place[op.stack_axis] = member - index[op.stack_axis].start
                del inner[op.stack_axis]
            found.append((entry, tuple(inner), out[tuple(place)]))
        return found
    return reads


def _chunk(plan: Plan, op: Chunk, key: KeyPath, shape: tuple[int, ...]) -> Reads:
    """``target = source[its part]``: the block's range, moved to the part's place in the source."""
    entry = plan.source[op.source]
    member, start, _ = op.slot(op.targets.index(key), len(op.targets))

    def reads(index, out):
        full = list(_concrete(index, shape))
        if member is not None:
            full.insert(op.stack_axis, member)
        full[op.axis] = slice(full[op.axis].start + start, full[op.axis].stop + start)
        return [(entry, tuple(full), out)]
    return reads


def _reorder(plan: Plan, op: Reorder, key: KeyPath, shape: tuple[int, ...]) -> Reads:
    """``target`` is the source with the rows along ``axis`` permuted: each run of the block's
    rows whose source rows are consecutive is one read."""
    entry = plan.source[op.source]
    rows = np.arange(int(np.prod(op.factors))).reshape(op.factors).transpose(op.order).reshape(-1)

    def reads(index, out):
        index = _concrete(index, shape)
        part = index[op.axis]
        wanted = rows[part.start:part.stop]
        if not len(wanted):
            return []
        breaks = np.flatnonzero(np.diff(wanted) != 1) + 1
        found = []
        for begin, end in zip([0, *breaks.tolist()], [*breaks.tolist(), len(wanted)]):
            source = list(index)
            source[op.axis] = slice(int(wanted[begin]), int(wanted[begin]) + end - begin)
            place = [slice(None)] * len(index)
            place[op.axis] = slice(begin, end)
            found.append((entry, tuple(source), out[tuple(place)]))
        return found
    return reads


def _boxes(start: int, stop: int, factors: list[int]) -> list[tuple[int, int, tuple[slice, ...]]]:
    """The range ``[start, stop)`` of an axis read row-major as ``factors``, cut into boxes:
    ``(begin, end, one slice per factor)``. A range of whole inner blocks is one box; otherwise
    at most a head and a tail within one outer index, around such a middle."""
    if start >= stop:
        return []
    if len(factors) == 1:
        return [(start, stop, (slice(start, stop),))]
    inner = math.prod(factors[1:])
    first, last = start // inner, (stop - 1) // inner
    if start % inner == 0 and stop % inner == 0:
        return [(start, stop, (slice(first, last + 1),) + tuple(slice(0, f) for f in factors[1:]))]
    if first == last:
        base = first * inner
        return [(b + base, e + base, (slice(first, first + 1),) + rest)
                for b, e, rest in _boxes(start - base, stop - base, factors[1:])]
    head = (first + 1) * inner if start % inner else start
    tail = last * inner if stop % inner else stop
    return _boxes(start, head, factors) + _boxes(head, tail, factors) + _boxes(tail, stop, factors)


def _split_view(array: np.ndarray, shape: list[int]) -> np.ndarray:
    """``array`` with its axes split into ``shape`` -- always a view (assigning ``shape`` raises
    rather than copy), so reads land in the block's buffer."""
    view = array.view()
    view.shape = shape
    return view


def _reshaped(plan: Plan, op: Reshape, key: KeyPath, shape: tuple[int, ...]) -> Reads:
    """``target = source.reshape(factors).transpose(perm).reshape(shape)``: each box of the block
    in the target's factors is a box of the source's factors, read into the block's buffer seen
    in the source's factor order (one read per stacked source)."""
    entries = [plan.source[k] for k in op.sources]
    target_factors = op.target_factors
    groups = axis_groups(target_factors, op.shape)
    back = inverse_perm(op.perm)
    at = op.targets.index(key)
    several = len(op.sources) > 1

    def reads(index, out):
        index = _concrete(index, shape)
        if len(op.targets) > 1:
            index, out = (slice(at, at + 1),) + index, out[None]
        found = []
        per_axis = [_boxes(part.start, part.stop, [target_factors[f] for f in group])
                    for part, group in zip(index, groups)]
        for pieces in product(*per_axis):
            place = tuple(slice(b - part.start, e - part.start) for (b, e, _), part in zip(pieces, index))
            slices = [s for *_, parts in pieces for s in parts]
            view = _split_view(out[place], [s.stop - s.start for s in slices]).transpose(back)
            source = tuple(slices[back[f]] for f in range(len(back)))
            if not several:
                found.append((_factored(entries[0], op.factors), source, view))
                continue
            for i in range(source[0].start, source[0].stop):
                found.append((_factored(entries[i], op.factors[1:]), source[1:], view[i - source[0].start]))
        return found
    return reads


def _factored(entry: Entry, factors: tuple[int, ...]) -> Entry:
    """``entry`` seen as ``factors`` (the same row-major bytes); itself when nothing is split."""
    return entry if entry.shape == factors else Entry(entry.key, factors, entry.dtype, entry.location)


#: Op kind -> the reads that fill a block of one of its targets.
READS: Mapping[str, Callable[[Plan, Any, KeyPath, tuple[int, ...]], Reads]] = {
    Rename.kind: _moved, Transpose.kind: _moved,
    Unstack.kind: _split, Split.kind: _split,
    Stack.kind: _join, Join.kind: _join,
    Concat.kind: _concat, Chunk.kind: _chunk, Reorder.kind: _reorder, Reshape.kind: _reshaped,
}


def _concrete(index: tuple, shape: tuple[int, ...]) -> tuple[slice, ...]:
    """A block's index ranges with every start and stop spelled out."""
    return tuple(slice(*part.indices(size)[:2]) for part, size in zip(index, shape))


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
