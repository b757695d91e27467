"""Block reads: fill any index range of a planned array from exactly the checkpoint bytes it needs.

This is the array executor behind both the JAX executor (each device's shard is one block) and
``ckptshim convert`` (an output array is one block). It runs every layout op through its
geometry (:mod:`ckptshim.geometry`), whatever its kind: the block is cut into boxes in the
target's factors, and the part of each box that one of the op's pieces holds is one read of
the source box the piece maps it to -- the same range of a renamed source, one layer of a
stacked one, the slot of a fused one, one run of a reordered axis, one box per source array of
a reshape -- handed to the checkpoint's ``read_into(entry, index, out)``, which copies
``entry[index]`` into ``out`` (cast to its dtype). A source the piece splits into factors
(``[heads, half, head_dim / 2, emb]`` for ``[heads * head_dim, emb]``) is indexed in them: a
checkpoint that stores each array as one row-major run (``row_major``: safetensors) reads that
shape of the same bytes as it is; any other reads the rows the box spans of each split axis
(the index range of every other) and copies the box out of them. A ``Scale`` of the target
then multiplies the filled block, as its op says. ``out`` is a view of the block's buffer in
the source's factor order (transposed where the piece permutes), so every element lands
straight in its final place: no full source array, no second copy of the block.

Reads go into a 64-byte aligned buffer (which JAX's CPU backend adopts without a copy); at most
:data:`IN_FLIGHT_BYTES` of reads are pending at once, bounding the transient memory of formats
that decompress chunks while keeping a few reads going in parallel.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from ckptshim.errors import CorruptCheckpointError, ShimError
from ckptshim.inventory import Entry, KeyPath, join_key
from ckptshim.formats.base import numpy_dtype
from ckptshim.geometry import Piece, axis_groups, factor_boxes, inverse_perm, meet
from ckptshim.ops import LayoutOp, Scale, pieces_by_target
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


def filler(source: SliceSource, plan: Plan, producer: LayoutOp, key: KeyPath, shape: tuple[int, ...],
           dtype: np.dtype, sep: str = "/", scale: Scale | None = None) -> Fill:
    """A function from an index range of target ``key`` (made by ``producer``, a layout op, then
    multiplied by ``scale``) to a freshly read ``dtype`` buffer holding it."""
    reads = _reads(plan, producer, key, shape)
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
    factored shape itself: of each axis split into factors, the rows from the first to the last
    index of its outermost factor (all of its inner ones); of every other axis, the index range."""
    covering, inner, factored = [], [], []
    for group in axis_groups(factors, stored.shape):
        outer = index[group[0]]
        low, high = (outer, outer + 1) if isinstance(outer, int) else (outer.start, outer.stop)
        rows = math.prod(factors[f] for f in group[1:])
        covering.append(slice(low * rows, high * rows))
        inner.append(0 if isinstance(outer, int) else slice(0, high - low))
        inner += [index[f] for f in group[1:]]
        factored += [high - low] + [factors[f] for f in group[1:]]
    region = aligned_empty(tuple(c.stop - c.start for c in covering), out.dtype)
    pending = source.read_into(stored, tuple(covering), region)
    if pending is not None:
        _wait(pending, source, stored, sep)
    np.copyto(out, region.reshape(factored)[tuple(inner)])


def whole(shape: tuple[int, ...]) -> tuple[slice, ...]:
    """The index range of a whole array."""
    return tuple(slice(0, n) for n in shape)


# -- the reads of a layout op's target ----------------------------------------------------------


def _reads(plan: Plan, op: LayoutOp, key: KeyPath, shape: tuple[int, ...]) -> Reads:
    """The reads that fill a block of target ``key`` of ``op``, from the op's pieces.

    The block is cut into boxes in the target's factors (:func:`~ckptshim.geometry.factor_boxes`);
    the part of each box a piece holds is read from the source box the piece maps it to, into
    the block's buffer seen as the box's factors, in the source's factor order (a view, so every
    element lands in its place). A source split into factors is read as an entry of that shape
    (the same row-major bytes; see :func:`filler`).
    """
    entries = [plan.source[k] for k in op.sources]
    pieces = target_pieces(plan, op, key)
    if len(pieces) == 1 and pieces[0].is_identity(entries[pieces[0].source.array].shape, shape):
        entry = entries[pieces[0].source.array]  # the source as it is (a rename): the block's own range of it
        return lambda index, out: [(entry, index, out)]
    factored = [(piece, _factored(entries[piece.source.array], piece.source.factors), inverse_perm(piece.perm),
                 piece.target.bounds(shape), piece.target.factors != shape) for piece in pieces]

    def reads(index, out):
        block = tuple(range(*part.indices(size)[:2]) for part, size in zip(index, shape))
        found = []
        for piece, entry, back, bounds, split in factored:
            if any(part.stop <= held.start or held.stop <= part.start for part, held in zip(block, bounds)):
                continue  # the piece lies outside the block (another device's layer or part)
            if not split:  # the block is one box of the target's own axes
                held = meet(block, piece.target.index)
                if held is None:  # an empty block
                    continue
                view = out[_relative(held, block)]
                found.append((entry, _numpy_index(piece.source_index(held)),
                              view if piece.ordered else view.transpose(back)))
                continue
            for parts, factor_parts in factor_boxes(block, shape, piece.target.factors):
                held = meet(factor_parts, piece.target.index)
                if held is None:
                    continue
                place = tuple(slice(p.start - b.start, p.stop - b.start) for p, b in zip(parts, block))
                view = _split_view(out[place + (Ellipsis,)], [len(p) for p in factor_parts])
                view = view[_relative(held, factor_parts)].transpose(back)
                found.append((entry, _numpy_index(piece.source_index(held)), view))
        return found
    return reads


def _relative(held: tuple, within: tuple[range, ...]) -> tuple:
    """Numpy's index of ``held`` (a fixed index or a range per axis) inside the box ``within``
    (a view, even where every index is fixed)."""
    return tuple(h - w.start if type(h) is int else slice(h.start - w.start, h.stop - w.start)
                 for h, w in zip(held, within)) + (Ellipsis,)


def target_pieces(plan: Plan, op: LayoutOp, key: KeyPath) -> list[Piece]:
    """The pieces of ``op`` that fill its target ``key``, for the shapes the plan gives its arrays."""
    return pieces_by_target(op, [plan.source[k].shape for k in op.sources],
                            [plan.target[k].shape for k in op.targets])[op.targets.index(key)]


def _numpy_index(index: tuple) -> tuple:
    """A view's index (ints and ranges) as numpy's (ints and slices)."""
    return tuple(part if type(part) is int else slice(part.start, part.stop) for part in index)


def _split_view(array: np.ndarray, shape: list[int]) -> np.ndarray:
    """``array`` with its axes split into ``shape`` -- always a view (assigning ``shape`` raises
    rather than copy), so reads land in the block's buffer."""
    view = array.view()
    view.shape = shape
    return view


def _factored(entry: Entry, factors: tuple[int, ...]) -> Entry:
    """``entry`` seen as ``factors`` (the same row-major bytes); itself when nothing is split."""
    return entry if entry.shape == factors else Entry(entry.key, factors, entry.dtype, entry.location)


def _wait(pending: Any, source: SliceSource, entry: Entry, sep: str) -> None:
    try:
        pending.result()
    except ShimError:
        raise
    except (ValueError, OSError) as error:  # tensorstore reports missing or corrupt data so
        raise CorruptCheckpointError(
            f"{source.path}: reading {join_key(entry.key, sep)!r} failed ({error}); the checkpoint "
            "is incomplete or corrupt. Run `ckptshim inspect` on it to see what is missing.") from None
