"""Where a checkpoint's bytes are: a local path or an object-store URL, as one value.

``pathlib`` turns ``gs://bucket/ckpt`` into ``gs:/bucket/ckpt``, a relative local path; a
:class:`Location` keeps a URL a URL. It joins, names and finds parents the way its kind does
(object keys are never normalised), tells whether a location lies inside a checkpoint (and
refuses one that leaves it, locally by real path, remotely by bucket and prefix), and reads:
stat, listing with a maximum count, and byte ranges, each checked against the size of what it
reads. Reads go to a :class:`Store` for the location's scheme (the package registers the local
file system and the fsspec clients), so this module imports none of them, nor torch or jax.

Arrays in zarr or OCDBT are read by tensorstore itself: :meth:`Location.kvstore_spec` is the
kvstore spec that reads a location's folder (``file``, ``gcs`` or ``s3``), and
:meth:`Location.require_kvstore_inside` refuses a spec, written in a checkpoint, that reaches
outside it. This is the split Orbax itself makes on ``gs://``: arrays through tensorstore, every
other file through fsspec (``etils.epath``).
"""

from __future__ import annotations

import mmap
import os
import re
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ckptshim.storage.problems import outside, too_large, too_many_names

#: The object-storage schemes a Location reads, as written -> the store that reads them
#: (``gcs://`` is fsspec's other spelling of ``gs://``).
REMOTE_SCHEMES = {"s3": "s3", "gs": "gs", "gcs": "gs"}
#: What one listing returns at most unless the caller says otherwise: more than any checkpoint
#: folder ckptshim reads holds (a per-array Orbax checkpoint of a large model has ~100,000).
DEFAULT_LIST_LIMIT = 1_000_000

#: What Orbax adds to an OCDBT store in object storage: byte ranges of one data file asked for
#: within a millisecond of each other fetched in one request (Orbax: "could reduce I/O ops by a
#: factor of 10"), as each request to a bucket costs a round trip.
REMOTE_OCDBT_READS = {
    "experimental_read_coalescing_threshold_bytes": 1_000_000,
    "experimental_read_coalescing_merged_bytes": 500_000_000_000,
    "experimental_read_coalescing_interval": "1ms",
}

_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://(.*)", re.DOTALL)


class UnsupportedLocation(ValueError):
    """A URL ckptshim does not read (``http://``, ``hf://``, ...). Not a refusal of the checkpoint:
    whoever asked steps aside and lets the framework read it."""


@dataclass(frozen=True, order=True)
class Location:
    """A local path (``scheme == ""``, ``key`` the path as pathlib spells it) or an object or prefix in a
    bucket (``scheme`` ``"s3"``/``"gs"``/``"gcs"`` as written, ``key`` without leading or
    trailing ``/``). Build one with :meth:`of`. Locations sort by scheme, bucket, then key (as a
    reader orders its reads file by file)."""

    scheme: str
    bucket: str
    key: str

    @classmethod
    def of(cls, where: str | os.PathLike[str] | Location) -> Location:
        """The location ``where`` names: a URL (``s3://``, ``gs://``, ``gcs://``, ``file://``) or a
        local path. Raises :class:`UnsupportedLocation` for any other URL -- ``S3://`` included:
        fsspec, through which the frameworks read buckets, knows schemes as written, so a hook
        steps aside for it and lets the framework say what it makes of it."""
        if isinstance(where, Location):
            return where
        text = os.fspath(where)
        if not isinstance(text, str):
            raise TypeError(f"a location is text or a path, not {type(text).__name__}")
        match = _URL.fullmatch(text) if not isinstance(where, os.PathLike) else None
        if match is None:
            if not text:
                raise ValueError("an empty location names nothing; give the checkpoint's path or URL")
            return cls("", "", str(Path(text)))
        scheme, rest = match.group(1), match.group(2)
        if scheme == "file":
            return cls("", "", str(Path(rest)))
        if scheme not in REMOTE_SCHEMES:  # as written: fsspec knows no ``S3://`` either
            raise UnsupportedLocation(
                f"{text}: ckptshim reads local paths and {', '.join(f'{s}://' for s in REMOTE_SCHEMES)} "
                f"URLs (in lower case, as fsspec and the frameworks spell them), not {scheme}://")
        bucket, _, key = rest.partition("/")
        if not bucket:
            raise ValueError(f"{text}: names no bucket; write {scheme}://BUCKET/PATH")
        return cls(scheme, bucket, key.rstrip("/"))

    # -- names --------------------------------------------------------------------------------

    @property
    def is_remote(self) -> bool:
        return bool(self.scheme)

    @property
    def path(self) -> Path:
        """The local path (refused for a remote location: nothing local may stand in for it)."""
        if self.is_remote:
            raise TypeError(f"{self} is in object storage, not a local path; read it through its Location")
        return Path(self.key)

    def __fspath__(self) -> str:
        return str(self.path)

    def __str__(self) -> str:
        if not self.is_remote:
            return self.key
        return f"{self.scheme}://{self.bucket}/{self.key}" if self.key else f"{self.scheme}://{self.bucket}"

    def __repr__(self) -> str:
        return f"Location({str(self)!r})"

    def __truediv__(self, part: str) -> Location:
        """The location of ``part`` (one name, or names joined by ``/``) inside this one.

        Remotely, a part is taken literally, so one that an HTTP client would rewrite (``.``,
        ``..``, an empty name) or that starts at the root is refused, as is a NUL byte anywhere.
        """
        if not isinstance(part, str):
            raise TypeError(f"join a location with a name (str), not {type(part).__name__}")
        if not self.is_remote:
            return Location("", "", str(self.path / part))
        bad = _bad_names(part)
        if bad:
            raise ValueError(f"{self}: cannot join {part!r} ({bad}); object keys are joined name by name")
        return Location(self.scheme, self.bucket, f"{self.key}/{part}" if self.key else part)

    joinpath = __truediv__

    @property
    def name(self) -> str:
        """The last name (``""`` for a bucket itself)."""
        return self.path.name if not self.is_remote else self.key.rpartition("/")[2]

    @property
    def parent(self) -> Location:
        """The folder or prefix this lies in (a bucket is its own parent, as ``/`` is)."""
        if not self.is_remote:
            return Location("", "", str(self.path.parent))
        return Location(self.scheme, self.bucket, self.key.rpartition("/")[0])

    def relative_to(self, root: Location) -> str:
        """This location's name below ``root``, ``/``-separated; ``ValueError`` when it is not below."""
        if not self.inside(root):
            raise ValueError(f"{self} is not inside {root}")
        if not self.is_remote:
            return Path(os.path.realpath(self.path)).relative_to(os.path.realpath(root.path)).as_posix()
        return self._below(root)

    # -- containment --------------------------------------------------------------------------

    def inside(self, root: Location) -> bool:
        """Whether this is ``root`` or lies below it: locally with ``..`` and links resolved;
        remotely in the same bucket, below the same prefix, with no name an HTTP client rewrites."""
        if self.is_remote != root.is_remote:
            return False
        if not self.is_remote:
            mine, theirs = Path(os.path.realpath(self.path)), Path(os.path.realpath(root.path))
            return mine == theirs or theirs in mine.parents
        if REMOTE_SCHEMES[self.scheme] != REMOTE_SCHEMES[root.scheme] or self.bucket != root.bucket:
            return False
        if root.key and not (self.key == root.key or self.key.startswith(root.key + "/")):
            return False
        below = self._below(root)
        return not below or not _bad_names(below)

    def _below(self, root: Location) -> str:
        """The remote key below ``root``'s (which it starts with), without the separating ``/``."""
        return self.key[len(root.key) + 1:] if root.key else self.key

    def child(self, relative: str) -> Location:
        """The location ``relative`` (as a checkpoint's metadata names a file in it) inside this
        one; refused with :class:`~ckptshim.errors.UnsafeCheckpointError` when it leaves it
        (an absolute path, a URL, ``..``, a link out)."""
        why = ("an absolute name" if relative.startswith("/") else "a URL, not a name" if _URL.fullmatch(relative)
               else _bad_names(relative) if self.is_remote else "a NUL byte" if "\0" in relative else "")
        if why:
            raise outside(f"{self}/{relative}", self, why)
        found = self / relative
        if not found.inside(self):
            raise outside(found, self, "its real path is elsewhere")
        return found

    def refuse_links_leaving(self, also: Sequence[str | os.PathLike[str] | Location] = ()) -> None:
        """Refuse the checkpoint folder here where it holds something ckptshim would read from
        outside it: locally a link whose target leaves it (and ``also``) or anything neither a
        file nor a folder (a FIFO, a device), found by one walk when the checkpoint is opened;
        an object store holds neither (:meth:`child` keeps each key inside the prefix)."""
        store_for(self).refuse_links_leaving(self, [Location.of(other) for other in also])

    def require_inside(self, root: Location) -> None:
        """Refuse this location when it is not inside ``root``, the checkpoint that names it."""
        if not self.inside(root):
            raise outside(self, root, "another bucket or prefix" if self.is_remote else "another folder")

    # -- tensorstore ----------------------------------------------------------------------------

    def kvstore_spec(self, ocdbt: bool = False) -> dict[str, Any]:
        """The tensorstore kvstore spec of this location as a folder (an OCDBT database in it,
        with ``ocdbt``; in a bucket, with Orbax's read coalescing: :data:`REMOTE_OCDBT_READS`).
        An ``s3`` spec carries the endpoint botocore would use (``AWS_ENDPOINT_URL_S3`` or
        ``AWS_ENDPOINT_URL``), which tensorstore reads from no setting of its own; credentials
        stay tensorstore's own business."""
        if not self.is_remote:
            base: dict[str, Any] = {"driver": "file", "path": os.path.realpath(self.path) + "/"}
        else:
            driver = "gcs" if REMOTE_SCHEMES[self.scheme] == "gs" else "s3"
            base = {"driver": driver, "bucket": self.bucket, "path": f"{self.key}/" if self.key else ""}
            endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
            if driver == "s3" and endpoint:
                base["endpoint"] = endpoint
        if not ocdbt:
            return base
        return {"driver": "ocdbt", "base": base, **(REMOTE_OCDBT_READS if self.is_remote else {})}

    @classmethod
    def of_kvstore(cls, spec: str | dict) -> Location:
        """The folder a tensorstore kvstore spec (a dict or a kvstore URL) reads from: ``file``,
        ``gcs`` and ``s3``, and the base of an ``ocdbt`` store. Any other driver raises
        :class:`UnsupportedLocation`."""
        if isinstance(spec, str):
            base, *adapters = spec.split("|")
            if any(not adapter.startswith("ocdbt:") for adapter in adapters):
                raise UnsupportedLocation(f"kvstore URL {spec!r}: ckptshim reads file, gs and s3 stores, "
                                          "and OCDBT over them")
            return cls.of(base)
        if not isinstance(spec, dict):
            raise UnsupportedLocation(f"not a tensorstore kvstore spec: {spec!r}")
        driver, path = spec.get("driver"), spec.get("path", "")
        if driver == "ocdbt":
            return cls.of_kvstore(spec.get("base"))
        if not isinstance(path, str) or "\0" in path:
            raise UnsupportedLocation(f"kvstore spec {spec!r}: its path is not a name")
        if driver == "file":
            return cls.of(path)
        if driver in ("gcs", "s3") and isinstance(spec.get("bucket"), str) and spec["bucket"]:
            return Location("gs" if driver == "gcs" else "s3", spec["bucket"], path.strip("/"))
        raise UnsupportedLocation(f"kvstore spec {spec!r}: ckptshim reads the file, gcs and s3 drivers "
                                  "(and ocdbt over them)")

    def require_kvstore_inside(self, spec: str | dict) -> Location:
        """The folder ``spec`` (a kvstore spec read from this checkpoint) names, refused unless it
        lies inside this location."""
        try:
            found = Location.of_kvstore(spec)
        except (UnsupportedLocation, ValueError) as error:
            raise outside(repr(spec), self, f"not a store ckptshim reads: {error}") from None
        found.require_inside(self)
        return found

    # -- reading --------------------------------------------------------------------------------

    def stat(self) -> ObjectInfo:
        """Size and kind; ``FileNotFoundError`` when nothing is there."""
        return store_for(self).stat(self)

    def exists(self) -> bool:
        try:
            self.stat()
        except (FileNotFoundError, NotADirectoryError):
            return False
        return True

    def is_file(self) -> bool:
        """A regular file, or an object (never a pipe, device or folder)."""
        try:
            return self.stat().kind == "file"
        except (FileNotFoundError, NotADirectoryError):
            return False

    def is_link(self) -> bool:
        """A symbolic link (locally; an object store holds none), whatever it points at."""
        return store_for(self).is_link(self)

    def is_dir(self) -> bool:
        """A folder, or a prefix that objects share."""
        try:
            return self.stat().kind == "directory"
        except (FileNotFoundError, NotADirectoryError):
            return False

    def list(self, limit: int = DEFAULT_LIST_LIMIT, *, recursive: bool = False) -> list[ObjectInfo]:
        """What lies in this folder or below this prefix (with ``recursive``, at every depth),
        sorted by name; a :class:`~ckptshim.errors.CorruptCheckpointError` when there are more
        than ``limit`` entries, which the store stops reading one past the limit."""
        return store_for(self).list(self, limit, recursive)

    def files_named(self, names: Collection[str], limit: int = DEFAULT_LIST_LIMIT) -> dict[str, ObjectInfo]:
        """Which of ``names`` (as a checkpoint's metadata names files in this folder or prefix:
        relative, ``/``-joined) are regular files or objects here, by name: found by one bounded
        listing (of the first level, or of every level where a name lies in a subfolder), never
        one request per name -- a marker or index naming 20,000 objects would take hours.

        A name that would leave this location is refused (:meth:`child`); more than ``limit``
        names, more than one listing returns, are refused before anything is listed."""
        if len(names) > limit:
            raise too_many_names(self, len(names), limit)
        for name in names:
            self.child(name)
        if not names:
            return {}
        listed = self.list(limit, recursive=any("/" in name for name in names))
        found = {info.location.relative_to(self): info for info in listed if info.kind == "file"}
        return {name: found[name] for name in names if name in found}

    def open(self) -> OpenFile:
        """The file or object here, opened for many reads by offset (a parser's ``pread``s, views
        of its arrays): what its store does best -- locally a descriptor and a memory map, remotely
        byte ranges, with the spans a parser is about to read fetched together
        (:func:`~ckptshim.storage.ranged.prefetch`). Close it (or use it in a ``with``)."""
        return store_for(self).open(self)

    def read(self, start: int, length: int) -> bytes:
        """Exactly ``length`` bytes from offset ``start``, or an error that says what is short."""
        buffer = bytearray(length)
        self.read_into(start, buffer)
        return bytes(buffer)

    def read_into(self, start: int, buffer: Any) -> None:
        """Fill ``buffer`` (anything writable that exposes bytes) from offset ``start``."""
        read_ranges([ByteRange(self, start, memoryview(buffer).nbytes)], [buffer])

    def head(self, count: int) -> bytes:
        """At most the first ``count`` bytes (fewer from a smaller file): for recognising a
        format by its magic bytes."""
        return self.read(0, min(count, self.stat().size))

    @property
    def read_ahead_bytes(self) -> int:
        """How many bytes of arrays a reader asks for here at once (a window of blocks, read
        together into buffers of their own): its store's, 0 for a local file (a block at a
        time, nothing held beyond it: each read comes from the page cache), a window for an
        object store, whose every read is a round trip."""
        return store_for(self).read_ahead_bytes

    def whole(self, limit: int | None = None, size: int | None = None) -> bytes | bytearray | mmap.mmap:
        """The whole file, for a parser that walks headers spread through it (a msgpack tree, a
        compressed chunk's frames): a local file memory-mapped (only the pages the walk touches
        are read; an empty one as ``b""``), an object fetched whole (``size``: its size, where a
        listing gave it). Refused, before a byte is read, when larger than ``limit``."""
        return store_for(self).whole(self, limit, size)

    def read_bytes(self, limit: int, size: int | None = None) -> bytes:
        """The whole file, refused (before any byte is read) when it is larger than ``limit``:
        for metadata files, whose size no other file vouches for. ``size`` is its size where a
        listing already gave it (remotely, a round trip less); a file that is shorter by now is
        an error, as any short read."""
        size = self.stat().size if size is None else size
        if size > limit:
            raise too_large(self, size, limit)
        return self.read(0, size)


@dataclass(frozen=True)
class ObjectInfo:
    """One file or object: where it is, its size in bytes, and its kind: ``"file"`` (a regular
    file, or an object), ``"directory"`` (a folder, or a prefix objects share) or, locally,
    what else is there (``"fifo"``, ``"socket"``, ``"device"``), which ckptshim never opens."""

    location: Location
    size: int
    kind: str = "file"


@dataclass(frozen=True)
class ByteRange:
    """``length`` bytes of the object at ``location`` from offset ``start``."""

    location: Location
    start: int
    length: int

    def __post_init__(self) -> None:
        if self.start < 0 or self.length < 0:
            raise ValueError(f"{self.location}: byte range {self.start}+{self.length} is negative")

    @property
    def end(self) -> int:
        return self.start + self.length


class OpenFile(Protocol):
    """A file or object opened by :meth:`Location.open`: read by offset as a parser reads a file.
    Every read fills exactly what it asks for or raises (a short file: a
    :class:`~ckptshim.errors.CorruptCheckpointError` naming it)."""

    location: Location

    def pread(self, buffer: memoryview, offset: int) -> int:
        """Fill ``buffer`` from ``offset``; how many bytes were read (fewer only at the end of the file)."""

    def view(self, start: int, length: int) -> memoryview:
        """``length`` bytes from ``start``, read-only: locally a view of a memory map (nothing is
        copied, only the pages touched are read), remotely the fetched bytes."""

    def wanted(self, spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
        """Which spans ``(start, length)`` are worth fetching ahead, together (none where every
        read is cheap: a local file, with the page cache behind it)."""

    def hold(self, start: int, data: bytearray) -> None:
        """Keep ``data``, fetched from ``start``, to answer reads inside it."""

    def close(self) -> None: ...

    def __enter__(self) -> OpenFile: ...

    def __exit__(self, *exc: object) -> None: ...


class Store(Protocol):
    """The reads a location delegates. Nothing there: ``FileNotFoundError``; something ckptshim
    will not read: a :class:`~ckptshim.errors.ShimError`; every read fills exactly the bytes
    asked for or raises."""

    #: How many bytes of arrays a reader asks for at once (see :attr:`Location.read_ahead_bytes`).
    read_ahead_bytes: int

    def stat(self, location: Location) -> ObjectInfo: ...

    def is_link(self, location: Location) -> bool: ...

    def list(self, location: Location, limit: int, recursive: bool) -> list[ObjectInfo]: ...

    def read_ranges(self, ranges: Sequence[ByteRange], buffers: Sequence[memoryview]) -> None: ...

    def whole(self, location: Location, limit: int | None, size: int | None) -> bytes | bytearray | mmap.mmap: ...

    def refuse_links_leaving(self, location: Location, also: Sequence[Location]) -> None: ...

    def open(self, location: Location) -> OpenFile: ...


_STORES: dict[str, Callable[[str], Store]] = {}
_OPEN: dict[str, Store] = {}


def register_store(kind: str, make: Callable[[str], Store]) -> None:
    """Read locations of ``kind`` (``""`` local, or a store name of :data:`REMOTE_SCHEMES`) with
    the store ``make(kind)`` builds on first use."""
    _STORES[kind] = make
    _OPEN.pop(kind, None)


def register_overlay(answer: Callable[[Location], Store | None]) -> None:
    """Ask ``answer(location)`` first which store reads a location: a store that answers for
    some locations in the current context before their scheme's (a snapshot of a bucket prefix:
    :mod:`ckptshim.storage.snapshot`), or ``None``."""
    _OVERLAYS.append(answer)


_OVERLAYS: list[Callable[[Location], Store | None]] = []


def store_for(location: Location) -> Store:
    """The store that reads ``location``: an overlay's (:func:`register_overlay`) where one
    answers for it, else its scheme's."""
    for answer in _OVERLAYS:
        store = answer(location)
        if store is not None:
            return store
    return scheme_store(location)


def scheme_store(location: Location) -> Store:
    """The store of ``location``'s scheme (``""``: the local file system)."""
    kind = REMOTE_SCHEMES[location.scheme] if location.is_remote else ""
    store = _OPEN.get(kind)
    if store is None:
        store = _OPEN[kind] = _STORES[kind](kind)
    return store


def read_ranges(ranges: Sequence[ByteRange], buffers: Sequence[Any] | None = None) -> list[bytearray] | None:
    """Read every range, remote ones in parallel (bounded: see :mod:`ckptshim.storage.objects`).
    With ``buffers`` (one writable buffer per range, of its length) the bytes go straight there
    and nothing is returned; without, each range's bytes are returned, in order."""
    views = [memoryview(b).cast("B") for b in buffers] if buffers is not None \
        else [memoryview(bytearray(r.length)) for r in ranges]
    if len(views) != len(ranges):
        raise ValueError(f"{len(ranges)} ranges but {len(views)} buffers")
    for where, view in zip(ranges, views):
        if view.nbytes != where.length or view.readonly:
            raise ValueError(f"{where.location}: a buffer of {view.nbytes} bytes"
                             f"{' (read-only)' if view.readonly else ''} for a range of {where.length}")
    by_store: dict[int, tuple[Store, list[int]]] = {}
    for i, where in enumerate(ranges):
        store = store_for(where.location)
        by_store.setdefault(id(store), (store, []))[1].append(i)
    for store, indices in by_store.values():
        store.read_ranges([ranges[i] for i in indices], [views[i] for i in indices])
    return None if buffers is not None else [view.obj for view in views]  # type: ignore[misc]  # the bytearrays


def _bad_names(relative: str) -> str:
    """Why ``relative`` is not a plain ``/``-joined run of names (``""`` when it is)."""
    if "\0" in relative:
        return "a NUL byte"
    for name in relative.split("/"):
        if name in ("", ".", ".."):
            return f"a name {name!r}" if name else "an empty name"
    return ""
