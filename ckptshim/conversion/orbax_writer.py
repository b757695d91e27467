"""Orbax writer: the tree of numpy arrays saved by Orbax's own PyTree handler, as today's Orbax
writes it (OCDBT, zarr, ``_METADATA``; ``StandardCheckpointer`` is a thin wrapper of the same
handler and restores it as is).

The tree's leaves are the source's read-only memory-mapped views (bfloat16 and float8 viewed
through ml_dtypes, no copy); only arrays a plan stacks are built in memory. Orbax's numpy
handler would first deep-copy every leaf (the whole model in memory at once) and reports no
progress, so the save goes through a handler registry of its own whose numpy handler skips the
copy (nothing else holds these arrays, and the source stays open until the save is done) and
counts each array once tensorstore has written it. The count hooks
``NumpyHandler._open_and_write``, the per-array step of Orbax 0.12's numpy handler and not public
API: tests/test_convert.py checks that every array is reported once, so an Orbax that renames it
fails there, not silently. The checkpoint goes into ``<tmp>/<DST name>``, which
:func:`ckptshim.conversion.atomic.atomic_destination` then renames to DST.
"""

from __future__ import annotations

import numpy as np

from ckptshim.conversion.atomic import LocalFolder
from ckptshim.execute.arrays import PlannedArrays
from ckptshim.conversion.progress import Progress
from ckptshim.formats.base import numpy_dtype
from ckptshim.inventory import Entry, unflatten

#: What writing needs beyond ckptshim's own dependencies (see ckptshim.conversion.WRITERS).
NEEDS: tuple[str, ...] = ("jax", "orbax.checkpoint", "tensorstore")


def _counting_registry(written: dict[int, Entry], progress: Progress):
    """A type-handler registry whose numpy handler writes without copying and reports each array.

    jax.Array keeps Orbax's own handler (no leaf is one), which Orbax looks up to decide whether
    to keep per-array metadata, as it does for a StandardCheckpointer save.
    """
    import jax
    import orbax.checkpoint as ocp

    class CountingNumpyHandler(ocp.type_handlers.NumpyHandler):
        async def _open_and_write(self, value, tspec, ts_context) -> None:
            await super()._open_and_write(value, tspec, ts_context)
            progress.written(written[id(value)])

    handler = CountingNumpyHandler(deepcopy_host_arrays=False)
    return ocp.type_handlers.create_type_handler_registry(
        (np.ndarray, handler), (jax.Array, ocp.type_handlers.get_type_handler(jax.Array)))


def write(arrays: PlannedArrays, folder: LocalFolder, destination_name: str, progress: Progress) -> None:
    """Save into the local ``folder`` (Orbax creates the checkpoint's folder itself)."""
    import orbax.checkpoint as ocp

    flat, entries = {}, {}
    for entry, value in arrays.values():
        value = value.view(numpy_dtype(entry.dtype)) if value.dtype != numpy_dtype(entry.dtype) else value
        flat[entry.key], entries[id(value)] = value, entry
    handler = ocp.PyTreeCheckpointHandler(type_handler_registry=_counting_registry(entries, progress))
    with ocp.Checkpointer(handler) as checkpointer:
        checkpointer.save(folder.path / destination_name, args=ocp.args.PyTreeSave(unflatten(flat)))
