"""Tensor-parallel merges and splits, and vocab padding, on arrays as formats read them.

Arrays arrive in their storage dtype (:func:`ckptshim.formats.base.storage_dtype`: bfloat16 as
``uint16`` bits), so concatenating, slicing and zero-padding are bit-exact on any dtype; only
``sum`` and its inverse need arithmetic, done in the tensor's own precision (bfloat16 through
float32 with round-to-nearest-even, as torch rounds). A split followed by a merge gives back
the input bit for bit whenever the degree is a power of two (the ``sum`` rule divides by it).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ckptshim.errors import CorruptCheckpointError, PlanError
from ckptshim.rules.profiles.neox import TPRule


def merge(shards: Sequence[np.ndarray], rule: TPRule, dtype: str, where: str) -> np.ndarray:
    """One full tensor from its per-rank ``shards`` (rank order)."""
    if len(shards) == 1:
        return shards[0]
    if rule.kind == "cat":
        return np.concatenate(shards, axis=rule.axis)
    if rule.kind == "sum":
        total = _arith(shards[0], dtype)
        for shard in shards[1:]:
            total = _round(total + _arith(shard, dtype), dtype)
        return _storage(total, dtype)
    first = np.ascontiguousarray(shards[0])
    for rank, shard in enumerate(shards[1:], 1):
        if not np.array_equal(first.view(np.uint8), np.ascontiguousarray(shard).view(np.uint8)):
            raise CorruptCheckpointError(
                f"{where}: tensor-parallel rank {rank} holds a different value than rank 0, but this "
                "tensor is replicated on every rank; the shards come from different runs or steps. "
                "Re-copy the checkpoint's layer files from one save.")
    return shards[0]


def split(full: np.ndarray, rule: TPRule, rank: int, degree: int, dtype: str, where: str) -> np.ndarray:
    """Rank ``rank``'s shard of ``full`` for a tensor-parallel degree of ``degree``."""
    if degree == 1 or rule.kind == "replicate":
        return full
    if rule.kind == "sum":
        return _storage(_round(_arith(full, dtype) / degree, dtype), dtype)
    size = full.shape[rule.axis]
    if size % degree:
        raise PlanError(f"{where}: axis {rule.axis} has {size} entries, which do not split evenly "
                        f"over {degree} tensor-parallel ranks.")
    step = size // degree
    index = [slice(None)] * full.ndim
    index[rule.axis] = slice(rank * step, (rank + 1) * step)
    return full[tuple(index)]


def resize_rows(array: np.ndarray, rows: int) -> np.ndarray:
    """``array`` with its first axis padded with zero rows, or cut, to ``rows`` (vocab padding)."""
    if array.shape[0] >= rows:
        return array[:rows]
    padded = np.zeros((rows, *array.shape[1:]), dtype=array.dtype)
    padded[:array.shape[0]] = array
    return padded


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
