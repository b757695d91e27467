"""Zarr array metadata (v2 ``.zarray`` and v3 ``zarr.json``), as Orbax and T5X write it.

Only what ckptshim needs: shape and dtype for the inventory, the tensorstore driver to read
with, and the chunk keys the array must have -- so that ``inspect`` can say which chunks are
gone. A chunk may legitimately be absent when it equals the fill value and the writer elides
such chunks; :func:`chunk_keys_required` says when absence is an error.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ckptshim.errors import CorruptCheckpointError
from ckptshim.formats import frames, located
from ckptshim.formats.base import ALLOWANCE_BYTES, FileInfo, Piece, strict_json
from ckptshim.formats.located import Where
from ckptshim.inventory import DTYPE_SIZES, dtype_name
from ckptshim.storage import snapshot

#: The metadata file of each zarr version, relative to the array's folder/prefix.
METADATA_FILES = {".zarray": "zarr", "zarr.json": "zarr3"}
#: The most an array's metadata file may hold: a ``.zarray`` or ``zarr.json`` is a few hundred
#: bytes (shape, chunks, dtype, codecs); a larger one is refused, naming it, before it is read.
MAX_METADATA_BYTES = 2**20
#: Missing chunk files of one array listed one by one in a completeness report; more are counted.
LISTED_MISSING = 1000


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
    compressor: str | None = None  # v2: of each chunk file ("zstd", "gzip", ...); None: not known

    @cached_property
    def grid(self) -> tuple[int, ...]:
        """Chunks along each axis (none at all when an axis is empty)."""
        return tuple(0 if n == 0 else -(-n // c) for n, c in zip(self.shape, self.chunks))

    def chunk_keys(self) -> Iterator[str]:
        """Every chunk key the full array consists of, relative to the array's folder."""
        if not self.shape:
            yield self._scalar_key
            return
        grid = self.grid
        if 0 in grid:
            return
        index = [0] * len(grid)  # counted up in C order, lazily: the grid may be astronomical
        while True:
            yield self.prefix + self.separator.join(map(str, index))
            for axis in reversed(range(len(grid))):
                index[axis] += 1
                if index[axis] < grid[axis]:
                    break
                index[axis] = 0
            else:
                return

    @property
    def _scalar_key(self) -> str:
        return self.prefix.rstrip("/") if self.prefix else "0"

    def is_chunk_key(self, key: str) -> bool:
        """Whether ``key`` is one of :meth:`chunk_keys`, without enumerating them."""
        if not self.shape:
            return key == self._scalar_key
        if not key.startswith(self.prefix):
            return False
        parts, grid = key[len(self.prefix):].split(self.separator), self.grid
        if len(parts) != len(grid):
            return False
        for part, n in zip(parts, grid):  # a loop, not all(...): a million keys go through here
            if not (part.isascii() and part.isdigit()) or (part[0] == "0" and part != "0") or int(part) >= n:
                return False
        return True

    def missing_chunks(self, present: Collection[str], shown: int = 4) -> tuple[int, list[str]]:
        """How many chunk keys are not in ``present``, and the first ``shown`` of them.

        Takes time in the size of ``present`` (what the folder or database lists), never in the
        number of chunks the metadata declares, which a damaged file can make astronomical.
        """
        total = math.prod(self.grid)
        if total <= len(present) + LISTED_MISSING:  # as many keys as the listing, give or take: list them
            absent = [key for key in self.chunk_keys() if key not in present]
            return len(absent), absent[:shown]
        missing = total - sum(1 for key in present if self.is_chunk_key(key))
        first = itertools.islice((k for k in self.chunk_keys() if k not in present), min(shown, missing))
        return missing, list(first)

    def chunk_region(self, key: str) -> str:
        """The elements chunk ``key`` (one of :meth:`chunk_keys`) holds, as ``"[0:32, 32:64]"``;
        ``""`` for a scalar's one chunk."""
        if not self.shape:
            return ""
        starts = map(int, key[len(self.prefix):].split(self.separator))
        return "[" + ", ".join(f"{i * c}:{min((i + 1) * c, n)}"
                               for i, c, n in zip(starts, self.chunks, self.shape)) + "]"

    def folder_files(self, folder: Where, present: Collection[str] | Mapping[str, int | None], key: str,
                     required: bool, root: Where, *, raw: bool = False) -> tuple[list[FileInfo], int]:
        """The chunk files of an array stored as a folder of its own (per-leaf Orbax, PaxML,
        T5X, Megatron-Core), for the completeness report: each one ``present`` (its size), and --
        when ``required`` (see :func:`chunk_keys_required`) -- each missing one, with the block of
        array ``key`` it would hold. ``raw``: the chunks are stored uncompressed, so each must be
        exactly :attr:`chunk_bytes` long. At most :data:`LISTED_MISSING` missing files are listed;
        the count of the others is returned (damaged metadata can declare any number). ``present``
        maps each name to its size where a bucket's listing gave them."""
        writer, size = f"{folder.name}/", self.chunk_bytes if raw else None
        sizes = present if isinstance(present, Mapping) else {}
        files = [located.file_info_at(folder / name, size, root=root, size=sizes.get(name), writer=writer,
                                      pieces=(Piece(key, self.chunk_region(name)),))
                 for name in sorted(present) if self.is_chunk_key(name)]
        if not required:
            return files, 0
        missing, first = self.missing_chunks(present, LISTED_MISSING)
        files += [FileInfo(f"{folder.relative_to(root)}/{name}", None, size, writer=writer,
                           pieces=(Piece(key, self.chunk_region(name)),)) for name in first]
        return files, missing - len(first)

    def folder_report(self, folder: Where, present: Collection[str] | Mapping[str, int | None], key: str,
                      required: bool, root: Where) -> tuple[list[FileInfo], list[str]]:
        """What the chunk files of an array stored as a folder of its own say: its files (see
        :meth:`folder_files`), and the problems -- chunk files missing beyond those listed, chunk
        files cut short or damaged (see :meth:`short_chunks`) -- each naming the folder."""
        files, unlisted = self.folder_files(folder, present, key, required, root)
        problems = [f"{folder.name}: {unlisted} more chunk file(s) missing"] if unlisted else []
        count, short = self.short_chunks(folder, present)
        if count:
            problems.append(f"{count} chunk(s) cut short or damaged: {'; '.join(short)}")
        return files, problems

    @property
    def chunk_bytes(self) -> int:
        """Bytes one chunk decompresses to (zarr v2 stores every chunk whole, edges padded)."""
        return math.prod(self.chunks) * DTYPE_SIZES[self.dtype]

    def short_chunks(self, folder: Where, present: Collection[str] | Mapping[str, int | None],
                     shown: int = 4) -> tuple[int, list[str]]:
        """How many of the chunk files ``present`` in ``folder`` (a local folder or a bucket
        prefix; ``present`` may map each name to its listed size) are shorter than their own
        compressed frames say, or declare more decompressed bytes than a chunk holds, and why
        for the first ``shown`` (see :mod:`frames`). Each is read whole; in a bucket listed by an
        active snapshot, a window of them at a time, in parallel
        (:func:`~ckptshim.storage.snapshot.reading_ahead`)."""
        if self.compressor not in frames.SIZED:
            return 0, []
        sizes = present if isinstance(present, Mapping) else {}
        keys = [key for key in sorted(present) if self.is_chunk_key(key)]
        with snapshot.reading_ahead(folder, keys):
            found = [problem for key in keys if (problem := frames.short_chunk(
                folder / key, self.compressor, f"{folder.name}/{key}", self.chunk_bytes, sizes.get(key)))]
        return len(found), found[:shown]


def parse(raw: bytes, where: str) -> ZarrArray:
    """Parse ``.zarray`` or ``zarr.json`` bytes (the file name decides; see :data:`METADATA_FILES`)."""
    try:
        meta = strict_json(raw)
        array = _parse_v3(meta) if meta.get("zarr_format") == 3 else _parse_v2(meta)
        _check(array)
        return array
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError,
            SyntaxError) as error:  # SyntaxError: numpy reads some dtype strings as literals
        raise CorruptCheckpointError(
            f"{where}: zarr metadata is not valid ({type(error).__name__}: {error}); the "
            "checkpoint is corrupt. Re-copy it from the original.") from None


def _check(array: ZarrArray) -> None:
    """``ValueError`` unless shape and chunks are as zarr defines them (one positive chunk
    length per axis, no negative lengths), the key separator is a string, and one chunk is not
    larger than the array plus :data:`~ckptshim.formats.base.ALLOWANCE_BYTES`: decoding a
    chunk takes its whole size in memory, however little of it the array uses."""
    if len(array.chunks) != len(array.shape) or any(n < 0 for n in array.shape) or any(
            c < 1 for c in array.chunks):
        raise ValueError(f"shape {list(array.shape)} with chunks {list(array.chunks)}")
    if not (isinstance(array.separator, str) and array.separator and isinstance(array.prefix, str)):
        raise ValueError(f"chunk key separator {array.separator!r:.40}")
    array_bytes = math.prod(array.shape) * DTYPE_SIZES[array.dtype]
    if array.chunk_bytes > array_bytes + ALLOWANCE_BYTES:
        raise ValueError(f"chunks {list(array.chunks)} of {array.chunk_bytes} bytes each for an array "
                         f"{list(array.shape)} of {array_bytes}; decoding one would take that much memory")


def _parse_v2(meta: dict) -> ZarrArray:
    raw_dtype = meta["dtype"]
    dtype = dtype_name(raw_dtype if raw_dtype == "bfloat16" else np.dtype(raw_dtype))
    compressor = meta.get("compressor")
    compressor = compressor.get("id") if isinstance(compressor, dict) else None
    return ZarrArray("zarr", tuple(int(n) for n in meta["shape"]), dtype,
                     tuple(int(n) for n in meta["chunks"]), meta.get("dimension_separator", "."),
                     "", meta.get("fill_value") is None,
                     compressor if isinstance(compressor, str) else None)


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
