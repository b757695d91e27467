"""One Orbax PyTree item folder, in any layout Orbax has written since 0.1.

Layouts, newest first:

- ``_METADATA`` (JSON tree of keys and value types) + an OCDBT database (``manifest.ocdbt``,
  ``d/``, per-process ``ocdbt.process_N/``) holding one zarr v2 or v3 array per leaf;
- ``_METADATA`` + one zarr folder per leaf (``use_ocdbt=False``);
- legacy (Orbax < 0.5, no ``_METADATA``): an aggregate msgpack file ``checkpoint`` whose leaves
  are ``PLACEHOLDER://<name>`` strings for arrays stored as zarr folders ``<name>/``, or the
  arrays themselves inline (Flax's msgpack encoding), or plain scalars.

Today's ``StandardCheckpointer`` restores only the ``_METADATA`` layouts, ``PyTreeCheckpointer``
the legacy aggregate too; the hooks use :func:`orbax_readers` to know when they
must step in. The inventory
comes from ``_METADATA`` or the aggregate file plus each array's ``.zarray``/``zarr.json``;
completeness from the OCDBT index and the listing of chunk keys.
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import numpy as np

from ckptshim.errors import CorruptCheckpointError, UnknownFormatError
from ckptshim.formats import kvstore, located, msgpack_tree, zarr
from ckptshim.formats.base import (Checkpoint, as_values, FileInfo, Piece, metadata_limit, numpy_dtype,
                                   reader, storage_dtype, strict_json)
from ckptshim.formats.ts_arrays import TensorstoreArrays
from ckptshim.inventory import Entry, Inventory, KeyPath
from ckptshim.storage import Location, snapshot

NAME = "orbax"
METADATA = "_METADATA"
AGGREGATE = "checkpoint"
PLACEHOLDER = "PLACEHOLDER://"
OCDBT_MANIFEST = kvstore.MANIFEST
#: What Orbax writes into a folder in object storage once its save is complete (its
#: ``CommitFileTemporaryPath``, the default for ``gs://``), by scheme: Orbax saves to gs:// only.
COMMIT_SUCCESS = "commit_success.txt"
REMOTE_COMMIT_FILE = {"gs": COMMIT_SUCCESS, "gcs": COMMIT_SUCCESS}
#: What opening an item in a bucket fetches beside its listing (see
#: :func:`~ckptshim.storage.snapshot.listed`), by the most bytes worth fetching before the
#: listing says how large it is: the OCDBT manifest, which the index walk needs before any
#: node (a few hundred bytes; a larger one is read after the listing, its size known).
#: ``_METADATA`` is not: it is read, once its listed size passes its limit, while the index's
#: first nodes are.
FIRST_READS = {OCDBT_MANIFEST: 2**20}
#: How many arrays a restore from object storage builds at once (see execute.jax.build).
REMOTE_TARGET_WORKERS = 8
_ARRAY_TYPES = frozenset({"jax.Array", "np.ndarray", "scalar"})


def sniff(path: Path | Location) -> bool:
    """Cheap: does ``path`` look like one Orbax PyTree item (any layout)?"""
    if not path.is_dir():
        return False
    if (path / METADATA).is_file() or (path / OCDBT_MANIFEST).is_file():
        return True
    return msgpack_tree.is_msgpack_file(path / AGGREGATE)


READERS = {"jax": sniff}


def sniff_listed(names: set[str] | frozenset[str]) -> bool:
    """Whether the names one listing of a prefix found are those of an Orbax item in the
    ``_METADATA`` layouts (OCDBT or per-leaf zarr folders)."""
    return METADATA in names


def orbax_readers(checkpoint: Checkpoint) -> frozenset[str]:
    """The restore args of today's Orbax (``"standard"``, ``"pytree"``) that read ``checkpoint``'s
    layout unaided: where the caller's args are among them and the keys fit, the Orbax hook lets
    Orbax restore it. None for a layout that is not Orbax's own (a Flax msgpack file, a Hugging
    Face folder), nor for the ones Orbax's classes no longer read (PaxML, T5X)."""
    return checkpoint.orbax_readers if isinstance(checkpoint, OrbaxCheckpoint) else frozenset()


@dataclass(frozen=True)
class StoredArray:
    """Where a tensorstore-backed leaf lives: its zarr array name and driver."""

    name: str
    driver: str


class OrbaxCheckpoint(Checkpoint):
    """An Orbax item folder; entry locations are :class:`StoredArray` or :class:`msgpack_tree.Inline`."""

    key_sep = "/"
    #: How many target arrays a restore builds at once (more for a remote item).
    target_workers = 1

    def __init__(self, path: Path | Location, version: str, inventory: Inventory, files, problems,
                 *, ocdbt: bool, native: bool, aggregate=None,
                 array_metadata: Mapping[str, bytes] | None = None) -> None:
        """``array_metadata``: array name -> its ``.zarray``/``zarr.json`` bytes, as read here."""
        super().__init__(path, NAME, version, inventory, tuple(files), tuple(problems))
        self.native = native
        self._arrays = TensorstoreArrays(path, ocdbt, array_metadata)
        if isinstance(path, Location) and path.is_remote:  # each read a round trip: build a few at once
            self.target_workers = REMOTE_TARGET_WORKERS
        self._aggregate = aggregate

    @property
    def orbax_readers(self) -> frozenset[str]:
        """``_METADATA`` layouts: both restore args; the legacy aggregate: ``PyTreeRestore`` only."""
        return frozenset({"standard", "pytree"} if self.native else {"pytree"})

    def read_into(self, entry: Entry, index: tuple, out: np.ndarray):
        """Copy ``entry``'s ``index`` range into ``out`` (cast to its dtype); may return a future."""
        where = entry.location
        if isinstance(where, StoredArray):  # tensorstore casts by value
            return self._arrays.read_into(where.name, where.driver, index, as_values(out, entry.dtype))
        msgpack_tree.copy_inline(self._aggregate, entry, index, out)
        return None

    def read(self, entry: Entry) -> np.ndarray:
        out = np.empty(entry.shape, numpy_dtype(entry.dtype))
        pending = self.read_into(entry, (), out)  # tensorstore's errors become ShimErrors (base.reading)
        if pending is not None:
            pending.result()
        return out.view(storage_dtype(entry.dtype))

    def close(self) -> None:
        self._arrays.close()


# -- listing ------------------------------------------------------------------------------------


def _metadata_leaves(where: object, read: Callable[[], bytes],
                     array_bytes: int) -> tuple[list[tuple[KeyPath, str]], dict]:
    """``_METADATA`` (at ``where``, its bytes from ``read()``) -> [(key path, zarr array name)]
    for array leaves, and the file's other fields (its options)."""
    try:
        meta = strict_json(read(), array_bytes)
        tree = meta["tree_metadata"]
        leaves = []
        for record in tree.values():
            value = record["value_metadata"]
            if value.get("skip_deserialize") or value.get("value_type") not in _ARRAY_TYPES:
                continue
            key = tuple(str(k["key"]) for k in record["key_metadata"])
            leaves.append((key, ".".join(key)))
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise CorruptCheckpointError(
            f"{where}: not a valid Orbax metadata file ({type(error).__name__}: {error}). "
            "Orbax writes it last, so the save may have been interrupted; restore an intact copy "
            "of the checkpoint, or remove the file to read the folder as a legacy layout.") from None
    return leaves, {name: value for name, value in meta.items() if name != "tree_metadata"}  # not the tree: big


def _require_plain_names(path: Path | Location, leaves: list[tuple[KeyPath, object]]) -> None:
    """Each ``PLACEHOLDER://<name>`` must name a folder of this item: no ``/``, ``..`` or root."""
    for key, name in leaves:
        if isinstance(name, str) and (not name or name in (".", "..") or PurePosixPath(name).name != name):
            raise CorruptCheckpointError(
                f"{path / AGGREGATE}: leaf {'/'.join(key)!r} points at {name!r}, which is not a folder "
                "of this checkpoint (it lies outside it); ckptshim reads only files inside the "
                "checkpoint. Re-copy the checkpoint from the original.")


@reader
def open_checkpoint(path: Path | Location) -> OrbaxCheckpoint:
    """The Orbax item folder ``path``, or, in a bucket, the item below the prefix ``path``: there
    its listing and the OCDBT manifest come in one parallel round (:data:`FIRST_READS`), then
    ``_METADATA`` beside the index's root node, then the index one level of nodes at a time."""
    with snapshot.listed(path, FIRST_READS):
        found = _Found.of(path)
        native, ocdbt = found.has(METADATA), found.has(OCDBT_MANIFEST)
        aggregate = None
        walked = None
        if ocdbt:  # each of the walk and _METADATA is a round trip or more in a bucket: at once
            walking = ThreadPoolExecutor(1, thread_name_prefix="ckptshim-ocdbt")
            walked = walking.submit(contextvars.copy_context().run, _Store.ocdbt, path, found.size_of)
            walking.shutdown(wait=False)
        if native:
            meta_file = path / METADATA
            size = found.size_of(METADATA)  # the listing's: a round trip less
            leaves, meta = _metadata_leaves(meta_file, lambda: located.read_whole(meta_file, found.limit, size),
                                            found.array_bytes)
        elif found.has(AGGREGATE):
            meta = {}
            aggregate = msgpack_tree.contents(path / AGGREGATE, found.limit)
            tree = msgpack_tree.read_tree(aggregate, str(path / AGGREGATE))
            leaves = _aggregate_leaves(path, tree)
        else:
            raise UnknownFormatError(f"{path} holds neither {METADATA} nor an aggregate {AGGREGATE} file; it is "
                                     "not an Orbax item. Point at the item's folder (a step's `default/`, "
                                     "`state/`, ...).")
        store = walked.result() if walked is not None else _Store.folders(path, found.listed)
        return _checkpoint(path, leaves, meta, store, ocdbt=ocdbt, native=native, aggregate=aggregate,
                           info=found.info, problems=found.problems)


def _aggregate_leaves(path: Path | Location, tree: object) -> list[tuple[KeyPath, object]]:
    """The leaves of a pre-``_METADATA`` aggregate: ``PLACEHOLDER://<name>`` -> ``<name>``, inline
    arrays and scalars as they are."""
    found = msgpack_tree.leaves(tree)
    if any(key[-2:] == ("kvstore", "driver") for key in found):
        raise UnknownFormatError(
            f"{path / AGGREGATE} names its arrays by tensorstore specs, as T5X's legacy "
            "checkpointer does, not by Orbax PLACEHOLDER leaves; ckptshim does not read T5X "
            "legacy checkpoints as Orbax ones.")
    leaves = [(key, leaf[len(PLACEHOLDER):] if isinstance(leaf, str) else leaf)
              for key, leaf in found.items() if not isinstance(leaf, str) or leaf.startswith(PLACEHOLDER)]
    _require_plain_names(path, leaves)
    return leaves


@dataclass(frozen=True)
class _Found:
    """What an item's folder or bucket prefix holds, as opening it needs to know, from one
    bounded listing (every file and its size), after a local folder was walked for links that
    leave it (tensorstore follows them; an object store has none). The listing bounds its
    metadata files and says whether a save to object storage was committed (:func:`_uncommitted`)."""

    has: Callable[[str], bool]
    array_bytes: int
    limit: int                             # the most bytes a metadata file read whole may have
    info: Callable[..., FileInfo]
    size_of: kvstore.SizeOf
    listed: dict[str, int | None]
    problems: tuple[str, ...] = ()

    @classmethod
    def of(cls, path: Path | Location) -> _Found:
        root = Location.of(path)
        root.refuse_links_leaving()  # array folders, chunks, OCDBT data files: tensorstore follows links
        listed = kvstore.list_files(root)
        array_bytes = sum(size or 0 for size in listed.values())
        return cls(listed.__contains__, array_bytes, metadata_limit(array_bytes),
                   lambda name, size, **kw: FileInfo(name, listed.get(name), size, **kw),
                   listed.get, listed, tuple(_uncommitted(root, listed)))


def _uncommitted(root: Location, listed: dict) -> list[str]:
    """The problem of an item in object storage that no commit file marks complete: neither its
    own nor (an item of a manager's step) its step's. Orbax checks the folder its restore is
    given, a step or an item; ckptshim, reading an item, takes either, so as never to refuse
    what Orbax restores."""
    marker = REMOTE_COMMIT_FILE.get(root.scheme)
    if marker is None or marker in listed or (root.parent / marker).is_file():
        return []
    return [f"{marker}: missing. Orbax writes it into {root} (and its step) when a save to "
            f"{root.scheme}:// is complete, and refuses to restore a folder without it (\"Found "
            "incomplete checkpoint\"); the save was interrupted or is still running. Restore another "
            "step, or save this one again."]


def _checkpoint(path: Path | Location, leaves: list[tuple[KeyPath, object]], meta: dict, store: _Store, *,
                ocdbt: bool, native: bool, info: Callable[..., FileInfo], aggregate=None,
                problems: list[str] | None = None) -> OrbaxCheckpoint:
    """The item whose leaves (key path -> array name, or an inline value) ``store`` holds, with
    the completeness of its arrays and files; ``info(name, needed, writer=, pieces=)`` says what
    is at a file of the item."""
    fill_stored = bool(meta.get("store_array_data_equal_to_fill_value", False))
    if native:
        version = f"{'ocdbt' if meta.get('use_ocdbt', ocdbt) else 'per-leaf'} " \
                  f"{'zarr3' if meta.get('use_zarr3') else 'zarr2'}"
    else:
        version = f"legacy aggregate{' + ocdbt' if ocdbt else ''}"
    wanted = [name for _, name in leaves if isinstance(name, str)]
    raw = store.metadata(wanted)

    entries: list[Entry] = []
    problems = list(problems or ())
    arrays: dict[str, zarr.ZarrArray] = {}
    parsed: dict[bytes, zarr.ZarrArray] = {}
    files: list[FileInfo] = []
    for key, leaf in leaves:
        if not isinstance(leaf, str):
            entries.append(msgpack_tree.inline_entry(key, leaf))
            continue
        meta_key, array_meta = raw.get(leaf, (None, None))
        if array_meta is None:
            problems.append(f"{leaf}: array metadata (.zarray or zarr.json) missing; the array "
                            "cannot be read")
            continue
        array = parsed.get(array_meta)
        if array is None:  # the layers of a model share their metadata: parse each text once
            array = parsed[array_meta] = zarr.parse(array_meta, f"{path}/{meta_key}")
        entries.append(Entry(key, array.shape, array.dtype, StoredArray(leaf, array.driver)))
        arrays[leaf] = array
        present = store.by_array.get(leaf, {})
        required = zarr.chunk_keys_required(array, fill_stored)
        if ocdbt:  # OCDBT records each chunk's size; the index's files are checked below
            count, absent = array.missing_chunks(present) if required else (0, [])
            if count:
                shown = ", ".join(absent) + (f" and {count - len(absent)} more" if count > len(absent) else "")
                problems.append(f"{leaf}: {count} chunk(s) missing from the OCDBT index ({shown})")
            continue
        chunk_files, found = array.folder_report(path / leaf, present, "/".join(key), required, path)
        files += chunk_files  # plain files: only their frames say whether they are whole
        problems += found
    if ocdbt:
        names = {name: "/".join(key) for key, name in leaves if isinstance(name, str)}
        files = ocdbt_files(path, store.index, names, arrays, info)
    return OrbaxCheckpoint(path, version, Inventory(entries, str(path)), files, problems,
                           ocdbt=ocdbt, native=native, aggregate=aggregate,
                           array_metadata={leaf: meta for leaf, (_, meta) in raw.items() if meta is not None})


class _Store:
    """The keys of an item's store grouped by array (``name/<chunk>``), and its arrays' zarr
    metadata: from the OCDBT index (one walk; Orbax stores metadata inline), or by listing and
    reading a folder of per-leaf arrays."""

    def __init__(self, root: Path | Location, by_array: dict[str, set[str]],
                 index: kvstore.OcdbtIndex | None) -> None:
        self.root, self.by_array, self.index = root, by_array, index
        self.listed: dict[str, int | None] | None = None

    @classmethod
    def ocdbt(cls, root: Path | Location, size_of: kvstore.SizeOf | None = None) -> _Store:
        index = kvstore.ocdbt_index(root, keep=_METADATA_SUFFIXES, size_of=size_of)
        return cls(root, index.keys, index)

    @classmethod
    def folders(cls, root: Path | Location, listed: dict[str, int | None] | None = None) -> _Store:
        """Per-leaf arrays; ``listed``: a bucket prefix's listing (names and sizes)."""
        self = cls(root, {}, None)
        self.listed = listed if listed is not None else kvstore.list_files(root)
        for key, size in self.listed.items():
            name, _, rest = key.partition("/")
            self.by_array.setdefault(name, {})[rest] = size
        return self

    def metadata(self, names: list[str]) -> dict[str, tuple[str, bytes | None]]:
        """Array name -> (its metadata key, the bytes of its ``.zarray``/``zarr.json``)."""
        keys = {name: next((f"{name}/{m}" for m in zarr.METADATA_FILES if m in self.by_array.get(name, ())), None)
                for name in names}
        wanted = [key for key in keys.values() if key is not None]
        if self.index is None:
            found = kvstore.read_values(self.root, False, wanted, sizes=self.listed,
                                        limit=zarr.MAX_METADATA_BYTES)
        else:  # stored inline, or out of line: those read together
            kept = {key: value for key in wanted if (value := self.index.kept.get(key)) is not None}
            elsewhere = [key for key, value in kept.items() if isinstance(value, kvstore.Reference)]
            found = kept | dict(zip(elsewhere, kvstore.read_references(self.root, [kept[k] for k in elsewhere])))
        return {name: (key, found.get(key)) for name, key in keys.items() if key is not None}


_METADATA_SUFFIXES = tuple(f"/{name}" for name in zarr.METADATA_FILES)


def ocdbt_files(root: Path | Location, index: kvstore.OcdbtIndex, names: dict[str, str],
                arrays: dict[str, zarr.ZarrArray], info: Callable[..., FileInfo]) -> list[FileInfo]:
    """Every file the OCDBT index of ``root`` references, with the bytes it must hold and the
    process folder that wrote it; a file with a problem lists what it costs (the chunks it
    holds, the arrays an unreadable index node indexes). ``names`` spells each stored array's
    name as a key; ``arrays`` has the zarr metadata of those the index let us read;
    ``info(name, needed, writer=)`` says what is at a file of the item."""
    files = [info(name, size, writer=_writer(name)) for name, size in sorted(index.files.items())]
    lost = {f.path for f in files if f.problem is not None}
    if not lost:
        return files
    pieces: dict[str, list[Piece]] = {}
    for key, where in kvstore.references_into(root, index, lost):
        name, _, chunk = key.partition("/")
        array = arrays.get(name)
        region = array.chunk_region(chunk) if array is not None and array.is_chunk_key(chunk) else chunk
        pieces.setdefault(where.file, []).append(Piece(names.get(name, name), region, where.offset, where.length))
    for node in index.unreadable():
        pieces.setdefault(node.where.file, []).extend(
            Piece(spelled, "(its index node)", node.where.offset, node.where.length)
            for name, spelled in sorted(names.items()) if node.overlaps(f"{name}/"))
    return [dataclasses.replace(f, pieces=tuple(sorted(pieces.get(f.path, ()), key=lambda p: p.offset)))
            if f.path in lost else f for f in files]


def _writer(name: str) -> str:
    """The process folder that wrote an OCDBT file (``ocdbt.process_3``), or ``root`` for the
    item's own database (the merged index of a multi-process save, or a single writer's data)."""
    first = name.split("/", 1)[0]
    return first if first.startswith("ocdbt.process_") else "root"
