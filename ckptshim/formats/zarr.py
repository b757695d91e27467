"""Zarr array metadata (v2 ``.zarray`` and v3 ``zarr.json``), as Orbax and T5X write it.

Only what ckptshim needs: shape and dtype for the inventory, the tensorstore driver to read
with, and the chunk keys the array must have -- so that ``inspect`` can say which chunks are
gone. A chunk may legitimately be absent when it equals the fill value and the writer elides
such chunks; :func:`chunk_keys_required` says when absence is an error.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ckptshim.errors import CorruptCheckpointError
from ckptshim.formats.base import strict_json
from ckptshim.inventory import dtype_name

#: The metadata file of each zarr version, relative to the array's folder/prefix.
METADATA_FILES = {".zarray": "zarr", "zarr.json": "zarr3"}
#: Side files that are neither metadata nor chunks.
SIDE_FILES = frozenset({".zattrs", ".zgroup"})


@dataclass(frozen=True)
class ZarrArray:
    """What one zarr array's metadata says."""

    driver: str                  # tensorstore driver: "zarr" (v2) or "zarr3"
    shape: tuple[int, ...]
    dtype: str                   # ckptshim dtype name
    chunks: tuple[int, ...]      # the grid of stored objects (v3: outer/shard chunks)
    separator: str               # between chunk indices in a key
    prefix: str                  # before the chunk indices ("c/" in zarr v3 default encoding)
    fill_value_null: bool        # v2 with no fill value: a missing chunk silently reads as zeros

    def chunk_keys(self) -> Iterator[str]:
        """Every chunk key the full array consists of, relative to the array's folder."""
        if not self.shape:
            yield self.prefix.rstrip("/") if self.prefix else "0"
            return
        counts = [max(1, math.ceil(n / c)) for n, c in zip(self.shape, self.chunks)]
        if 0 in self.shape:
            return
        for index in itertools.product(*(range(n) for n in counts)):
            yield self.prefix + self.separator.join(map(str, index))


def parse(raw: bytes, where: str) -> ZarrArray:
    """Parse ``.zarray`` or ``zarr.json`` bytes (the file name decides; see :data:`METADATA_FILES`)."""
    try:
        meta = strict_json(raw)
        if meta.get("zarr_format") == 3:
            return _parse_v3(meta)
        return _parse_v2(meta)
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise CorruptCheckpointError(
            f"{where}: zarr metadata is not valid ({error}); the checkpoint is corrupt. "
            "Re-copy it from the original.") from None


def _parse_v2(meta: dict) -> ZarrArray:
    raw_dtype = meta["dtype"]
    dtype = dtype_name(raw_dtype if raw_dtype == "bfloat16" else np.dtype(raw_dtype))
    return ZarrArray("zarr", tuple(int(n) for n in meta["shape"]), dtype,
                     tuple(int(n) for n in meta["chunks"]), meta.get("dimension_separator", "."),
                     "", meta.get("fill_value") is None)


def _parse_v3(meta: dict) -> ZarrArray:
    chunks = meta["chunk_grid"]["configuration"]["chunk_shape"]
    encoding = meta.get("chunk_key_encoding", {"name": "default"})
    config = encoding.get("configuration", {})
    if encoding["name"] == "default":
        separator, prefix = config.get("separator", "/"), "c" + config.get("separator", "/")
    else:  # "v2" encoding
        separator, prefix = config.get("separator", "."), ""
    return ZarrArray("zarr3", tuple(int(n) for n in meta["shape"]), dtype_name(meta["data_type"]),
                     tuple(int(n) for n in chunks), separator, prefix, False)


def chunk_keys_required(array: ZarrArray, fill_chunks_stored: bool) -> bool:
    """Whether every chunk key must exist: the writer stores fill-valued chunks, or has no fill."""
    return fill_chunks_stored or array.fill_value_null
