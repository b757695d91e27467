"""The key-value stores Orbax keeps arrays in: a plain folder, or an OCDBT database.

Both are opened through tensorstore so that listing keys and reading small metadata values use
the same code; neither reads array chunks. For OCDBT, :func:`ocdbt_data_files` walks the
B+tree index (metadata only) and returns every data file it points at, with the size it must
have, so that a deleted or truncated ``d/...`` file (including one in a per-process
``ocdbt.process_N/`` folder) is reported before any read is attempted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

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


def ocdbt_data_files(root: Path) -> dict[str, int]:
    """Data files the OCDBT index of ``root`` references -> bytes each must at least hold.

    Raises :class:`CorruptCheckpointError` when the manifest or an index node itself cannot be
    read, since then no key of the database can be found.
    """
    ts = _ts()
    base = ts.KvStore.open(file_url(root)).result()
    needed: dict[str, int] = {}
    try:
        manifest = ts.ocdbt.dump(base).result()
        versions = manifest.get("versions") or []
        if not versions:
            return needed
        latest = max(versions, key=lambda v: v["generation_number"])
        location = latest.get("root", {}).get("location")
        pending = [location] if location else []
        while pending:
            location = pending.pop()
            _note(location, needed)
            node = ts.ocdbt.dump(base, location).result()
            for entry in node.get("entries", ()):
                if node.get("height", 0) > 0 and "location" in entry:
                    pending.append(entry["location"])
                elif "indirect_value" in entry:
                    _note(entry["indirect_value"], needed)
    except (ValueError, OSError, KeyError, TypeError) as error:
        raise CorruptCheckpointError(
            f"{root}: the OCDBT index (manifest.ocdbt and the index nodes it points at) cannot be "
            f"read ({error}); the checkpoint is incomplete or corrupt. Re-copy it from the "
            "original.") from None
    return needed


def _note(location: str, needed: dict[str, int]) -> None:
    """``"value:ocdbt.process_0/:d/abc:10:20"`` -> ``needed["ocdbt.process_0/d/abc"] >= 30``."""
    _kind, rest = location.split(":", 1)
    paths, offset, length = rest.rsplit(":", 2)
    base_path, relative = paths.split(":", 1)
    name = base_path + relative
    needed[name] = max(needed.get(name, 0), int(offset) + int(length))
