"""The key-value stores Orbax keeps arrays in: a plain folder, or an OCDBT database.

Both are opened through tensorstore so that listing keys and reading small metadata values use
the same code; neither reads array chunks. For OCDBT, :func:`ocdbt_index` walks the manifest
and the b-tree (metadata only) and returns every key with its value or the byte range that
holds it, and every index node, so that a deleted, truncated or replaced file (including one
in a per-process ``ocdbt.process_N/`` folder) is reported, with what it costs, before any read
is attempted.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import unquote

from ckptshim.errors import CorruptCheckpointError


def _ts():
    import tensorstore

    return tensorstore


def file_url(path: Path) -> str:
    return "file://" + str(path.resolve()) + "/"


def kvstore_spec(root: Path, ocdbt: bool) -> dict[str, Any]:
    """The tensorstore kvstore spec for a checkpoint folder (OCDBT database or plain files)."""
    if ocdbt:
        return {"driver": "ocdbt", "base": file_url(root)}
    return {"driver": "file", "path": str(root.resolve()) + "/"}


def list_keys(root: Path, ocdbt: bool, context=None) -> list[str]:
    """Every key in the store (for a plain folder: every file path below it)."""
    ts = _ts()
    try:
        store = ts.KvStore.open(kvstore_spec(root, ocdbt), context=context).result()
        return [key.decode("utf-8", "replace") for key in store.list().result()]
    except (ValueError, OSError) as error:
        raise CorruptCheckpointError(
            f"{root}: cannot list the {'OCDBT database' if ocdbt else 'folder'} ({error}); its "
            "index is missing or corrupt. Re-copy the checkpoint from the original.") from None


def read_values(root: Path, ocdbt: bool, keys: list[str], context=None) -> dict[str, bytes | None]:
    """Small values (metadata files) by key; ``None`` for a key that is absent."""
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


@dataclass(frozen=True)
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
    keys in its range are then unknown, and whatever they hold is lost."""

    where: Reference
    first: str
    end: str | None
    read: bool

    def overlaps(self, prefix: str) -> bool:
        """Whether any key starting with ``prefix`` (non-empty) can lie under this node."""
        after = prefix[:-1] + chr(ord(prefix[-1]) + 1)  # the first string above every such key
        return self.first < after and (self.end is None or prefix < self.end)


@dataclass
class OcdbtIndex:
    """What an OCDBT database's manifest and b-tree say: every key with its value (the bytes
    themselves when stored inline, else a :class:`Reference` into a data file), and every index
    node the latest version consists of. Read once, metadata only; no array chunk is read."""

    values: dict[str, bytes | Reference] = field(default_factory=dict)
    nodes: list[IndexNode] = field(default_factory=list)

    def unreadable(self) -> list[IndexNode]:
        return [node for node in self.nodes if not node.read]

    def files(self) -> dict[str, int]:
        """Each file the index references -> the bytes it must at least hold."""
        needed: dict[str, int] = {}
        references = [node.where for node in self.nodes]
        references += [v for v in self.values.values() if isinstance(v, Reference)]
        for ref in references:
            if needed.get(ref.file, -1) < ref.end:
                needed[ref.file] = ref.end
        return needed


def ocdbt_index(root: Path) -> OcdbtIndex:
    """Walk the latest version of the OCDBT database at ``root``: its manifest, then each b-tree
    node it reaches, with tensorstore's own decoder (``ts.ocdbt.dump``).

    Nodes may live in other databases' folders (Orbax's per-process ``ocdbt.process_N/``, which
    the root's index points into after a multi-process save). A node whose file is missing, not
    a regular file or too short is recorded and skipped, so the walk goes on and the report
    can say what it costs; a manifest or node that is there but cannot be decoded raises
    :class:`CorruptCheckpointError`.
    """
    ts = _ts()
    base = ts.KvStore.open(file_url(root)).result()
    index = OcdbtIndex()
    sizes: dict[str, int | None] = {}
    try:
        manifest = ts.ocdbt.dump(base).result()
        versions = manifest.get("versions") or []
        if not versions:
            return index
        latest = max(versions, key=lambda v: v["generation_number"])
        location = latest.get("root", {}).get("location")
        pending = [(location, "", None)] if location else []
        while pending:
            location, first, end = pending.pop()
            where = _reference(location, root)
            if where.file not in sizes:
                sizes[where.file] = regular_size(root / where.file)
            readable = sizes[where.file] is not None and sizes[where.file] >= where.end
            index.nodes.append(IndexNode(where, first, end, readable))
            if readable:
                _walk_node(ts.ocdbt.dump(base, location).result(), end, root, index, pending)
    except (ValueError, OSError, KeyError, TypeError) as error:
        raise CorruptCheckpointError(
            f"{root}: the OCDBT index (manifest.ocdbt and the index nodes it points at) cannot be "
            f"read ({error}); the checkpoint is incomplete or corrupt. Re-copy it from the "
            "original.") from None
    return index


def _walk_node(node: dict, end: str | None, root: Path, index: OcdbtIndex, pending: list) -> None:
    """Record a leaf node's values, or queue an interior node's children with their key ranges."""
    entries = node.get("entries", ())
    if node.get("height", 0) > 0:
        for i, entry in enumerate(entries):
            upper = _text(entries[i + 1]["key"]) if i + 1 < len(entries) else end
            pending.append((entry["location"], _text(entry["key"]), upper))
        return
    values = index.values
    for entry in entries:
        key = _text(entry["key"])
        values[key] = entry["inline_value"] if "inline_value" in entry else \
            _reference(entry["indirect_value"], root)


def _text(key: bytes) -> str:
    return bytes(key).decode("utf-8", "replace")


def regular_size(path: Path) -> int | None:
    """The size of the regular file at ``path`` (a link followed); ``None`` for anything else."""
    try:
        found = os.stat(path)
    except OSError:
        return None
    return found.st_size if stat.S_ISREG(found.st_mode) else None


def _reference(location: str, root: Path) -> Reference:
    """``"value:ocdbt.process_0/:d/abc:10:20"`` -> ``Reference("ocdbt.process_0/d/abc", 10, 20)``.

    tensorstore percent-encodes both path parts; a path that would leave the database's folder
    is refused (tensorstore would read it relative to the folder, wherever that leads).
    """
    _kind, rest = location.split(":", 1)
    paths, offset, length = rest.rsplit(":", 2)
    base_path, relative = paths.split(":", 1)
    name = unquote(base_path) + unquote(relative)
    parts = PurePosixPath(name).parts
    if not parts or PurePosixPath(name).is_absolute() or ".." in parts:
        raise CorruptCheckpointError(
            f"{root}: the OCDBT index points at {name!r}, which is not a file inside the "
            "checkpoint; ckptshim reads only files the checkpoint contains. Re-copy it from the original.")
    return Reference(name, int(offset), int(length))
