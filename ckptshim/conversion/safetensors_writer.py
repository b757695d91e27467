"""Streaming safetensors writer: the header is computed from the entries, then each array's bytes.

safetensors needs every shape, dtype and byte range in the header before the data, and an
inventory has all of them before any byte is read, so each array is written once, in order,
without ever holding more than one in memory.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import numpy as np

from ckptshim.execute.arrays import PlannedArrays
from ckptshim.conversion.progress import Progress
from ckptshim.formats.base import storage_dtype
from ckptshim.formats.safetensors_header import DTYPES
from ckptshim.inventory import join_key

if TYPE_CHECKING:
    from ckptshim.conversion import Folder

#: What writing needs beyond ckptshim's own dependencies (see ckptshim.conversion.WRITERS).
NEEDS: tuple[str, ...] = ()

#: ckptshim dtype name -> safetensors header spelling (the reader's table, inverted).
SAFETENSORS_DTYPES = {ours: name for name, (_, ours) in DTYPES.items() if ours is not None}


def file_name(destination_name: str) -> str:
    """The file written: DST itself when it ends in .safetensors, else model.safetensors inside."""
    return destination_name if destination_name.endswith(".safetensors") else "model.safetensors"


def key_sep(arrays: PlannedArrays) -> str:
    """``.``, as torch and transformers name tensors, so readers split keys back into the same
    paths; ``/`` only when some key component itself contains a dot."""
    return "/" if any("." in part for entry in arrays.entries for part in entry.key) else "."


def header(arrays: PlannedArrays) -> bytes:
    from ckptshim.conversion import ConvertError

    sep = key_sep(arrays)
    fields: dict = {"__metadata__": {"format": "pt", "written_by": "ckptshim convert"}}
    offset = 0
    for entry in arrays.entries:
        if entry.dtype not in SAFETENSORS_DTYPES:
            raise ConvertError(f"{join_key(entry.key, sep)}: safetensors cannot hold {entry.dtype}")
        fields[join_key(entry.key, sep)] = {
            "dtype": SAFETENSORS_DTYPES[entry.dtype], "shape": list(entry.shape),
            "data_offsets": [offset, offset + entry.nbytes]}
        offset += entry.nbytes
    raw = json.dumps(fields, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors itself writes
    return len(raw).to_bytes(8, "little") + raw


def write(arrays: PlannedArrays, folder: Folder, destination_name: str, progress: Progress) -> None:
    """Write the file into ``folder`` (each array handed on, to the disk or the upload, before
    it counts as written)."""
    with folder.create(file_name(destination_name)) as out:
        out.write(header(arrays))
        for entry, value in arrays.values():
            value = np.ascontiguousarray(value, dtype=storage_dtype(entry.dtype))
            out.write(memoryview(value.reshape(-1)).cast("B"))
            out.flush()
            progress.written(entry)
