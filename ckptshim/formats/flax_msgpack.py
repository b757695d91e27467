"""Legacy Flax checkpoints: one msgpack file per step (``checkpoint_<step>``), or their folder.

``flax.training.checkpoints.save_checkpoint`` wrote these before Flax switched to Orbax (and
still does with ``flax_use_orbax_checkpointing=False``): the target's state dict
(``serialization.to_state_dict``) with arrays as msgpack extension records. The structure is
read from a memory map (:mod:`ckptshim.formats.msgpack_tree`; from a bucket, the object is
fetched whole, as Flax reads it); array bytes are only touched when
a restore reads them. A folder of such files reads as its latest step, ordered the way Flax's
``latest_checkpoint`` orders them (natural sort of the step suffix).
"""

from __future__ import annotations

import re

import numpy as np

from ckptshim.formats import located, msgpack_tree
from ckptshim.formats.base import Checkpoint, numpy_dtype, reader, storage_dtype
from ckptshim.formats.located import Where
from ckptshim.inventory import Entry, Inventory
from ckptshim.storage import Location
from ckptshim.storage.problems import not_regular

NAME = "flax-msgpack"
PREFIX = "checkpoint_"
_STEP = re.compile(r"^(-?\d+(?:\.\d+)?(?:e[+-]?\d+)?)$")


def step_files(folder: Where, prefix: str = PREFIX) -> list[Location]:
    """Legacy step files in ``folder`` (a local folder or a bucket prefix, listed once), oldest
    first (Flax's natural order of the step suffix).

    Flax picks its latest step by name alone, so a step name that is neither a file nor a
    folder (a local FIFO, which Flax would open and wait on) is refused, not passed over for an
    older step; a dangling link is no step.
    """
    found = []
    for info in located.listing(folder):
        child = info.location
        suffix = child.name[len(prefix):] if child.name.startswith(prefix) else ""
        if not _STEP.match(suffix):
            continue
        if info.kind not in ("file", "directory"):
            raise not_regular(child, info.kind)
        if msgpack_tree.is_msgpack_file(child):
            found.append((float(suffix), child))
    return [path for _, path in sorted(found)]


def sniff(path: Where) -> bool:
    return msgpack_tree.is_msgpack_file(path) or (path.is_dir() and bool(step_files(path)))


READERS = {"jax": sniff}


class FlaxMsgpackCheckpoint(Checkpoint):
    """One legacy Flax msgpack file; entry locations are :class:`msgpack_tree.Inline`."""

    key_sep = "/"

    def __init__(self, path: Where, version: str, inventory: Inventory, files, data) -> None:
        super().__init__(path, NAME, version, inventory, tuple(files))
        self._data = data

    def read_into(self, entry: Entry, index: tuple, out: np.ndarray) -> None:
        msgpack_tree.copy_inline(self._data, entry, index, out)

    def read(self, entry: Entry) -> np.ndarray:
        out = np.empty(entry.shape, numpy_dtype(entry.dtype))
        self.read_into(entry, (), out)
        return out.view(storage_dtype(entry.dtype))

    def close(self) -> None:
        self._data = None


@reader
def open_checkpoint(path: Where) -> FlaxMsgpackCheckpoint:
    """A step file, or a folder (or prefix) of them (its latest step)."""
    version = "legacy msgpack"
    if path.is_dir():
        Location.of(path).refuse_links_leaving()  # the step Flax picks by name must lie inside
        steps = step_files(path)
        version += f", latest of {len(steps)} step file(s)"
        path = steps[-1]
    data = msgpack_tree.contents(path)
    tree = msgpack_tree.read_tree(data, str(path))
    entries = [msgpack_tree.inline_entry(key, leaf)
               for key, leaf in msgpack_tree.leaves(tree).items() if not isinstance(leaf, str)]
    return FlaxMsgpackCheckpoint(path, version, Inventory(entries, str(path)),
                                 [located.file_info_at(path, size=len(data))], data)
