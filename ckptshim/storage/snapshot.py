"""One listing of a bucket prefix, and the small objects fetched beside it, answering every
question opening a checkpoint there asks.

Opening a checkpoint in a bucket asks many small questions one after another -- is anything
there, what does the prefix hold at its first level and below, which metadata files are there
and how large, what do they say -- and each one put to the server is a round trip. Inside
:func:`listed`, one bounded recursive listing of the prefix answers every stat and listing of a
location below it, and the objects named in ``fetch`` are fetched in the same parallel round:
a read of one of them is answered from memory, once the listing vouches for it (listed, and as
long as the listing says). Anything else goes to the scheme's store, as it would have.

A prefix that cannot be listed (nothing there, no permission, no server, more entries than a
listing returns) takes no snapshot: every question then goes to the store, which answers (or
fails) as it always did. A snapshot holds what the server said when it was taken; it lives as
long as one checkpoint is opened and its load planned, never across the reading of its arrays.
Local folders take none: a disk answers each question without a round trip.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import mmap
import os
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from ckptshim.storage.location import (DEFAULT_LIST_LIMIT, ByteRange, Location, ObjectInfo, OpenFile, Store,
                                       register_overlay, scheme_store)
from ckptshim.storage.problems import too_large, too_many, truncated

#: The snapshots this context reads through, innermost last.
_ACTIVE: contextvars.ContextVar[tuple[Snapshot, ...]] = contextvars.ContextVar("ckptshim_snapshots", default=())


class Snapshot:
    """The :class:`~ckptshim.storage.location.Store` of the locations at and below ``root`` while
    the snapshot is active: ``files`` (every object below ``root``, by its key relative to it,
    with its listed size) answers stats and listings, ``fetched`` (whole objects, each as long
    as listed) answers reads of them; every other read goes to ``inner``, the scheme's store."""

    def __init__(self, root: Location, inner: Store, files: Mapping[str, int],
                 fetched: Mapping[str, bytes | bytearray]) -> None:
        self.root, self.inner = root, inner
        self.files = dict(files)
        self.fetched = {name: data for name, data in fetched.items() if self.files.get(name) == len(data)}
        self._ahead: list[str] = []         # objects read in this order, a window at a time
        self._at: dict[str, int] = {}       # each one's place in it
        self._window: dict[str, bytes | bytearray] = {}
        self._folders = {name.rsplit("/", 1)[0] for name in self.files if "/" in name}
        for folder in list(self._folders):  # every level of each folder
            while "/" in folder:
                folder = folder.rsplit("/", 1)[0]
                self._folders.add(folder)

    @property
    def read_ahead_bytes(self) -> int:
        return self.inner.read_ahead_bytes

    def covers(self, location: Location) -> bool:
        return location.is_remote and location.inside(self.root)

    def _name(self, location: Location) -> str:
        return location.relative_to(self.root) if location != self.root else ""

    def stat(self, location: Location) -> ObjectInfo:
        name = self._name(location)
        if name in self.files:
            return ObjectInfo(location, self.files[name], "file")
        if (not name and self.files) or name in self._folders:  # a prefix objects share
            return ObjectInfo(location, 0, "directory")
        raise FileNotFoundError(f"{location}: no such object (the listing of {self.root} holds none)")

    def list(self, location: Location, limit: int, recursive: bool) -> list[ObjectInfo]:
        """What the scheme's store lists (see :meth:`~ckptshim.storage.Location.list`), from the
        snapshot's listing: objects, and at one level the folders they lie in too."""
        name = self._name(location)
        prefix = f"{name}/" if name else ""
        found: dict[str, ObjectInfo] = {}
        for key, size in self.files.items():
            if not key.startswith(prefix):
                continue
            below = key[len(prefix):]
            first, nested, _ = below.partition("/")
            if recursive or not nested:
                found[below] = ObjectInfo(location / below, size, "file")
            elif first not in found:
                found[first] = ObjectInfo(location / first, 0, "directory")
            if len(found) > limit:
                raise too_many(location, limit)
        if not found and location.key:
            raise FileNotFoundError(f"{location}: nothing is stored below this prefix")
        return sorted(found.values(), key=lambda info: info.location.key)

    def _held(self, name: str) -> bytes | bytearray | None:
        """The bytes of object ``name`` where the snapshot holds them: fetched with the listing,
        or in the window read ahead (the next window read now where ``name`` opens it)."""
        data = self.fetched.get(name)
        if data is None and name in self._at:
            if name not in self._window:
                self._window = self._read_window(self._at[name])
            data = self._window[name]
        return data

    def _read_window(self, start: int) -> dict[str, bytearray]:
        """The objects of the read-ahead order from ``start``, as many as fit in the store's
        :attr:`read_ahead_bytes` (one at least), in one batch of ranges."""
        names, total = [], 0
        for name in self._ahead[start:]:
            if names and total + self.files[name] > self.read_ahead_bytes:
                break
            names.append(name)
            total += self.files[name]
        self._window = {}  # the last window's memory goes before the next one's is taken
        data = [bytearray(self.files[name]) for name in names]
        self.inner.read_ranges([ByteRange(self.root / name, 0, self.files[name]) for name in names],
                               [memoryview(d) for d in data])
        return dict(zip(names, data))

    def read_ahead(self, names: Sequence[str]) -> None:
        """Read the listed objects among ``names`` (in the order they will be asked for) a window
        at a time, in parallel: the first read of one that no window holds fetches the next."""
        self._ahead = [name for name in names if self.files.get(name)]
        self._at = {name: at for at, name in enumerate(self._ahead)}
        self._window = {}

    def whole(self, location: Location, limit: int | None, size: int | None) -> bytes | bytearray | mmap.mmap:
        data = self._held(self._name(location))
        if data is None:
            return self.inner.whole(location, limit, size)
        if limit is not None and len(data) > limit:
            raise too_large(location, len(data), limit)
        return data

    def read_ranges(self, ranges: Sequence[ByteRange], buffers: Sequence[memoryview]) -> None:
        rest: list[tuple[ByteRange, memoryview]] = []
        for where, buffer in zip(ranges, buffers):
            data = self._held(self._name(where.location))
            if data is None:
                rest.append((where, buffer))
                continue
            if where.end > len(data):
                raise truncated(where.location, where.start, where.end, len(data))
            buffer[:] = memoryview(data)[where.start:where.end]
        if rest:
            self.inner.read_ranges([where for where, _ in rest], [buffer for _, buffer in rest])

    def refuse_links_leaving(self, location: Location, also: Sequence[Location]) -> None:
        self.inner.refuse_links_leaving(location, also)

    def open(self, location: Location) -> OpenFile:
        """An object opened for many reads by offset: the scheme's own (its spans fetched by
        range, as without the snapshot)."""
        return self.inner.open(location)


def covering(location: Location) -> Snapshot | None:
    """The innermost active snapshot that answers for ``location``, if any."""
    for snapshot in reversed(_ACTIVE.get()):
        if snapshot.covers(location):
            return snapshot
    return None


@contextlib.contextmanager
def listed(where: Location | os.PathLike[str],
           fetch: Mapping[str, int] | None = None) -> Iterator[Snapshot | None]:
    """Within this block, answer for ``where`` (a bucket prefix) from one listing of it, and read
    the objects ``fetch`` names (relative name -> the most bytes to fetch of it) from memory.

    The listing and the fetches go out together, in one parallel round; a fetched object is
    kept only where the listing lists it with the size fetched (one larger than its bound, or
    not there, is read, or refused, by whoever asks, as without a snapshot). Below an active
    snapshot, the listing is the enclosing one's, and the objects come in one batch of ranges.
    ``None`` for a local folder, or where the prefix cannot be listed."""
    root = Location.of(where)
    if not root.is_remote:
        yield None
        return
    enclosing, fetch = covering(root), fetch or {}
    try:
        snapshot = _below(enclosing, root, fetch) if enclosing is not None else _take(root, fetch)
    except Exception:  # noqa: BLE001 - the store answers (or refuses) each question itself
        snapshot = None
    if snapshot is None:
        yield None
        return
    with _answering(snapshot):
        yield snapshot


@contextlib.contextmanager
def reading_ahead(folder: Location | os.PathLike[str], names: Sequence[str]) -> Iterator[None]:
    """Within this block, where an active snapshot lists ``folder``, the objects ``names`` below
    it (relative, in the order they will be read whole: a check that walks each one's headers)
    are fetched a window at a time, each window's objects in parallel
    (:meth:`Snapshot.read_ahead`), not one round trip each. Elsewhere, nothing changes."""
    where = Location.of(folder)
    enclosing = covering(where) if where.is_remote else None
    if enclosing is None:
        yield
        return
    below = _below(enclosing, where, {})
    below.read_ahead(names)
    with _answering(below):
        yield


@contextlib.contextmanager
def _answering(snapshot: Snapshot) -> Iterator[None]:
    """``snapshot`` answers for its prefix in this context (before any it lies in) for the block."""
    token = _ACTIVE.set((*_ACTIVE.get(), snapshot))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def _take(root: Location, fetch: Mapping[str, int]) -> Snapshot:
    """A listing of ``root`` and the objects of ``fetch``, all at once."""
    store = scheme_store(root)
    if not fetch:
        return Snapshot(root, store, _files(root, store), {})
    pool = _pool()
    listing = pool.submit(_files, root, store)
    fetching = {name: pool.submit(_at_most, store, root / name, most) for name, most in fetch.items()}
    fetched = {name: data for name, future in fetching.items() if (data := future.result()) is not None}
    return Snapshot(root, store, listing.result(), fetched)


@functools.cache
def _pool() -> ThreadPoolExecutor:
    """The threads that wait on a snapshot's requests (the client's event loop runs them at
    once), started on the first snapshot and kept: starting them costs more than a request."""
    return ThreadPoolExecutor(8, thread_name_prefix="ckptshim-snapshot")


os.register_at_fork(after_in_child=_pool.cache_clear)  # a forked child has none of its threads


def _files(root: Location, store: Store) -> dict[str, int]:
    """Every object below ``root``, by its name relative to it, with its size: one bounded listing."""
    return {info.location.relative_to(root): info.size
            for info in store.list(root, DEFAULT_LIST_LIMIT, True) if info.kind == "file"}


def _at_most(store: Store, location: Location, most: int) -> bytes | None:
    """At most ``most`` bytes of the object at ``location``; ``None`` where it cannot be read
    (missing, empty, refused): whoever asks for it later reads it, and hears why."""
    try:
        return store.read_at_most(location, most)  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - see above
        return None


def _below(enclosing: Snapshot, root: Location, fetch: Mapping[str, int]) -> Snapshot:
    """The part of ``enclosing`` at and below ``root``, with the objects of ``fetch`` that its
    listing holds within their bounds read in one batch."""
    prefix = enclosing._name(root)
    prefix = f"{prefix}/" if prefix else ""
    files = {key[len(prefix):]: size for key, size in enclosing.files.items() if key.startswith(prefix)}
    wanted = [name for name, most in fetch.items() if name in files and 0 < files[name] <= most]
    data = [bytearray(files[name]) for name in wanted]
    enclosing.read_ranges([ByteRange(root / name, 0, files[name]) for name in wanted], [memoryview(d) for d in data])
    empty = {name: b"" for name in fetch if files.get(name) == 0}
    return Snapshot(root, enclosing.inner, files, empty | dict(zip(wanted, data)))


register_overlay(covering)
