"""A checkpoint's small files, read the same way in a local folder and below a bucket prefix.

The JAX-side formats (Flax msgpack, T5X, PaxML, Orbax's per-leaf and pre-``_METADATA`` layouts)
recognise a checkpoint by a folder's names and a file's first bytes, and read their metadata
files whole. Each of those reads goes through :class:`~ckptshim.storage.Location` here, so a
format has one code path for a local path and an ``s3://``/``gs://`` prefix: locally only
regular files are read (never a pipe); remotely a listing is bounded and a whole-file read is
refused beyond its limit before a byte is fetched.
"""

from __future__ import annotations

from pathlib import Path

from ckptshim.formats.base import FileInfo, Piece, file_info
from ckptshim.storage import Location, ObjectInfo

#: Where a checkpoint or one of its files lies: a local path, or a remote location.
Where = Path | Location


def is_remote(path: Where) -> bool:
    return isinstance(path, Location) and path.is_remote


def head(path: Where, count: int) -> bytes:
    """At most the first ``count`` bytes of the regular file or object at ``path``; ``b""`` when
    nothing readable is there (a folder, a missing name, a FIFO, which is never opened)."""
    where = Location.of(path)
    try:
        found = where.stat()
    except (FileNotFoundError, NotADirectoryError):
        return b""
    if found.kind != "file":
        return b""
    return where.read(0, min(count, found.size))


def read_whole(path: Where, limit: int, size: int | None = None) -> bytes:
    """The whole file at ``path``, refused before reading when it is larger than ``limit``;
    ``size`` is its size where a listing already gave it (remotely, a round trip less)."""
    return Location.of(path).read_bytes(limit, size)


def listing(root: Where) -> list[ObjectInfo]:
    """What lies directly in the folder or bucket prefix ``root`` (one bounded listing); nothing
    where it is no folder or prefix."""
    try:
        return Location.of(root).list()
    except (FileNotFoundError, NotADirectoryError):
        return []


def file_info_at(path: Where, expected_size: int | None = None, root: Where | None = None, *,
                 size: int | None = None, pieces: tuple[Piece, ...] = (), writer: str = "") -> FileInfo:
    """What is at ``path`` (shown relative to ``root``) for a completeness report: locally as
    :func:`~ckptshim.formats.base.file_info` says; remotely the object's size (``size``, where a
    listing already gave it, else one request), or missing."""
    if not is_remote(path):
        return file_info(Path(path), expected_size, None if root is None else Path(root), pieces=pieces, writer=writer)
    shown = path.relative_to(root) if root is not None else str(path)
    if size is None:
        try:
            found = path.stat()
        except (FileNotFoundError, NotADirectoryError):
            return FileInfo(shown, None, expected_size, pieces=pieces, writer=writer)
        size = found.size if found.kind == "file" else None
    return FileInfo(shown, size, expected_size, pieces=pieces, writer=writer)
