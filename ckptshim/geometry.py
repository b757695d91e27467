"""Where each element of a layout op's targets comes from: one description that every executor runs.

A *layout* op moves elements and changes none (rename, transpose, stack, split, concatenate,
reorder, reshape, ...). Its geometry is a tuple of :class:`Piece`\\ s, computed from the op and
the shapes of its arrays alone (``op.pieces(source_shapes, target_shapes)``). Each piece says

    targets[piece.target.array].reshape(piece.target.factors)[piece.target.index]
        == sources[piece.source.array].reshape(piece.source.factors)[piece.source.index]
                                                                .transpose(piece.perm)

Each side is a :class:`View`: the array's axes split row-major into ``factors`` (an axis that is
not split is one factor of its own), then, per factor, one index (the factor is dropped) or a
``range``. The factors that keep a range are the piece's *kept* factors; ``perm`` orders the
source's kept factors as the target's (target kept factor ``k`` is source kept factor
``perm[k]``). A stacked layer is its target at one index of the stacking axis; a fused part a
range of the fused axis; a reordered axis two views of it in factors; a reshape its factors
and their permutation. The pieces of an op tile each of its targets.

Each executor implements one primitive over pieces, whatever the op's kind:

- the torch executor views both sides of each piece (``view`` splits axes into factors,
  indexing narrows and selects, ``permute`` orders them) and copies one into the other;
- the block reader (:mod:`ckptshim.execute.blocks`, behind the JAX executor and ``convert``)
  cuts a target block into boxes in the target's factors (:func:`factor_boxes`), keeps what
  each piece holds (:func:`meet`) and reads the matching source box (:meth:`Piece.source_index`);
- the DCP load planner shows each stored chunk where its elements land, as the maps between
  boxes of the two arrays that DCP's read items can express (:func:`box_maps`), or, for a
  reader that copies into a permuted view, a reorder's whole heads as one strided copy.

Nothing here imports numpy, torch or jax.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import product

#: One factor's part of a view: a fixed index (the factor is dropped) or a range of indices.
Index = int | range


def inverse_perm(perm: Sequence[int]) -> tuple[int, ...]:
    """The permutation that undoes ``perm`` (its argsort)."""
    out = [0] * len(perm)
    for position, axis in enumerate(perm):
        out[axis] = position
    return tuple(out)


def axis_groups(factors: Sequence[int], shape: Sequence[int]) -> list[range] | None:
    """Which consecutive ``factors`` make up each axis of ``shape`` (row-major), or ``None`` when
    they do not split it so. An axis of length 1 (or 0) takes one factor of that length; factors
    of 1 left over at the end belong to the last axis."""
    groups, at = [], 0
    for size in shape:
        start, product_ = at, 1
        while at < len(factors) and (product_ < size or (size <= 1 and at == start and factors[at] == size)):
            product_ *= factors[at]
            at += 1
        if product_ != size:
            return None
        groups.append(range(start, at))
    if groups and all(factor == 1 for factor in factors[at:]):
        groups[-1], at = range(groups[-1].start, len(factors)), len(factors)
    return groups if at == len(factors) else None


@dataclass(frozen=True, slots=True)
class View:
    """Part of one of an op's arrays: the array (its position among the op's sources, or among
    its targets) seen as ``factors``, at ``index`` (one entry per factor).

    ``kept`` (the positions of the factors that keep a range) and ``shape`` (the part's shape:
    the lengths of those ranges) follow from the index; they are computed once, as executors
    ask for them per block and per chunk.
    """

    array: int
    factors: tuple[int, ...]
    index: tuple[Index, ...]
    kept: tuple[int, ...] = field(init=False, repr=False, compare=False)
    shape: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        kept = tuple(at for at, part in enumerate(self.index) if type(part) is range)
        object.__setattr__(self, "kept", kept)
        object.__setattr__(self, "shape", tuple(len(self.index[at]) for at in kept))

    def bounds(self, shape: Sequence[int]) -> tuple[range, ...]:
        """Per axis of the array (of ``shape``), the range from the view's first index along it
        to its last: the box that holds the view (exactly, where no axis is split)."""
        out = []
        for group in axis_groups(self.factors, shape):
            first = last = 0
            for f in group:
                part = self.index[f]
                low, high = (part, part) if type(part) is int else (part.start, part.stop - 1)
                first, last = first * self.factors[f] + low, last * self.factors[f] + high
            out.append(range(first, last + 1))
        return tuple(out)

    def is_whole(self, shape: tuple[int, ...]) -> bool:
        """Whether the view is the whole array of ``shape`` as it is (no axis split, nothing left out)."""
        return self.shape == self.factors == shape


@lru_cache(maxsize=4096)
def whole(array: int, shape: tuple[int, ...]) -> View:
    """All of ``array`` (of ``shape``), its axes as they are."""
    return View(array, shape, tuple(range(size) for size in shape))


def at(array: int, shape: tuple[int, ...], index: dict[int, Index]) -> View:
    """``array`` (of ``shape``, no axis split) at ``index`` along some axes, whole along the rest."""
    return View(array, shape, tuple(index.get(axis, range(size)) for axis, size in enumerate(shape)))


def unravel(position: int, sizes: Sequence[int]) -> tuple[int, ...]:
    """``position``'s row-major index into ``sizes`` (``numpy.unravel_index``)."""
    out = []
    for size in reversed(sizes):
        position, rest = divmod(position, size)
        out.append(rest)
    return tuple(reversed(out))


@dataclass(frozen=True, slots=True)
class Piece:
    """``target`` is ``source`` with its kept factors permuted by ``perm`` (see the module
    docstring)."""

    source: View
    target: View
    perm: tuple[int, ...]
    #: ``perm`` is the identity: the kept factors are in the same order on both sides
    ordered: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ordered", self.perm == tuple(range(len(self.perm))))

    def inverse(self) -> Piece:
        """The same correspondence read the other way (the source as the target)."""
        return Piece(self.target, self.source, inverse_perm(self.perm))

    def is_identity(self, source_shape: tuple[int, ...], target_shape: tuple[int, ...]) -> bool:
        """Whether the target is the whole source as it is."""
        return self.ordered and self.source.is_whole(source_shape) and self.target.is_whole(target_shape)

    def fits(self, source_shape: Sequence[int], target_shape: Sequence[int]) -> bool:
        """Whether both views lie inside arrays of these shapes and, permuted, have one shape."""
        return (_inside(self.source, source_shape) and _inside(self.target, target_shape)
                and len(self.perm) == len(self.source.kept) == len(self.target.kept)
                and sorted(self.perm) == list(range(len(self.perm)))
                and tuple(self.source.shape[p] for p in self.perm) == self.target.shape)

    def source_index(self, target_index: Sequence[Index]) -> tuple[Index, ...]:
        """The source's index (per source factor) of what ``target_index`` -- a part of the
        target's view, as :func:`meet` gives it -- holds."""
        out = list(self.source.index)
        source_kept, own = self.source.kept, self.target.index
        for k, position in enumerate(self.target.kept):
            part, base = target_index[position], own[position].start
            into = source_kept[self.perm[k]]
            start = out[into].start - base
            out[into] = range(part.start + start, part.stop + start)
        return tuple(out)


def _inside(view: View, shape: Sequence[int]) -> bool:
    if axis_groups(view.factors, shape) is None or len(view.index) != len(view.factors):
        return False
    return all(0 <= part < size if type(part) is int else
               (part.step == 1 and 0 <= part.start <= part.stop <= size)
               for part, size in zip(view.index, view.factors))


def tiles(pieces: Sequence[Piece], source_shapes: Sequence[tuple[int, ...]],
          target_shapes: Sequence[tuple[int, ...]]) -> bool:
    """Whether ``pieces`` fit arrays of these shapes, fill each target exactly once and read all
    of every source, once or (copies of it: a replicate) several times -- by count: an op's
    pieces do not overlap on a target by construction, so the counts say whether the shapes are
    the ones the op makes of each other."""
    filled, read = [0] * len(target_shapes), [0] * len(source_shapes)
    for piece in pieces:
        if not (0 <= piece.source.array < len(source_shapes) and 0 <= piece.target.array < len(target_shapes)):
            return False
        if not piece.fits(source_shapes[piece.source.array], target_shapes[piece.target.array]):
            return False
        size = math.prod(piece.target.shape)
        filled[piece.target.array] += size
        read[piece.source.array] += size
    sizes = [math.prod(shape) for shape in source_shapes]
    return (all(count == math.prod(shape) for count, shape in zip(filled, target_shapes))
            and all(count == size if size == 0 else count >= size and count % size == 0
                    for count, size in zip(read, sizes)))


# -- boxes ------------------------------------------------------------------------------------------


def split_range(start: int, stop: int, factors: Sequence[int]) -> list[tuple[int, int, tuple[range, ...]]]:
    """The range ``[start, stop)`` of an axis read row-major as ``factors``, cut into boxes:
    ``(begin, end, one range per factor)``. A range of whole inner blocks is one box; otherwise
    at most a head and a tail within one outer index, around such a middle."""
    if start >= stop:
        return []
    if len(factors) <= 1:
        return [(start, stop, (range(start, stop),) if factors else ())]
    inner = math.prod(factors[1:])
    first, last = start // inner, (stop - 1) // inner
    if start % inner == 0 and stop % inner == 0:
        return [(start, stop, (range(first, last + 1),) + tuple(range(f) for f in factors[1:]))]
    if first == last:
        base = first * inner
        return [(b + base, e + base, (range(first, first + 1),) + rest)
                for b, e, rest in split_range(start - base, stop - base, factors[1:])]
    head = (first + 1) * inner if start % inner else start
    tail = last * inner if stop % inner else stop
    return split_range(start, head, factors) + split_range(head, tail, factors) + split_range(tail, stop, factors)


def factor_boxes(box: Sequence[range], shape: Sequence[int], factors: Sequence[int]
                 ) -> Iterator[tuple[tuple[range, ...], tuple[range, ...]]]:
    """``box`` (a range per axis of an array of ``shape``) cut into boxes of the array seen as
    ``factors``: for each, its range per axis and its range per factor."""
    if tuple(factors) == tuple(shape):  # no axis split: the box itself
        parts = tuple(box)
        yield parts, parts
        return
    groups = axis_groups(factors, shape)
    if groups is None:
        raise ValueError(f"factors {tuple(factors)} do not split shape {tuple(shape)} row-major")
    per_axis = [split_range(part.start, part.stop, [factors[f] for f in group]) for part, group in zip(box, groups)]
    for pieces in product(*per_axis):
        yield (tuple(range(b, e) for b, e, _ in pieces),
               tuple(part for *_, parts in pieces for part in parts))


def meet(parts: Sequence[range], index: Sequence[Index]) -> tuple[Index, ...] | None:
    """The common part of a factor box (``parts``) and a view's ``index``, or ``None`` when they
    share nothing: a fixed index where the view has one, else the overlap of the two ranges."""
    out: list[Index] = []
    for part, own in zip(parts, index):
        if type(own) is int:
            if own not in part:
                return None
            out.append(own)
            continue
        low, high = max(part.start, own.start), min(part.stop, own.stop)
        if low >= high:
            return None
        out.append(range(low, high))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class BoxMap:
    """``target[target_box]`` is ``source[source_box]`` with its axes rearranged: target axis
    ``t`` runs along source axis ``axes[t]``, or has one index where that is ``None``; a source
    axis no target axis runs along has one index. Any block of the target box is then the block
    of the source box at the same offsets along the matching axes -- what a DCP read item
    (offsets and lengths into one stored chunk) can say."""

    source_box: tuple[range, ...]
    target_box: tuple[range, ...]
    axes: tuple[int | None, ...]


@dataclass(frozen=True, slots=True)
class StridedMap:
    """``target[target_box]``, its axes split row-major into ``factors`` and those permuted by
    ``order``, is ``source[source_box]`` with its axes split row-major: one strided copy (a
    view of either side) where :class:`BoxMap`\\ s would cut a reordered axis into one per run."""

    source_box: tuple[range, ...]
    target_box: tuple[range, ...]
    factors: tuple[int, ...]
    order: tuple[int, ...]


def box_maps(piece: Piece, source_shape: Sequence[int], target_shape: Sequence[int],
             source_box: Sequence[range], strided: bool = False) -> Iterator[BoxMap | StridedMap]:
    """What ``piece`` takes from ``source_box`` (a box of the source array: a stored chunk), as
    maps between boxes of the two arrays (:class:`BoxMap`).

    Within one map each target axis runs along one source axis, one index after the other on
    both sides. Where the piece splits axes, a target axis does so along the run of its
    innermost factors that are also, in the same order, the innermost factors of one source
    axis; every other factor that varies is enumerated, one map per index. So a transpose, a
    stacked layer or a fused part is one map per box, and a reordered axis one map per run of
    target rows whose source rows are consecutive -- or, with ``strided`` (a reader that copies
    a block into a permuted view of its destination), one :class:`StridedMap` per box of the
    source in its factors whose part of the target is one box (a reorder of whole heads).
    """
    if piece.source.factors == tuple(source_shape) and piece.target.factors == tuple(target_shape):
        yield from _unsplit(piece, source_box)
        return
    back, strided = piece.inverse(), strided and not piece.ordered
    for box, parts in factor_boxes(source_box, source_shape, piece.source.factors):
        source_index = meet(parts, piece.source.index)
        if source_index is None:
            continue
        target_index = back.source_index(source_index)
        whole = _strided(piece, box, source_index, target_index, target_shape) if strided else None
        if whole is not None:
            yield whole
        else:
            yield from _lowered(source_index, target_index, piece, source_shape, target_shape)


def _strided(piece: Piece, box: tuple[range, ...], source_index: tuple[Index, ...], target_index: tuple[Index, ...],
             target_shape: Sequence[int]) -> StridedMap | None:
    """One box of the source (``box``; ``source_index`` in its factors) of a piece that keeps
    every factor on both sides as one :class:`StridedMap`, where its part of the target
    (``target_index``) is one box of the target too."""
    if len(piece.source.kept) != len(piece.source.factors) or len(piece.target.kept) != len(piece.target.factors):
        return None
    target_box = View(piece.target.array, piece.target.factors, target_index).bounds(target_shape)
    factors = tuple(len(part) for part in target_index)
    if math.prod(map(len, target_box)) != math.prod(factors):
        return None
    return StridedMap(box, target_box, factors, inverse_perm(piece.perm))


def _unsplit(piece: Piece, source_box: Sequence[range]) -> Iterator[BoxMap]:
    """:func:`box_maps` of a piece that splits no axis on either side: one map, each kept target
    axis running along the source axis the permutation names."""
    held = meet(source_box, piece.source.index)
    if held is None:
        return
    along = iter(piece.source.kept[p] for p in piece.perm)  # the source axis of each kept target axis
    target_box: list[range] = []
    axes: list[int | None] = []
    for part in piece.target.index:
        if type(part) is int:
            target_box.append(range(part, part + 1))
            axes.append(None)
            continue
        axis = next(along)
        start = part.start + held[axis].start - piece.source.index[axis].start
        target_box.append(range(start, start + len(held[axis])))
        axes.append(axis)
    source = tuple(range(h, h + 1) if type(h) is int else h for h in held)
    yield BoxMap(source, tuple(target_box), tuple(axes))


def _lowered(source_index: tuple[Index, ...], target_index: tuple[Index, ...], piece: Piece,
             source_shape: Sequence[int], target_shape: Sequence[int]) -> Iterator[BoxMap]:
    """One box of each side in factors (a piece's part) as :class:`BoxMap`\\ s (see :func:`box_maps`)."""
    sf, tf = piece.source.factors, piece.target.factors
    source_groups, target_groups = axis_groups(sf, source_shape), axis_groups(tf, target_shape)
    source_axis = {f: axis for axis, group in enumerate(source_groups) for f in group}
    source_kept, target_kept = piece.source.kept, piece.target.kept
    twin = {target_kept[k]: source_kept[p] for k, p in enumerate(piece.perm)}  # target factor -> source factor
    runs: dict[int, tuple[list[int], int]] = {}  # target axis -> (its run of target factors, source axis)
    for axis, group in enumerate(target_groups):
        mine = [f for f in group if tf[f] != 1]
        if not mine or type(target_index[mine[-1]]) is not range:
            continue
        partner = twin[mine[-1]]
        theirs = [f for f in source_groups[source_axis[partner]] if sf[f] != 1]
        if not theirs or theirs[-1] != partner:  # (a factor of 1 on the source side: one index here)
            continue
        run = [mine[-1]]
        while (len(run) < min(len(mine), len(theirs)) and len(target_index[run[-1]]) == tf[run[-1]]
               and sf[twin[run[-1]]] == tf[run[-1]] and twin.get(mine[-1 - len(run)]) == theirs[-1 - len(run)]):
            run.append(mine[-1 - len(run)])
        runs[axis] = (run, source_axis[partner])
    in_run = {f for run, _ in runs.values() for f in run}
    enumerated = [f for f in target_kept if f not in in_run and len(target_index[f]) > 1]
    source_of = {source: target for target, source in twin.items()}
    axes = tuple(runs[axis][1] if axis in runs else None for axis in range(len(target_groups)))
    for values in product(*(target_index[f] for f in enumerated)):
        chosen = dict(zip(enumerated, values))
        target_at = [chosen.get(f, part if type(part) is int else part.start) for f, part in enumerate(target_index)]
        source_at = [part if type(part) is int else
                     part.start + target_at[source_of[f]] - target_index[source_of[f]].start
                     for f, part in enumerate(source_index)]
        target_box = _box(target_at, tf, target_groups, {axis: run for axis, (run, _) in runs.items()}, target_index)
        source_box = _box(source_at, sf, source_groups,
                          {s: [twin[f] for f in run] for run, s in runs.values()}, source_index)
        yield BoxMap(source_box, target_box, axes)


def _box(start: Sequence[int], factors: Sequence[int], groups: Sequence[range], runs: dict[int, list[int]],
         index: Sequence[Index]) -> tuple[range, ...]:
    """Per axis: the row-major position of ``start`` in the axis's factors, and as long as the
    axis's run of factors (their ranges in ``index``) says, else one index."""
    out = []
    for axis, group in enumerate(groups):
        position = 0
        for f in group:
            position = position * factors[f] + start[f]
        length = 1
        for f in runs.get(axis, ()):
            length *= len(index[f])
        out.append(range(position, position + length))
    return tuple(out)
