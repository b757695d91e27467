"""Reading a file by offset through :meth:`~ckptshim.storage.Location.open`, the same way on a disk and in a bucket.

Header parsers (a ``torch.save`` archive's zip directory and pickle) make many small reads; against
object storage each would be a round trip. :func:`prefetch` fetches, in one parallel batch, the
spans the parsers of many files are about to read (the head and tail of each archive: see
:func:`archive_spans`); an object (:class:`RangedFile`, the object stores' open file) answers a
read that lies inside a fetched span from it, and sends any other to the store as one byte
range. A local file wants nothing fetched ahead (the page cache is there), so the same calls
cost it nothing. Every read is checked against the file's size by its store. A :class:`Window`
gives a parser that wants a seekable file (``zipfile``) exactly one archive's bytes of an open
file, and nothing outside them.
"""

from __future__ import annotations

import bisect
import errno
import io
import os
from collections.abc import Iterable, Sequence

from ckptshim.storage.location import ByteRange, Location, OpenFile, read_ranges

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
    """The object at ``location`` opened (:class:`~ckptshim.storage.OpenFile`): read by byte
    ranges, those inside spans fetched ahead (:func:`prefetch`) answered from them."""

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

    def wanted(self, spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
        """The spans not already held: each read here is a round trip, so fetch them together."""
        return sorted({(start, length) for start, length in spans if length and self._held(start, length) is None})

    def hold(self, start: int, data: bytearray) -> None:
        at = bisect.bisect(self._starts, start)
        self._starts.insert(at, start)
        self._spans.insert(at, (start, data))

    def _held(self, start: int, length: int) -> memoryview | None:
        """The bytes ``start..start+length`` where one span fetched ahead holds them all."""
        at = bisect.bisect(self._starts, start) - 1
        if at >= 0:
            begin, data = self._spans[at]
            if start + length <= begin + len(data):
                return memoryview(data)[start - begin:start - begin + length]
        return None

    def pread(self, buffer: memoryview, offset: int) -> int:
        """Fill ``buffer`` from ``offset``; the number of bytes read (all of them, or an error
        that says the object is shorter)."""
        held = self._held(offset, len(buffer))
        if held is not None:
            buffer[:] = held
        elif len(buffer):
            self.location.read_into(offset, buffer)
        return len(buffer)

    def view(self, start: int, length: int) -> memoryview:
        """The bytes, fetched (or sliced from a span fetched ahead)."""
        held = self._held(start, length)
        if held is not None:
            return held
        data = bytearray(length)
        self.pread(memoryview(data), start)
        return memoryview(data)


def prefetch(wanted: Sequence[tuple[OpenFile, Iterable[tuple[int, int]]]]) -> None:
    """Fetch the spans of every open file that it wants fetched ahead (:meth:`OpenFile.wanted
    <ckptshim.storage.OpenFile.wanted>`: an object's not yet held; a local file's, none), all in
    one parallel batch (bounded): the headers of a folder's archives cost one round trip, not one
    per archive."""
    missing = [(file, span) for file, spans in wanted for span in file.wanted(spans)]
    if not missing:
        return
    fetched = read_ranges([ByteRange(file.location, start, length) for file, (start, length) in missing])
    for (file, (start, _)), data in zip(missing, fetched or ()):
        file.hold(start, data)


class Window(io.RawIOBase):
    """A read-only, seekable view of ``length`` bytes of ``raw`` from ``start`` (one archive: a
    whole ``torch.save`` file, or a DCP chunk inside a larger one). Nothing outside it is read."""

    def __init__(self, raw: OpenFile, start: int, length: int) -> None:
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
        got = self._raw.pread(memoryview(buffer)[:count], self._start + self._pos) if count else 0
        self._pos += got
        return got

    def prefetch(self, spans: Iterable[tuple[int, int]]) -> None:
        """Fetch these spans of the window (clipped to it) in one parallel batch where its file
        wants them fetched ahead (an object), before a parser reads them piecemeal."""
        prefetch([(self._raw, [(self._start + start, min(length, self._length - start))
                               for start, length in spans if 0 <= start < self._length])])
