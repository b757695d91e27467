"""Orbax ``CheckpointManager`` folders: a root of step folders, each holding named items.

A root holds one folder per step (``1/``, ``2/``, or with a prefix such as ``checkpoint_5/``);
a step folder holds one folder per item -- ``default/`` (single-item managers), ``state/``
(MaxText before 2024, T5X), ``items/`` (MaxText today), or any other name. Inspecting either
reads the latest step; its keys are the item's own keys when it has one array item (so a step
saved as ``state`` plans against one saved as ``default``) and ``<item>/<key>`` when it has
several. The hooks use :func:`steps` and :func:`items` to find what a restore call names.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np

from ckptshim.errors import CorruptCheckpointError
from ckptshim.formats import orbax
from ckptshim.formats.base import Checkpoint, reader, step_folders
from ckptshim.inventory import Entry, Inventory
from ckptshim.storage import Location

NAME = "orbax-manager"
_STEP = re.compile(r"^(?:.*_)?(\d+)$")


def items(step_dir: Path) -> dict[str, Path]:
    """Item name -> folder, for the Orbax PyTree items in one step folder."""
    if not step_dir.is_dir() or orbax.sniff(step_dir):
        return {}
    return {child.name: child for child in sorted(step_dir.iterdir()) if orbax.sniff(child)}


def remote_items(step: Location) -> dict[str, Location]:
    """Item name -> prefix, for the Orbax items ckptshim reads from object storage (see
    :func:`~ckptshim.formats.orbax.sniff_listed`) in one step prefix: a listing of the step,
    then one of each folder in it (a step holds a few items)."""
    listed = step.list()
    if orbax.sniff_listed({info.location.name for info in listed if info.kind == "file"}):
        return {}  # an item itself, not a step
    found = {}
    for info in listed:
        if info.kind == "directory" and orbax.sniff_listed(
                {child.location.name for child in info.location.list() if child.kind == "file"}):
            found[info.location.name] = info.location
    return found


def steps(root: Path) -> dict[int, Path]:
    """Step number -> step folder, for the step folders (with at least one item) under ``root``."""
    return step_folders(root, _STEP, lambda child: child if items(child) else None)


def sniff(path: Path) -> bool:
    return bool(items(path)) or bool(steps(path))


#: A root or step folder holds items; a restore call names one item (see :func:`items`).
READERS: dict = {}


class ManagerCheckpoint(Checkpoint):
    """The array items of one step; entry locations are ``(item name, item location)``."""

    key_sep = "/"

    def __init__(self, path: Path, version: str, parts: dict[str, orbax.OrbaxCheckpoint]) -> None:
        prefixed = len(parts) > 1
        entries = [Entry(((name,) if prefixed else ()) + e.key, e.shape, e.dtype, (name, e.location))
                   for name, part in parts.items() for e in part.inventory.values()]
        files = [dataclasses.replace(f, path=f"{name}/{f.path}") for name, part in parts.items() for f in part.files]
        problems = [f"{name}: {p}" for name, part in parts.items() for p in part.problems]
        super().__init__(path, NAME, version, Inventory(entries, str(path)), tuple(files), tuple(problems))
        self._parts = parts

    def _inner(self, entry: Entry) -> tuple[orbax.OrbaxCheckpoint, Entry]:
        name, location = entry.location
        part = self._parts[name]
        return part, Entry(entry.key[1:] if len(self._parts) > 1 else entry.key, entry.shape,
                           entry.dtype, location)

    def read_into(self, entry: Entry, index: tuple, out: np.ndarray):
        part, inner = self._inner(entry)
        return part.read_into(inner, index, out)

    def read(self, entry: Entry) -> np.ndarray:
        part, inner = self._inner(entry)
        return part.read(inner)

    def close(self) -> None:
        for part in self._parts.values():
            part.close()


@reader
def open_checkpoint(path: Path) -> ManagerCheckpoint:
    found = items(path)
    if found:
        version = "step folder"
    else:
        all_steps = steps(path)
        if not all_steps:
            raise CorruptCheckpointError(f"{path}: no step folder with an Orbax item found")
        latest = max(all_steps)
        version = f"step {latest} (steps: {', '.join(map(str, all_steps))})"
        path = all_steps[latest]
        found = items(path)
    parts = {name: orbax.open_checkpoint(folder) for name, folder in found.items()}
    return ManagerCheckpoint(path, f"{version}; items: {', '.join(parts)}", parts)
