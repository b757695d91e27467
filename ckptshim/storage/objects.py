"""Object storage as a store, through the fsspec clients the frameworks themselves use.

torch's ``FsspecReader``/``FsspecWriter`` and Orbax's paths (``etils.epath``) reach ``s3://``
and ``gs://`` through fsspec (s3fs, gcsfs); so does ckptshim, with the same filesystem instances
(``fsspec.filesystem(protocol)``), so credentials, endpoints and retries are whatever the user
configured for those clients (``AWS_ENDPOINT_URL``, ``STORAGE_EMULATOR_HOST``, ``FSSPEC_*``,
``~/.aws``, application default credentials). ckptshim handles no credentials.

Reads are byte ranges, at most :data:`MAX_PARALLEL_READS` in flight (the next starting as soon
as one ends). Ranges of one object that overlap or lie within :data:`MERGE_GAP` bytes of each
other are fetched as one run (a request costs a round trip, and some servers answer each in time
proportional to the whole object), and a long run is split into :data:`PIECE_BYTES` pieces, so a
multi-gigabyte tensor is fetched in parallel. Each answer is streamed, a chunk at a time, into
every buffer it overlaps: fsspec's ``cat_ranges`` would first build each answer as one new bytes
object, and faulting in that fresh memory, then copying it, cost more than the transfer (3-4x
"download, then load" on the local servers). The request is each client's own (s3fs's
``get_object`` call, gcsfs's session, URL and headers), so settings and credentials are still
the client's; a failed connection is retried (:data:`RETRIES`). Every read is checked against the size of its object. Listings ask the server for at
most one entry more than their limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ckptshim.storage.location import ByteRange, Location, ObjectInfo
from ckptshim.storage.ranged import RangedFile
from ckptshim.storage.problems import outside, too_large, too_many, truncated, unreachable

#: Byte ranges in flight at once, per call.
MAX_PARALLEL_READS = 16
#: The largest single request; longer runs are split into pieces of this size.
PIECE_BYTES = 16 * 2**20
#: Ranges of one object this close (or overlapping) are fetched as one run.
MERGE_GAP = 64 * 2**10
#: What one read of a response body asks for: small enough that no piece is held whole.
CHUNK_BYTES = 1 << 20
#: Further tries of a piece whose connection failed (not a missing object or a refusal).
RETRIES = 2
#: The most bytes of arrays one batched read asks for at once (a window of blocks, see
#: :attr:`~ckptshim.storage.Location.read_ahead_bytes`): enough for every request in flight to
#: be a full piece (:data:`MAX_PARALLEL_READS` of :data:`PIECE_BYTES`), and the most a load
#: holds in buffers of its own (blocks read ahead, or staged for a cast) beyond its destinations.
READ_AHEAD_BYTES = 256 * 2**20

logger = logging.getLogger(__name__)

#: fsspec's protocol and the package that provides it, for each scheme a Location accepts.
CLIENTS = {"s3": ("s3", "s3fs"), "gs": ("gcs", "gcsfs")}


def filesystem(scheme: str) -> Any:
    """The fsspec filesystem for ``scheme``: the shared instance torch and Orbax get too (fsspec
    caches it, and makes a new one in a forked child, whose event loop the parent's cannot be)."""
    protocol, package = CLIENTS[scheme]
    try:
        import fsspec

        return fsspec.filesystem(protocol)
    except ImportError as error:
        raise ModuleNotFoundError(
            f"reading {scheme}:// locations needs the {package} package (the fsspec client that "
            f"torch's FsspecReader and Orbax use too): pip install {package}") from error


class FsspecObjects:
    """The :class:`~ckptshim.storage.store.Store` of one object-storage scheme."""

    def __init__(self, scheme: str) -> None:
        self.scheme = scheme

    @property
    def read_ahead_bytes(self) -> int:
        """:data:`READ_AHEAD_BYTES`: every read is a round trip, so a window's go in parallel."""
        return READ_AHEAD_BYTES

    def refuse_links_leaving(self, location: Location, also: Sequence[Location]) -> None:
        """Nothing to refuse: an object store holds objects only (no links, pipes or devices),
        and a key below the prefix lies inside it (:meth:`~ckptshim.storage.Location.child`)."""

    @property
    def fs(self) -> Any:
        return filesystem(self.scheme)

    @contextlib.contextmanager
    def _reaching(self, location: Location) -> Iterator[None]:
        """A request for ``location`` whose failure to reach the server at all (after the
        client's own retries) is said as such, naming the endpoint -- not blamed on the checkpoint."""
        try:
            yield
        except Exception as error:
            if _unreached(error):
                raise unreachable(location, endpoint(self.fs, self.scheme), error) from error
            raise

    def open(self, location: Location) -> RangedFile:
        return RangedFile(location)

    def stat(self, location: Location) -> ObjectInfo:
        with self._reaching(location):
            info = self.fs.info(fsspec_path(location))
        kind = "directory" if info.get("type") == "directory" else "file"
        return ObjectInfo(location, int(info.get("size") or 0), kind)

    def is_link(self, location: Location) -> bool:
        """Never: an object store holds objects only."""
        return False

    def list(self, location: Location, limit: int, recursive: bool) -> list[ObjectInfo]:
        prefix = fsspec_path(location).rstrip("/") + "/"
        found = []
        with self._reaching(location):
            listed = _bounded_listing(self.fs, self.scheme, fsspec_path(location), limit + 1, recursive)
        for info in listed:
            name = info["name"].rstrip("/")
            if not name.startswith(prefix) or name == prefix.rstrip("/"):
                continue  # the folder itself, or a marker object of it
            kind = "directory" if info.get("type") == "directory" else "file"
            try:
                child = location / name[len(prefix):]
            except ValueError:
                raise outside(f"{location.scheme}://{name}", location, "a name with '.', '..' or an empty part, "
                              "which HTTP clients rewrite into another object's") from None
            found.append(ObjectInfo(child, int(info.get("size") or 0), kind))
        if len(found) > limit:
            raise too_many(location, limit)
        if not found and location.key:  # object stores hold no empty folders
            raise FileNotFoundError(f"{location}: nothing is stored below this prefix")
        return sorted(found, key=lambda info: info.location.key)

    def whole(self, location: Location, limit: int | None, size: int | None) -> bytearray:
        """The object fetched whole (in parallel pieces): every byte a header walk may touch."""
        size = self.stat(location).size if size is None else size
        if limit is not None and size > limit:
            raise too_large(location, size, limit)
        buffer = bytearray(size)
        self.read_ranges([ByteRange(location, 0, size)], [memoryview(buffer)])
        return buffer

    def read_at_most(self, location: Location, most: int) -> bytes:
        """The first ``most`` bytes of the object (all of a smaller one), in one request that
        needs no size first: the client's own ranged read (``cat_file``), whose answer the
        server cuts at the object's end."""
        with self._reaching(location):
            data = self.fs.cat_file(fsspec_path(location), start=0, end=most)
        return bytes(data[:most])

    def read_ranges(self, ranges: Sequence[ByteRange], buffers: Sequence[memoryview]) -> None:
        for where in ranges:
            if where.length == 0:  # no request (an empty HTTP range means the whole object)
                size = self.stat(where.location).size
                if where.start > size:
                    raise truncated(where.location, where.start, where.end, size)
        pieces = [piece for run in _runs(ranges, buffers) for piece in _pieces(run)]
        if pieces:
            from fsspec.asyn import sync

            fs = self.fs
            with self._reaching(pieces[0][1].location):
                answers = sync(fs.loop, _fetch_all, fs, self.scheme, pieces)
                for (run, piece), answer in zip(pieces, answers):
                    self._check(run, piece, answer)

    def _check(self, run: _Run, piece: ByteRange, answer: int | BaseException) -> None:
        """Raise what went wrong with one piece (``answer``: the bytes it streamed, or the error)."""
        if isinstance(answer, FileNotFoundError | PermissionError):
            raise answer
        if isinstance(answer, BaseException) or answer != piece.length:
            size = self.stat(piece.location).size
            for where, _ in run.parts:
                if where.end > size:
                    raise truncated(where.location, where.start, where.end, size)
            if isinstance(answer, BaseException):
                raise answer
            raise OSError(f"{piece.location}: asked for {piece.length} bytes at {piece.start}, "
                          f"got {answer} from a {size}-byte object; retry the load")


async def _fetch_all(fs: Any, scheme: str, pieces: list[tuple[_Run, ByteRange]]) -> list[int | BaseException]:
    """Every piece, at most :data:`MAX_PARALLEL_READS` in flight (a new one starts as soon as one
    ends), each streamed into its run's buffers; per piece, the bytes it streamed or its error."""
    slots = asyncio.Semaphore(MAX_PARALLEL_READS)
    stream = _stream_for(fs, scheme)

    async def fetch(run: _Run, piece: ByteRange) -> int:
        async with slots:
            for attempt in range(RETRIES + 1):
                sink = _Sink(run, piece)
                try:
                    await stream(fs, piece, sink)
                    return sink.received
                except (FileNotFoundError, PermissionError, _WrongLength):
                    raise
                except (OSError, asyncio.TimeoutError, ConnectionError) as error:
                    if attempt == RETRIES:
                        raise
                    logger.debug("%s: retrying bytes %d-%d after %s", piece.location, piece.start, piece.end, error)
        raise AssertionError("unreachable")

    return await asyncio.gather(*(fetch(run, piece) for run, piece in pieces), return_exceptions=True)


class _Sink:
    """Where one piece's bytes go as they arrive: copied into every buffer of its run that they
    overlap (the piece's bytes are never held whole); ``received`` counts them."""

    def __init__(self, run: _Run, piece: ByteRange) -> None:
        self.piece = piece
        self.parts = [(where, target) for where, target in run.parts
                      if where.start < piece.end and where.end > piece.start]
        self.first = 0  # parts before it end before what has arrived
        self.received = 0

    def write(self, chunk: bytes) -> None:
        begin = self.piece.start + self.received
        end = min(begin + len(chunk), self.piece.end)  # a server sending more is caught by the count
        self.received += len(chunk)
        data = memoryview(chunk)
        while self.first < len(self.parts) and self.parts[self.first][0].end <= begin:
            self.first += 1
        for where, target in self.parts[self.first:]:
            if where.start >= end:
                break
            low, high = max(where.start, begin), min(where.end, end)
            if low < high:
                target[low - where.start:high - where.start] = data[low - begin:high - begin]


async def _gcs_stream(fs: Any, piece: ByteRange, sink: _Sink) -> None:
    """gcsfs's own request for a range (``_cat_file``'s, its session and headers), read as chunks."""
    from gcsfs.retry import validate_response

    await fs._set_session()
    url = fs.url(fsspec_path(piece.location))
    async with fs.session.get(url, params=fs._get_params({}), timeout=fs.requests_timeout,
                              headers=fs._get_headers({"Range": f"bytes={piece.start}-{piece.end - 1}"})) as answer:
        if answer.status >= 400:
            validate_response(answer.status, await answer.read(), url)
        _require_length(piece, answer.content_length)
        async for chunk in answer.content.iter_chunked(CHUNK_BYTES):
            sink.write(chunk)


async def _s3_stream(fs: Any, piece: ByteRange, sink: _Sink) -> None:
    """s3fs's own ``get_object`` call for a range (as its ``_cat_file``), its body read as chunks."""
    bucket, key, version = fs.split_path(fsspec_path(piece.location))
    extra = {"VersionId": version} if version else {}
    answer = await fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={piece.start}-{piece.end - 1}",
                               **extra)
    body = answer["Body"]
    try:
        _require_length(piece, answer.get("ContentLength"))
        while chunk := await body.read(CHUNK_BYTES):
            sink.write(chunk)
    finally:
        body.close()


def _require_length(piece: ByteRange, announced: int | None) -> None:
    """Refuse an answer whose announced length is not the range's (a server that ignored the
    range, or one past the object's end) before a byte of it reaches a buffer; the piece's
    check (:meth:`FsspecObjects._check`) then says whether the object is short."""
    if announced is not None and announced != piece.length:
        raise _WrongLength(f"{piece.location}: asked for {piece.length} bytes at {piece.start}, "
                           f"the server answers {announced}")


class _WrongLength(OSError):
    """An answer of another length than asked for: not retried (the server would answer the same)."""


async def _cat_stream(fs: Any, piece: ByteRange, sink: _Sink) -> None:
    """Any fsspec client's own ranged read (its async ``_cat_file``): the piece as one bytes
    object, then into the sink. Slower (fresh memory per answer), but public fsspec protocol."""
    data = await fs._cat_file(fsspec_path(piece.location), start=piece.start, end=piece.end)
    _require_length(piece, len(data))
    sink.write(data)


#: How each scheme's client streams a byte range into a :class:`_Sink`.
_STREAMS = {"gs": _gcs_stream, "s3": _s3_stream}
#: The client attributes each of :data:`_STREAMS` uses that are not fsspec's public protocol
#: (gcsfs's and s3fs's own request helpers, stable across their releases but private).
_NEEDS = {"gs": ("_set_session", "_get_params", "_get_headers", "url"), "s3": ("_call_s3", "split_path")}


def _stream_for(fs: Any, scheme: str) -> Any:
    """The streaming reader of ``scheme``, or :func:`_cat_stream` where the client lacks what it
    uses (another release of gcsfs or s3fs): a read never fails for want of a private helper."""
    return _STREAMS[scheme] if all(hasattr(fs, name) for name in _NEEDS[scheme]) else _cat_stream


def _unreached(error: BaseException) -> bool:
    """Whether ``error`` (a client's, its causes included) is a failure to reach the server at all:
    a refused or timed-out connection, or a host name that does not resolve."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, ConnectionError | TimeoutError | socket.gaierror):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def endpoint(fs: Any, scheme: str) -> str:
    """The server a client sends its requests to, as its settings say (gcsfs: its location,
    ``STORAGE_EMULATOR_HOST`` included; s3fs: its botocore client's endpoint URL)."""
    if scheme == "gs":
        return str(getattr(fs, "_location", "") or "the Google Cloud Storage endpoint")
    client = getattr(fs, "s3", None)  # s3fs's botocore client, once it has connected
    url = getattr(getattr(client, "meta", None), "endpoint_url", None)
    return str(url or (getattr(fs, "client_kwargs", None) or {}).get("endpoint_url") or "the S3 endpoint")


def fsspec_path(location: Location) -> str:
    """The fsspec path of a location: ``bucket/key``."""
    return f"{location.bucket}/{location.key}" if location.key else location.bucket


@dataclass(frozen=True)
class _Run:
    """Bytes ``start..end`` of one object, fetched together for the ranges in ``parts`` (each
    with the buffer its bytes go to)."""

    location: Location
    start: int
    end: int
    parts: list[tuple[ByteRange, memoryview]]


def _runs(ranges: Sequence[ByteRange], buffers: Sequence[memoryview]) -> list[_Run]:
    """The non-empty ranges, grouped into runs: per object, those that overlap or lie within
    :data:`MERGE_GAP` of each other."""
    by_object: dict[Location, list[tuple[ByteRange, memoryview]]] = {}
    for where, buffer in zip(ranges, buffers):
        if where.length:
            by_object.setdefault(where.location, []).append((where, buffer))
    runs: list[_Run] = []
    for location, parts in by_object.items():
        parts.sort(key=lambda part: part[0].start)
        current: list[tuple[ByteRange, memoryview]] = []
        start = end = 0
        for where, buffer in parts:
            if current and where.start > end + MERGE_GAP:
                runs.append(_Run(location, start, end, current))
                current = []
            if not current:
                start, end = where.start, where.end
            current.append((where, buffer))
            end = max(end, where.end)
        runs.append(_Run(location, start, end, current))
    return runs


def _pieces(run: _Run) -> Iterator[tuple[_Run, ByteRange]]:
    for start in range(run.start, run.end, PIECE_BYTES):
        yield run, ByteRange(run.location, start, min(start + PIECE_BYTES, run.end) - start)


def _bounded_listing(fs: Any, scheme: str, path: str, most: int, recursive: bool) -> list[dict]:
    """At most ``most`` entries under ``path`` (one level, or everything below it), asking the
    server for no more: s3fs's ``_lsdir(max_items=)``, gcsfs's ``_list_objects(max_results=)``
    (fsspec's public ``ls``/``find`` take no limit)."""
    from fsspec.asyn import sync

    delimiter = "" if recursive else "/"
    if scheme == "s3":
        listed = sync(fs.loop, fs._lsdir, path, refresh=True, max_items=most, delimiter=delimiter)
    else:
        fs.invalidate_cache(path)  # gcsfs answers from a cached one-level listing, even for a recursive one
        try:
            listed = sync(fs.loop, fs._list_objects, path, max_results=most, delimiter=delimiter)
        except FileNotFoundError:
            listed = []
        if len(listed) == 1 and listed[0]["name"].rstrip("/") == path and listed[0].get("type") == "file":
            listed = []  # gcsfs answers an object's own entry when nothing lies below its name
    if len(listed) >= most:
        fs.invalidate_cache(path)  # s3fs keeps a one-level listing, cut short here, as if whole
    return listed[:most]
