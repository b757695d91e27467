"""Megatron-Core ``dist_checkpointing`` folders: which backend wrote them, and the zarr backend's reader.

Every ``dist_checkpointing.save`` writes ``metadata.json`` (``{"sharded_backend": "torch_dist" |
"zarr", "sharded_backend_version": 1, "common_backend": "torch", ...}``) and ``common.pt`` (the
state dict's non-sharded values: ``iteration``, ``args``...) beside the sharded part:

- ``torch_dist`` (the default since Megatron-Core 0.7): a DCP checkpoint (``.metadata``,
  ``__<rank>_<n>.distcp``), read by :mod:`ckptshim.formats.dcp`; :func:`config` says it is
  Megatron-Core's, so that a load can pick the Megatron-Core profile;
- ``zarr`` (Megatron-Core <= 0.12, removed in 0.16): one zarr-v2 array folder per sharded tensor
  key, uncompressed, chunked by the shards that wrote it; each ``ShardedObject`` (a module's
  ``_extra_state``) a ``torch.save`` file ``<key>/shard_<offset>_<shape>.pt``. Read here.

Keys are Megatron-Core's checkpoint keys, the same under both backends: transformer layers
stacked on a new axis 0 under one key without the layer index
(``decoder.layers.self_attention.linear_qkv.weight`` ``[L, 3h, h]``, axis 0 the global layer
index across pipeline stages); with the local (non-Transformer-Engine) spec the layer norms
under their TE-fused names (``input_layernorm.weight`` as
``self_attention.linear_qkv.layer_norm_weight``, ``pre_mlp_layernorm.*`` as
``mlp.linear_fc1.layer_norm_*``). A ``ShardedObject`` is listed as DCP lists one: its key
``<key>/shard_<offset>_<shape>`` as a ``uint8`` array of its stored bytes (never unpickled here).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from fnmatch import fnmatch
from itertools import islice
from pathlib import Path

import numpy as np

from ckptshim.errors import CorruptCheckpointError, UnknownFormatError
from ckptshim.formats import dcp, located, model_yaml, zarr
from ckptshim.formats.base import Checkpoint, FileInfo, Piece, reader, storage_dtype, strict_json
from ckptshim.inventory import Entry, Inventory, split_key
from ckptshim.storage import ByteRange, Location, ObjectInfo, read_ranges

NAME = "megatron-core-zarr"
CONFIG_FILE = "metadata.json"
COMMON_FILE = "common.pt"
#: ``metadata.json`` is a few hundred bytes; a larger one is not Megatron-Core's.
MAX_CONFIG_BYTES = 64 * 1024


@dataclass(frozen=True)
class Config:
    """``metadata.json``: the backends (and their versions) that wrote the folder."""

    sharded_backend: str
    sharded_backend_version: int
    common_backend: str
    common_backend_version: int


def config(path: Path | Location) -> Config | None:
    """The folder's (or bucket prefix's) ``metadata.json`` if it is Megatron-Core's
    (``sharded_backend`` named); ``None`` for any other folder, or one whose ``metadata.json`` is
    not a small regular file of JSON (never read otherwise: a FIFO there would block)."""
    where = Location.of(path) / CONFIG_FILE
    try:
        found = where.stat()
        if found.kind != "file" or found.size > MAX_CONFIG_BYTES:
            return None
        meta = strict_json(where.read_bytes(MAX_CONFIG_BYTES, found.size))
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or not isinstance(meta.get("sharded_backend"), str):
        return None
    version = meta.get("sharded_backend_version", 1)
    common_version = meta.get("common_backend_version", 1)
    return Config(meta["sharded_backend"], version if type(version) is int else 1,
                  str(meta.get("common_backend", "torch")), common_version if type(common_version) is int else 1)


#: Megatron-LM's save root names its newest iteration here (``iter_<N:07d>``, or ``release``).
LATEST_FILE = "latest_checkpointed_iteration.txt"
#: Megatron-Bridge's record of the run beside each iteration: the model's config under ``model:``.
RUN_CONFIG_FILE = "run_config.yaml"


def iteration_folder(path: Path | Location, listed: Sequence[ObjectInfo] | None = None) -> Path | Location | None:
    """For a Megatron-LM save root (``latest_checkpointed_iteration.txt`` beside ``iter_*``
    folders, no checkpoint of its own), the iteration folder it names, as Megatron-LM's
    ``read_metadata`` reads it (a path for a local folder, a location for a bucket prefix);
    ``None`` for any other path. ``listed``: the folder's listing, where the caller has it."""
    root = Location.of(path)
    latest = root / LATEST_FILE
    try:  # a listing of the folder, not a stat of the file: what cannot be reached is the checkpoint
        found = next((info for info in (root.list() if listed is None else listed)
                      if info.location.name == LATEST_FILE and info.kind == "file"), None)
    except (FileNotFoundError, NotADirectoryError):
        return None
    if found is None or found.size > 64 or config(root) is not None:
        return None
    text = latest.read_bytes(64, found.size).decode(errors="replace").strip()
    name = "release" if text == "release" else f"iter_{int(text):07d}" if text.isdigit() else ""
    folder = root / name if name else root
    if not name or config(folder) is None:
        raise CorruptCheckpointError(f"{latest} names {text!r:.40}, but {name or 'no folder'} is no "
                                     "Megatron-Core checkpoint beside it; point at an iter_* folder directly.")
    return folder if folder.is_remote else folder.path


def run_config(path: Path | Location) -> dict | None:
    """The model's config from ``run_config.yaml`` in a Megatron-Core checkpoint folder (its
    ``model:`` mapping, where the run nests it so), the head counts the hub needs; ``None``
    without one. Parsed with PyYAML's safe loader (plain data only), from a small regular file."""
    if config(path) is None:
        return None
    found = model_yaml.read_mapping(Location.of(path) / RUN_CONFIG_FILE, "reading Megatron's run config")
    model = found.get("model", found) if found is not None else None
    return model if isinstance(model, dict) else None


def is_torch_dist(path: Path | Location) -> bool:
    """A DCP folder written by Megatron-Core's ``torch_dist`` backend (read by :mod:`dcp`)."""
    found = config(path)
    return (found is not None and found.sharded_backend == "torch_dist"
            and bool(dcp.metadata_names(info.location.name for info in located.listing(path))))


def is_zarr(path: Path | Location) -> bool:
    """A folder written by Megatron-Core's ``zarr`` backend: its ``metadata.json`` says so and it
    holds at least one zarr-v2 array folder."""
    found = config(path)
    return (found is not None and found.sharded_backend == "zarr"
            and any(info.kind == "directory" and (info.location / ".zarray").is_file()
                    for info in located.listing(path)))


sniff = is_zarr
READERS = {"torch": is_zarr}


@dataclass(frozen=True)
class _Array:
    """A sharded tensor's zarr folder: its metadata, read from raw chunk files."""

    folder: str
    meta: zarr.ZarrArray

    @property
    def chunk_bytes(self) -> int:
        return self.meta.chunk_bytes


class MegatronZarrCheckpoint(Checkpoint):
    """A Megatron-Core zarr-backend folder (a local folder or a bucket prefix). Tensor entries'
    locations are :class:`_Array`; a ``ShardedObject``'s is its ``.pt`` file's name, read as bytes."""

    def read(self, entry: Entry) -> np.ndarray:
        root = Location.of(self.path)
        where = entry.location
        if isinstance(where, str):  # a sharded object: the file's bytes
            out = np.empty(entry.shape[0], np.uint8)
            root.child(where).read_into(0, out)
            return out
        meta = where.meta
        out = np.empty(meta.shape, storage_dtype(meta.dtype))
        # from a bucket a window of chunks fetched together, from a disk one at a time
        per_window = max(1, root.read_ahead_bytes // max(1, where.chunk_bytes))
        keys = iter(meta.chunk_keys())
        while window := list(islice(keys, per_window)):
            chunks = [np.empty(where.chunk_bytes, np.uint8) for _ in window]
            read_ranges([ByteRange(root.child(f"{where.folder}/{key}"), 0, where.chunk_bytes) for key in window],
                        chunks)
            for key, raw in zip(window, chunks):
                starts = [int(i) * c for i, c in zip(key.split(meta.separator), meta.chunks)] if meta.shape else []
                region = tuple(slice(s, min(s + c, n)) for s, c, n in zip(starts, meta.chunks, meta.shape))
                chunk = raw.view(storage_dtype(meta.dtype)).reshape(meta.chunks if meta.shape else ())
                out[region] = chunk[tuple(slice(0, r.stop - r.start) for r in region)]
        return out


@reader
def open_checkpoint(path: Path | Location) -> MegatronZarrCheckpoint:
    """The folder or bucket prefix ``path``, from one bounded listing of every file below it:
    each array's ``.zarray`` read (small, bounded), its chunk files checked against it by size."""
    root = Location.of(path)
    found = config(root)
    if found is None or found.sharded_backend != "zarr":
        raise CorruptCheckpointError(f"{path}: no {CONFIG_FILE} naming the zarr sharded backend; not a "
                                     "Megatron-Core zarr checkpoint")
    root.refuse_links_leaving()
    listed = [info for info in root.list(recursive=True) if info.kind == "file"]
    array_bytes = sum(info.size for info in listed)
    folders: dict[str, dict[str, int]] = {}  # folder -> its files (relative to it) -> size
    for info in listed:
        folder, _, name = info.location.relative_to(root).partition("/")
        if name:
            folders.setdefault(folder, {})[name] = info.size
    entries: list[Entry] = []
    files: list[FileInfo] = [located.file_info_at(root / CONFIG_FILE, root=root),
                             located.file_info_at(root / COMMON_FILE, root=root)]
    problems: list[str] = []
    for name, present in sorted(folders.items()):
        folder = root / name
        if ".zarray" in present:
            array = _array(folder, array_bytes, present[".zarray"])
            entries.append(Entry(split_key(name), array.meta.shape, array.meta.dtype, array))
            files += _chunk_files(folder, array, {file: size for file, size in present.items() if file != ".zarray"},
                                  root, problems)
        for obj, size in sorted(present.items()):
            if fnmatch(obj, "shard_*.pt") and "/" not in obj:
                key = f"{name}/{obj.removesuffix('.pt')}"
                entries.append(Entry(split_key(key), (size,), "uint8", f"{name}/{obj}"))
                files.append(located.file_info_at(folder / obj, root=root, size=size, writer=f"{name}/",
                                                  pieces=(Piece(key, "object"),)))
    version = f"Megatron-Core dist_checkpointing zarr v{found.sharded_backend_version}"
    return MegatronZarrCheckpoint(path, NAME, version, Inventory(entries, str(path)), tuple(files), tuple(problems))


def _array(folder: Location, array_bytes: int, size: int) -> _Array:
    """A zarr folder's ``.zarray`` (``size`` bytes, as listed), refused unless it is what
    Megatron-Core writes: C order, no compressor, no filters (raw chunks, each exactly one
    chunk's bytes)."""
    where = folder / ".zarray"
    raw = where.read_bytes(zarr.MAX_METADATA_BYTES, size)  # a few hundred bytes, never more than this
    try:
        meta = strict_json(raw, array_bytes)
    except ValueError as error:
        raise CorruptCheckpointError(f"{where}: not valid JSON ({error}). Re-copy the checkpoint.") from None
    if not isinstance(meta, dict) or meta.get("zarr_format") != 2:
        raise CorruptCheckpointError(f"{where}: not zarr v2 array metadata, which Megatron-Core's zarr backend writes")
    dtype = meta.get("dtype")
    if (meta.get("compressor") is not None or meta.get("filters") or meta.get("order", "C") != "C"
            or not (dtype == "bfloat16" or (isinstance(dtype, str) and dtype[:1] in "<|"))):
        raise UnknownFormatError(
            f"{where}: compressor {json.dumps(meta.get('compressor'))[:80]}, filters "
            f"{json.dumps(meta.get('filters'))[:80]}, order {meta.get('order')!r:.10}, dtype {dtype!r:.20}; "
            "Megatron-Core writes uncompressed little-endian C-order chunks, which is all ckptshim reads "
            "in this layout.")
    return _Array(folder.name, zarr.parse(raw, str(where)))


def _chunk_files(folder: Location, array: _Array, present: dict[str, int], root: Location,
                 problems: list[str]) -> list[FileInfo]:
    """Every chunk the array needs (Megatron-Core writes them all: no fill value), each exactly
    one chunk's bytes; a missing, short or long one is a completeness problem naming its block."""
    files, unlisted = array.meta.folder_files(folder, present, folder.name, True, root, raw=True)
    if unlisted:
        problems.append(f"{folder.name}: {unlisted} more chunk file(s) missing")
    problems += [f"{info.path}: {info.size} bytes, more than the {array.chunk_bytes} of one chunk"
                 for info in files if info.size is not None and info.size > array.chunk_bytes]
    return files
