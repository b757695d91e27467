"""A checkpoint's small files, read the same way in a local folder and below a bucket prefix.

The JAX-side formats (Flax msgpack, T5X, PaxML, Orbax's per-leaf and pre-``_METADATA`` layouts)
recognise a checkpoint by a folder's names and a file's first bytes, and read their metadata
files whole. Each of those reads goes through :class:`~ckptshim.storage.Location` here, so a
format has one code path for a local path and an ``s3://``/``gs://`` prefix: locally only
regular files are read (never a pipe); remotely a listing is bounded and a whole-file read is
refused beyond its limit before a byte is fetched.
"""

from __future__ import annotations

import os
from pathlib import Path

from ckptshim.formats.base import FileInfo, Piece
from ckptshim.storage import Location, ObjectInfo

#: Where a checkpoint or one of its files lies: a local path (as detection passes it to the JAX
#: formats), or a location; every read below goes through :meth:`Location.of
#: <ckptshim.storage.Location.of>` of it.
Where = Path | Location


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
    """What is at ``path`` (shown relative to ``root``) for a completeness report: its size
    (``size``, where a listing already gave it, else one stat), and what it is (a regular file,
    or a folder or a pipe, which ckptshim never reads as one), or missing."""
    where = Location.of(path)
    shown = str(where) if root is None else _below(where, Location.of(root))
    if size is not None:
        return FileInfo(shown, size, expected_size, pieces=pieces, writer=writer)
    try:
        found = where.stat()
    except (FileNotFoundError, NotADirectoryError):
        return FileInfo(shown, None, expected_size, pieces=pieces, writer=writer)
    return FileInfo(shown, found.size, expected_size, pieces=pieces, writer=writer, kind=found.kind)


def _below(where: Location, root: Location) -> str:
    """``where``'s name below ``root`` as the two are spelled (links not followed: a report names
    the file the checkpoint names)."""
    prefix = str(root).rstrip("/") + "/"
    text = str(where)
    return text[len(prefix):] if text.startswith(prefix) else os.path.relpath(text, str(root))
