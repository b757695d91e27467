"""How long a compressed zarr chunk must be, and how much it decompresses to, from its headers alone.

Zarr metadata records no chunk sizes, so a chunk file cut short looks whole until it is
decompressed. Two of the compressors Orbax, PaxML and T5X write say their own length up front:
a zstd frame is a header followed by blocks that each state their size (RFC 8878, section 3.1.1),
and a blosc chunk's 16-byte header holds its compressed size. Walking those headers maps the chunk
and takes one step per frame and block header (a real chunk has a few; a hostile one can have
one every 3 bytes, so the time is linear in the chunk's size), and no decompression. gzip
(T5X's default) records no length before its end, so a cut gzip chunk is found when read.

The same headers say how many bytes a chunk decompresses to: a zstd frame's content size (or,
without one, at least its raw and RLE blocks' sizes), blosc's ``nbytes``, gzip's trailing
``ISIZE``. A chunk that declares more than its array's chunk holds is refused before anything
is decompressed (:func:`short_chunk` with ``chunk_bytes``): 128 KiB of zstd can declare 4 GiB.
"""

from __future__ import annotations

import mmap
import os
import struct

from ckptshim.storage import Location

_ZSTD_MAGIC = 0xFD2FB528
_ZSTD_SKIPPABLE = 0x184D2A50  # 0x184D2A50..5F: a skippable frame, length in its header
_BLOCK_HEADER = 3
#: Compressors whose chunks :func:`needed_length` can measure.
MEASURABLE = frozenset({"zstd", "blosc"})
#: Compressors whose chunks :func:`declared_content` can size.
SIZED = MEASURABLE | {"gzip"}


def needed_length(fd: int, compressor: str) -> int | None:
    """Bytes the chunk open at ``fd`` must have, as its headers say; ``None`` when they cannot
    say (not a frame of this compressor, or a header cut off before it says)."""
    return _needed_length(_mapped(fd), compressor)


def declared_content(fd: int, compressor: str) -> int | None:
    """Bytes the chunk open at ``fd`` says it decompresses to (at least), or ``None`` when its
    headers do not say (not a frame of this compressor; a zstd frame of compressed blocks only)."""
    return _declared_content(_mapped(fd), compressor)


def _mapped(fd: int) -> bytes | mmap.mmap:
    """The whole file open at ``fd``, mapped: the header walks below take one step per frame and
    block header, without a system call for each (a hostile chunk can hold a block every 3 bytes)."""
    size = os.fstat(fd).st_size
    return mmap.mmap(fd, size, access=mmap.ACCESS_READ) if size else b""


def _needed_length(data: bytes | mmap.mmap, compressor: str) -> int | None:
    return _zstd_length(data) if compressor == "zstd" else _blosc_length(data)


def _declared_content(data: bytes | mmap.mmap, compressor: str) -> int | None:
    size = len(data)
    if compressor == "gzip":
        tail = data[size - 4:] if size >= 18 else b""  # ISIZE, after a 10-byte header
        return struct.unpack("<I", tail)[0] if len(tail) == 4 and data[:2] == b"\x1f\x8b" else None
    if compressor == "blosc":
        header = data[:16]
        return struct.unpack_from("<I", header, 4)[0] if len(header) == 16 else None
    total, offset = 0, 0
    while offset < size:
        frame = _zstd_frame(data, offset)
        if frame is None:
            return None
        offset += frame[0]
        total += frame[1]
    return total or None


def _blosc_length(data: bytes | mmap.mmap) -> int | None:
    header = data[:16]
    return struct.unpack_from("<I", header, 12)[0] if len(header) == 16 else None


def _zstd_length(data: bytes | mmap.mmap) -> int | None:
    """Sum of the frames' lengths: numcodecs and tensorstore write one frame per chunk, but a
    chunk may hold several (and skippable frames) back to back."""
    offset, size = 0, len(data)
    while offset < size:
        frame = _zstd_frame(data, offset)
        if frame is None:
            return None
        offset += frame[0]
    return offset or None


def _zstd_frame(data: bytes | mmap.mmap, start: int) -> tuple[int, int] | None:
    """(bytes the frame at ``start`` occupies, bytes it declares it decompresses to -- its
    content size, or else at least its raw and RLE blocks), or ``None`` for no zstd frame."""
    head = data[start:start + 18]  # magic, descriptor, window, dictionary id, content size at most
    if len(head) < 5:
        return None
    (magic,) = struct.unpack_from("<I", head)
    if magic & 0xFFFFFFF0 == _ZSTD_SKIPPABLE:
        return (8 + struct.unpack_from("<I", head, 4)[0], 0) if len(head) >= 8 else None
    if magic != _ZSTD_MAGIC:
        return None
    descriptor = head[4]
    single_segment = descriptor >> 5 & 1
    content_size_bytes = (1 if single_segment else 0, 2, 4, 8)[descriptor >> 6]
    dictionary_bytes = (0, 1, 2, 4)[descriptor & 3]
    content_at = 5 + (0 if single_segment else 1) + dictionary_bytes
    declared = None
    if content_size_bytes and len(head) >= content_at + content_size_bytes:
        declared = int.from_bytes(head[content_at:content_at + content_size_bytes], "little")
        declared += 256 if content_size_bytes == 2 else 0  # RFC 8878 3.1.1.1.4
    offset, blocks, size = start + content_at + content_size_bytes, 0, len(data)
    while True:
        if offset + _BLOCK_HEADER > size:  # the file ends before the frame does
            return offset + _BLOCK_HEADER - start, declared if declared is not None else blocks
        bits = data[offset] | data[offset + 1] << 8 | data[offset + 2] << 16
        last, kind, block_size = bits & 1, bits >> 1 & 3, bits >> 3
        offset += _BLOCK_HEADER + (1 if kind == 1 else block_size)  # an RLE block holds one byte
        blocks += block_size if kind in (0, 1) else 0  # raw and RLE: exactly; compressed: unknown
        if last:
            length = offset + (4 if descriptor >> 2 & 1 else 0) - start  # the content checksum
            return length, declared if declared is not None else blocks


def short_chunk(path: str | os.PathLike | Location, compressor: str, name: str, chunk_bytes: int | None = None,
                size: int | None = None) -> str | None:
    """Why the chunk file or object at ``path`` (``name`` in messages) is too short, not
    ``compressor`` data, or declares more decompressed bytes than ``chunk_bytes`` (what its
    array's chunk holds); ``None`` when its headers are satisfied. Read through its
    :class:`~ckptshim.storage.Location` (:meth:`~ckptshim.storage.Location.whole`: a local
    file mapped, an object fetched whole; ``size``, where a listing gave it), so a bucket's
    chunk is checked as a disk's."""
    try:
        data = Location.of(path).whole(size=size)
    except OSError as error:
        return f"{name} cannot be opened ({error.strerror or error})"
    size = len(data)
    needed = _needed_length(data, compressor) if compressor in MEASURABLE else size
    content = _declared_content(data, compressor) if chunk_bytes is not None else None
    if needed is None:
        return f"{name} is damaged: its {size} bytes are not the {compressor} data its metadata promises"
    if size < needed:
        return f"{name} is truncated: {size} bytes, but its {compressor} frame needs at least {needed}"
    if content is not None and content > chunk_bytes:
        return (f"{name} is damaged: its {compressor} header declares {content} bytes decompressed, "
                f"but a chunk of its array holds {chunk_bytes}; refused before decompressing")
    return None
