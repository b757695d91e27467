"""PaxML checkpoints in the tensorstore layout: ``checkpoint_%08d/{metadata/metadata, state/}``.

PaxML (``paxml/checkpoint_version.py``) has written, newest first:

- 1.2: ``state/`` is an OCDBT database plus an Orbax aggregate ``checkpoint`` file -- an Orbax
  legacy-aggregate item, read by :mod:`ckptshim.formats.orbax`;
- 1.1: as 1.0, and ``metadata/metadata`` gains ``train_state_metadata``: per ``mdl_vars`` array
  its dtype and ``unpadded_shape`` (PaxML pads arrays to shard evenly; the padding is not data);
- 1.0: per-step folders with items ``state/`` (one zarr folder per variable, named by its
  ``.``-joined tree path: ``mdl_vars.params.lm.transformer.repeat.sub.x_layers_0.<...>``,
  ``opt_states_0.<...>``, ``step``) and ``metadata/`` (``{"version": 1.0}``);
- 0.0: no item folders; the zarr folders sit in the step folder itself.

Keys are the tree paths (the folder names split at ``.``); a padded array is listed with its
unpadded shape, and reads never touch the padding. A ``Repeat`` layer stack keeps the layers on
axis 0 (``repeat/sub/x_layers_0/...`` is ``[L, ...]``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ckptshim.errors import CorruptCheckpointError
from ckptshim.formats import kvstore, located, orbax, zarr
from ckptshim.formats.base import Checkpoint, metadata_limit, reader, step_folders, strict_json
from ckptshim.formats.located import Where
from ckptshim.inventory import Entry, Inventory, KeyPath, flatten
from ckptshim.storage import Location

NAME = "paxml"
STATE = "state"
METADATA = "metadata/metadata"
_STEP = re.compile(r"^checkpoint_(\d+)$")


def _version(step_dir: Where) -> tuple[float | None, dict]:
    """(version, metadata) from ``metadata/metadata``; ``(None, {})`` when there is none."""
    where = step_dir / METADATA
    if not where.is_file():
        return None, {}
    try:
        meta = strict_json(located.read_whole(where, metadata_limit(0)))
        return float(meta["version"]), meta
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CorruptCheckpointError(
            f"{where}: not a valid PaxML metadata file ({type(error).__name__}: {error}); "
            "PaxML writes {\"version\": ...}. Re-copy the checkpoint.") from None


def _zarr_folders(folder: Where) -> list[str]:
    """Names of the zarr array folders directly in ``folder`` (a local folder or a bucket
    prefix: from one listing)."""
    return sorted({name.partition("/")[0] for name in kvstore.list_files(folder)
                   if name.count("/") == 1 and name.partition("/")[2] in zarr.METADATA_FILES})


def is_state_dir(path: Where) -> bool:
    """A PaxML ``state/`` item (or 0.0 step folder) of per-variable zarr folders."""
    if not path.is_dir() or (path / orbax.METADATA).exists() or (path / orbax.AGGREGATE).exists():
        return False
    names = _zarr_folders(path)
    return any(n.startswith(("mdl_vars.", "opt_states")) for n in names)


def is_step_dir(path: Where) -> bool:
    return path.is_dir() and (path / METADATA).is_file() and (path / STATE).is_dir()


def steps(root: Where) -> dict[int, Where]:
    """Step number -> step folder, for ``checkpoint_%08d`` folders under ``root``."""
    return step_folders(root, _STEP,
                        lambda child: child if is_step_dir(child) or is_state_dir(child) else None)


def sniff(path: Where) -> bool:
    return is_step_dir(path) or is_state_dir(path) or bool(steps(path))


#: An Orbax restore names the ``state/`` item (1.2's is an Orbax item).
READERS = {"jax": is_state_dir}


@dataclass(frozen=True)
class _Padded(orbax.StoredArray):
    """A leaf stored larger than its data (PaxML padding): reads stay inside the unpadded part."""


class PaxmlCheckpoint(orbax.OrbaxCheckpoint):
    """A PaxML ``state/`` folder; reads are Orbax's per-leaf zarr reads, clipped to the data."""

    #: Today's Orbax finds no tree metadata here; the Orbax hooks always step in.
    orbax_readers: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, path: Where, version: str, inventory: Inventory, files, problems,
                 array_metadata: dict[str, bytes]) -> None:
        super().__init__(path, version, inventory, files, problems, ocdbt=False, native=False,
                         array_metadata=array_metadata)
        self.format = NAME

    def read_into(self, entry: Entry, index: tuple, out: np.ndarray):
        if isinstance(entry.location, _Padded):
            index = tuple(slice(*i.indices(n)) if isinstance(i, slice) else i
                          for i, n in zip(index or (slice(None),) * len(entry.shape), entry.shape))
        return super().read_into(entry, index, out)


def unpadded_shapes(meta: dict) -> dict[KeyPath, tuple[int, ...]]:
    """``mdl_vars`` key -> unpadded shape, from version >= 1.1 ``train_state_metadata``."""
    tree = meta.get("train_state_metadata") or {}
    out = {}
    for key, leaf in flatten(tree, is_leaf=lambda n: isinstance(n, dict) and "_array_metadata_tag" in n).items():
        if isinstance(leaf, dict) and leaf.get("unpadded_shape") is not None:
            out[key] = tuple(int(n) for n in leaf["unpadded_shape"])
    return out


@reader
def open_checkpoint(path: Where) -> Checkpoint:
    """A step folder, its ``state/`` item, or a ``checkpoints/`` root (latest step); locally or
    below a bucket prefix (listed once; each array's metadata fetched with a size cap)."""
    if not (is_step_dir(path) or is_state_dir(path)):
        found = steps(path)
        if not found:
            raise CorruptCheckpointError(f"{path}: no PaxML checkpoint_%08d folder found")
        path = found[max(found)]
    step_dir, state = (path, path / STATE) if is_step_dir(path) else (
        (path.parent, path) if (path.parent / METADATA).is_file() else (path, path))
    Location.of(step_dir).refuse_links_leaving()
    version, meta = _version(step_dir)
    if orbax.sniff(state):  # 1.2: OCDBT + Orbax aggregate
        item = orbax.open_checkpoint(state)
        item.format, item.version = NAME, f"{version} ({item.version})"
        return item
    try:
        unpadded = unpadded_shapes(meta)
    except (TypeError, ValueError, OverflowError) as error:
        raise CorruptCheckpointError(f"{step_dir / METADATA}: an unpadded_shape that is not a list of "
                                     f"sizes ({type(error).__name__}: {error}). Re-copy the checkpoint.") from None
    files_of = kvstore.list_files(state)
    names = _zarr_folders(state)
    raw = kvstore.read_values(state, False, [f"{n}/{m}" for n in names for m in zarr.METADATA_FILES], sizes=files_of,
                              limit=zarr.MAX_METADATA_BYTES)
    listed: dict[str, dict[str, int | None]] = {}
    for key, size in files_of.items():
        folder, _, rest = key.partition("/")
        listed.setdefault(folder, {})[rest] = size
    entries, problems, files, known = [], [], [], {}
    for name in names:
        meta_key = next(f"{name}/{m}" for m in zarr.METADATA_FILES if raw.get(f"{name}/{m}") is not None)
        known[name] = raw[meta_key]
        array = zarr.parse(raw[meta_key], f"{state / meta_key}")
        key = tuple(name.split("."))
        shape = unpadded.get(key, array.shape)
        if len(shape) != len(array.shape) or any(not 0 <= u <= s for u, s in zip(shape, array.shape)):
            raise CorruptCheckpointError(
                f"{step_dir / METADATA}: {name} has unpadded shape {list(shape)}, but its zarr "
                f"array is {list(array.shape)}; an unpadded shape never exceeds the stored one. "
                "The metadata belongs to another checkpoint; re-copy the step folder.")
        location = orbax.StoredArray(name, array.driver) if shape == array.shape else \
            _Padded(name, array.driver)
        entries.append(Entry(key, shape, array.dtype, location))
        chunk_files, found = array.folder_report(state / name, listed.get(name, {}), "/".join(key),
                                                 zarr.chunk_keys_required(array, False), state)
        files += chunk_files
        problems += found
    shown = "0.0 (no metadata)" if version is None else f"{version:g}"
    return PaxmlCheckpoint(state, f"{shown}, tensorstore", Inventory(entries, str(state)), files, problems, known)
