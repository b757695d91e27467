"""The local file system as a store: regular files only, opened without ever blocking.

Every file is checked with a ``stat`` before it is opened (a device is never opened) and again on
the descriptor, which is opened ``O_NONBLOCK`` so that a FIFO swapped in between cannot block the
open; then bytes are ``preadv``-ed straight into the caller's buffer. Listings are ``scandir``
walks that stop one entry past their limit. A checkpoint folder is walked once when it is
opened, refusing a link that leaves it and anything neither a file nor a folder
(:func:`refuse_links_leaving`): what a local disk has and a bucket does not.
"""

from __future__ import annotations

import mmap
import os
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

from ckptshim.errors import UnsafeCheckpointError
from ckptshim.storage.location import ByteRange, Location, ObjectInfo
from ckptshim.storage.problems import not_regular, too_large, too_many, truncated


def kind(mode: int) -> str:
    """What a file of ``mode`` is, in the words errors use."""
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISFIFO(mode):
        return "fifo"
    if stat.S_ISSOCK(mode):
        return "socket"
    return "device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "special file"


def open_regular(location: Location, buffering: int = -1) -> BinaryIO:
    """Open the regular file at ``location`` for reading, refusing anything else without
    blocking (see the module docstring). ``OSError`` (missing, no permission) passes to the
    caller, which knows what the file is for."""
    path = location.path
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        raise not_regular(location, kind(mode))
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise not_regular(location, kind(mode))
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb", buffering=buffering)
    except BaseException:
        os.close(fd)
        raise


def refuse_links_leaving(root: Path, also: Sequence[Path] = ()) -> None:
    """Refuse a checkpoint folder holding a symlink whose target lies outside it (or ``also``),
    or anything that is neither a regular file nor a folder (a FIFO, socket or device node, or
    a link to one).

    ckptshim reads only files a checkpoint contains: a chunk, rank or data file that is a link
    to ``/etc/machine-id`` would otherwise be read (and converted) as weights, and a FIFO in
    place of a chunk blocks whoever opens it -- tensorstore included, which opens zarr chunks
    and OCDBT files itself -- forever. Links inside the folder are fine (their targets are
    checked where they are). One ``scandir`` walk: the kind of each entry comes from the
    listing itself, so only links cost a ``stat``.
    """
    allowed = (root.resolve(), *(p.resolve() for p in also))
    for entry in entries(root):
        if entry.is_symlink():
            require_target_inside(Path(entry.path), allowed, root)
            require_plain(Path(entry.path), target_mode(entry.path))
        elif not (entry.is_file(follow_symlinks=False) or entry.is_dir(follow_symlinks=False)):
            require_plain(Path(entry.path), entry.stat(follow_symlinks=False).st_mode)


def target_mode(path: str | os.PathLike) -> int | None:
    """The mode of what a link points at; ``None`` for a dangling link (reported as missing
    wherever the format needs the file)."""
    try:
        return os.stat(path).st_mode
    except OSError:
        return None


def require_plain(path: Path, mode: int | None) -> None:
    """Refuse ``path`` when ``mode`` (what it is; ``None``: nothing there) is neither a regular
    file nor a folder."""
    if mode is not None and not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise not_regular(path, kind(mode))


def entries(root: Path) -> Iterator[os.DirEntry]:
    """Everything under ``root``, depth first, without descending into linked folders."""
    pending = [str(root)]
    while pending:
        with os.scandir(pending.pop()) as listing:
            for entry in listing:
                yield entry
                if entry.is_dir(follow_symlinks=False):
                    pending.append(entry.path)


def require_target_inside(path: Path, allowed: tuple[Path, ...], root: Path) -> None:
    """Refuse the link ``path`` (in the checkpoint at ``root``) unless its real path lies in one
    of the ``allowed`` folders."""
    target = Path(os.path.realpath(path))
    if not any(target == real or real in target.parents for real in allowed):
        raise UnsafeCheckpointError(
            f"{path} is a symlink to {target}, which lies outside the directory of the checkpoint "
            f"({root}); ckptshim reads only files the checkpoint contains. Copy the file into the "
            "checkpoint instead of linking to it.")


class LocalFile:
    """A local regular file opened for reads by offset (:meth:`~ckptshim.storage.Location.open`):
    ``preadv`` on its descriptor straight into the caller's buffer, and views of one memory map
    of it, mapped on the first view -- an array read whole is never copied until its destination
    takes it. Nothing is fetched ahead: the page cache does that."""

    def __init__(self, location: Location) -> None:
        self.location = location
        self._raw = open_regular(location, buffering=0)
        self._map: mmap.mmap | bytes | None = None

    def __enter__(self) -> LocalFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the descriptor; a memory map lives on in views handed out (it is dropped, never
        closed under them)."""
        self._raw.close()
        self._map = None

    def pread(self, buffer: memoryview, offset: int) -> int:
        return os.preadv(self._raw.fileno(), [buffer], offset)

    def view(self, start: int, length: int) -> memoryview:
        if self._map is None:
            size = os.fstat(self._raw.fileno()).st_size
            self._map = mmap.mmap(self._raw.fileno(), size, access=mmap.ACCESS_READ) if size else b""
        if start < 0 or start + length > len(self._map):
            raise truncated(self.location, start, start + length, len(self._map))
        return memoryview(self._map)[start:start + length]

    def wanted(self, spans: object) -> list[tuple[int, int]]:
        return []

    def hold(self, start: int, data: bytearray) -> None:
        raise AssertionError(f"{self.location}: a local file fetches nothing ahead")


class LocalFiles:
    """The :class:`~ckptshim.storage.store.Store` of local paths."""

    #: A block at a time: a read is a copy from the page cache, and nothing is held beyond it.
    read_ahead_bytes = 0

    def refuse_links_leaving(self, location: Location, also: Sequence[Location]) -> None:
        refuse_links_leaving(location.path, [other.path for other in also])

    def stat(self, location: Location) -> ObjectInfo:
        found = os.stat(location.path)
        return ObjectInfo(location, found.st_size, kind(found.st_mode))

    def is_link(self, location: Location) -> bool:
        return os.path.islink(location.path)

    def list(self, location: Location, limit: int, recursive: bool) -> list[ObjectInfo]:
        found: list[ObjectInfo] = []
        for entry in self._entries(location, recursive):
            if len(found) == limit:
                raise too_many(location, limit)
            found.append(entry)
        return sorted(found, key=lambda info: info.location.key)

    def _entries(self, root: Location, recursive: bool) -> Iterator[ObjectInfo]:
        """What lies under ``root``, depth first, linked folders not entered (a link's own kind
        is that of its target: listing follows links as reading does)."""
        pending = [root]
        while pending:
            folder = pending.pop()
            with os.scandir(folder.path) as listing:
                for entry in listing:
                    child = folder / entry.name
                    try:
                        found = entry.stat()
                    except OSError:  # a dangling link
                        continue
                    yield ObjectInfo(child, found.st_size, kind(found.st_mode))
                    if recursive and entry.is_dir(follow_symlinks=False):
                        pending.append(child)

    def open(self, location: Location) -> LocalFile:
        return LocalFile(location)

    def whole(self, location: Location, limit: int | None, size: int | None) -> bytes | mmap.mmap:
        """The file memory-mapped (an empty one as ``b""``, which cannot be mapped)."""
        with open_regular(location, buffering=0) as raw:
            length = os.fstat(raw.fileno()).st_size
            if limit is not None and length > limit:
                raise too_large(location, length, limit)
            return mmap.mmap(raw.fileno(), length, access=mmap.ACCESS_READ) if length else b""

    def read_ranges(self, ranges: Sequence[ByteRange], buffers: Sequence[memoryview]) -> None:
        for where, buffer in zip(ranges, buffers):
            with open_regular(where.location, buffering=0) as raw:
                done = 0
                while done < where.length:
                    got = os.preadv(raw.fileno(), [buffer[done:]], where.start + done)
                    if got == 0:
                        raise truncated(where.location, where.start, where.end, os.fstat(raw.fileno()).st_size)
                    done += got
