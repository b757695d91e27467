"""An object in a bucket, read the way ckptshim's parsers read a local file: ``pread`` at an offset.

Header parsers (a ``torch.save`` archive's zip directory and pickle) make many small reads; against
object storage each would be a round trip. :meth:`RangedFile.prefetch` fetches, in one parallel
batch, the spans a parser is about to read (the head and tail of each archive: see
:func:`archive_spans`; :func:`prefetch` does it for many objects at once); a read that lies inside
a fetched span is answered from it, any other goes to the store as one byte range. Every read is
checked against the object's size by the store. A :class:`Window` gives a parser that wants a
seekable file (``zipfile``) exactly one archive's bytes of a local file or an object, and nothing
outside them.
"""

from __future__ import annotations

import bisect
import errno
import io
import os
from collections.abc import Iterable, Sequence
from typing import BinaryIO

from ckptshim.storage.local import open_regular
from ckptshim.storage.location import ByteRange, Location, read_ranges

#: How much of each end of an archive :func:`archive_spans` asks for: a ``torch.save`` archive
#: of one tensor keeps its pickle and the tensor's local header at the start, and its zip
#: directory at the end, each well inside this.
HEADER_BYTES = 8 << 10


def archive_spans(start: int, length: int, head: int = HEADER_BYTES, tail: int = HEADER_BYTES) -> list[tuple[int, int]]:
    """The spans ``(start, length)`` of an archive at ``start`` that hold its headers: the whole
    archive when it is small, else its first ``head`` and last ``tail`` bytes (zip keeps its
    directory at the end)."""
    if length <= head + tail:
        return [(start, length)]
    return [(start, head), (start + length - tail, tail)]


class RangedFile:
    """The object at ``location``, read by byte ranges; the stand-in for a local file's
    descriptor wherever a parser reads with ``pread`` (see :func:`pread`)."""

    def __init__(self, location: Location) -> None:
        self.location = location
        self._starts: list[int] = []
        self._spans: list[tuple[int, bytearray]] = []

    def __enter__(self) -> RangedFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._starts, self._spans = [], []

    def prefetch(self, spans: Iterable[tuple[int, int]]) -> None:
        """Fetch every span ``(start, length)`` not already held, in parallel (bounded)."""
        prefetch([(self, spans)])

    def _missing(self, spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
        return sorted({(start, length) for start, length in spans if length and not self._holds(start, length)})

    def _hold(self, start: int, data: bytearray) -> None:
        at = bisect.bisect(self._starts, start)
        self._starts.insert(at, start)
        self._spans.insert(at, (start, data))

    def _holds(self, start: int, length: int) -> bytearray | None:
        at = bisect.bisect(self._starts, start) - 1
        if at >= 0:
            begin, data = self._spans[at]
            if start + length <= begin + len(data):
                return data
        return None

    def pread(self, buffer: memoryview, offset: int) -> int:
        """Fill ``buffer`` from ``offset``; the number of bytes read (all of them, or an error
        that says the object is shorter)."""
        length = len(buffer)
        held = self._holds(offset, length)
        if held is not None:
            begin = self._starts[bisect.bisect(self._starts, offset) - 1]
            buffer[:] = memoryview(held)[offset - begin:offset - begin + length]
        elif length:
            self.location.read_into(offset, buffer)
        return length


def prefetch(wanted: Sequence[tuple[RangedFile, Iterable[tuple[int, int]]]]) -> None:
    """Fetch the spans of every file that it does not already hold, all in one parallel batch
    (bounded): the headers of a folder's archives cost one round trip, not one per archive."""
    missing = [(file, span) for file, spans in wanted for span in file._missing(spans)]
    if not missing:
        return
    fetched = read_ranges([ByteRange(file.location, start, length) for file, (start, length) in missing])
    for (file, (start, _)), data in zip(missing, fetched or ()):
        file._hold(start, data)


#: What archives are read from: a local file (opened by ``open_regular``), or an object.
Source = BinaryIO | RangedFile


def open_source(where: str | os.PathLike[str] | Location) -> Source:
    """The file or object at ``where``, opened for :func:`pread`: a local regular file (refused,
    without blocking, when it is anything else: :func:`~ckptshim.storage.local.open_regular`),
    an object as a :class:`RangedFile`. A parser reads either the same way."""
    location = Location.of(where)
    if location.is_remote:
        return RangedFile(location)
    return open_regular(location, buffering=0)


def pread(raw: Source, buffer: memoryview, offset: int) -> int:
    """Bytes from ``offset`` into ``buffer``: how many were read (0 at the end of the file)."""
    if isinstance(raw, RangedFile):
        return raw.pread(buffer, offset)
    return os.preadv(raw.fileno(), [buffer], offset)


class Window(io.RawIOBase):
    """A read-only, seekable view of ``length`` bytes of ``raw`` from ``start`` (one archive: a
    whole ``torch.save`` file, or a DCP chunk inside a larger one). Nothing outside it is read."""

    def __init__(self, raw: Source, start: int, length: int) -> None:
        super().__init__()
        self._raw, self._start, self._length, self._pos = raw, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        """As a file seeks: before the start is ``EINVAL`` (a damaged zip directory's offsets must
        fail here as they fail on the local file), past the end reads nothing."""
        position = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence] + offset
        if position < 0:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        self._pos = position
        return self._pos

    def readinto(self, buffer) -> int:  # type: ignore[override]
        count = max(0, min(len(buffer), self._length - self._pos))
        got = pread(self._raw, memoryview(buffer)[:count], self._start + self._pos) if count else 0
        self._pos += got
        return got

    def prefetch(self, spans: Iterable[tuple[int, int]]) -> None:
        """Over an object, fetch these spans of the window (clipped to it) in one parallel batch,
        before a parser reads them piecemeal; over a local file, nothing (the page cache is there)."""
        if isinstance(self._raw, RangedFile):
            self._raw.prefetch((self._start + start, min(length, self._length - start))
                               for start, length in spans if 0 <= start < self._length)
