"""T5X checkpoints, both generations, read as T5X's own optimizer state dict.

- **Legacy** (``t5x.checkpoints.Checkpointer``, versions 2 and 3): ``checkpoint_<step>/checkpoint``
  is a Flax msgpack ``{'version': 3, 'optimizer': {'target': ..., 'state': ...}}`` whose
  partitioned arrays are tensorstore spec dicts ``{'driver': 'zarr', 'kvstore': {'driver':
  'file'|'gcs', 'path': 'target.<dotted>/'}, 'metadata': ...}`` relative to the step folder, and
  whose small arrays and scalars are stored inline. (Version 2 differs only in writing bfloat16
  arrays to tensorstore as uint16 bit patterns; those are listed and read as bfloat16, as
  T5X's ``LazyAwaitableArray.from_tensor_store_spec`` reads them.)
- **Orbax-era** (``OrbaxCheckpointManagerInterface``): ``checkpoint_<step>/state/`` is an Orbax
  PyTree item whose tree paths are ``('target', ...)`` / ``('state', ...)``, next to a
  ``dataset/`` item.

Both are listed with the keys of the state dict ``load_t5x_checkpoint`` returns (``target/...``,
``state/...``), so one generation plans against the other with no renames. A spec is rewritten
to the step folder (local, or the step's own bucket prefix) whatever bucket or driver it names
-- the checkpoint may have been copied off GCS, or onto it -- and refused if its path leaves
that folder: a checkpoint must not make ckptshim read files it does not contain.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from ckptshim.errors import CorruptCheckpointError, UnknownFormatError, UnsafeCheckpointError
from ckptshim.formats import kvstore, located, msgpack_tree, orbax, zarr
from ckptshim.formats.base import (Checkpoint, as_values, metadata_limit, numpy_dtype, reader, step_folders,
                                   storage_dtype)
from ckptshim.formats.located import Where
from ckptshim.inventory import Entry, Inventory, KeyPath
from ckptshim.storage import Location

NAME = "t5x"
AGGREGATE = "checkpoint"
STATE_ITEM = "state"
VERSIONS = (2, 3)
_STEP = re.compile(r"^checkpoint_(\d+)$")
_TOP_KEYS = frozenset({"version", "optimizer"})
_SPEC_KEYS = frozenset({"driver", "kvstore", "metadata"})
_KVSTORE_DRIVERS = frozenset({"file", "gfile", "gcs"})
#: The first key of an Orbax ``_METADATA`` tree written for T5X's state dict.
_FIRST_TREE_KEY = re.compile(r'"tree_metadata"\s*:\s*\{\s*"\(\'(?:state|target)\',')


# -- recognising ------------------------------------------------------------------------------


def _first_key(path: Where) -> str | None:
    """The first key of the msgpack map in ``path`` (reads a few bytes), or ``None``."""
    head = located.head(path, 64)
    if not head or not (0x80 <= head[0] <= 0x8F or head[0] in (0xDE, 0xDF)):
        return None
    offset = 1 if head[0] <= 0x8F else 3 if head[0] == 0xDE else 5
    if len(head) <= offset:
        return None
    b = head[offset]
    start, length = (offset + 1, b & 0x1F) if 0xA0 <= b <= 0xBF else \
        (offset + 2, head[offset + 1]) if b == 0xD9 and len(head) > offset + 1 else (0, -1)
    if length < 0:
        return None
    return head[start:start + length].decode("utf-8", "replace")


def is_legacy_step(path: Where) -> bool:
    """Cheap: a folder whose ``checkpoint`` msgpack starts with T5X's ``version``/``optimizer``."""
    return path.is_dir() and _first_key(path / AGGREGATE) in _TOP_KEYS


def is_orbax_step(path: Where) -> bool:
    """A step folder written by T5X's Orbax path: a ``state`` item whose tree is target/state.

    Recognised by the manager's ``_CHECKPOINT_METADATA`` naming T5X's handlers, or else by the
    item's own tree: ``('target', ...)`` keys in ``_METADATA``, or (Orbax before ``_METADATA``)
    an aggregate ``checkpoint`` whose first key is ``state`` or ``target``.
    """
    item = path / STATE_ITEM
    if not (path.is_dir() and orbax.sniff(item)):
        return False
    meta = path / "_CHECKPOINT_METADATA"
    if "t5x." in located.head(meta, 4096).decode("utf-8", "replace"):
        return True
    tree = item / orbax.METADATA
    if tree.is_file():  # the first tree key is near the start; the file may be many MiB
        return _FIRST_TREE_KEY.search(located.head(tree, 4096).decode("utf-8", "replace")) is not None
    return _first_key(item / AGGREGATE) in {"state", "target"}


def steps(root: Where) -> dict[int, Where]:
    """Step number -> ``checkpoint_<step>`` folder of either generation, under a model dir."""
    return step_folders(root, _STEP,
                        lambda child: child if is_legacy_step(child) or is_orbax_step(child) else None)


def sniff(path: Where) -> bool:
    if path.is_file():
        return path.name == AGGREGATE and is_legacy_step(path.parent)
    return is_legacy_step(path) or is_orbax_step(path) or bool(steps(path))


#: An Orbax restore names an item: a legacy step is one (its msgpack would otherwise pass for an
#: Orbax aggregate); an Orbax-era step's ``state/`` item is an Orbax item.
READERS = {"jax": is_legacy_step}


# -- the legacy msgpack -----------------------------------------------------------------------


@dataclass(frozen=True)
class _Uint16Bits(orbax.StoredArray):
    """A version-2 leaf: bfloat16 values that T5X wrote to tensorstore as uint16 bit patterns."""


def _is_spec(node: Any) -> bool:
    return isinstance(node, dict) and _SPEC_KEYS <= node.keys()


def _walk(node: Any, prefix: KeyPath, out: dict[KeyPath, Any]) -> None:
    """Flatten ``node`` into ``out``, keeping tensorstore spec dicts whole as leaves."""
    if _is_spec(node):
        out[prefix] = node
    elif isinstance(node, dict):
        for key, value in node.items():
            _walk(value, prefix + (str(key),), out)
    elif isinstance(node, (msgpack_tree.ArrayRef, bool, int, float)):
        out[prefix] = node
    # None (a parameter no optimizer updates) and strings hold no array


def local_folder(spec: dict, step_dir: Where, where: str) -> str:
    """The spec's zarr folder as a name relative to ``step_dir`` (a folder, or a bucket prefix);
    refuses one outside it.

    T5X resolves ``kvstore.path`` (or the pre-0.1.14 top-level ``path``) against the folder of
    the msgpack file, and rewrites ``gcs`` to ``file`` when reading locally; so does this, and
    reads the folder through the step's own store wherever the step is (a bucket named in the
    spec is not followed: the folder must be the step's).
    """
    store = spec.get("kvstore")
    if isinstance(store, dict) and "path" in store:
        driver, relative = store.get("driver"), store["path"]
    elif "path" in spec:
        driver, relative = "file", spec["path"]
    else:
        raise CorruptCheckpointError(
            f"{where}: tensorstore spec without a path ({spec!r}); T5X expects 'path' in the spec "
            "or its 'kvstore'. The msgpack is corrupt; re-copy the checkpoint.")
    if (driver not in _KVSTORE_DRIVERS or not isinstance(relative, str) or not relative.strip("/")
            or "\x00" in relative):  # no file name holds a NUL byte
        raise CorruptCheckpointError(
            f"{where}: tensorstore spec with kvstore driver {driver!r} and path {relative!r}; T5X "
            f"writes drivers {sorted(_KVSTORE_DRIVERS)} with a relative folder name.")
    root = Location.of(step_dir)
    try:  # refuses an absolute name, a URL, '..' out, a link out; remotely any '.', '..' or empty name
        name = root.child(relative.rstrip("/")).relative_to(root)
    except UnsafeCheckpointError:
        name = "."
    if name in ("", "."):
        raise UnsafeCheckpointError(
            f"{where}: its tensorstore spec points at {relative!r}, outside the checkpoint folder "
            f"{step_dir}. T5X writes each array next to the msgpack file; ckptshim does not read "
            "files a checkpoint does not contain. Fix the spec or move the array into the folder.")
    return name


class T5XCheckpoint(orbax.OrbaxCheckpoint):
    """A legacy T5X step: zarr folders beside an aggregate msgpack, read as Orbax's legacy layout.

    Locations are Orbax's (zarr folder name and driver, or :class:`msgpack_tree.Inline`), so
    reads are :class:`~ckptshim.formats.orbax.OrbaxCheckpoint`'s, except for version-2 bfloat16
    arrays, whose uint16 bits are copied, never converted as numbers.
    """

    #: Today's Orbax cannot read the tensorstore-spec leaves; the Orbax hooks always step in.
    orbax_readers: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, path: Where, version: str, inventory: Inventory, files, problems,
                 aggregate, t5x_version: int, array_metadata: dict[str, bytes]) -> None:
        super().__init__(path, version, inventory, files, problems, ocdbt=False, native=False,
                         aggregate=aggregate, array_metadata=array_metadata)
        self.format = NAME
        self.t5x_version = t5x_version

    def read_into(self, entry: Entry, index: tuple, out: np.ndarray):
        if not isinstance(entry.location, _Uint16Bits):
            return super().read_into(entry, index, out)
        out = as_values(out, entry.dtype)
        same = out.dtype == numpy_dtype("bfloat16")
        bits = out.view(np.uint16) if same else np.empty(out.shape, np.uint16)
        pending = super().read_into(Entry(entry.key, entry.shape, "uint16", entry.location), index, bits)
        if same:
            return pending
        pending.result()
        np.copyto(out, bits.view(numpy_dtype("bfloat16")), casting="unsafe")
        return None


def read_contents(step_dir: Where, limit: int | None = None) -> tuple[Any, Any, int]:
    """(its bytes, tree, version) of a legacy step's msgpack (a memory map locally, fetched whole
    from a bucket; refused beyond ``limit``); refuses versions T5X does not read."""
    where = step_dir / AGGREGATE
    data = msgpack_tree.contents(where, limit)
    tree = msgpack_tree.read_tree(data, str(where))
    if not isinstance(tree, dict) or "optimizer" not in tree:
        raise CorruptCheckpointError(
            f"{where}: a T5X checkpoint holds {{'version', 'optimizer'}}, this one "
            f"{sorted(tree) if isinstance(tree, dict) else type(tree).__name__}. Re-copy it.")
    version = tree.get("version", 0)
    if isinstance(version, msgpack_tree.ArrayRef):
        version = int(np.frombuffer(data, storage_dtype(version.dtype), 1, version.ranges[0][0])[0])
    if version not in VERSIONS:
        raise UnknownFormatError(
            f"{where}: T5X checkpoint version {version!r}; ckptshim (like T5X) reads versions "
            f"{', '.join(map(str, VERSIONS))}. Re-save it with a T5X from after 2021.")
    return data, tree, int(version)


def _open_legacy(step_dir: Where) -> T5XCheckpoint:
    """A legacy step: its msgpack (from a bucket, capped by what its files can justify), then
    each array's ``.zarray`` and chunk files, found by one listing of the step."""
    Location.of(step_dir).refuse_links_leaving()  # a chunk linked out of the folder would be read as weights
    listed = kvstore.list_files(step_dir)
    data, tree, t5x_version = read_contents(step_dir, metadata_limit(sum(size or 0 for size in listed.values())))
    found: dict[KeyPath, Any] = {}
    _walk(tree["optimizer"], (), found)
    by_folder: dict[str, dict[str, int | None]] = {}
    for key, size in listed.items():
        folder, _, rest = key.rpartition("/")
        by_folder.setdefault(folder, {})[rest] = size
    entries: list[Entry] = []
    problems: list[str] = []
    files = [located.file_info_at(step_dir / AGGREGATE, len(data), root=step_dir, size=listed.get(AGGREGATE))]
    specs = {key: local_folder(leaf, step_dir, f"{step_dir / AGGREGATE} leaf {'/'.join(key)!r}")
             for key, leaf in found.items() if _is_spec(leaf)}
    raw = kvstore.read_values(step_dir, False, [f"{name}/.zarray" for name in specs.values()], sizes=listed,
                              limit=zarr.MAX_METADATA_BYTES)
    for key, leaf in found.items():
        if not _is_spec(leaf):
            entries.append(msgpack_tree.inline_entry(key, leaf))
            continue
        name = specs[key]
        meta = raw.get(f"{name}/.zarray")
        if meta is None:
            problems.append(f"{name}/: the zarr folder of {'/'.join(key)!r} is missing (the "
                            "msgpack names it, the step folder lacks it)")
            shape, dtype = _spec_shape_dtype(leaf)
            entries.append(Entry(key, shape, dtype, orbax.StoredArray(name, str(leaf["driver"]))))
            continue
        array = zarr.parse(meta, f"{step_dir / name}/.zarray")
        if t5x_version == 2 and array.dtype == "uint16":
            entries.append(Entry(key, array.shape, "bfloat16", _Uint16Bits(name, array.driver)))
        else:
            entries.append(Entry(key, array.shape, array.dtype, orbax.StoredArray(name, array.driver)))
        chunk_files, found = array.folder_report(step_dir / name, by_folder.get(name, {}), "/".join(key),
                                                 zarr.chunk_keys_required(array, False), step_dir)
        files += chunk_files
        problems += found
    return T5XCheckpoint(step_dir, f"legacy msgpack v{t5x_version}", Inventory(entries, str(step_dir)),
                         files, problems, data, t5x_version,
                         {name: meta for name in specs.values() if (meta := raw.get(f"{name}/.zarray")) is not None})


def _spec_shape_dtype(spec: dict) -> tuple[tuple[int, ...], str]:
    """What the spec itself says (used for inspect when the array's folder is gone)."""
    from ckptshim.inventory import dtype_name

    try:
        shape = tuple(int(n) for n in spec["metadata"]["shape"])
        dtype = dtype_name(spec.get("dtype") or np.dtype(spec["metadata"]["dtype"]))
    except (KeyError, TypeError, ValueError):
        return (), "uint8"
    return shape, dtype


# -- opening ----------------------------------------------------------------------------------


@reader
def open_checkpoint(path: Where) -> Checkpoint:
    """A step folder of either generation, its ``checkpoint`` file, or a model dir (latest step);
    locally or below a bucket prefix."""
    if path.is_file():
        path = path.parent
    if not (is_legacy_step(path) or is_orbax_step(path)):
        found = steps(path)
        if not found:
            raise CorruptCheckpointError(f"{path}: no T5X checkpoint_<step> folder found")
        path = found[max(found)]
    if is_legacy_step(path):
        return _open_legacy(path)
    item = orbax.open_checkpoint(path / STATE_ITEM)
    item.format, item.version = NAME, f"orbax-era, {STATE_ITEM}/ item ({item.version})"
    return item

