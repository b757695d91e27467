"""safetensors files: an 8-byte header length, a JSON header, then raw little-endian bytes.

The header is parsed without the safetensors library and refused wherever the library refuses
it (:mod:`~ckptshim.formats.safetensors_header`). A local file and an object in a bucket are read
the same way, through their :class:`~ckptshim.storage.Location`: the header from the file's
first :data:`HEAD_BYTES` (a folder's shards' asked for in one parallel batch: :func:`heads`), and
one more range where it is longer; a whole array as a read-only view of the file's bytes
(:meth:`~ckptshim.storage.OpenFile.view`: locally of a memory map, nothing copied; remotely
exactly its bytes); a contiguous range of one as its byte range, read straight into the
caller's buffer (:meth:`SafetensorsCheckpoint.byte_range`). A load reads many at once
(``read_blocks``): their ranges go to the store in one batch (a bucket's fetches neighbouring
tensors as one run, in parallel pieces).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Sequence
from pathlib import Path, PurePosixPath

import numpy as np

from ckptshim.errors import CorruptCheckpointError, UnknownFormatError, brief
from ckptshim.formats import safetensors_header
from ckptshim.formats.base import (Checkpoint, FileInfo, check_view, contiguous, numpy_dtype, reader,
                                   storage_dtype)
from ckptshim.formats.safetensors_header import MAX_HEADER, Header
from ckptshim.inventory import Entry, Inventory, split_key
from ckptshim.storage import ByteRange, Location, OpenFile, read_ranges

NAME = "safetensors"
#: The most a read into a view (a transposed block) or another dtype holds in its own buffer at once.
BUFFER_BYTES = 16 * 2**20


def sniff(path: Path | Location) -> bool:
    where = Location.of(path)
    return PurePosixPath(where.name).suffix == ".safetensors" and where.is_file()


#: torch's loaders read it, and a JAX restore takes one (a Hugging Face model as MaxText params)
READERS = {"torch": sniff, "jax": sniff}


#: How much of a remote file's start is fetched for its header: its length and a header of up to
#: this size (about 100 bytes a tensor) in one round trip; a larger header takes a second one.
HEAD_BYTES = 256 << 10


def head_range(where: Location, size: int) -> ByteRange:
    """The start of the ``size``-byte file ``where`` read for its header: from a bucket the first
    :data:`HEAD_BYTES` (or all), so that every shard's header of a folder comes in one round
    trip; from a disk only the header's length (a read there is no round trip, and reading
    ahead would read bytes nobody asked for, as safetensors itself does not)."""
    return ByteRange(where, 0, min(size, HEAD_BYTES if where.read_ahead_bytes else 8))


def heads(files: Sequence[tuple[Location, int]]) -> list[bytes]:
    """The start of each ``(file, size)`` (:func:`head_range`), read in one batch (a bucket's in
    parallel)."""
    fetched = read_ranges([head_range(where, size) for where, size in files])
    return [bytes(data) for data in fetched or ()]


def read_header(path: Location, size: int | None = None, head: bytes | None = None) -> tuple[Header, int]:
    """The header, validated as the safetensors library validates it
    (:mod:`~ckptshim.formats.safetensors_header`), and the offset where tensor data starts. It
    comes from the file's ``head`` (:func:`heads`; read here when not given), and from one more
    byte range where it is longer; ``size`` is the file's size when already known (from a
    listing)."""
    size = path.stat().size if size is None else size
    held = heads([(path, size)])[0] if head is None else head

    def read(start: int, count: int) -> bytes:
        count = min(count, size - start)
        return held[start:start + count] if start + count <= len(held) else path.read(start, count)
    return _parse_header(path, size, read)


def _parse_header(path: object, size: int, read: Callable[[int, int], bytes]) -> tuple[Header, int]:
    """The header of the ``size``-byte file ``path``, whose bytes ``read(start, count)`` gives
    (at most ``count``: fewer at its end), asked for in order."""
    raw = read(0, 8)
    if len(raw) < 8:
        raise CorruptCheckpointError(f"{path}: {size} bytes is too short for a safetensors header")
    (length,) = struct.unpack("<Q", raw)
    if length > MAX_HEADER:
        raise CorruptCheckpointError(
            f"{path}: header claims {length} bytes, more than the {MAX_HEADER:,} safetensors reads; "
            "it is not a safetensors file, or a damaged one.")
    if length > size - 8:
        raise CorruptCheckpointError(
            f"{path}: header claims {length} bytes but the file has {size}; it is truncated "
            "or not a safetensors file.")
    data = read(8, length)
    try:
        header = safetensors_header.parse(data, size - 8 - length)
    except ValueError as error:  # HeaderError, or the JSON budget
        raise CorruptCheckpointError(f"{path}: the header is not one safetensors reads: {error}. The file "
                                     "is damaged or was not written by safetensors; re-copy it.") from None
    unowned = size - 8 - length - header.data_length
    if unowned > 0:
        raise CorruptCheckpointError(
            f"{path}: {unowned} bytes after the last tensor's data belong to no tensor; safetensors "
            "refuses the file (its metadata must cover every byte). Re-copy it from the original.")
    return header, 8 + length


def entries(path: Location | os.PathLike[str], header: Header, data_start: int, key_sep: str = ".") -> list[Entry]:
    """One entry per tensor of ``header``, located in ``path``'s data (starting at ``data_start``)."""
    out = []
    for name, info in header.tensors.items():
        dtype = safetensors_header.DTYPES[info.dtype][1]
        if dtype is None or not _numpy_holds(info.shape):
            what = f"is {info.dtype}, a dtype" if dtype is None else \
                f"has shape {brief(info.shape, 60)}, more axes or elements than an array"
            raise UnknownFormatError(
                f"{path}: {brief(name)} {what} ckptshim does not read yet; load the file with "
                "safetensors itself (safetensors.safe_open) and without ckptshim.")
        out.append(Entry(split_key(name, key_sep), info.shape, dtype,
                         (str(path), data_start + info.begin, data_start + info.end)))
    return out


def _numpy_holds(shape: tuple[int, ...]) -> bool:
    """Whether a numpy array can take ``shape`` (safetensors allows any number of axes, and an
    empty tensor whose other axes multiply past 64 bits); one with elements is in the file, so
    only its axes can be too many."""
    if len(shape) > 64:
        return False
    if 0 not in shape:
        return True
    try:
        np.empty(shape, np.uint8)  # no elements: nothing is allocated
    except ValueError:
        return False
    return True


class SafetensorsCheckpoint(Checkpoint):
    """One safetensors file; entry locations are ``(file, begin, end)``. Its bytes are read
    through the file opened at its location (:meth:`~ckptshim.storage.Location.open`), on the
    first read of a whole array."""

    #: each array is one row-major run of bytes, so an entry may be read under any shape of the
    #: same size (a block read of a ``Reshape`` splits axes into factors)
    row_major = True

    def __init__(self, path: Location | os.PathLike[str], inventory: Inventory, files, problems=(),
                 fmt: str = NAME) -> None:
        super().__init__(path, fmt, "1", inventory, tuple(files), tuple(problems))
        self._location = Location.of(path)
        self._size = self.files[0].size or 0
        self._file: OpenFile | None = None

    def read(self, entry: Entry) -> np.ndarray:
        """The whole array, a read-only view of the file's bytes."""
        file, begin, end = entry.location
        check_view(entry, begin, end, self._size, file)
        if self._file is None:
            self._file = self._location.open()
        data = self._file.view(begin, end - begin)
        return np.frombuffer(data, storage_dtype(entry.dtype)).reshape(entry.shape)

    def check_entry(self, entry: Entry) -> None:
        """The entry's range checked against the file's size; nothing is read."""
        file, begin, end = entry.location
        check_view(entry, begin, end, self._size, file)

    def read_into(self, entry: Entry, index: tuple, out: np.ndarray) -> None:
        """``entry[index]`` into ``out``: one read of exactly its bytes when the range is
        contiguous in the file (what a sharded load asks for: rows of a tensor) -- straight into
        ``out`` when it is a C-contiguous buffer of the stored dtype (:meth:`byte_range`), so
        nothing is copied twice; else into a buffer of that range, then copied (cast) into ``out``
        (a transposed view, another dtype). A range that is not one run is copied from
        :meth:`read`'s view (its bytes only)."""
        direct = self.byte_range(entry, index, out)
        if direct is not None:
            read_ranges([direct], [out.reshape(-1).view(np.uint8)])
            return None
        span = contiguous(entry.shape, index)
        if span is None:
            return super().read_into(entry, index, out)
        stored = storage_dtype(entry.dtype)
        if span[1] * stored.itemsize > BUFFER_BYTES:
            return self._read_in_parts(entry, index, out, span[1] * stored.itemsize)
        buffer = np.empty(out.shape, stored)
        self.read_into(entry, index, buffer)
        np.copyto(out, buffer if out.dtype == stored else buffer.view(numpy_dtype(entry.dtype)), casting="unsafe")
        return None

    def byte_range(self, entry: Entry, index: tuple, out: np.ndarray) -> ByteRange | None:
        """Where ``entry[index]`` is one run of the tensor's bytes and ``out`` a C-contiguous
        buffer of the stored dtype (what ``dcp.load`` and ``convert`` ask for): that run's byte
        range, which :meth:`read_blocks` reads with the others in one batch (in a bucket,
        neighbouring ranges as one run, bounded requests in parallel), straight into ``out``."""
        file, begin, end = entry.location
        span = contiguous(entry.shape, index)
        stored = storage_dtype(entry.dtype)
        if span is None or out.dtype != stored or not out.flags.c_contiguous:
            return None
        check_view(entry, begin, end, self._size, file)
        first, count = span
        return ByteRange(self._location, begin + first * stored.itemsize, count * stored.itemsize)

    def _read_in_parts(self, entry: Entry, index: tuple, out: np.ndarray, nbytes: int) -> None:
        """A contiguous range too big for one buffer, read as runs of its first ranged axis (each
        still contiguous), so the buffer stays near :data:`BUFFER_BYTES`."""
        bounds = [part.indices(size)[:2] if isinstance(part, slice) else None for part, size in zip(index, entry.shape)]
        axis = next(a for a, b in enumerate(bounds) if b is not None and b[1] - b[0] > 1)
        at = sum(1 for b in bounds[:axis] if b is not None)  # out has an axis per ranged index only
        start, stop = bounds[axis]
        step = max(1, (stop - start) * BUFFER_BYTES // nbytes)
        for low in range(start, stop, step):
            high = min(low + step, stop)
            part = index[:axis] + (slice(low, high),) + index[axis + 1:]
            self.read_into(entry, part, out[(slice(None),) * at + (slice(low - start, high - start),)])

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


@reader
def open_checkpoint(path: Location | os.PathLike[str], size: int | None = None, head: bytes | None = None) -> SafetensorsCheckpoint:
    """The file at ``path`` (``size`` its size when a listing already gave it, ``head`` its first
    bytes when read with other files' by :func:`heads`). Its ``path`` is ``path`` as given."""
    where = Location.of(path)
    size = where.stat().size if size is None else size
    header, start = read_header(where, size, head)
    expected = start + header.data_length
    return SafetensorsCheckpoint(path, Inventory(entries(path, header, start), str(path)),
                                 [FileInfo(str(path), size, expected)])
