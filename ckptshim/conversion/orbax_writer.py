"""Orbax writer: ``StandardCheckpointer.save`` of a tree of numpy arrays, as today's Orbax writes it.

The tree's leaves are the source's read-only memory-mapped views (bfloat16 and float8 viewed
through ml_dtypes, no copy), so Orbax reads each array from disk as it serializes it; only
arrays a plan stacks are built in memory. The checkpoint goes into ``<tmp>/<DST name>``, which
:func:`ckptshim.conversion.atomic.atomic_destination` then renames to DST. Orbax shows no
progress of its own, so ``progress`` is accepted and ignored here.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ckptshim.conversion.arrays import PlannedArrays
from ckptshim.formats.ts_arrays import numpy_dtype
from ckptshim.inventory import join_key, unflatten


def write(arrays: PlannedArrays, folder: Path, destination_name: str, *, progress: bool | None = None,
          on_array: Callable[[str], None] | None = None) -> None:
    import orbax.checkpoint as ocp

    flat = {}
    for entry in arrays.entries:
        value = arrays.read(entry)
        flat[entry.key] = value.view(numpy_dtype(entry.dtype)) if value.dtype != numpy_dtype(entry.dtype) else value
        if on_array is not None:
            on_array(join_key(entry.key, arrays.sep))
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(folder / destination_name, unflatten(flat))
