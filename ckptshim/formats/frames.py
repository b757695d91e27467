"""How long a compressed zarr chunk must be, read from its frame headers alone.

Zarr metadata records no chunk sizes, so a chunk file cut short looks whole until it is
decompressed. Two of the compressors Orbax, PaxML and T5X write say their own length up front:
a zstd frame is a header followed by blocks that each state their size (RFC 8878, section 3.1.1),
and a blosc chunk's 16-byte header holds its compressed size. Walking those headers costs a few
small reads per chunk and no decompression. gzip (T5X's default) records no length before its
end, so it is not checked here; a cut gzip chunk is found when read.
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


def needed_length(fd: int, compressor: str) -> int | None:
    """Bytes the chunk open at ``fd`` must have, as its headers say; ``None`` when they cannot
    say (not a frame of this compressor, or a header cut off before it says)."""
    return _zstd_length(fd) if compressor == "zstd" else _blosc_length(fd)


def _read(fd: int, size: int, offset: int) -> bytes:
    return os.pread(fd, size, offset)


def _blosc_length(fd: int) -> int | None:
    header = _read(fd, 16, 0)
    return struct.unpack_from("<I", header, 12)[0] if len(header) == 16 else None


def _zstd_length(fd: int) -> int | None:
    """Sum of the frames' lengths: numcodecs and tensorstore write one frame per chunk, but a
    chunk may hold several (and skippable frames) back to back."""
    size = os.fstat(fd).st_size
    offset = 0
    while offset < size:
        frame = _zstd_frame_length(fd, offset)
        if frame is None:
            return None
        offset += frame
    return offset or None


def _zstd_frame_length(fd: int, start: int) -> int | None:
    head = _read(fd, 18, start)  # magic, descriptor, window, dictionary id, content size at most
    if len(head) < 5:
        return None
    (magic,) = struct.unpack_from("<I", head)
    if magic & 0xFFFFFFF0 == _ZSTD_SKIPPABLE:
        return 8 + struct.unpack_from("<I", head, 4)[0] if len(head) >= 8 else None
    if magic != _ZSTD_MAGIC:
        return None
    descriptor = head[4]
    single_segment = descriptor >> 5 & 1
    content_size_bytes = (1 if single_segment else 0, 2, 4, 8)[descriptor >> 6]
    dictionary_bytes = (0, 1, 2, 4)[descriptor & 3]
    offset = start + 5 + (0 if single_segment else 1) + dictionary_bytes + content_size_bytes
    while True:
        block = _read(fd, _BLOCK_HEADER, offset)
        if len(block) < _BLOCK_HEADER:  # the file ends before the frame does
            return offset + _BLOCK_HEADER - start
        (bits,) = struct.unpack("<I", block + b"\0")
        last, kind, block_size = bits & 1, bits >> 1 & 3, bits >> 3
        offset += _BLOCK_HEADER + (1 if kind == 1 else block_size)  # an RLE block holds one byte
        if last:
            return offset + (4 if descriptor >> 2 & 1 else 0) - start  # the content checksum


def short_chunk(path: Path, compressor: str, name: str) -> str | None:
    """Why the chunk file at ``path`` (``name`` in messages) is too short or not ``compressor``
    data, or ``None`` when its headers are satisfied."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as error:
        return f"{name} cannot be opened ({error.strerror})"
    try:
        size = os.fstat(fd).st_size
        needed = needed_length(fd, compressor)
    finally:
        os.close(fd)
    if needed is None:
        return f"{name} is damaged: its {size} bytes are not the {compressor} data its metadata promises"
    if size < needed:
        return f"{name} is truncated: {size} bytes, but its {compressor} frame needs at least {needed}"
    return None
