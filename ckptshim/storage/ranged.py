"""An object in a bucket, read the way ckptshim's parsers read a local file: ``pread`` at an offset.

Header parsers (a ``torch.save`` archive's zip directory and pickle) make many small reads; against
object storage each would be a round trip. :meth:`RangedFile.prefetch` fetches, in one parallel
batch, the spans a parser is about to read (the head and tail of each archive: see
:func:`archive_spans`); a read that lies inside a fetched span is answered from it, any other goes
to the store as one byte range. Every read is checked against the object's size by the store.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

from ckptshim.storage.location import ByteRange, Location, read_ranges

#: How much of each end of an archive :func:`archive_spans` asks for: a ``torch.save`` archive
#: of one tensor keeps its pickle and the tensor's local header at the start, and its zip
#: directory at the end, each well inside this.
HEADER_BYTES = 8 << 10


def archive_spans(start: int, length: int) -> list[tuple[int, int]]:
    """The spans ``(start, length)`` of an archive at ``start`` that hold its headers: the whole
    archive when it is small, else its first and last :data:`HEADER_BYTES`."""
    if length <= 2 * HEADER_BYTES:
        return [(start, length)]
    return [(start, HEADER_BYTES), (start + length - HEADER_BYTES, HEADER_BYTES)]


class RangedFile:
    """The object at ``location``, read by byte ranges; the stand-in for a local file's
    descriptor wherever a parser reads with ``pread`` (see :func:`ckptshim.formats.dcp.pread`)."""

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
        wanted = sorted({(start, length) for start, length in spans if length and not self._holds(start, length)})
        if not wanted:
            return
        fetched = read_ranges([ByteRange(self.location, start, length) for start, length in wanted])
        for (start, _), data in zip(wanted, fetched or ()):
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
