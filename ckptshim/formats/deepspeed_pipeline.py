"""DeepSpeed pipeline checkpoints as GPT-NeoX writes them, read as one tensor-parallel-free model.

Layout (``PipelineModule.save_state_dict`` / ``ckpt_layer_path``)::

    CKPT/latest                                   text: the tag, e.g. ``global_step1000``
    CKPT/<tag>/layer_<ii>-model_<rr>-model_states.pt   pipeline layer ii, tensor-parallel rank rr
    CKPT/<tag>/mp_rank_<rr>_model_states.pt       engine state: args, RNG, optimizer, iteration

(``layer_<ii>-model_states.pt`` without ``model_<rr>`` when the topology has no model axis.)
A NeoX run without pipeline parallelism instead keeps the whole ``sequential.<i>.*`` state dict
under ``module`` in each ``mp_rank`` file; both read the same way.

The inventory is the model as NeoX names it at tensor-parallel degree 1 --
``sequential.<layer>.<name>`` -- whatever degree it was saved with: each entry's read merges the
ranks' shards by the op NeoX's layout gives that tensor (a ``Concat``, ``Sum`` or ``Replicated``:
:func:`ckptshim.layouts.neox.spread`, run by :mod:`ckptshim.formats.tensor_parallel`), so plans,
conversions and loads into another degree see one tensor per name. Each layer file's own shards
are listed under its :class:`FileInfo` and read with :meth:`DeepSpeedPipelineCheckpoint.read_shard`.

The ``.pt`` files are read with :mod:`ckptshim.formats.torch_pickle`'s allow-listed unpickler.
``mp_rank`` files also hold numpy RNG state and (Megatron-style) an ``argparse.Namespace``; for
those files only, exactly these globals are allowed, each built as inert data here. Anything
else is refused, naming the global.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ckptshim.errors import CorruptCheckpointError, UnsafeCheckpointError
from ckptshim.formats import safe_pickle, tensor_parallel, torch_globals, torch_pickle
from ckptshim.formats.base import Checkpoint, FileInfo, file_info, open_regular, reader
from ckptshim.inventory import Entry, Inventory, KeyPath, dtype_name, join_key
from ckptshim.layouts import neox
from ckptshim.storage import Location

NAME = "deepspeed-pipeline"
_LAYER_FILE = re.compile(r"layer_([0-9]{2,})-(?:model_([0-9]+)-)?model_states\.pt")
#: Every name DeepSpeed's ``load_state_dir`` globs for a layer (``layer_{i:02d}-*model_states.pt``)
#: and hands to ``torch.load(weights_only=False)``: each must be one ckptshim reads as a layer.
_LOADED_AS_LAYER = re.compile(r"layer_([0-9]{2,})-.*model_states\.pt", re.DOTALL)
_MP_RANK_FILE = re.compile(r"mp_rank_([0-9]+)_model_states\.pt")
#: What in a folder name is a pattern to ``glob.glob`` (DeepSpeed's ``ckpt_layer_path_list``).
_GLOB_CHARACTERS = "*?["


# -- inert stand-ins for the globals an mp_rank file may name -------------------------------

class _NumpyDtype:
    """``numpy.dtype(name, align, copy)`` as data: the type code and byte order."""

    def __init__(self, name: str, *_flags: Any) -> None:
        if type(name) is not str:  # numpy pickles a dtype by its type code
            raise safe_pickle.Refused(f"numpy.dtype of a {type(name).__name__}, not a type code")
        self.name, self.byteorder = name, "|"

    def __setstate__(self, state: tuple) -> None:
        self.byteorder = state[1] if len(state) > 1 and isinstance(state[1], str) else "|"

    def numpy(self) -> np.dtype:
        return np.dtype(self.name).newbyteorder("<" if self.byteorder in "<|=" else ">")


class NumpyArray:
    """A pickled ``numpy.ndarray`` as data: shape, dtype and raw bytes (never a live array)."""

    def __init__(self, *_args: Any) -> None:
        self.shape: tuple[int, ...] = ()
        self.dtype: _NumpyDtype | None = None
        self.raw = b""

    def __setstate__(self, state: tuple) -> None:
        _version, shape, dtype, _fortran, raw = state if len(state) == 5 else (1, *state)
        self.shape, self.dtype = tuple(shape), dtype
        self.raw = raw if isinstance(raw, bytes) else b""

    def value(self) -> np.ndarray:
        """A copy as a real array (only ``bytes`` and a dtype name go into numpy)."""
        return np.frombuffer(self.raw, dtype=self.dtype.numpy()).reshape(self.shape).copy()


def _reconstruct(_cls: Any, _shape: Any, _typecode: Any) -> NumpyArray:
    return NumpyArray()


def _scalar(dtype: _NumpyDtype, raw: bytes = b"") -> Any:
    return np.frombuffer(raw, dtype=dtype.numpy())[0].item() if isinstance(raw, bytes) else None


class Namespace(safe_pickle.SafeDict):
    """``argparse.Namespace`` (Megatron/DeepSpeed ``args``) as a plain dict of its attributes."""

    def __setstate__(self, state: dict) -> None:
        self.update(state if isinstance(state, dict) else {})


MP_RANK_GLOBALS: torch_globals.ExtraGlobals = {
    ("numpy", "ndarray"): NumpyArray,
    ("numpy", "dtype"): _NumpyDtype,
    ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy.core.multiarray", "scalar"): _scalar,
    ("numpy._core.multiarray", "scalar"): _scalar,
    ("argparse", "Namespace"): Namespace,
}


def _layer_of(key: KeyPath) -> int | None:
    """The pipeline index of a ``sequential.<i>.<name>`` key, else ``None``."""
    return int(key[1]) if len(key) > 2 and key[0] == neox.SEQUENTIAL and key[1].isdigit() else None


# -- finding the step directory -------------------------------------------------------------

def _is_step_dir(path: Path) -> bool:
    return any(_globbed_layer(p.name) is not None or _MP_RANK_FILE.fullmatch(p.name) for p in path.iterdir())


def _globbed_layer(name: str) -> int | None:
    """The layer ``i`` whose glob ``layer_{i:02d}-*model_states.pt`` matches the file name
    ``name`` (as ``fnmatch`` matches: ``*`` is any run of characters), or ``None``. ``layer_5-``
    and ``layer_005-`` name no layer: DeepSpeed spells layer 5 ``layer_05-``."""
    match = _LOADED_AS_LAYER.fullmatch(name)
    if match is None or match[1] != f"{int(match[1]):02d}":
        return None
    return int(match[1])


def _layer_files(step: Path) -> list[tuple[int, int, Path]]:
    """(layer, tensor-parallel rank, file) for every file DeepSpeed would load as a layer; a
    name it would load that ckptshim cannot place is refused, not left to DeepSpeed's unpickler."""
    found = []
    for file in sorted(step.iterdir()):
        layer = _globbed_layer(file.name)
        if layer is None:
            continue
        match = _LAYER_FILE.fullmatch(file.name)
        if match is None or int(match[1]) != layer:
            raise CorruptCheckpointError(
                f"{file}: DeepSpeed's load_state_dir would load this file as layer {layer:02d}, but its "
                "name is not one DeepSpeed writes (layer_<ii>[-model_<rr>]-model_states.pt), so which "
                "tensor-parallel rank it holds is unknown. Move it out of the checkpoint folder.")
        found.append((layer, int(match[2] or 0), file))
    return found


def files_deepspeed_reads(load_dir: Path, layers: Iterable[int]) -> list[Path]:
    """The files ``PipelineModule.load_state_dir(load_dir)`` reads -- and unpickles with
    ``torch.load(weights_only=False)`` -- for the pipeline layers ``layers``: for each,
    ``glob.glob(os.path.join(load_dir, f"layer_{i:02d}-") + "*model_states.pt")``
    (``ckpt_layer_path_list``), which (see :func:`require_pattern_is_itself`) finds exactly
    ``load_dir``'s own files of those names."""
    require_pattern_is_itself(load_dir)
    layers = set(layers)
    names = sorted(os.listdir(load_dir)) if load_dir.is_dir() else []
    return [load_dir / name for name in names if _globbed_layer(name) in layers]


def require_pattern_is_itself(folder: Path) -> None:
    """Refuse a step folder whose path, as the pattern DeepSpeed globs it with, matches other
    folders than itself (or not itself).

    DeepSpeed finds a layer's files with ``glob.glob(<folder>/layer_<ii>-*model_states.pt)``:
    where the folder's path holds glob characters -- ``global_step[1]``, which a ``latest`` file
    can name -- that reads the files of every folder the path matches as a pattern
    (``global_step1``), not this one's. ckptshim reads exactly the files the framework would,
    so it reads this folder only when the pattern matches exactly it; otherwise it cannot vouch
    for what DeepSpeed would unpickle, and refuses.
    """
    text = os.fspath(folder)
    if not any(character in text for character in _GLOB_CHARACTERS):
        return
    matched = sorted(os.path.realpath(found) for found in glob.glob(text))
    if matched != [os.path.realpath(folder)]:
        pattern = os.path.join(text, "layer_<ii>-*model_states.pt")
        raise UnsafeCheckpointError(
            f"{folder}: the path holds glob characters ({_GLOB_CHARACTERS}), and DeepSpeed's "
            f"load_state_dir reads its layer files with glob.glob({pattern!r}), "
            + (f"which reads the files of {', '.join(matched[:3])}" if matched else "which matches no folder")
            + (f" and {len(matched) - 3} more" if len(matched) > 3 else "")
            + " instead of this folder's. ckptshim reads exactly the files DeepSpeed would read, and "
            "cannot vouch for those: DeepSpeed unpickles them without limits. Rename the folder (and "
            "the tag in `latest`) to a name without glob characters.")


def step_directory(path: Path) -> Path:
    """The ``global_stepN`` directory ``path`` means: itself, or the one ``path/latest`` names."""
    latest = path / "latest"
    if latest.is_file() and not _is_step_dir(path):
        tag = _tag(latest)
        step = (path / tag).resolve()
        if not tag or path.resolve() not in step.parents:
            raise CorruptCheckpointError(f"{latest} names {tag!r}, which is not a folder inside {path}")
        if not _is_dir(step):
            raise CorruptCheckpointError(f"{latest} names {tag!r:.200}, but {path / tag} does not exist; "
                                         "point at an existing global_step folder instead.")
        return path / tag
    return path


def sniff(path: Path) -> bool:
    if not path.is_dir():
        return False
    if _is_step_dir(path):
        return True
    latest = path / "latest"
    if not latest.is_file() or latest.stat().st_size > MAX_TAG_BYTES:
        return False
    try:
        step = path / _tag(latest)
        return step.is_dir() and _is_step_dir(step)
    except (CorruptCheckpointError, OSError):  # a damaged ``latest`` beside step folders: open says why
        return any(child.is_dir() and child.name.startswith("global_step") for child in path.iterdir())


READERS = {"torch": sniff}


def _is_dir(path: Path) -> bool:
    """``path.is_dir()``, and False for a name no file system holds (too long for one)."""
    try:
        return path.is_dir()
    except OSError:
        return False


#: The most a ``latest`` file may hold: it names a folder beside it, and no path is longer than
#: PATH_MAX (4096 bytes on Linux); DeepSpeed writes one line, the tag.
MAX_TAG_BYTES = 4096


def read_latest(latest: Path) -> bytes:
    """The bytes of DeepSpeed's ``latest`` (or ``latest_universal``) file, refused, naming it,
    when it is larger than :data:`MAX_TAG_BYTES`, before it is read."""
    return Location.of(latest).read_bytes(MAX_TAG_BYTES)


def _tag(latest: Path) -> str:
    """The step folder name DeepSpeed wrote into ``latest`` (one line of text)."""
    try:
        return read_latest(latest).decode("utf-8").strip()
    except UnicodeDecodeError as error:
        raise CorruptCheckpointError(
            f"{latest}: not text ({error}); DeepSpeed writes the latest step folder's name there. "
            "Fix the file, or point at a global_stepN folder directly.") from None


# -- the checkpoint -------------------------------------------------------------------------

@dataclass(frozen=True)
class Shard:
    """One tensor-parallel rank's piece of one tensor: the file part that holds it."""

    part: Checkpoint
    entry: Entry


@dataclass
class _Scan:
    """What the files hold, before the checks that turn shards into model entries."""

    shards: dict[KeyPath, dict[int, Shard]] = field(default_factory=dict)
    ranks_by_layer: dict[int, set[int]] = field(default_factory=dict)
    files: list[FileInfo] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    engine: dict[str, Any] = field(default_factory=dict)
    parts: list[Checkpoint] = field(default_factory=list)


class DeepSpeedPipelineCheckpoint(Checkpoint):
    """A NeoX pipeline (or sequential) checkpoint; entries are merged over tensor parallelism."""

    def __init__(self, path: Path, version: str, entries: list[Entry], scan: _Scan, degree: int) -> None:
        super().__init__(path, NAME, version, Inventory(entries, str(path)), tuple(scan.files),
                         tuple(scan.problems))
        self.shards = scan.shards
        self.tp_degree = degree
        self.engine = scan.engine
        self._parts = scan.parts
        args = scan.engine.get("args")
        self.model_config = args if isinstance(args, dict) else None  # the run's model sizes (head counts)

    def read_shard(self, key: KeyPath, rank: int) -> np.ndarray:
        shard = self.shards[key][rank]
        return shard.part.read(shard.entry)

    def read(self, entry: Entry) -> np.ndarray:
        shards = self.shards.get(entry.key)
        if shards is None:
            raise CorruptCheckpointError(f"{self.path}: no tensor {join_key(entry.key)!r}")
        return tensor_parallel.merge(entry.key, [self.read_shard(entry.key, rank) for rank in sorted(shards)],
                                     entry.dtype, f"{self.path}: {join_key(entry.key)}")

    def close(self) -> None:
        for part in self._parts:
            part.close()


@reader
def open_checkpoint(path: Path) -> DeepSpeedPipelineCheckpoint:
    step = step_directory(path)
    require_pattern_is_itself(step)
    Location.of(step).refuse_links_leaving()
    scan = _Scan()
    layer_files = _layer_files(step)
    for file in sorted(step.iterdir()):
        if (match := _MP_RANK_FILE.fullmatch(file.name)) is not None:
            _scan_mp_rank(file, int(match[1]), step, scan, weights_elsewhere=bool(layer_files))
    if layer_files:
        scan.shards.clear()  # a pipeline run's mp_rank files hold no module; layer files rule
        scan.ranks_by_layer.clear()
    for layer, rank, file in layer_files:
        part = torch_pickle.open_checkpoint(file)
        scan.parts.append(part)
        scan.files.append(FileInfo(file.name, part.files[0].size, part.files[0].expected_size,
                                   tuple(f"{join_key(e.key)} {e.dtype}{list(e.shape)}" for e in part.inventory.values())))
        scan.problems += [f"{file.name}: {p}" for p in part.problems]
        scan.ranks_by_layer.setdefault(layer, set()).add(rank)
        for entry in part.inventory.values():
            key = (neox.SEQUENTIAL, str(layer)) + entry.key
            scan.shards.setdefault(key, {})[rank] = Shard(part, entry)
    if not scan.shards and not scan.problems:
        raise CorruptCheckpointError(f"{step}: no layer_*-model_states.pt files and no module in the "
                                     "mp_rank files; this DeepSpeed checkpoint holds no model weights.")
    degree = _check_layers(step, scan)
    entries = _merged_entries(scan, degree)
    return DeepSpeedPipelineCheckpoint(path, _version(step, scan, degree), entries, scan, degree)


def _scan_mp_rank(file: Path, rank: int, step: Path, scan: _Scan, weights_elsewhere: bool) -> None:
    """Engine state (args, versions) from ``mp_rank_00``; ``module`` tensors from every rank.

    When layer files hold the weights, an ``mp_rank`` file that needs a global outside the
    allow-list is not read (and said so): the weights do not depend on it, and DeepSpeed's
    ``load_state_dir`` does not read it either. Otherwise the refusal stands.
    """
    try:
        with open_regular(file) as raw:
            archive = torch_pickle.read_archive(raw, str(file), MP_RANK_GLOBALS)
    except OSError as error:
        raise CorruptCheckpointError(f"{file}: cannot be read ({error})") from None
    except UnsafeCheckpointError as error:
        if not weights_elsewhere:
            raise
        scan.files.append(FileInfo(file.name, file.stat().st_size, None,
                                   (f"engine state not read: {str(error).split(' to unpickle')[0]}",)))
        return
    tree = archive.tree if isinstance(archive.tree, dict) else {}
    if rank == 0:
        scan.engine = {k: v for k, v in tree.items() if k in (
            "ds_version", "iteration", "args", "mp_world_size", "checkpoint_parallel_dimensions")}
    part = torch_pickle.TorchPickleCheckpoint(file, Inventory([], str(file)), [file_info(file, root=step)],
                                              archive.offsets)
    scan.parts.append(part)
    module = tree.get("module")
    scan.files.append(FileInfo(file.name, file.stat().st_size, None,
                               ("engine state (args, RNG, optimizer)",) if module is None else ()))
    if isinstance(module, dict):
        for path, leaf in torch_pickle.flat_tree(module, str(file)).items():
            if isinstance(leaf, torch_globals.TensorRef):
                key = tuple(part for component in path for part in component.split("."))
                entry = Entry(key, leaf.shape, dtype_name(leaf.storage.dtype), (str(file), leaf))
                if (layer := _layer_of(key)) is not None:
                    scan.ranks_by_layer.setdefault(layer, set()).add(rank)
                scan.shards.setdefault(key, {})[rank] = Shard(part, entry)


def _check_layers(step: Path, scan: _Scan) -> int:
    """The tensor-parallel degree; missing layer files and uneven ranks become problems."""
    args = scan.engine.get("args") or {}
    degrees = {len(ranks) for ranks in scan.ranks_by_layer.values()}
    degree = max(degrees, default=1)
    stated = args.get("model_parallel_size") if isinstance(args, dict) else None
    if isinstance(stated, int) and stated != degree and scan.ranks_by_layer:
        scan.problems.append(f"the layer files hold {degree} tensor-parallel rank(s) but the run's "
                             f"args say model_parallel_size={stated}")
    for layer, ranks in sorted(scan.ranks_by_layer.items()):
        if ranks != set(range(degree)):
            missing = sorted(set(range(degree)) - ranks)
            scan.problems.append(f"layer {layer:02d} has tensor-parallel ranks {sorted(ranks)}; ranks "
                                 f"{missing} are missing (other layers have {degree})")
            scan.files += [file_info(step / f"layer_{layer:02d}-model_{r:02d}-model_states.pt", root=step)
                           for r in missing]
    num_layers = args.get("num_layers") if isinstance(args, dict) else None
    if isinstance(num_layers, int) and scan.ranks_by_layer:
        for layer in neox.state_layer_indices(num_layers):
            # With weight tying (NeoX's default) the output layer is a function of the embedding
            # (TiedLayerSpec with forward_fn) and has no file; the args do not say which it is,
            # so its absence is not a problem here -- a model that wants final_linear says so.
            if layer not in scan.ranks_by_layer and layer != neox.output_index(num_layers):
                scan.files += [file_info(step / f"layer_{layer:02d}-model_{r:02d}-model_states.pt", root=step)
                               for r in range(degree)]
    elif scan.ranks_by_layer:  # no args: the transformer layers must at least be contiguous
        blocks = sorted(i for i in scan.ranks_by_layer if neox.FIRST_BLOCK <= i < max(scan.ranks_by_layer) - 2)
        for gap in sorted(set(range(neox.FIRST_BLOCK, blocks[-1] + 1)) - set(blocks)) if blocks else ():
            scan.problems.append(f"layer {gap:02d}: no layer file (layers {blocks[0]}..{blocks[-1]} expected)")
    return degree


def _merged_entries(scan: _Scan, degree: int) -> list[Entry]:
    """One entry per tensor at degree 1; shards that disagree in shape or presence are problems."""
    entries = []
    for key, shards in scan.shards.items():
        name = join_key(key)
        first = shards[min(shards)].entry
        layer = _layer_of(key)
        if layer is None:  # a plain DeepSpeed engine's module
            if len(shards) == 1:
                entries.append(Entry(key, first.shape, first.dtype, key))
            else:
                scan.problems.append(f"{name}: held by {len(shards)} mp_rank files, and ckptshim knows "
                                     "how to merge GPT-NeoX's sequential.<i> tensors only")
            continue
        if len(shards) != len(scan.ranks_by_layer.get(layer, shards)):
            scan.problems.append(f"{name}: only in tensor-parallel rank(s) {sorted(shards)} of layer {key[1]}")
            continue
        shapes = {s.entry.shape for s in shards.values()}
        dtypes = {s.entry.dtype for s in shards.values()}
        if len(shapes) > 1 or len(dtypes) > 1:
            scan.problems.append(f"{name}: tensor-parallel shards disagree "
                                 f"({', '.join(f'rank {r}: {s.entry.dtype}{list(s.entry.shape)}' for r, s in sorted(shards.items()))})")
            continue
        shape = first.shape
        if degree > 1:
            spread = neox.spread(key)
            if spread is None:
                scan.problems.append(f"{name}: no tensor-parallel rule for this GPT-NeoX tensor, so its "
                                     f"{degree} shards cannot be merged; ckptshim knows NeoX's own tensors")
                continue
            _, shape = spread.merge(neox.shard_keys(key, degree), key, shape)
        entries.append(Entry(key, shape, first.dtype, key))
    entries.sort(key=lambda e: -1 if (layer := _layer_of(e.key)) is None else layer)
    return entries


def _version(step: Path, scan: _Scan, degree: int) -> str:
    """``deepspeed 0.19.8, global_step3, tp=2 pp=2``: from the engine state, only where its
    values are what DeepSpeed writes (a version string, a degree), never ``str()`` of another."""
    dims = scan.engine.get("checkpoint_parallel_dimensions")
    pp = dims.get("pp_degree") if isinstance(dims, dict) else None
    ds = scan.engine.get("ds_version")
    parts = [f"deepspeed {ds[:40]}" if isinstance(ds, str) and ds else "deepspeed", step.name]
    parts.append(f"tp={degree}" + (f" pp={pp}" if type(pp) is int and pp.bit_length() <= 32 else ""))
    return ", ".join(parts)
