"""The key-value stores Orbax keeps arrays in: a plain folder, or an OCDBT database.

Neither is read for array chunks here. For OCDBT, :func:`ocdbt_index` walks the manifest and
the b-tree (metadata only) and returns every key with its value or the byte range that holds
it, and every index node, so that a deleted, truncated or replaced file (including one in a
per-process ``ocdbt.process_N/`` folder) is reported, with what it costs, before any read is
attempted. Its bytes are read through the store's :class:`~ckptshim.storage.Location`, as every
file of a checkpoint is (each read checked against its file's size; from a bucket, the nodes of
one level of the tree in one parallel batch), and decoded by tensorstore's own decoder
(``ts.ocdbt.dump``) from memory. Keys of a plain folder are listed by tensorstore
(:func:`list_keys`) or come from the caller's listing.

A store's root is a local folder (a :class:`~pathlib.Path`) or a prefix in a bucket (a remote
:class:`~ckptshim.storage.Location`); the sizes of a bucket's files come from the caller's
bounded listing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import unquote

from ckptshim.errors import CorruptCheckpointError
from ckptshim.formats.base import metadata_limit, regular_size
from ckptshim.storage import ByteRange, Location, read_ranges
from ckptshim.storage.problems import too_large

#: Where a store lies: a local folder, or a prefix in a bucket.
Root = Path | Location
#: The size of a file of a store, by its name relative to the root (``None``: not a regular file).
SizeOf = Callable[[str], "int | None"]


def _ts():
    import tensorstore

    return tensorstore


def kvstore_spec(root: Root, ocdbt: bool) -> dict[str, Any]:
    """The tensorstore kvstore spec for a checkpoint folder (OCDBT database or plain files)."""
    return Location.of(root).kvstore_spec(ocdbt)


def list_keys(root: Path, ocdbt: bool, context=None) -> list[str]:
    """Every key in the store (for a plain folder: every file path below it), as tensorstore lists it."""
    ts = _ts()
    try:
        store = ts.KvStore.open(kvstore_spec(root, ocdbt), context=context).result()
        return [key.decode("utf-8", "replace") for key in store.list().result()]
    except (ValueError, OSError) as error:
        raise CorruptCheckpointError(
            f"{root}: cannot list the {'OCDBT database' if ocdbt else 'folder'} ({error}); its "
            "index is missing or corrupt. Re-copy the checkpoint from the original.") from None


def list_files(root: Root) -> dict[str, int | None]:
    """Every regular file (or object) below the folder or bucket prefix ``root``, by its name
    relative to it, with its size: from one bounded listing (locally, links followed as a read
    follows them; a dangling one is no file); empty where nothing is there."""
    where = Location.of(root)
    try:
        listed = where.list(recursive=True)
    except (FileNotFoundError, NotADirectoryError):
        return {}
    # by the name the listing found each file under (a link's, not its target's: ``relative_to``
    # would resolve it, and a link leaving the folder is the opener's to refuse, naming it)
    return {PurePosixPath(info.location.key).relative_to(where.key).as_posix(): info.size
            for info in listed if info.kind == "file"}


def read_values(root: Root, ocdbt: bool, keys: list[str], context=None,
                sizes: Mapping[str, int | None] | None = None, limit: int | None = None) -> dict[str, bytes | None]:
    """Small values (metadata files) by key; ``None`` for a key that is absent.

    In a plain folder or bucket prefix, ``sizes`` is its listing (:func:`list_files`): each file
    is read whole, together (from a bucket, in parallel), refused before it is read when larger
    than metadata can be (:func:`~ckptshim.formats.base.metadata_limit` of the listed bytes, or
    ``limit``, the bound of the files' own format, where smaller). In an OCDBT database, by
    tensorstore."""
    if not ocdbt:
        return _read_files(Location.of(root), keys, sizes if sizes is not None else list_files(root), limit)
    ts = _ts()
    store = ts.KvStore.open(kvstore_spec(root, ocdbt), context=context).result()
    futures = {key: store.read(key.encode()) for key in keys}
    out: dict[str, bytes | None] = {}
    for key, future in futures.items():
        try:
            result = future.result()
        except (ValueError, OSError) as error:
            raise CorruptCheckpointError(
                f"{root}: cannot read {key!r} ({error}); a data file of the checkpoint is missing "
                "or corrupt. Run `ckptshim inspect` on it to see which.") from None
        out[key] = bytes(result.value) if result.state == "value" else None
    return out


def _read_files(root: Location, keys: list[str], sizes: Mapping[str, int | None],
                bound: int | None) -> dict[str, bytes | None]:
    limit = metadata_limit(sum(size or 0 for size in sizes.values()))
    limit = limit if bound is None else min(limit, bound)
    present = [key for key in keys if sizes.get(key) is not None]
    for key in present:
        if sizes[key] > limit:
            raise too_large(root.child(key), sizes[key], limit)
    found = dict(zip(present, read_ranges([ByteRange(root.child(key), 0, sizes[key]) for key in present])
                     if present else []))
    return {key: bytes(found[key]) if key in found else None for key in keys}


@dataclass(frozen=True, slots=True)
class Reference:
    """A byte range of one file of an OCDBT database (a value or an index node)."""

    file: str    # relative to the database's root folder
    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class IndexNode:
    """One b-tree node of the index, with the range of keys under it: ``[first, end)``
    (``end`` ``None``: unbounded). A node whose file is missing or too short is not read: the
    keys in its range are then unknown, and whatever they hold is lost.

    A node stores its keys without the ``prefix`` every key under it shares (the path from the
    root says it: each parent's key prefix plus the child's ``subtree_common_prefix``), so a key
    ``ts.ocdbt.dump`` lists is ``prefix`` + its key.
    """

    where: Reference
    location: str   # as tensorstore spells it (what ``ts.ocdbt.dump`` reads the node by)
    first: str
    end: str | None
    read: bool
    leaf: bool
    prefix: bytes = b""

    def overlaps(self, prefix: str) -> bool:
        """Whether any key starting with ``prefix`` (non-empty) can lie under this node."""
        after = prefix[:-1] + chr(ord(prefix[-1]) + 1)  # the first string above every such key
        return self.first < after and (self.end is None or prefix < self.end)


@dataclass
class OcdbtIndex:
    """What an OCDBT database's manifest and b-tree say, read once (metadata only; no array
    chunk is read), kept small: a million keys are a million chunks, and the index that lists
    them a few MiB on disk.

    ``keys``: every key, grouped by its first path component (``"w/0.0"`` under ``"w"``);
    ``kept``: the value of each key the walk was asked to keep (small metadata: the bytes when
    stored inline, else their :class:`Reference`); ``files``: every file the index references,
    with the bytes it must at least hold; ``nodes``: the index nodes of the latest version.
    Which values live in a file is found again only when asked (:func:`references_into`).
    """

    keys: dict[str, set[str]] = field(default_factory=dict)
    kept: dict[str, bytes | Reference] = field(default_factory=dict)
    files: dict[str, int] = field(default_factory=dict)
    nodes: list[IndexNode] = field(default_factory=list)

    def unreadable(self) -> list[IndexNode]:
        return [node for node in self.nodes if not node.read]

    def _need(self, where: Reference) -> None:
        if self.files.get(where.file, -1) < where.end:
            self.files[where.file] = where.end


def ocdbt_index(root: Root, keep: tuple[str, ...] = (), size_of: SizeOf | None = None) -> OcdbtIndex:
    """Walk the latest version of the OCDBT database at ``root``: its manifest, then each b-tree
    node it reaches, with tensorstore's own decoder (``ts.ocdbt.dump``); keep the values of the
    keys that end with one of ``keep``.

    Nodes may live in other databases' folders (Orbax's per-process ``ocdbt.process_N/``, which
    the root's index points into after a multi-process save). A node whose file is missing, not
    a regular file or too short is recorded and skipped, so the walk goes on and the report
    can say what it costs; a manifest or node that is there but cannot be decoded raises
    :class:`CorruptCheckpointError`. ``size_of`` gives a file's size (by default, of a local
    regular file: a remote root's come from its listing).
    """
    index = OcdbtIndex()
    locations = _Locations(root)
    keys, kept, files = index.keys, index.kept, index.files
    if size_of is None:
        size_of = lambda name: regular_size(root / name)  # noqa: E731 - a local root's files
    for node, dumped in _walk(root, locations, index.nodes, size_of):
        index._need(node.where)
        if dumped is None or not node.leaf:
            continue
        prefix = node.prefix
        for entry in dumped["entries"]:  # a tight loop: a leaf node may hold a million entries
            key = (prefix + entry["key"]).decode("utf-8", "replace")
            group, _, rest = key.partition("/")
            found = keys.get(group)
            if found is None:
                found = keys[group] = set()
            found.add(rest)
            value = entry.get("inline_value")
            if value is None:
                head, offset, length = entry["indirect_value"].rsplit(":", 2)
                file, end = locations.file(head), int(offset) + int(length)
                if files.get(file, -1) < end:
                    files[file] = end
                if key.endswith(keep):
                    kept[key] = Reference(file, int(offset), int(length))
            elif key.endswith(keep):
                kept[key] = value
    return index


def references_into(root: Root, index: OcdbtIndex, files: set[str]) -> Iterator[tuple[str, Reference]]:
    """``(key, where its value lies)`` for every value the index stores in one of ``files``:
    the leaf nodes read again (only a report of what a damaged file costs asks this)."""
    locations = _Locations(root)
    leaves = [node for node in index.nodes if node.leaf and node.read]
    for node, dumped in zip(leaves, _Nodes(root).dump([node.location for node in leaves])):
        for entry in dumped["entries"]:
            if "indirect_value" in entry:
                where = locations.reference(entry["indirect_value"])
                if where.file in files:
                    yield (node.prefix + entry["key"]).decode("utf-8", "replace"), where


def read_reference(root: Root, where: Reference) -> bytes:
    """The bytes of one value stored out of line (see :func:`read_references`)."""
    return read_references(root, [where])[0]


def read_references(root: Root, references: list[Reference]) -> list[bytes]:
    """The bytes of values stored out of line (OCDBT stores values uncompressed), or of index
    nodes, read together (from a bucket, in parallel), each checked against its file's size."""
    where = Location.of(root)
    out = [bytearray(ref.length) for ref in references]
    try:  # names :class:`_Locations` checked; ``child`` keeps them inside the item
        read_ranges([ByteRange(where.child(ref.file), ref.offset, ref.length) for ref in references], out)
    except OSError as error:
        raise CorruptCheckpointError(f"{root}: a file of the OCDBT database cannot be read ({error}); run "
                                     "`ckptshim inspect` on the checkpoint to see what is missing.") from None
    return [bytes(data) for data in out]


def _walk(root: Root, locations: _Locations, nodes: list[IndexNode],
          size_of: SizeOf) -> Iterator[tuple[IndexNode, dict | None]]:
    """Each index node of the latest version, level by level (the nodes of one level read
    together: :class:`_Nodes`), with its dump (``None`` when its file cannot hold it); interior
    nodes' children are queued with their key ranges and key prefixes. Each node is visited
    once, at the height its parent says: one reached again, or at another height (its
    checksums may all be valid), is refused."""
    reader = _Nodes(root)
    sizes: dict[str, int | None] = {}
    with _decoding(root):
        manifest = reader.manifest(size_of(MANIFEST))
        versions = manifest.get("versions") or []
        if not versions:
            return
        latest = max(versions, key=lambda v: v["generation_number"])
        location = latest.get("root", {}).get("location")
        level = [(location, "", None, latest.get("root_height", 0), b"")] if location else []
    seen: set[Reference] = set()
    while level:
        readable: list[tuple[IndexNode, int]] = []
        below = []
        for location, first, end, height, prefix in level:
            where = locations.reference(location)
            if where in seen:  # a b-tree reaches each node once; a node met again is a cycle or a merge
                raise CorruptCheckpointError(
                    f"{root}: the OCDBT index reaches the node at {where.file} bytes {where.offset}..{where.end} "
                    "twice (a node pointing back at an ancestor, or two parents sharing one); it is not a "
                    "b-tree, and walking it would not end. Re-copy the checkpoint from the original.")
            seen.add(where)
            if where.file not in sizes:
                sizes[where.file] = size_of(where.file)
            fits = sizes[where.file] is not None and sizes[where.file] >= where.end
            node = IndexNode(where, location, first, end, fits, height == 0, prefix)
            if not fits:
                nodes.append(node)
                yield node, None
            else:
                readable.append((node, height))
        for (node, height), dumped in zip(readable, reader.dump([node.location for node, _ in readable])):
            with _decoding(root):
                entries = dumped.get("entries", ())
                if dumped.get("height", 0) != height:
                    raise CorruptCheckpointError(
                        f"{root}: the OCDBT index node at {node.where.file} bytes {node.where.offset}.."
                        f"{node.where.end} has height {dumped.get('height', 0)} where its parent (or the "
                        f"manifest) says {height}; it is not a b-tree. Re-copy the checkpoint from the original.")
                for i, entry in enumerate(entries if height > 0 else ()):
                    key = node.prefix + entry["key"]
                    upper = _text(node.prefix + entries[i + 1]["key"]) if i + 1 < len(entries) else node.end
                    below.append((entry["location"], _text(key), upper, height - 1,
                                  node.prefix + entry.get("subtree_common_prefix", b"")))
            nodes.append(node)
            yield node, dumped
        level = below


#: The manifest of an OCDBT database, in its root folder.
MANIFEST = "manifest.ocdbt"
#: The most bytes of index nodes read at once (one level of the b-tree may be wide).
NODE_BATCH_BYTES = 64 * 2**20


class _Nodes:
    """The manifest and index nodes of the OCDBT database at ``root``, read through its
    :class:`~ckptshim.storage.Location` -- the one reading path for disk and bucket, each read
    checked against its file's size -- and decoded from memory by tensorstore's own decoder
    (``ts.ocdbt.dump``). Nodes asked for together are read in one batch of ranges (from a
    bucket, in parallel), at most :data:`NODE_BATCH_BYTES` at a time."""

    def __init__(self, root: Root) -> None:
        self.root = root
        self.where = Location.of(root)

    def manifest(self, size: int | None) -> dict:
        """The manifest, decoded (``size``: its size, as listed; ``None``: there is none)."""
        if size is None:
            raise FileNotFoundError(f"{self.where / MANIFEST}: missing, or not a regular file")
        data = (self.where / MANIFEST).whole(metadata_limit(0), size)
        return _ts().ocdbt.dump(_in_memory({MANIFEST: bytes(data)})).result()

    def dump(self, locations: list[str]) -> Iterator[dict]:
        """Each node at ``locations`` (tensorstore's location strings), decoded, in order."""
        parsed = _Locations(self.root)
        batch: list[tuple[str, Reference]] = []
        for location in locations:
            where = parsed.reference(location)
            if batch and sum(ref.length for _, ref in batch) + where.length > NODE_BATCH_BYTES:
                yield from self._dump(batch)
                batch = []
            batch.append((location, where))
        if batch:
            yield from self._dump(batch)

    def _dump(self, batch: list[tuple[str, Reference]]) -> list[dict]:
        with _decoding(self.root):
            data = read_references(self.root, [where for _, where in batch])
            store = _in_memory({str(i): node for i, node in enumerate(data)})
            # the same kind of node, at its own key: ``<kind>:<base>:<name>:<offset>:<length>``
            # one at a time: decoding is quick, the reads above were the round trips, and
            # tensorstore decoding hostile nodes side by side crashed the process
            return [_ts().ocdbt.dump(store, f"{location.split(':', 1)[0]}::{i}:0:{where.length}").result()
                    for i, (location, where) in enumerate(batch)]


def _in_memory(values: dict[str, bytes]) -> Any:
    """A tensorstore key-value store in memory holding ``values``."""
    store = _ts().KvStore.open({"driver": "memory"}).result()
    for future in [store.write(key.encode(), value) for key, value in values.items()]:
        future.result()
    return store


@contextlib.contextmanager
def _decoding(root: Root) -> Iterator[None]:
    try:
        yield
    except (ValueError, OSError, KeyError, TypeError) as error:
        raise CorruptCheckpointError(
            f"{root}: the OCDBT index (manifest.ocdbt and the index nodes it points at) cannot be "
            f"read ({error}); the checkpoint is incomplete or corrupt. Re-copy it from the "
            "original.") from None


def _text(key: bytes) -> str:
    return bytes(key).decode("utf-8", "replace")


class _Locations:
    """Parses tensorstore's location strings, ``"value:ocdbt.process_0/:d/abc:10:20"`` ->
    ``Reference("ocdbt.process_0/d/abc", 10, 20)``, checking each file name once.

    tensorstore percent-encodes both path parts; a path that would leave the database's folder
    is refused (tensorstore would read it relative to the folder, wherever that leads).
    """

    def __init__(self, root: Root) -> None:
        self._root = root
        self._files: dict[str, str] = {}

    def reference(self, location: str) -> Reference:
        head, offset, length = location.rsplit(":", 2)
        return Reference(self.file(head), int(offset), int(length))

    def file(self, head: str) -> str:
        """The file of a location without its offset and length (``"value:<base>:<relative>"``)."""
        file = self._files.get(head)
        if file is None:
            file = self._files[head] = self._checked(head)
        return file

    def _checked(self, head: str) -> str:
        _kind, base_path, relative = head.split(":", 2)
        name = unquote(base_path) + unquote(relative)
        parts = name.split("/")
        if not name or name.startswith("/") or ".." in parts or "\0" in name:
            raise CorruptCheckpointError(
                f"{self._root}: the OCDBT index points at {name!r}, which is not a file inside the "
                "checkpoint; ckptshim reads only files the checkpoint contains. Re-copy it from the original.")
        return name

