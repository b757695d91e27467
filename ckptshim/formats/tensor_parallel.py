"""Tensor-parallel merges and splits, and vocab padding, on arrays as formats read them.

A merge or a split is an op between a tensor's shards (one per rank, in rank order) and the
whole tensor, as the model's profile says (:func:`ckptshim.layouts.neox.spread`): a
``Concat``/``Chunk`` along the axis the ranks split, a ``Sum``/``Share`` of the row-parallel
biases, a ``Replicated``/``Replicate`` tensor each rank holds whole. :func:`run` runs one such op
over whole arrays: a layout op through its geometry (numpy views, so a rank's ``Chunk`` of an
array is a view of it and a ``Concat`` one new array), each other kind by its handler.

Arrays arrive in their storage dtype (:func:`ckptshim.formats.base.storage_dtype`: bfloat16 as
``uint16`` bits), so concatenating, slicing and zero-padding are bit-exact on any dtype; only a
sum and its share need arithmetic, done in the tensor's own precision (bfloat16 through float32
with round-to-nearest-even, as torch rounds). A split followed by a merge gives back the input
bit for bit whenever the degree is a power of two (a share divides by it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from ckptshim.errors import CorruptCheckpointError, InternalError, PlanError
from ckptshim.geometry import View, inverse_perm
from ckptshim.inventory import KeyPath
from ckptshim.ops import Op, Replicated, Share, Sum, is_layout, pieces_by_target
from ckptshim.layouts import neox

Arrays = Mapping[KeyPath, np.ndarray]


def run(op: Op, arrays: Arrays, shapes: Mapping[KeyPath, tuple[int, ...]], dtype: str, where: str
        ) -> dict[KeyPath, np.ndarray]:
    """``op``'s targets (of ``shapes``) from its sources' ``arrays``, all in the storage dtype of
    ``dtype``."""
    sources = [arrays[key] for key in op.sources]
    if is_layout(op):
        return _moved(op, sources, [shapes[key] for key in op.targets])
    handler = HANDLERS.get(op.kind)
    if handler is None:
        raise InternalError(f"{where}: a tensor-parallel {op.kind!r} op, which ckptshim cannot run on arrays; "
                            "this is a bug in ckptshim: please report it.")
    return dict(zip(op.targets, handler(op, sources, dtype, where)))


def merge(key: KeyPath, shards: Sequence[np.ndarray], dtype: str, where: str) -> np.ndarray:
    """The whole NeoX tensor ``key`` from its per-rank ``shards`` (rank order); a tensor NeoX
    has no rule for is taken as replicated."""
    if len(shards) == 1:
        return shards[0]
    names = neox.shard_keys(key, len(shards))
    op, whole = (neox.spread(key) or neox.REPLICATED).merge(names, key, shards[0].shape)
    return run(op, dict(zip(names, shards)), {key: whole}, dtype, where)[key]


def split(key: KeyPath, whole: np.ndarray, rank: int, degree: int, dtype: str, where: str) -> np.ndarray:
    """Rank ``rank``'s shard of the whole NeoX tensor ``key`` at a tensor-parallel degree of
    ``degree`` (a view of ``whole`` where it is a slice of it)."""
    if degree == 1:
        return whole
    names = neox.shard_keys(key, degree)
    op, shard = (neox.spread(key) or neox.REPLICATED).split(key, names, whole.shape)
    return run(op, {key: whole}, dict.fromkeys(names, shard), dtype, where)[names[rank]]


def resize_rows(array: np.ndarray, rows: int) -> np.ndarray:
    """``array`` with its first axis padded with zero rows, or cut, to ``rows`` (vocab padding)."""
    if array.shape[0] >= rows:
        return array[:rows]
    padded = np.zeros((rows, *array.shape[1:]), dtype=array.dtype)
    padded[:array.shape[0]] = array
    return padded


# -- the one primitive of layout ops, and a handler per other kind ---------------------------------


def _moved(op: Op, sources: list[np.ndarray], shapes: list[tuple[int, ...]]) -> dict[KeyPath, np.ndarray]:
    """Each target from the op's pieces: a view of its source where one piece is the whole
    target, else one new array filled piece by piece."""
    out = {}
    for index, (key, pieces) in enumerate(zip(op.targets, pieces_by_target(op, [a.shape for a in sources], shapes))):
        if len(pieces) == 1 and pieces[0].target.is_whole(shapes[index]):
            (piece,) = pieces
            out[key] = _viewed(sources[piece.source.array], piece.source).transpose(piece.perm)
            continue
        whole = np.empty(shapes[index], dtype=sources[0].dtype)
        for piece in pieces:
            _viewed(whole, piece.target).transpose(inverse_perm(piece.perm))[...] = \
                _viewed(sources[piece.source.array], piece.source)
        out[key] = whole
    return out


def _viewed(array: np.ndarray, view: View) -> np.ndarray:
    """The part of ``array`` that ``view`` names, as a view (its axes split into the view's
    factors -- assigning ``shape`` raises rather than copy -- then indexed)."""
    seen = array.view()
    seen.shape = view.factors
    return seen[tuple(part if type(part) is int else slice(part.start, part.stop) for part in view.index) + (Ellipsis,)]


def _summed(op: Sum, shards: list[np.ndarray], dtype: str, where: str) -> list[np.ndarray]:
    total = _arith(shards[0], dtype)
    for shard in shards[1:]:
        total = _round(total + _arith(shard, dtype), dtype)
    return [_storage(total, dtype)]


def _shared(op: Share, whole: list[np.ndarray], dtype: str, where: str) -> list[np.ndarray]:
    part = _storage(_round(_arith(whole[0], dtype) / len(op.targets), dtype), dtype)
    return [part] * len(op.targets)


def _replicated(op: Replicated, shards: list[np.ndarray], dtype: str, where: str) -> list[np.ndarray]:
    first = np.ascontiguousarray(shards[0])
    for rank, shard in enumerate(shards[1:], 1):
        if not np.array_equal(first.view(np.uint8), np.ascontiguousarray(shard).view(np.uint8)):
            raise CorruptCheckpointError(
                f"{where}: tensor-parallel rank {rank} holds a different value than rank 0, but this "
                "tensor is replicated on every rank; the shards come from different runs or steps. "
                "Re-copy the checkpoint's layer files from one save.")
    return [shards[0]]


#: Op kind -> the handler of a kind that is not a layout op.
HANDLERS: Mapping[str, Callable[[Op, list[np.ndarray], str, str], list[np.ndarray]]] = {
    Sum.kind: _summed, Share.kind: _shared, Replicated.kind: _replicated,
}


def _arith(array: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (np.asarray(array, dtype=np.uint32) << 16).view(np.float32)
    if not dtype.startswith("float"):
        raise PlanError(f"cannot sum or divide {dtype} tensor-parallel shards")
    return np.asarray(array)


def _round(values: np.ndarray, dtype: str) -> np.ndarray:
    if dtype != "bfloat16":
        return values
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return rounded.astype(np.uint32).view(np.float32)


def _storage(values: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (np.ascontiguousarray(values, dtype=np.float32).view(np.uint32) >> 16).astype("<u2")
    return values
