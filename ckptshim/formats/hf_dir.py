"""Hugging Face model directories: ``config.json`` beside one weights file or a sharded index.

Weights come as ``model.safetensors`` or ``pytorch_model.bin``, or as shards listed in
``*.index.json`` (``{"weight_map": {key: shard file}}``). A folder may hold several of them (a
model re-saved as safetensors beside its old ``.bin`` shards); ckptshim reads the one
transformers' ``from_pretrained`` reads (:func:`open_checkpoint`), never another. The directory
reads as one checkpoint whose entries delegate to the file that holds them; a shard the index
names but the directory lacks is reported, not skipped. A local folder and a bucket prefix are
read the same way, through :class:`~ckptshim.storage.Location`: one bounded listing, the small
files and every shard's header read in one batch. :func:`model_config` reads the
``config.json`` that names the model a checkpoint holds (its ``model_type`` and
``architectures``, and the weights file it may name).
"""

from __future__ import annotations

import os
from collections.abc import Collection, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from ckptshim.errors import CorruptCheckpointError, UnknownFormatError, UnsafeCheckpointError
from ckptshim.formats import marker, torch_pickle
from ckptshim.formats.base import UNREAD, Checkpoint, FileInfo, reader, strict_json
from ckptshim.inventory import Entry, Inventory
from ckptshim.storage import ByteRange, Location, ObjectInfo, UnsupportedLocation, read_ranges
from ckptshim.storage.problems import outside

NAME = "hf-dir"
#: What a Hugging Face model folder holds its weights in, in the order transformers' ``from_pretrained``
#: looks for them in a local folder (``modeling_utils._get_resolved_checkpoint_files``, 5.x): the
#: first one present is the one it reads.
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json",
                "pytorch_model.bin", "pytorch_model.bin.index.json")
_INDEX_SUFFIX = ".index.json"
#: The ``config.json`` entry that names the weights file outright, ahead of :data:`WEIGHT_FILES`,
#: and the names transformers accepts there.
_EXPLICIT = "transformers_weights"
_EXPLICIT_SUFFIXES = (".safetensors", ".safetensors.index.json")
_EXPLICIT_ADAPTER = "adapter_model.bin"
CONFIG = "config.json"
#: The longest name of one file a file system holds (Linux's ``NAME_MAX``).
_NAME_MAX = 255
#: The most a ``config.json`` may hold; real ones are a few KiB (a hostile one is not read whole).
MAX_CONFIG_BYTES = 16 * 2**20


def model_config(path: Location | os.PathLike[str] | str) -> dict | None:
    """The ``config.json`` of the model a checkpoint at ``path`` holds: in the folder (or bucket
    prefix), or beside the file (``model.safetensors`` in a Hugging Face folder). ``None`` when
    there is none or it is not a JSON object; a damaged one is refused, naming the file."""
    try:
        where = Location.of(path)
    except (UnsupportedLocation, TypeError, ValueError):  # another URL, or names nothing
        return None
    folder = where
    found = folder / CONFIG
    if not found.is_file():
        folder = where.parent
        found = folder / CONFIG
        if not where.is_file() or not found.is_file():
            return None
    if not any(found.inside(root) for root in _roots(folder)):  # a hub-cache snapshot links it into blobs/
        raise outside(found, folder, "its real path is elsewhere")
    return _config_from(found.read_bytes(MAX_CONFIG_BYTES), found)


def _config_from(data: bytes, found: object) -> dict | None:
    """The model config in ``data``, the bytes of ``config.json`` at ``found``."""
    try:
        config = strict_json(data)
    except ValueError as error:  # not JSON, not UTF-8, too deep, a key twice, too long
        raise CorruptCheckpointError(f"{found}: not valid JSON ({error}); transformers cannot read this "
                                     "folder either. Re-copy it from the original.") from None
    return config if isinstance(config, dict) else None


def config_of(checkpoint: Checkpoint) -> dict | None:
    """The :func:`model_config` of an opened checkpoint, read once per checkpoint (this format
    reads it while opening) and kept on it."""
    if checkpoint.model_config is UNREAD:
        checkpoint.model_config = model_config(checkpoint.path)
    return checkpoint.model_config


def sniff(path: Path | Location) -> bool:
    where = Location.of(path)
    return where.is_dir() and any((where / name).is_file() for name in WEIGHT_FILES)


def sniff_listed(names: Collection[str]) -> bool:
    """:func:`sniff` from the names one listing of the folder gave (a bucket prefix is
    recognised from the listing detection makes anyway)."""
    return any(name in names for name in WEIGHT_FILES)


#: torch's loaders read it, and a JAX restore takes one (a Hugging Face model as MaxText params)
READERS = {"torch": sniff, "jax": sniff}


class HFDirCheckpoint(Checkpoint):
    """A folder of weight files that together hold the model (``name``: the format that found
    them, a Hugging Face folder's or another producer's); each entry is read from its file."""

    def __init__(self, path: Location | os.PathLike[str], version: str, parts: dict[str, Checkpoint], files, problems,
                 name: str = NAME) -> None:
        entries = [Entry(e.key, e.shape, e.dtype, (shard, e.location))
                   for shard, part in parts.items() for e in part.inventory.values()]
        super().__init__(path, name, version, Inventory(entries, str(path)), tuple(files), tuple(problems))
        self._parts = parts
        #: every shard stores its arrays row-major (see ``SafetensorsCheckpoint.row_major``)
        self.row_major = all(getattr(part, "row_major", False) for part in parts.values())

    def _in_shard(self, entry: Entry) -> tuple[Checkpoint, Entry]:
        """The shard that holds ``entry``, and the entry as that shard names it."""
        name, inner = entry.location
        return self._parts[name], Entry(entry.key, entry.shape, entry.dtype, inner)

    def read(self, entry: Entry) -> np.ndarray:
        part, inner = self._in_shard(entry)
        return part.read(inner)

    def read_into(self, entry: Entry, index: tuple, out: np.ndarray) -> Any:
        part, inner = self._in_shard(entry)
        return part.read_into(inner, index, out)

    def check_entry(self, entry: Entry) -> None:
        """The shard's own check (for a shard in a bucket, its range against the object's size:
        nothing is fetched)."""
        part, inner = self._in_shard(entry)
        part.check_entry(inner)

    def byte_range(self, entry: Entry, index: tuple, out: np.ndarray) -> ByteRange | None:
        """The shard's own (so that the blocks of every shard in a bucket are one batch)."""
        part, inner = self._in_shard(entry)
        return part.byte_range(inner, index, out)

    def close(self) -> None:
        for part in self._parts.values():
            part.close()


def _roots(path: Location) -> tuple[Location, ...]:
    """Where a shard of the folder ``path`` may really live.

    Its own folder, and — for a snapshot in the Hugging Face hub cache
    (``models--org--name/snapshots/<revision>/``, whose files are symlinks to
    ``../../blobs/<hash>``) — that repository's ``blobs/`` folder, which the cache shares
    between revisions. Every component of that layout is checked, not followed: the revision
    folder, ``snapshots`` and ``blobs`` must each be a real folder (no link) of one repository
    folder; a ``blobs`` that is a link (to ``/``, say) would make anything it reaches part of
    the checkpoint, and is refused.
    """
    snapshots, repository = path.parent, path.parent.parent
    blobs = repository / "blobs"
    if snapshots.name != "snapshots" or not (blobs.is_link() or blobs.exists()):
        return (path,)
    for part in (blobs, snapshots, path):
        if part.is_link() or not part.is_dir():
            raise UnsafeCheckpointError(
                f"{part} is {'a symlink' if part.is_link() else 'not a folder'}; in a Hugging Face hub "
                f"cache ({repository}) the revision folder, snapshots/ and blobs/ are real folders of the "
                "repository's cache, and ckptshim reads a snapshot's linked files only from that blobs/ "
                "folder. Download the model again, or copy the snapshot's files into a folder of their own.")
    return path, blobs


def _explicit_weights_file(path: Location, settings: dict | None) -> str | None:
    named = settings.get(_EXPLICIT) if settings is not None else None
    if named is None:
        return None
    inside = isinstance(named, str) and named and not PurePosixPath(named).is_absolute() \
        and ".." not in PurePosixPath(named).parts
    if not inside or not (named.endswith(_EXPLICIT_SUFFIXES) or named == _EXPLICIT_ADAPTER):
        raise CorruptCheckpointError(
            f"{path / CONFIG}: {_EXPLICIT} is {named!r:.100}, not a .safetensors file or index inside the "
            "folder; transformers refuses it too. Fix config.json.")
    return named


def _shards(index: bytes, where: object) -> list[str]:
    """The shard files the weight index ``index`` (read from ``where``) names, each once."""
    try:
        return sorted(set(strict_json(index)["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError) as error:  # UnicodeDecodeError too
        raise CorruptCheckpointError(
            f"{where}: not a valid weight index ({type(error).__name__}: {error}); "
            "re-copy it from the original.") from None


def _not_a_name(shard: object) -> str:
    """Why ``shard``, as a weight index names it, is no file name on a disk or in a bucket
    (``""`` when it is one): not text, empty, a NUL byte, or a part longer than any file
    system's names (``NAME_MAX``), which transformers could not open either."""
    if not isinstance(shard, str):
        return f"a {type(shard).__name__}, not text"
    if not shard or "\0" in shard:
        return "empty" if not shard else "a NUL byte"
    if any(len(os.fsencode(part)) > _NAME_MAX for part in shard.split("/")):
        return f"a name longer than {_NAME_MAX} bytes"
    return ""


def _named_inside(shard: object) -> bool:
    """Whether an index names ``shard`` as a file inside the folder (relative, no ``..``)."""
    return not PurePosixPath(shard).is_absolute() and ".." not in PurePosixPath(shard).parts


@reader
def open_checkpoint(path: Location | os.PathLike[str], listed: Sequence[ObjectInfo] | None = None) -> HFDirCheckpoint:
    """The folder or bucket prefix ``path`` (whose listing ``listed`` may already be at hand):
    one bounded listing gives every file and its size; config.json and the index are read
    whole, and the shards' headers by byte ranges, those of every shard together
    (:func:`_open_shards`). Links are followed only inside the folder (and a hub-cache
    snapshot's ``blobs/``: :func:`_roots`). Its ``path`` is ``path`` as given."""
    given, path = path, Location.of(path)
    roots = _roots(path)
    path.refuse_links_leaving(also=roots[1:])
    listed = {info.location.name: info for info in (path.list() if listed is None else listed) if info.kind == "file"}
    marker.require_complete(path, listed)  # a folder ckptshim convert wrote: every object it lists
    fetched = _fetch_together(listed)
    settings = None if CONFIG not in listed else \
        _config_from(fetched[CONFIG], path / CONFIG) if CONFIG in fetched else model_config(path)
    chosen = _explicit_weights_file(path, settings) or next((name for name in WEIGHT_FILES if name in listed), None)
    if chosen is None:
        raise UnknownFormatError(
            f"{path}: holds none of {', '.join(WEIGHT_FILES)}; it is not a Hugging Face folder ckptshim "
            "reads. Point at the folder that holds the weights.")
    if chosen.endswith(_INDEX_SUFFIX):
        index = path / chosen  # a name inside the folder (a link out of it refused above)
        raw = fetched.get(chosen) or index.read_bytes(MAX_CONFIG_BYTES, listed[chosen].size if chosen in listed else None)
        shards = _shards(raw, index)
    else:
        shards = [chosen]
    for shard in shards:
        why = _not_a_name(shard)
        if why:
            raise CorruptCheckpointError(f"{path / chosen}: shard {shard!r:.100} is not a file name ({why}); "
                                         "re-copy the index from the original.")
        if not _named_inside(shard):
            raise CorruptCheckpointError(f"{path / chosen}: shard {shard!r:.500} lies outside the directory")
    # shards in subfolders: one listing of every level finds them all (never a request per shard)
    present = listed if all("/" not in shard for shard in shards) else path.files_named(shards)
    objects = {shard: present.get(shard) for shard in shards}
    parts = _open_shards({shard: found for shard, found in objects.items() if found is not None}, fetched)
    files: list[FileInfo] = []
    problems: list[str] = []
    for shard, found in objects.items():
        if found is None:
            files.append(FileInfo(shard, None))
            continue
        part = parts[shard]
        files += [FileInfo(shard, f.size, f.expected_size) for f in part.files]
        problems += [f"{shard}: {p}" for p in part.problems]
    checkpoint = HFDirCheckpoint(given, chosen, parts, files, problems)
    checkpoint.model_config = settings
    return checkpoint


def _fetch_together(listed: dict[str, ObjectInfo]) -> dict[str, bytes]:
    """What opening a folder reads before any tensor, read in one batch (in a bucket, one
    round trip, not one per file in turn), by name: ``config.json`` and the weight indexes
    whole (those no larger than a config may be: a larger one is refused where it is read), and
    the head of every ``.safetensors`` object listed (:func:`~ckptshim.formats.safetensors.head_range`),
    ahead of the index that names the shards -- a folder's safetensors objects are its shards."""
    from ckptshim.formats import safetensors

    small = [name for name in (CONFIG, *WEIGHT_FILES) if name.endswith(".json") and name in listed
             and listed[name].size <= MAX_CONFIG_BYTES]
    shards = [name for name in listed if name.endswith(".safetensors")]
    ranges = [ByteRange(listed[name].location, 0, listed[name].size) for name in small] + \
        [safetensors.head_range(listed[name].location, listed[name].size) for name in shards]
    return {name: bytes(data) for name, data in zip(small + shards, read_ranges(ranges) or ())}


def _open_shards(shards: dict[str, ObjectInfo], fetched: dict[str, bytes]) -> dict[str, Checkpoint]:
    """Each shard opened by its name (a hub-cache blob has no suffix of its own): the
    safetensors shards from their heads (``fetched`` already, or here in one batch), the
    ``torch.save`` shards' ends in another."""
    from ckptshim.formats import safetensors  # only to open: the sniffers run before dcp.load's first read

    tensors = {shard: found for shard, found in shards.items() if shard.endswith(".safetensors")}
    pickles = {shard: found for shard, found in shards.items() if shard not in tensors}
    missing = [shard for shard in tensors if shard not in fetched]
    heads = {**fetched, **dict(zip(missing, safetensors.heads([(tensors[s].location, tensors[s].size) for s in missing])))}
    parts: dict[str, Checkpoint] = {
        shard: safetensors.open_checkpoint(found.location, found.size, heads[shard]) for shard, found in tensors.items()}
    parts.update(zip(pickles, torch_pickle.open_files([(found.location, found.size) for found in pickles.values()])))
    return {shard: parts[shard] for shard in shards}
