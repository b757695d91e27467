"""How long a compressed zarr chunk must be, and how much it decompresses to, from its headers alone.

Zarr metadata records no chunk sizes, so a chunk file cut short looks whole until it is
decompressed. Two of the compressors Orbax, PaxML and T5X write say their own length up front:
a zstd frame is a header followed by blocks that each state their size (RFC 8878, section 3.1.1),
and a blosc chunk's 16-byte header holds its compressed size. Walking those headers costs a few
small reads per chunk and no decompression. gzip (T5X's default) records no length before its
end, so a cut gzip chunk is found when read.

The same headers say how many bytes a chunk decompresses to: a zstd frame's content size (or,
without one, at least its raw and RLE blocks' sizes), blosc's ``nbytes``, gzip's trailing
``ISIZE``. A chunk that declares more than its array's chunk holds is refused before anything
is decompressed (:func:`short_chunk` with ``chunk_bytes``): 128 KiB of zstd can declare 4 GiB.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

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
    return _zstd_length(fd) if compressor == "zstd" else _blosc_length(fd)


def _read(fd: int, size: int, offset: int) -> bytes:
    return os.pread(fd, size, offset)


def declared_content(fd: int, compressor: str) -> int | None:
    """Bytes the chunk open at ``fd`` says it decompresses to (at least), or ``None`` when its
    headers do not say (not a frame of this compressor; a zstd frame of compressed blocks only)."""
    if compressor == "gzip":
        size = os.fstat(fd).st_size
        tail = _read(fd, 4, size - 4) if size >= 18 else b""  # ISIZE, after a 10-byte header
        return struct.unpack("<I", tail)[0] if len(tail) == 4 and _read(fd, 2, 0) == b"\x1f\x8b" else None
    if compressor == "blosc":
        header = _read(fd, 16, 0)
        return struct.unpack_from("<I", header, 4)[0] if len(header) == 16 else None
    total, offset, size = 0, 0, os.fstat(fd).st_size
    while offset < size:
        frame = _zstd_frame(fd, offset)
        if frame is None:
            return None
        offset += frame[0]
        total += frame[1]
    return total or None


def _blosc_length(fd: int) -> int | None:
    header = _read(fd, 16, 0)
    return struct.unpack_from("<I", header, 12)[0] if len(header) == 16 else None


def _zstd_length(fd: int) -> int | None:
    """Sum of the frames' lengths: numcodecs and tensorstore write one frame per chunk, but a
    chunk may hold several (and skippable frames) back to back."""
    size = os.fstat(fd).st_size
    offset = 0
    while offset < size:
        frame = _zstd_frame(fd, offset)
        if frame is None:
            return None
        offset += frame[0]
    return offset or None


def _zstd_frame(fd: int, start: int) -> tuple[int, int] | None:
    """(bytes the frame at ``start`` occupies, bytes it declares it decompresses to -- its
    content size, or else at least its raw and RLE blocks), or ``None`` for no zstd frame."""
    head = _read(fd, 18, start)  # magic, descriptor, window, dictionary id, content size at most
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
    offset, blocks = start + content_at + content_size_bytes, 0
    while True:
        block = _read(fd, _BLOCK_HEADER, offset)
        if len(block) < _BLOCK_HEADER:  # the file ends before the frame does
            return offset + _BLOCK_HEADER - start, declared if declared is not None else blocks
        (bits,) = struct.unpack("<I", block + b"\0")
        last, kind, block_size = bits & 1, bits >> 1 & 3, bits >> 3
        offset += _BLOCK_HEADER + (1 if kind == 1 else block_size)  # an RLE block holds one byte
        blocks += block_size if kind in (0, 1) else 0  # raw and RLE: exactly; compressed: unknown
        if last:
            length = offset + (4 if descriptor >> 2 & 1 else 0) - start  # the content checksum
            return length, declared if declared is not None else blocks


def short_chunk(path: Path, compressor: str, name: str, chunk_bytes: int | None = None) -> str | None:
    """Why the chunk file at ``path`` (``name`` in messages) is too short, not ``compressor``
    data, or declares more decompressed bytes than ``chunk_bytes`` (what its array's chunk
    holds); ``None`` when its headers are satisfied."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as error:
        return f"{name} cannot be opened ({error.strerror})"
    try:
        size = os.fstat(fd).st_size
        needed = needed_length(fd, compressor) if compressor in MEASURABLE else size
        content = declared_content(fd, compressor) if chunk_bytes is not None else None
    finally:
        os.close(fd)
    if needed is None:
        return f"{name} is damaged: its {size} bytes are not the {compressor} data its metadata promises"
    if size < needed:
        return f"{name} is truncated: {size} bytes, but its {compressor} frame needs at least {needed}"
    if content is not None and content > chunk_bytes:
        return (f"{name} is damaged: its {compressor} header declares {content} bytes decompressed, "
                f"but a chunk of its array holds {chunk_bytes}; refused before decompressing")
    return None
