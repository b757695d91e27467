"""Meta's original Llama layout: ``consolidated.NN.pth`` (one per model-parallel rank) beside
``params.json``, read as one model at model parallel 1.

Each rank's file is a ``torch.save`` of its part of llama-models' ``Transformer``, read with
:mod:`ckptshim.formats.torch_pickle`'s allow-listed unpickler. The inventory holds each tensor
whole, as llama-models' ``reshard_mp`` merges the ranks: row-parallel weights (``attention.wo``,
``feed_forward.w2``) side by side on their last axis, column-parallel ones (``wq``, ``wk``,
``wv``, ``w1``, ``w3``, ``output``) on their first, the embeddings on the axis their shards
split (the vocabulary in Llama 3's ``VocabParallelEmbedding``, the width in Llama 2's
``ParallelEmbedding``), and every other tensor (the norms) once, each rank's copy checked equal.
``params.json`` is the model description the hub reads the head counts from
(:func:`ckptshim.rules.decoder.read_dims`), kept as the checkpoint's model config.

How many ranks wrote the folder, ``params.json``'s ``dim`` says through the query projection's
rows per file; a file missing from that run is a problem ``inspect`` names, and loads refuse.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from ckptshim.errors import CorruptCheckpointError
from ckptshim.formats import located, tensor_parallel, torch_pickle
from ckptshim.formats.base import Checkpoint, FileInfo, reader
from ckptshim.inventory import Entry, Inventory, KeyPath, join_key
from ckptshim.ops import Concat, Op, Replicated
from ckptshim.storage import Location

NAME = "meta-llama"
PARAMS = "params.json"
_SHARD = re.compile(r"consolidated\.([0-9]{2})\.pth")
#: The tensors each rank holds a slice of, by the axis the slices join on (``reshard_mp``'s
#: ``_WEIGHT_ROW_KEY`` and ``_WEIGHT_COLUMN_KEY``, Llama's rows); the embeddings are decided by shape.
ROW_PARALLEL = (("attention", "wo", "weight"), ("feed_forward", "w2", "weight"))
COLUMN_PARALLEL = (("attention", "wq", "weight"), ("attention", "wk", "weight"), ("attention", "wv", "weight"),
                   ("feed_forward", "w1", "weight"), ("feed_forward", "w3", "weight"), ("output", "weight"))
EMBEDDINGS: KeyPath = ("tok_embeddings", "weight")
_QUERY: KeyPath = ("layers", "0", "attention", "wq", "weight")
_PARAMS_LIMIT = 1 << 20


def sniff(path: Path | Location) -> bool:
    """``params.json`` beside at least one ``consolidated.NN.pth``, in a folder or a bucket prefix
    (listed only where ``params.json`` is there)."""
    return (Location.of(path) / PARAMS).is_file() and any(_SHARD.fullmatch(info.location.name)
                                                          for info in located.listing(path))


READERS = {"torch": sniff}


class MetaLlamaCheckpoint(Checkpoint):
    """A Meta Llama folder; each entry is read from every rank's file and merged."""

    def __init__(self, path: Path | Location, version: str, entries: list[Entry], merges: dict[KeyPath, Op],
                 parts: list[Checkpoint], files: list[FileInfo], problems: list[str], params: dict) -> None:
        super().__init__(path, NAME, version, Inventory(entries, str(path)), tuple(files), tuple(problems))
        self.model_config = params
        self._merges = merges
        self._parts = parts

    def read(self, entry: Entry) -> np.ndarray:
        if self.problems:
            raise CorruptCheckpointError(f"{self.path} is incomplete: {'; '.join(self.problems)}")
        shards = [part.read(part.inventory[entry.key]) for part in self._parts]
        op = self._merges.get(entry.key)
        if op is None:
            return shards[0]
        return tensor_parallel.run(op, dict(zip(op.sources, shards)), {entry.key: entry.shape}, entry.dtype,
                                   f"{self.path}: {join_key(entry.key)}")[entry.key]

    def close(self) -> None:
        for part in self._parts:
            part.close()


@reader
def open_checkpoint(path: Path | Location) -> MetaLlamaCheckpoint:
    """The folder or bucket prefix ``path``: one listing gives ``params.json`` and the ranks'
    files with their sizes; every rank's pickle and zip directory are then read in one batch."""
    root = Location.of(path)
    root.refuse_links_leaving()
    listed = root.list()
    params = _params(root, next((info.size for info in listed if info.location.name == PARAMS), None))
    ranks = sorted((int(match[1]), info) for info in listed
                   if info.kind == "file" and (match := _SHARD.fullmatch(info.location.name)))
    parts = torch_pickle.open_files([(info.location, info.size) for _, info in ranks])
    files = [FileInfo(info.location.name, part.files[0].size, part.files[0].expected_size,
                      tuple(f"{join_key(e.key)} {e.dtype}{list(e.shape)}" for e in part.inventory.values()))
             for (_, info), part in zip(ranks, parts)]
    problems = [f"{info.location.name}: {problem}" for (_, info), part in zip(ranks, parts)
                for problem in part.problems]
    degree = _degree(root, params, parts[0])
    missing = sorted(set(range(degree)) - {rank for rank, _ in ranks})
    problems += [f"consolidated.{rank:02d}.pth is missing: params.json's dim {params.get('dim')} and "
                 f"{join_key(_QUERY)} say {degree} model-parallel ranks wrote this folder, and every rank's "
                 "file holds part of every weight" for rank in missing]
    first = parts[0].inventory
    for (_, info), part in zip(ranks[1:], parts[1:]):
        if set(part.inventory) != set(first):
            raise CorruptCheckpointError(f"{info.location}: holds other tensors than {ranks[0][1].location.name}; "
                                         "every rank of one model-parallel run holds the same names. Re-copy the "
                                         "folder.")
    entries, merges = [], {}
    for entry in first.values():
        op, shape = _merge(entry, [part.inventory[entry.key] for part in parts], params, missing)
        entries.append(Entry(entry.key, shape, entry.dtype))
        if op is not None:
            merges[entry.key] = op
    dims = (f"{params.get('n_heads')} heads in {params.get('n_kv_heads', params.get('n_heads'))} key/value groups "
            "(params.json)")
    return MetaLlamaCheckpoint(path, f"model parallel {degree}, {dims}", entries, merges, parts, files, problems,
                               params)


def _params(root: Location, size: int | None) -> dict:
    """``params.json`` (``size``: its size as listed), refused unread beyond a MiB."""
    where = root / PARAMS
    data = where.read_bytes(_PARAMS_LIMIT, size)
    try:
        params = json.loads(data)
    except (ValueError, UnicodeDecodeError) as error:
        raise CorruptCheckpointError(f"{where}: not JSON ({error}); Meta writes the model's dimensions "
                                     "there. Restore the file.") from None
    if not isinstance(params, dict):
        raise CorruptCheckpointError(f"{where}: not a JSON object; restore the file.")
    return params.get("model", params) if isinstance(params.get("model"), dict) else params


def _degree(path: Location, params: dict, part: Checkpoint) -> int:
    """How many ranks wrote the folder: ``dim`` over the query rows one rank holds."""
    query, dim = part.inventory.get(_QUERY), params.get("dim")
    rows = query.shape[0] if query is not None and query.shape else 0
    if type(dim) is not int or rows < 1 or dim % rows:
        raise CorruptCheckpointError(f"{path}: params.json's dim {dim!r:.20} and {join_key(_QUERY)} "
                                     f"{list(query.shape) if query else 'absent'} do not say how many model-parallel "
                                     "ranks wrote it; this is no Meta Llama checkpoint of these params.")
    return dim // rows


def _merge(entry: Entry, shards: list[Entry], params: dict, missing: list[int]) -> tuple[Op | None, tuple]:
    """The op that merges ``shards`` of ``entry`` (``None`` for one rank) and the whole shape;
    with ranks ``missing``, the whole shape all the same (the folder is incomplete)."""
    axis = _axis(entry.key, entry.shape, params)
    names = tuple(entry.key + (f"consolidated.{rank:02d}",) for rank in range(len(shards)))
    if axis is None:
        return (Replicated(names, entry.key) if len(shards) > 1 else None), entry.shape
    for shard in shards:
        if (shard.shape[:axis] + shard.shape[axis + 1:] != entry.shape[:axis] + entry.shape[axis + 1:]
                or shard.dtype != entry.dtype):
            raise CorruptCheckpointError(f"{join_key(entry.key)}: {list(shard.shape)} {shard.dtype} in one rank's "
                                         f"file, {list(entry.shape)} {entry.dtype} in another's; re-copy the folder.")
    sizes = tuple(shard.shape[axis] for shard in shards)
    whole = list(entry.shape)
    whole[axis] = sum(sizes) + entry.shape[axis] * len(missing)  # a missing rank's part: the folder is incomplete
    if len(shards) == 1 or missing:
        return None, tuple(whole)
    return Concat(names, entry.key, axis, sizes), tuple(whole)


def _axis(key: KeyPath, shape: tuple[int, ...], params: dict) -> int | None:
    rest = key[2:] if key[:1] == ("layers",) else key
    if rest in ROW_PARALLEL:
        return len(shape) - 1
    if rest in COLUMN_PARALLEL:
        return 0
    if key == EMBEDDINGS and len(shape) == 2:
        return 1 if shape[1] != params.get("dim") else 0
    return None
