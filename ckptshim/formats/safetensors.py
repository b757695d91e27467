"""safetensors files: an 8-byte header length, a JSON header, then raw little-endian bytes.

The header is parsed without the safetensors library and refused wherever the library refuses
it (:mod:`~ckptshim.formats.safetensors_header`); arrays are read-only views of one memory map of
the file, and a contiguous range of one is read with one
``pread`` straight into the caller's buffer (:meth:`SafetensorsCheckpoint.read_into`).

A file in a bucket (a remote :class:`~ckptshim.storage.Location`) is read the same way by byte
ranges: the header from the file's first :data:`HEAD_BYTES` (a folder's shards' fetched in one
parallel batch: :func:`heads`), validated by the same code; each array, or
contiguous range of one, by exactly its bytes. A load reads many at once
(:meth:`SafetensorsCheckpoint.byte_range`, then ``read_blocks``): their ranges go to the store in one batch, which
fetches neighbouring tensors as one run and runs in parallel pieces, straight into the buffers.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from ckptshim.errors import CorruptCheckpointError, UnknownFormatError, brief
from ckptshim.formats import safetensors_header
from ckptshim.formats.base import (Checkpoint, FileInfo, check_view, contiguous, file_info, numpy_dtype,
                                   open_regular, reader, storage_dtype)
from ckptshim.formats.safetensors_header import MAX_HEADER, Header
from ckptshim.inventory import Entry, Inventory, split_key
from ckptshim.storage import ByteRange, Location, read_ranges

NAME = "safetensors"
#: The most a read into a view (a transposed block) or another dtype holds in its own buffer at once.
BUFFER_BYTES = 16 * 2**20


def sniff(path: Path) -> bool:
    return path.is_file() and path.suffix == ".safetensors"


#: torch's loaders read it, and a JAX restore takes one (a Hugging Face model as MaxText params)
READERS = {"torch": sniff, "jax": sniff}


#: How much of a remote file's start is fetched for its header: its length and a header of up to
#: this size (about 100 bytes a tensor) in one round trip; a larger header takes a second one.
HEAD_BYTES = 256 << 10


def heads(files: Sequence[tuple[Location, int]]) -> list[bytes]:
    """The first :data:`HEAD_BYTES` (or all) of each remote ``(file, size)``, fetched in parallel:
    every shard's header of a folder in one round trip."""
    fetched = read_ranges([ByteRange(where, 0, min(size, HEAD_BYTES)) for where, size in files])
    return [bytes(data) for data in fetched or ()]


def read_header(path: Path | Location, size: int | None = None, head: bytes | None = None) -> tuple[Header, int]:
    """The header, validated as the safetensors library validates it
    (:mod:`~ckptshim.formats.safetensors_header`), and the offset where tensor data starts. A
    remote file's header comes from its ``head`` (:func:`heads`; fetched here when not given),
    and from one more byte range where it is longer; ``size`` is its size when already known
    (from a listing)."""
    if isinstance(path, Location) and path.is_remote:
        size = path.stat().size if size is None else size
        held = heads([(path, size)])[0] if head is None else head

        def read(start: int, count: int) -> bytes:
            count = min(count, size - start)
            return held[start:start + count] if start + count <= len(held) else path.read(start, count)
        return _parse_header(path, size, read)
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        return _parse_header(path, size, lambda start, count: f.read(count))


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


def entries(path: Path | Location, header: Header, data_start: int, key_sep: str = ".") -> list[Entry]:
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
    """One or more safetensors files; entry locations are ``(file, begin, end)``."""

    #: each array is one row-major run of bytes, so an entry may be read under any shape of the
    #: same size (a block read of a ``Reshape`` splits axes into factors)
    row_major = True

    def __init__(self, path: Path | Location, inventory: Inventory, files, problems=(), fmt: str = NAME) -> None:
        super().__init__(path, fmt, "1", inventory, tuple(files), tuple(problems))
        self._maps: dict[str, np.memmap] = {}
        #: a remote file by its name in the entries' locations, with its size (from the listing)
        self._objects: dict[str, tuple[Location, int]] = {}
        if isinstance(path, Location) and path.is_remote:
            self._objects[str(path)] = (path, self.files[0].size or 0)

    def read(self, entry: Entry) -> np.ndarray:
        file, begin, end = entry.location
        if file in self._objects:  # remote: exactly the tensor's bytes, by one (parallel) range read
            where, size = self._objects[file]
            check_view(entry, begin, end, size, file)
            data = np.empty(end - begin, np.uint8)
            where.read_into(begin, data)
            return data.view(storage_dtype(entry.dtype)).reshape(entry.shape)
        data = self._maps.get(file)
        if data is None:
            with open_regular(file) as raw:
                data = self._maps[file] = np.memmap(raw, dtype=np.uint8, mode="r")
        check_view(entry, begin, end, len(data), file)
        return data[begin:end].view(storage_dtype(entry.dtype)).reshape(entry.shape)

    def check_entry(self, entry: Entry) -> None:
        """A remote entry's range is checked against its object's size, never fetched."""
        file, begin, end = entry.location
        if file in self._objects:
            check_view(entry, begin, end, self._objects[file][1], file)
        else:
            super().check_entry(entry)

    def read_into(self, entry: Entry, index: tuple, out: np.ndarray) -> None:
        """``entry[index]`` into ``out``: one ``pread`` of exactly its bytes when the range is
        contiguous in the file (what a sharded load asks for: rows of a tensor) -- straight into
        ``out`` when it is a C-contiguous buffer of the stored dtype, so nothing is mapped or
        copied twice; else into a buffer of that range, then copied (cast) into ``out`` (a
        transposed view, another dtype). A range that is not one run is copied from the memory
        map (its pages only)."""
        file, begin, end = entry.location
        span = contiguous(entry.shape, index)
        if span is None:
            return super().read_into(entry, index, out)
        remote = self._objects.get(file)
        check_view(entry, begin, end, os.path.getsize(file) if remote is None else remote[1], file)
        first, count = span
        stored = storage_dtype(entry.dtype)
        direct = out.dtype == stored and out.flags.c_contiguous
        if not direct and count * stored.itemsize > BUFFER_BYTES:
            return self._read_in_parts(entry, index, out, count * stored.itemsize)
        buffer = out if direct else np.empty(out.shape, stored)
        target = memoryview(buffer.reshape(-1).view(np.uint8))
        if remote is None:
            _pread(file, begin + first * stored.itemsize, target, entry)
        else:
            remote[0].read_into(begin + first * stored.itemsize, target)
        if not direct:
            np.copyto(out, buffer if out.dtype == stored else buffer.view(numpy_dtype(entry.dtype)), casting="unsafe")
        return None

    def byte_range(self, entry: Entry, index: tuple, out: np.ndarray) -> ByteRange | None:
        """For a remote file, where ``entry[index]`` is one run of the tensor's bytes and ``out``
        a C-contiguous buffer of the stored dtype (what ``dcp.load`` and ``convert`` ask for): that
        run's byte range, which :meth:`read_blocks` fetches with the others in one batch
        (neighbouring ranges as one run, bounded requests in parallel, straight into ``out``)."""
        file, begin, end = entry.location
        remote = self._objects.get(file)
        span = contiguous(entry.shape, index)
        stored = storage_dtype(entry.dtype)
        if remote is None or span is None or out.dtype != stored or not out.flags.c_contiguous:
            return None
        check_view(entry, begin, end, remote[1], file)
        first, count = span
        return ByteRange(remote[0], begin + first * stored.itemsize, count * stored.itemsize)

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
        self._maps.clear()


def _pread(file: str, offset: int, target: memoryview, entry: Entry) -> None:
    """Fill ``target`` from ``file`` at ``offset``."""
    with open_regular(file, buffering=0) as raw:
        done = 0
        while done < len(target):
            read = os.preadv(raw.fileno(), [target[done:]], offset + done)
            if read == 0:
                raise CorruptCheckpointError(f"{file}: {'.'.join(entry.key)!r} ends early; the file is truncated.")
            done += read


@reader
def open_checkpoint(path: Path | Location, size: int | None = None, head: bytes | None = None) -> SafetensorsCheckpoint:
    """The file ``path``, local or an object in a bucket (its header fetched by byte ranges;
    ``size`` its size when a listing already gave it, ``head`` its first bytes when fetched
    with other files' by :func:`heads`)."""
    remote = isinstance(path, Location) and path.is_remote
    if remote and size is None:
        size = path.stat().size
    header, start = read_header(path, size, head)
    found = entries(path, header, start)
    expected = start + header.data_length
    info = FileInfo(str(path), size, expected) if remote else file_info(path, expected)
    return SafetensorsCheckpoint(path, Inventory(found, str(path)), [info])
