"""One Orbax PyTree item folder, in any layout Orbax has written since 0.1.

Layouts, newest first:

- ``_METADATA`` (JSON tree of keys and value types) + an OCDBT database (``manifest.ocdbt``,
  ``d/``, per-process ``ocdbt.process_N/``) holding one zarr v2 or v3 array per leaf;
- ``_METADATA`` + one zarr folder per leaf (``use_ocdbt=False``);
- legacy (Orbax < 0.5, no ``_METADATA``): an aggregate msgpack file ``checkpoint`` whose leaves
  are ``PLACEHOLDER://<name>`` strings for arrays stored as zarr folders ``<name>/``, or the
  arrays themselves inline (Flax's msgpack encoding), or plain scalars.

Today's ``StandardCheckpointer`` restores only the ``_METADATA`` layouts, ``PyTreeCheckpointer``
the legacy aggregate too; the hooks use :attr:`OrbaxCheckpoint.orbax_readers` to know when they
must step in. The inventory
comes from ``_METADATA`` or the aggregate file plus each array's ``.zarray``/``zarr.json``;
completeness from the OCDBT index and the listing of chunk keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import numpy as np

from ckptshim.errors import CorruptCheckpointError, UnknownFormatError
from ckptshim.formats import kvstore, msgpack_tree, zarr
from ckptshim.formats.base import (Checkpoint, FileInfo, file_info, folder_bytes, numpy_dtype, reader,
                                   refuse_links_leaving, storage_dtype, strict_json)
from ckptshim.formats.ts_arrays import TensorstoreArrays
from ckptshim.inventory import Entry, Inventory, KeyPath

NAME = "orbax"
METADATA = "_METADATA"
AGGREGATE = "checkpoint"
PLACEHOLDER = "PLACEHOLDER://"
_ARRAY_TYPES = frozenset({"jax.Array", "np.ndarray", "scalar"})


def sniff(path: Path) -> bool:
    """Cheap: does ``path`` look like one Orbax PyTree item (any layout)?"""
    if not path.is_dir():
        return False
    if (path / METADATA).is_file() or (path / "manifest.ocdbt").is_file():
        return True
    return msgpack_tree.is_msgpack_file(path / AGGREGATE)


READERS = {"jax": sniff}


@dataclass(frozen=True)
class StoredArray:
    """Where a tensorstore-backed leaf lives: its zarr array name and driver."""

    name: str
    driver: str


class OrbaxCheckpoint(Checkpoint):
    """An Orbax item folder; entry locations are :class:`StoredArray` or :class:`msgpack_tree.Inline`."""

    key_sep = "/"

    def __init__(self, path: Path, version: str, inventory: Inventory, files, problems,
                 *, ocdbt: bool, native: bool, aggregate=None) -> None:
        super().__init__(path, NAME, version, inventory, tuple(files), tuple(problems))
        self.native = native
        self._arrays = TensorstoreArrays(path, ocdbt)
        self._aggregate = aggregate

    @property
    def orbax_readers(self) -> frozenset[str]:
        """``_METADATA`` layouts: both restore args; the legacy aggregate: ``PyTreeRestore`` only."""
        return frozenset({"standard", "pytree"} if self.native else {"pytree"})

    def read_into(self, entry: Entry, index: tuple, out: np.ndarray):
        """Copy ``entry``'s ``index`` range into ``out`` (cast to its dtype); may return a future."""
        where = entry.location
        if isinstance(where, StoredArray):
            return self._arrays.read_into(where.name, where.driver, index, out)
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


def _metadata_leaves(path: Path) -> tuple[list[tuple[KeyPath, str]], dict]:
    """``_METADATA`` -> [(key path, zarr array name)] for array leaves, and the file's options."""
    where = path / METADATA
    try:
        meta = strict_json(where.read_bytes(), folder_bytes(path))
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
    return leaves, meta


def _require_plain_names(path: Path, leaves: list[tuple[KeyPath, object]]) -> None:
    """Each ``PLACEHOLDER://<name>`` must name a folder of this item: no ``/``, ``..`` or root."""
    for key, name in leaves:
        if isinstance(name, str) and (not name or name in (".", "..") or PurePosixPath(name).name != name):
            raise CorruptCheckpointError(
                f"{path / AGGREGATE}: leaf {'/'.join(key)!r} points at {name!r}, which is not a folder "
                "of this checkpoint (it lies outside it); ckptshim reads only files inside the "
                "checkpoint. Re-copy the checkpoint from the original.")


@reader
def open_checkpoint(path: Path) -> OrbaxCheckpoint:
    refuse_links_leaving(path)  # array folders, chunks, OCDBT data files: tensorstore follows links
    native = (path / METADATA).is_file()
    ocdbt = (path / "manifest.ocdbt").is_file()
    aggregate = None
    fill_stored = False
    if native:
        leaves, meta = _metadata_leaves(path)
        fill_stored = bool(meta.get("store_array_data_equal_to_fill_value", False))
        version = f"{'ocdbt' if meta.get('use_ocdbt', ocdbt) else 'per-leaf'} " \
                  f"{'zarr3' if meta.get('use_zarr3') else 'zarr2'}"
    else:
        aggregate = msgpack_tree.map_file(path / AGGREGATE)
        tree = msgpack_tree.read_tree(aggregate, str(path / AGGREGATE))
        found = msgpack_tree.leaves(tree)
        if any(key[-2:] == ("kvstore", "driver") for key in found):
            raise UnknownFormatError(
                f"{path / AGGREGATE} names its arrays by tensorstore specs, as T5X's legacy "
                "checkpointer does, not by Orbax PLACEHOLDER leaves; ckptshim does not read T5X "
                "legacy checkpoints as Orbax ones.")
        leaves = [(key, leaf[len(PLACEHOLDER):] if isinstance(leaf, str) else leaf)
                  for key, leaf in found.items() if not isinstance(leaf, str) or leaf.startswith(PLACEHOLDER)]
        _require_plain_names(path, leaves)
        version = f"legacy aggregate{' + ocdbt' if ocdbt else ''}"
    listed = kvstore.list_keys(path, ocdbt)
    by_array: dict[str, set[str]] = {}
    for key in listed:
        name, _, rest = key.partition("/")
        if rest:
            by_array.setdefault(name, set()).add(rest)
    wanted = [name for _, name in leaves if isinstance(name, str)]
    meta_keys = {name: next((f"{name}/{m}" for m in zarr.METADATA_FILES if m in by_array.get(name, ())), None)
                 for name in wanted}
    raw = kvstore.read_values(path, ocdbt, [k for k in meta_keys.values() if k is not None])

    entries: list[Entry] = []
    problems: list[str] = []
    for key, leaf in leaves:
        if not isinstance(leaf, str):
            entries.append(msgpack_tree.inline_entry(key, leaf))
            continue
        meta_key = meta_keys[leaf]
        if meta_key is None or raw.get(meta_key) is None:
            problems.append(f"{leaf}: array metadata (.zarray or zarr.json) missing; the array "
                            "cannot be read")
            continue
        array = zarr.parse(raw[meta_key], f"{path}/{meta_key}")
        entries.append(Entry(key, array.shape, array.dtype, StoredArray(leaf, array.driver)))
        if zarr.chunk_keys_required(array, fill_stored):
            count, absent = array.missing_chunks(by_array.get(leaf, set()))
            if count:
                shown = ", ".join(absent) + (f" and {count - len(absent)} more" if count > len(absent) else "")
                problems.append(f"{leaf}: {count} chunk(s) missing ({shown})")
        if not ocdbt:  # OCDBT records each chunk's size; plain files only their frames do
            count, short = array.short_chunks(path / leaf, by_array.get(leaf, set()))
            if count:
                problems.append(f"{count} chunk(s) cut short or damaged: {'; '.join(short)}")

    files: list[FileInfo] = []
    if ocdbt:
        files = [file_info(path / name, size, root=path)
                 for name, size in sorted(kvstore.ocdbt_data_files(path).items())]
    return OrbaxCheckpoint(path, version, Inventory(entries, str(path)), files, problems,
                           ocdbt=ocdbt, native=native, aggregate=aggregate)
