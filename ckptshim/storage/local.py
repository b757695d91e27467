"""The local file system as a store: regular files only, opened without ever blocking.

Every file is checked with a ``stat`` before it is opened (a device is never opened) and again on
the descriptor, which is opened ``O_NONBLOCK`` so that a FIFO swapped in between cannot block the
open; then bytes are ``preadv``-ed straight into the caller's buffer. Listings are ``scandir``
walks that stop one entry past their limit.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator, Sequence
from typing import BinaryIO

from ckptshim.storage.location import ByteRange, Location, ObjectInfo
from ckptshim.storage.problems import not_regular, too_many, truncated


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


class LocalFiles:
    """The :class:`~ckptshim.storage.store.Store` of local paths."""

    #: A block at a time: a read is a copy from the page cache, and nothing is held beyond it.
    read_ahead_bytes = 0

    def stat(self, location: Location) -> ObjectInfo:
        found = os.stat(location.path)
        return ObjectInfo(location, found.st_size, kind(found.st_mode))

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

    def read_ranges(self, ranges: Sequence[ByteRange], buffers: Sequence[memoryview]) -> None:
        for where, buffer in zip(ranges, buffers):
            with open_regular(where.location, buffering=0) as raw:
                done = 0
                while done < where.length:
                    got = os.preadv(raw.fileno(), [buffer[done:]], where.start + done)
                    if got == 0:
                        raise truncated(where.location, where.start, where.end, os.fstat(raw.fileno()).st_size)
                    done += got
