"""torchtune's checkpointer output folder: the ``model-NNNNN-of-NNNNN.bin`` files that
``FullModelTorchTuneCheckpointer`` and ``FullModelMetaCheckpointer`` (0.6) write with
``torch.save``, and the ``config.json`` they copy beside them from the model's input folder.

No Hugging Face folder: transformers' ``from_pretrained`` reads neither name, and there is no
index; the shards are numbered, each holds its own tensors, and together they are the model.
Each is read with :mod:`ckptshim.formats.torch_pickle`'s allow-listed unpickler; the
``config.json`` is the model description the hub reads the head counts and the model family
(whose rotary convention torchtune's names leave open) from.
"""

from __future__ import annotations

import re
from pathlib import Path

from ckptshim.errors import CorruptCheckpointError
from ckptshim.formats import hf_dir, located, torch_pickle
from ckptshim.formats.base import FileInfo, reader
from ckptshim.inventory import join_key
from ckptshim.storage import Location

NAME = "torchtune"
_SHARD = re.compile(r"model-([0-9]{5})-of-([0-9]{5})\.bin")


def sniff(path: Path | Location) -> bool:
    """``config.json`` beside at least one ``model-NNNNN-of-NNNNN.bin``, in a folder or a bucket
    prefix (listed only where ``config.json`` is there)."""
    return (Location.of(path) / hf_dir.CONFIG).is_file() and any(_SHARD.fullmatch(info.location.name)
                                                                 for info in located.listing(path))


READERS = {"torch": sniff}


@reader
def open_checkpoint(path: Path | Location) -> hf_dir.HFDirCheckpoint:
    """The folder or bucket prefix ``path``: one listing gives the shards and their sizes; every
    shard's pickle and zip directory are then read in one batch."""
    root = Location.of(path)
    root.refuse_links_leaving()
    found = {info.location.name: (match, info) for info in root.list()
             if info.kind == "file" and (match := _SHARD.fullmatch(info.location.name))}
    counts = {match[2] for match, _ in found.values()}
    if len(counts) != 1:
        raise CorruptCheckpointError(f"{path}: shards of {len(counts)} different runs ({', '.join(sorted(found))}); "
                                     "one torchtune save numbers its files alike. Keep one save per folder.")
    total = int(counts.pop())
    names = [f"model-{at:05d}-of-{total:05d}.bin" for at in range(1, total + 1)]
    present = [name for name in names if name in found]
    parts = dict(zip(present, torch_pickle.open_files([(found[name][1].location, found[name][1].size)
                                                         for name in present])))
    files: list[FileInfo] = []
    problems: list[str] = []
    holder: dict = {}
    for name in names:
        if name not in parts:
            files.append(FileInfo(name, None, None))
            continue
        part = parts[name]
        files += [FileInfo(name, f.size, f.expected_size) for f in part.files]
        problems += [f"{name}: {problem}" for problem in part.problems]
        for key in part.inventory:
            if holder.setdefault(key, name) != name:
                raise CorruptCheckpointError(f"{path}: {join_key(key)} is in both {holder[key]} and {name}; each "
                                             "tensor of a torchtune save is in one file. Re-copy the folder.")
    checkpoint = hf_dir.HFDirCheckpoint(path, f"{total} file(s)", parts, files, problems, NAME)
    checkpoint.model_config = hf_dir.model_config(path)
    return checkpoint
