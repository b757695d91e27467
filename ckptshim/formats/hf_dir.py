"""Hugging Face model directories: ``config.json`` beside one weights file or a sharded index.

Weights come as ``model.safetensors`` or ``pytorch_model.bin``, or as shards listed in
``*.index.json`` (``{"weight_map": {key: shard file}}``). The directory reads as one
checkpoint whose entries delegate to the file that holds them; a shard the index names but
the directory lacks is reported, not skipped.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

import numpy as np

from ckptshim.errors import CorruptCheckpointError
from ckptshim.formats import safetensors, torch_pickle
from ckptshim.formats.base import Checkpoint, FileInfo, file_info, reader, refuse_links_leaving, strict_json
from ckptshim.inventory import Entry, Inventory

NAME = "hf-dir"
_SINGLE = ("model.safetensors", "pytorch_model.bin")
_INDEX = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
#: What a Hugging Face model folder holds its weights in.
WEIGHT_FILES = _SINGLE + _INDEX


def sniff(path: Path) -> bool:
    return path.is_dir() and any((path / name).is_file() for name in WEIGHT_FILES)


READERS = {"torch": sniff}


def _open_file(path: Path) -> Checkpoint:
    return safetensors.open_checkpoint(path) if path.suffix == ".safetensors" else torch_pickle.open_checkpoint(path)


class HFDirCheckpoint(Checkpoint):
    def __init__(self, path: Path, version: str, parts: dict[str, Checkpoint], files, problems) -> None:
        entries = [Entry(e.key, e.shape, e.dtype, (name, e.location))
                   for name, part in parts.items() for e in part.inventory.values()]
        super().__init__(path, NAME, version, Inventory(entries, str(path)), tuple(files), tuple(problems))
        self._parts = parts

    def read(self, entry: Entry) -> np.ndarray:
        name, inner = entry.location
        part = self._parts[name]
        return part.read(Entry(entry.key, entry.shape, entry.dtype, inner))

    def close(self) -> None:
        for part in self._parts.values():
            part.close()


def _roots(path: Path) -> tuple[Path, ...]:
    """Where a shard of the folder ``path`` may really live.

    Its own folder, and — for a snapshot in the Hugging Face hub cache
    (``models--org--name/snapshots/<revision>/``, whose files are symlinks to
    ``../../blobs/<hash>``) — that repository's ``blobs/`` folder, which the cache shares
    between revisions.
    """
    blobs = path.parent.parent / "blobs"
    if path.parent.name == "snapshots" and blobs.is_dir():
        return path.resolve(), blobs.resolve()
    return (path.resolve(),)


@reader
def open_checkpoint(path: Path) -> HFDirCheckpoint:
    roots = _roots(path)
    refuse_links_leaving(path, also=roots[1:])
    index_name = next((n for n in _INDEX if (path / n).is_file()), None)
    problems: list[str] = []
    files: list[FileInfo] = []
    if index_name is None:
        shards = [next(n for n in _SINGLE if (path / n).is_file())]
        version = shards[0]
    else:
        try:
            weight_map = strict_json((path / index_name).read_bytes())["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as error:  # UnicodeDecodeError too
            raise CorruptCheckpointError(
                f"{path / index_name}: not a valid weight index ({type(error).__name__}: {error}); "
                "re-copy it from the original.") from None
        version = index_name
    parts: dict[str, Checkpoint] = {}
    for shard in shards:
        try:
            shard_path = (path / shard).resolve()
            named_inside = not PurePosixPath(shard).is_absolute() and ".." not in PurePosixPath(shard).parts
            outside = not named_inside or not any(root in shard_path.parents for root in roots)
            present = not outside and shard_path.is_file()
        except (OSError, ValueError, TypeError) as error:  # not a string, too long, a NUL byte
            raise CorruptCheckpointError(f"{path / index_name}: shard {shard!r:.100} is not a file "
                                         f"name ({error}); re-copy the index from the original.") from None
        if outside:
            raise CorruptCheckpointError(f"{path / index_name}: shard {shard!r} lies outside the directory")
        if not present:
            files.append(file_info(path / shard, root=path))
            continue
        part = _open_file(path / shard)  # by its name: a hub-cache blob has no suffix
        parts[shard] = part
        files += [FileInfo(shard, f.size, f.expected_size) for f in part.files]
        problems += [f"{shard}: {p}" for p in part.problems]
    return HFDirCheckpoint(path, version, parts, files, problems)
