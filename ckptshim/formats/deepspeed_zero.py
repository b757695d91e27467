"""DeepSpeed ZeRO checkpoints (stages 1, 2 and 3), read as the model's fp32 master weights.

Layout (``DeepSpeedEngine.save_checkpoint(save_dir, tag)``)::

    save_dir/latest                                       text: the tag, e.g. ``global_step1000``
    save_dir/<tag>/mp_rank_00_model_states.pt             ZeRO-1/2: module, param_shapes, ... (dp rank 0)
    save_dir/<tag>/zero_pp_rank_<d>_mp_rank_00_model_states.pt   ZeRO-3: the same, one per dp rank
    save_dir/<tag>/[bf16_]zero_pp_rank_<d>_mp_rank_00_optim_states.pt   every dp rank's optimizer partition

The model states hold ``module`` (ZeRO-1/2: the 16-bit training weights; ZeRO-3: an empty
``tensor[0]`` placeholder per parameter, buffers in full), ``buffer_names``, ``param_shapes``
(one ordered ``{name: torch.Size}`` per optimizer group: the order of the flat partitions),
``frozen_param_shapes``/``frozen_param_fragments`` (parameters the optimizer does not own, saved
from stage 2 on: whole under ZeRO-2, each rank's partition under ZeRO-3), ``shared_params``
(``{tied name: name holding the data}``) and ``dp_world_size``. The optimizer states hold, under
``optimizer_state_dict``:

- ZeRO-1/2: ``single_partition_of_fp32_groups`` (per group, this rank's slice of the group's
  flat fp32 vector, with the last rank's alignment padding removed), ``param_alignment_paddings``
  (per group, elements after each parameter), ``group_paddings``, ``partition_count``,
  ``param_slice_mappings`` (``{name: fragment_address(numel, start)}``: each parameter's piece in
  this rank's partition) and ``base_optimizer_state`` (the torch optimizer's state dict, one flat
  state per group, padded partition length);
- ZeRO-3: ``fp32_flat_groups`` (per sub-group, this rank's flat fp32 partition: every parameter
  padded to a multiple of the world size and cut into equal pieces, ``ceil(numel / world)`` each,
  in ``param_shapes`` order), ``partition_count`` and ``optimizer_state_dict`` (the torch
  optimizer's, one flat state per sub-group, as long as its fp32 partition).

The inventory is exactly what DeepSpeed's own ``get_fp32_state_dict_from_zero_checkpoint``
returns, in its order: the buffers (floating ones as float32), the frozen parameters (stage 2
and 3; in the dtype they were saved in), the trainable parameters' fp32 masters, then each tied
name with its partner's value. Reads assemble a parameter from the ranks' partitions, bit for
bit; :meth:`ZeroCheckpoint.read_optimizer_state` does the same for the Adam moments.

DeepSpeed pickles its own objects into these files (``ZeroStageEnum``, ``LossScaler``,
``fragment_address``; and ``torch.Size``, which torch's own allow-list admits). For these files
only they are allowed, each built as
inert data by :data:`ZERO_GLOBALS` (model-state files also allow :mod:`deepspeed_pipeline`'s
``mp_rank`` globals: numpy RNG state and ``argparse.Namespace`` that Megatron-DeepSpeed and
GPT-NeoX add); any other global is refused, naming it. DeepSpeed is never imported.

Precedence: a tag folder with ZeRO optimizer partitions and no pipeline layer files is this
format, although it holds ``mp_rank_00_model_states.pt`` as GPT-NeoX's pipeline checkpoints do
(:data:`ckptshim.formats.detect.FORMATS` lists this module first): under ZeRO-1/2 that file's
``module`` holds only the 16-bit weights, and the fp32 masters are in the partitions. A folder
with ``layer_*-model_states.pt`` files (a pipeline engine's) is the pipeline reader's, and so is
a ZeRO checkpoint of several model-parallel ranks, whose partitions are tensor-parallel shards.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ckptshim.errors import CorruptCheckpointError
from ckptshim.formats import deepspeed_pipeline, safe_pickle, torch_globals, torch_pickle
from ckptshim.formats.base import Checkpoint, FileInfo, Piece, file_info, reader, storage_dtype
from ckptshim.formats.dcp import read_exact
from ckptshim.formats.kvstore import regular_size
from ckptshim.formats.torch_globals import TensorRef
from ckptshim.inventory import Entry, Inventory, split_key
from ckptshim.storage import Location

NAME = "deepspeed-zero"
_OPTIM_FILE = re.compile(r"(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_?optim_states\.pt")
_ZERO3_MODEL_FILE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt")
_MODEL_FILE = "mp_rank_00_model_states.pt"
_LAYER_FILE = re.compile(r"layer_\d+-.*model_states\.pt", re.DOTALL)
#: What the optimizer states name their fp32 partitions, by stage.
_FP32_GROUPS = {1: "single_partition_of_fp32_groups", 2: "single_partition_of_fp32_groups", 3: "fp32_flat_groups"}
#: The Adam moments (and other per-element optimizer states) :meth:`read_optimizer_state` gathers.
MOMENTS = ("exp_avg", "exp_avg_sq")


# -- DeepSpeed's objects, as inert data ------------------------------------------------------------

def _zero_stage(value: Any) -> int:
    """``ZeroStageEnum(value)`` (an ``IntEnum``): the stage as a plain int."""
    if type(value) is not int or not 0 <= value <= 3:
        raise safe_pickle.Refused(f"ZeroStageEnum({value!r:.40}), which is not a ZeRO stage")
    return value


class _Record(dict):
    """A DeepSpeed object pickled as its attributes (``LossScaler``, ``fragment_address``): a plain
    dict of them, built by ``NEWOBJ`` without arguments and given its state by ``BUILD``."""

    def __new__(cls, *args: Any) -> _Record:
        if args:
            raise safe_pickle.Refused(f"a DeepSpeed record built with {len(args)} argument(s); "
                                      "DeepSpeed pickles these by their attributes only")
        return dict.__new__(cls)

    def __init__(self, *args: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        if not (isinstance(state, dict) and all(type(k) is str for k in state)):
            raise safe_pickle.Refused(f"a DeepSpeed record given a {type(state).__name__} as its attributes")
        self.update(state)


#: The globals DeepSpeed's ZeRO optimizer states name, each built as inert data (for these
#: files only; see the module docstring). ``param_shapes`` holds ``torch.Size`` values, which
#: torch's own allow-list admits everywhere (:class:`~ckptshim.formats.torch_globals.Size`).
ZERO_GLOBALS: torch_globals.ExtraGlobals = {
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"): _zero_stage,
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"): _Record,
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"): _Record,
    ("deepspeed.utils.tensor_fragment", "fragment_address"): _Record,
}
#: Model-state files: ZeRO's globals and those of an engine's ``mp_rank`` file.
MODEL_STATE_GLOBALS: torch_globals.ExtraGlobals = {**deepspeed_pipeline.MP_RANK_GLOBALS, **ZERO_GLOBALS}


# -- recognising the folder ------------------------------------------------------------------------

def _partition_files(folder: Path) -> dict[int, list[Path]]:
    """dp rank -> its optimizer partition file(s), when ``folder`` is a ZeRO tag folder this
    module reads (partitions of one model-parallel rank, no pipeline layer files); else empty."""
    found: dict[int, list[Path]] = {}
    model_ranks: set[int] = set()
    for child in sorted(folder.iterdir()):
        if _LAYER_FILE.fullmatch(child.name):
            return {}
        match = _OPTIM_FILE.fullmatch(child.name)
        if match is not None:
            found.setdefault(int(match[2]), []).append(child)
            model_ranks.add(int(match[3]))
    return found if model_ranks == {0} else {}


def tag_folder(path: Path) -> Path | None:
    """The tag folder ``path`` means (itself, or the one its ``latest`` names) if it holds ZeRO
    partitions this module reads; ``None`` otherwise. Never raises on a damaged ``latest``."""
    if not path.is_dir():
        return None
    if _partition_files(path):
        return path
    latest = path / "latest"
    if not latest.is_file():
        return None
    try:
        tag = deepspeed_pipeline.read_latest(latest).decode("utf-8").strip()
        step = path / tag
        if not tag or "/" in tag or not step.is_dir() or step.resolve().parent != path.resolve():
            return None  # the pipeline reader's checks say what is wrong with it
        return step if _partition_files(step) else None
    except (OSError, UnicodeDecodeError, CorruptCheckpointError):  # unreadable, not text, too long for a name
        return None


def sniff(path: Path) -> bool:
    return tag_folder(path) is not None


READERS = {"torch": sniff}


# -- where each parameter lives --------------------------------------------------------------------

@dataclass(frozen=True)
class Slot:
    """Where one trainable parameter's fp32 master (and its moments) lies in the flat partitions.

    ZeRO-1/2: elements ``offset .. offset + numel`` of group ``group``'s flat vector (every rank's
    partition of that group, concatenated in rank order). ZeRO-3: elements ``offset .. offset +
    piece`` of every rank's flat partition (its sub-groups concatenated), ``piece`` being
    ``ceil(numel / world)``; the ranks' pieces concatenated in rank order and cut to ``numel`` are
    the parameter.
    """

    name: str
    shape: tuple[int, ...]
    group: int
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Flat:
    """One rank's flat partition of one group (under ZeRO-3, of all its sub-groups; or one rank's
    piece of a ZeRO-3 frozen parameter): its 1-D tensors in order, each read from the rank's
    file, whose storages' bytes begin at ``storage_starts`` (the archive's offsets)."""

    part: torch_pickle.TorchPickleCheckpoint
    refs: tuple[TensorRef, ...]
    storage_starts: Mapping[str, int]

    @property
    def numel(self) -> int:
        return sum(ref.shape[0] for ref in self.refs)

    def views(self) -> list[np.ndarray]:
        """The tensors as read-only views of the file (each one's byte range checked against it)."""
        return [self.part.read(Entry(("flat",), ref.shape, ref.storage.dtype, (str(self.part.path), ref)))
                for ref in self.refs]

    def copy(self, start: int, stop: int, out: np.ndarray) -> None:
        """Elements ``start .. stop`` of the concatenated tensors into ``out`` (1-D, that long, of
        their storage dtype: :func:`~ckptshim.formats.base.storage_dtype`): a ``pread`` straight
        into ``out`` per tensor it spans, so that no page of the file
        stays mapped (a load's memory is its destination); a tensor that is not one run of its
        storage is copied from the memory map."""
        base = 0
        for ref in self.refs:
            size = ref.shape[0]
            lo, hi = max(start, base), min(stop, base + size)
            if lo < hi:
                target = out[lo - start:hi - start]
                begin = self.storage_starts.get(ref.storage.key)
                if begin is not None and ref.stride == (1,) and ref.offset + size <= ref.storage.numel:
                    with Location.of(self.part.path).open() as raw:
                        read_exact(raw, memoryview(target.view(np.uint8)),
                                   begin + (ref.offset + lo - base) * target.itemsize, str(self.part.path))
                else:
                    view = self.part.read(Entry(("flat",), ref.shape, ref.storage.dtype, (str(self.part.path), ref)))
                    target[:] = view[lo - base:hi - base]
            base += size
        if stop > base:
            raise CorruptCheckpointError(f"{self.part.path}: a partition of {base} elements has no elements "
                                         f"{max(start, base)}..{stop}")


@dataclass(frozen=True)
class Rank:
    """One data-parallel rank's optimizer partition file: its fp32 partitions and the optimizer's
    per-element states (:data:`MOMENTS`), one :class:`Flat` per group (ZeRO-3: one for all), the
    optimizer's ``step``, and the rest of ``optimizer_state_dict`` as read (``param_slice_mappings``,
    ``group_paddings``, ``loss_scaler`` as a dict...)."""

    file: Path
    fp32: tuple[Flat, ...]
    states: Mapping[str, tuple[Flat, ...]]
    step: Any
    optimizer: Mapping[str, Any]

    def read(self, ref: TensorRef) -> np.ndarray:
        """A tensor of this rank's file (the optimizer's ``step``...), as stored."""
        part = self.fp32[0].part
        return part.read(Entry(("value",), ref.shape, ref.storage.dtype, (str(part.path), ref)))


class ZeroCheckpoint(Checkpoint):
    """A ZeRO tag folder; entries are the fp32 state dict DeepSpeed's ``zero_to_fp32`` makes.

    ``slots`` places each trainable parameter in the partitions, ``frozen`` lists the ZeRO-3
    frozen parameters (their entries: shape, saved dtype) whose pieces every rank's model states
    hold, ``ranks`` holds
    each readable rank's partitions, ``engine`` the model states' bookkeeping (``ds_version``, ``global_steps``,
    ``ds_config``...): what a resume at another world size re-cuts.
    """

    def __init__(self, path: Path, version: str, entries: list[Entry], files: list[FileInfo],
                 problems: list[str], layout: _Layout) -> None:
        super().__init__(path, NAME, version, Inventory(entries, str(path)), tuple(files), tuple(problems))
        self.stage, self.world = layout.stage, layout.world
        self.slots: Mapping[str, Slot] = layout.slots
        self.ranks: Mapping[int, Rank] = layout.ranks
        self.engine: Mapping[str, Any] = layout.engine
        self._whole = layout.whole
        self.frozen: Mapping[str, Entry] = layout.frozen
        self._frozen_pieces = layout.frozen_pieces
        self._parts = layout.parts

    def read(self, entry: Entry) -> np.ndarray:
        kind, name = entry.location
        if kind == "master":
            return self.read_elements(name, None, 0, self.slots[name].numel).reshape(entry.shape)
        pieces = self._whole[name]
        arrays = [part.read(Entry(entry.key, ref.shape, ref.storage.dtype, (str(part.path), ref)))
                  for part, ref in pieces]
        value = arrays[0] if len(arrays) == 1 else \
            np.concatenate([a.reshape(-1) for a in arrays])[:math.prod(entry.shape)]
        stored = pieces[0][1].storage.dtype
        value = value.reshape(entry.shape)
        return _as_float32(value, stored) if stored != entry.dtype else value

    def read_into(self, entry: Entry, index: tuple, out: np.ndarray) -> None:
        """A block of a master: only the elements of the rows it spans are gathered from the
        partitions (an FSDP2 rank's rows, a shard of them), then cast to ``out``'s dtype."""
        kind, name = entry.location
        slot = self.slots.get(name) if kind == "master" else None
        if slot is None or not slot.shape:
            super().read_into(entry, index, out)
            return
        first, last, _ = index[0].indices(slot.shape[0]) if isinstance(index[0], slice) else (index[0], index[0] + 1, 1)
        inner = math.prod(slot.shape[1:])
        rows = self.read_elements(name, None, first * inner, max(last, first) * inner)
        rows = rows.reshape((max(last - first, 0), *slot.shape[1:]))
        np.copyto(out, rows[(slice(None) if isinstance(index[0], slice) else 0, *index[1:])], casting="unsafe")

    def check_entry(self, entry: Entry) -> None:
        """Every partition a master is gathered from is there and as long as its metadata says
        (views only: nothing is gathered)."""
        kind, name = entry.location
        if kind != "master":
            super().check_entry(entry)
            return
        self._require_every_rank()
        for rank in self.ranks.values():
            for flat in rank.fp32:
                flat.views()

    def read_optimizer_state(self, name: str, state: str) -> np.ndarray:
        """Trainable parameter ``name``'s optimizer state ``state`` (one of :data:`MOMENTS`), in
        the parameter's shape, assembled from the ranks' partitions as its master is."""
        self.require_complete()
        return self.read_elements(name, state, 0, self.slots[name].numel).reshape(self.slots[name].shape)

    def read_elements(self, name: str, state: str | None, start: int, stop: int) -> np.ndarray:
        """Elements ``start .. stop`` of trainable parameter ``name``'s flattened fp32 master
        (``state`` ``None``) or optimizer state ``state``, as float32; zeros past the parameter's
        end (the padding a partition of another world size has there). Reads only the saved
        partitions that hold those elements: a resume at another world size re-cuts each rank's
        new partition with it, never assembling the whole model."""
        self._require_every_rank()
        if state is not None:
            lacking = [rank for rank, found in self.ranks.items() if state not in found.states]
            if lacking:
                raise CorruptCheckpointError(f"{self.path}: rank(s) {lacking} hold no optimizer state {state!r}")
        slot = self.slots[name]
        out = np.zeros(stop - start, dtype=np.float32)
        end = min(stop, slot.numel)

        def flats(rank: int) -> tuple[Flat, ...]:
            found = self.ranks[rank]
            return found.fp32 if state is None else found.states[state]

        if self.stage == 3:
            _copy_pieces([flats(rank)[0] for rank in range(self.world)], slot.offset, slot.numel, start, stop, out)
            return out
        for rank, first, size in _rank_ranges(self.ranks, slot.group, self.world):
            lo, hi = max(slot.offset + start, first), min(slot.offset + end, first + size)
            if lo < hi:  # a moment is as long as the padded partition; its first ``size`` elements match
                flats(rank)[slot.group].copy(lo - first, hi - first,
                                             out[lo - slot.offset - start:hi - slot.offset - start])
        return out

    def flat_group_of(self, name: str) -> int:
        """The saved flat group holding trainable parameter ``name``: its param group's (ZeRO-1/2),
        or the sub-group of every rank's partition its piece lies in (ZeRO-3)."""
        slot = self.slots[name]
        if self.stage != 3:
            return slot.group
        ends = np.cumsum([ref.shape[0] for ref in self.ranks[min(self.ranks)].fp32[0].refs])
        return int(np.searchsorted(ends, slot.offset, side="right"))

    def read_frozen_elements(self, name: str, start: int, stop: int) -> np.ndarray:
        """ZeRO-3: elements ``start .. stop`` of frozen parameter ``name`` (one of :attr:`frozen`),
        flattened, in the dtype its fragments were saved in (bfloat16 as its bits); zeros past its
        end. Reads only the saved ranks' pieces that hold those elements."""
        pieces = self._frozen_pieces[name]
        out = np.zeros(stop - start, storage_dtype(pieces[0].refs[0].storage.dtype))
        _copy_pieces(pieces, 0, math.prod(self.frozen[name].shape), start, stop, out)
        return out

    def _require_every_rank(self) -> None:
        missing = [rank for rank in range(self.world) if rank not in self.ranks]
        if missing:
            raise CorruptCheckpointError(
                f"{self.path}: the optimizer partitions of data-parallel rank(s) {missing} are missing or "
                "unreadable, and every parameter's fp32 master needs all of them. Restore those files "
                "(`ckptshim inspect` names them).")

    @property
    def files_read(self) -> frozenset[Path]:
        """The files opening this checkpoint read through the allow-listed unpickler."""
        return frozenset(Path(part.path) for part in self._parts)

    def close(self) -> None:
        for part in self._parts:
            part.close()


def _rank_ranges(ranks: Mapping[int, Rank], group: int, world: int) -> list[tuple[int, int, int]]:
    """ZeRO-1/2: (rank, first element, elements) of each rank's partition of ``group`` in the
    group's flat vector. A missing rank's partition is taken to be as long as rank 0's (all but
    the last are: DeepSpeed cuts equal partitions and strips only the last one's padding)."""
    ranges, start = [], 0
    usual = ranks[min(ranks)].fp32[group].numel if ranks else 0
    for rank in range(world):
        size = ranks[rank].fp32[group].numel if rank in ranks else usual
        ranges.append((rank, start, size))
        start += size
    return ranges


def _copy_pieces(flats: list[Flat] | tuple[Flat, ...], offset: int, numel: int, start: int, stop: int,
                 out: np.ndarray) -> None:
    """ZeRO-3's geometry: rank ``r``'s flat (of ``len(flats)`` ranks) holds, from ``offset`` on,
    elements ``r * piece .. (r + 1) * piece`` of a parameter of ``numel`` elements, ``piece``
    being ``ceil(numel / world)``. Elements ``start .. stop`` of the parameter into ``out``
    (those past ``numel`` are left as they are: the zero padding), reading only the ranks that
    hold them."""
    world, end = len(flats), min(stop, numel)
    piece = -(-numel // world)
    for rank in range(start // piece, min(world, -(-end // piece))) if end > start else ():
        lo, hi = max(start, rank * piece), min(end, (rank + 1) * piece)
        flats[rank].copy(offset + lo - rank * piece, offset + hi - rank * piece, out[lo - start:hi - start])


def _as_float32(value: np.ndarray, stored: str) -> np.ndarray:
    """A floating buffer as float32, as ``zero_to_fp32`` makes it (``tensor.float()``): bfloat16
    widened by its bits, float16 and float64 as numpy casts them (IEEE round to nearest, as torch)."""
    if stored == "bfloat16":
        return (value.astype(np.uint32) << 16).view(np.float32)
    return value.astype(np.float32)


# -- opening -------------------------------------------------------------------------------------

@dataclass
class _Layout:
    """What :func:`open_checkpoint` gathers on its way (see :class:`ZeroCheckpoint`)."""

    stage: int = 0
    world: int = 0
    slots: dict[str, Slot] = field(default_factory=dict)
    ranks: dict[int, Rank] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)
    whole: dict[str, list[tuple[torch_pickle.TorchPickleCheckpoint, TensorRef]]] = field(default_factory=dict)
    frozen: dict[str, Entry] = field(default_factory=dict)
    frozen_pieces: dict[str, tuple[Flat, ...]] = field(default_factory=dict)
    parts: list[torch_pickle.TorchPickleCheckpoint] = field(default_factory=list)
    files: list[FileInfo] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Archive:
    """One ``.pt`` file of the folder, read through the allow-listed unpickler."""

    tree: dict
    part: torch_pickle.TorchPickleCheckpoint
    info: FileInfo
    offsets: Mapping[str, int]  # where each storage's bytes begin in the file


def _unpickle(file: Path, extra: torch_globals.ExtraGlobals) -> torch_pickle.Archive:
    """``file``'s ``torch.save`` archive, read through the allow-listed unpickler (``extra``
    besides torch's globals); a file that is not a regular, whole archive is named."""
    if regular_size(file) is None:  # a pipe would block the read; a folder is no archive
        raise CorruptCheckpointError(f"{file}: not a regular file; DeepSpeed writes a torch.save archive there")
    try:
        with open(file, "rb") as raw:
            archive = torch_pickle.read_archive(raw, str(file), extra)
    except OSError as error:
        raise CorruptCheckpointError(f"{file}: cannot be read ({error})") from None
    if archive.problems:
        raise CorruptCheckpointError(f"{file}: {'; '.join(archive.problems)}. Re-copy it from the original.")
    return archive


def _read(file: Path, step: Path, extra: torch_globals.ExtraGlobals, writer: str) -> _Archive:
    archive = _unpickle(file, extra)
    if not isinstance(archive.tree, dict):
        raise CorruptCheckpointError(f"{file}: holds a {type(archive.tree).__name__}, not the dictionary "
                                     "DeepSpeed's save_checkpoint writes")
    part = torch_pickle.TorchPickleCheckpoint(file, Inventory([], str(file)), [], archive.offsets)
    ends = [archive.offsets[leaf.storage.key] + leaf.storage.nbytes
            for leaf in torch_pickle.flat_tree(archive.tree, str(file)).values()
            if isinstance(leaf, TensorRef) and leaf.storage.key in archive.offsets]
    return _Archive(archive.tree, part, file_info(file, max(ends, default=None), root=step, writer=writer),
                    archive.offsets)


def read_state_file(file: Path) -> None:
    """Read ``file`` (a ``.pt`` file DeepSpeed's engine would unpickle: model or optimizer states,
    a universal checkpoint's per-parameter tensors) through the allow-listed unpickler: a file
    needing any global but torch's and :data:`MODEL_STATE_GLOBALS` is refused
    (:class:`~ckptshim.errors.UnsafeCheckpointError`), a damaged one named
    (:class:`~ckptshim.errors.CorruptCheckpointError`). What it holds is DeepSpeed's to judge."""
    _unpickle(file, MODEL_STATE_GLOBALS)


#: More data-parallel ranks than any run has had: a larger ``dp_world_size`` is a damaged file.
MAX_WORLD = 1 << 20


@reader
def open_checkpoint(path: Path) -> ZeroCheckpoint:
    step = tag_folder(path)
    if step is None:
        step = deepspeed_pipeline.step_directory(path)  # says what is wrong with a damaged ``latest``
        raise CorruptCheckpointError(f"{step}: no DeepSpeed ZeRO optimizer partitions "
                                     "(*zero_pp_rank_<d>_mp_rank_00_optim_states.pt) to read")
    Location.of(step).refuse_links_leaving()
    layout = _Layout()
    models, zero3 = _model_states(step, layout)
    first = models[min(models)].tree
    layout.engine = {key: first.get(key) for key in ("ds_version", "dp_world_size", "mp_world_size", "global_steps",
                                                      "global_samples", "skipped_steps", "ds_config")}
    world = first.get("dp_world_size")
    if type(world) is not int or not 1 <= world <= MAX_WORLD:
        raise CorruptCheckpointError(f"{step}: dp_world_size {world!r:.40} in the model states is not a world size")
    layout.world = world
    if zero3:
        _list_missing(step, models, "zero_pp_rank_{}_mp_rank_00_model_states.pt", layout)
    _optimizer_partitions(step, layout)
    layout.stage = next(iter({rank.optimizer["zero_stage"] for rank in layout.ranks.values()}), 3 if zero3 else 2)
    if (layout.stage == 3) != zero3:
        raise CorruptCheckpointError(f"{step}: ZeRO-{layout.stage} optimizer partitions beside "
                                     f"{'ZeRO-3' if zero3 else 'ZeRO-1/2'} model states; the files are of different runs")
    entries = _entries(step, models, layout)
    layout.files = [_with_pieces(info, layout) for info in layout.files]
    training = _training(layout.engine.get("ds_config"))
    version = (f"deepspeed {layout.engine.get('ds_version') or '?'}, ZeRO-{layout.stage}, dp={world}, "
               f"{training}; {len(layout.slots)} trainable parameters as fp32 masters from the optimizer "
               "partitions")
    if not zero3 and training != "fp32 training":  # the 16-bit copies are there too, and not what is read
        version += f", not the {training.split()[0]} module weights also in {_MODEL_FILE}"
    return ZeroCheckpoint(path, version, entries, layout.files, layout.problems, layout)


def _model_states(step: Path, layout: _Layout) -> tuple[dict[int, _Archive], bool]:
    """dp rank -> model states (ZeRO-3: one file per rank; ZeRO-1/2: dp rank 0's ``mp_rank_00``),
    and whether they are ZeRO-3's. ZeRO-3 needs one readable file (every rank's has the shapes)."""
    zero3 = {int(m[1]): step / m[0] for child in sorted(step.iterdir())
             if (m := _ZERO3_MODEL_FILE.fullmatch(child.name)) and m[2] == "00"}
    candidates = zero3 or {0: step / _MODEL_FILE}
    models: dict[int, _Archive] = {}
    for rank, file in sorted(candidates.items()):
        if not file.exists():
            layout.files.append(file_info(file, root=step, writer=f"rank {rank}"))
            continue
        try:
            models[rank] = _read(file, step, MODEL_STATE_GLOBALS, f"rank {rank}")
        except CorruptCheckpointError as error:
            if not zero3:
                raise
            layout.problems.append(str(error))
            layout.files.append(file_info(file, root=step, writer=f"rank {rank}"))
            continue
        layout.parts.append(models[rank].part)
        layout.files.append(replace(models[rank].info, notes=(
            "module: empty placeholders for the parameters (and the buffers)" if zero3 else
            "module: the training-dtype copies of the weights, not read: the inventory holds the "
            "fp32 masters from the optimizer partitions",)))
    if not models:
        raise CorruptCheckpointError(
            f"{step}: no readable model states ({_MODEL_FILE}, or zero_pp_rank_<d>_mp_rank_00_model_states.pt "
            "under ZeRO-3); they hold the parameter names and shapes the partitions are cut by. Restore it.")
    return models, bool(zero3)


def _list_missing(step: Path, found: Mapping[int, Any], pattern: str, layout: _Layout) -> None:
    """Every rank below the world size without a file of ``pattern`` (``{}``: the rank) is missing."""
    present = {info.path for info in layout.files}
    for rank in range(layout.world):
        name = pattern.format(rank)
        if rank not in found and name not in present:
            layout.files.append(file_info(step / name, root=step, writer=f"rank {rank}"))


def _optimizer_partitions(step: Path, layout: _Layout) -> None:
    """Read every rank's optimizer partition file; name the missing, unreadable and surplus ones."""
    partitions = _partition_files(step)
    prefixes = {_OPTIM_FILE.fullmatch(file.name)[1] or "" for files in partitions.values() for file in files}
    if len(prefixes) > 1:
        layout.problems.append("the optimizer partitions mix bf16_zero_pp_rank_* and zero_pp_rank_* names: "
                               "files of two runs share this folder")
    for rank, (file, *others) in sorted(partitions.items()):
        if others:
            layout.problems.append(f"{file.name} and {', '.join(o.name for o in others)} all hold data-parallel "
                                   f"rank {rank}: files of two runs share this folder")
        if rank >= layout.world:
            layout.problems.append(f"{file.name}: data-parallel rank {rank}, but the checkpoint was written by "
                                   f"{layout.world} ranks (dp_world_size); a file of another run?")
            continue
        try:
            archive = _read(file, step, ZERO_GLOBALS, f"rank {rank}")
        except CorruptCheckpointError as error:
            layout.problems.append(str(error))
            layout.files.append(file_info(file, root=step, writer=f"rank {rank}"))
            continue
        layout.parts.append(archive.part)
        layout.files.append(archive.info)
        layout.ranks[rank] = _rank(file, archive.tree.get("optimizer_state_dict"), archive, layout.world)
    stages = {rank.optimizer["zero_stage"] for rank in layout.ranks.values()}
    if len(stages) > 1:
        raise CorruptCheckpointError(f"{step}: optimizer partitions of ZeRO stages {sorted(stages)}; the files "
                                     "are of different runs")
    _list_missing(step, partitions, min(prefixes) + "zero_pp_rank_{}_mp_rank_00_optim_states.pt", layout)


def _rank(file: Path, optimizer: Any, archive: _Archive, world: int) -> Rank:
    if not isinstance(optimizer, dict) or optimizer.get("zero_stage") not in _FP32_GROUPS:
        raise CorruptCheckpointError(f"{file}: no ZeRO optimizer state (optimizer_state_dict.zero_stage 1, 2 "
                                     "or 3); not a DeepSpeed ZeRO partition file")
    stage = optimizer["zero_stage"]
    counts = optimizer.get("partition_count")
    counts = counts if isinstance(counts, list) else [counts]
    if not counts or any(type(c) is not int for c in counts) or max(counts) != world:
        raise CorruptCheckpointError(f"{file}: partition_count {optimizer.get('partition_count')!r:.60}, but the "
                                     f"model states say dp_world_size {world}; the files are of different runs")
    groups = optimizer.get(_FP32_GROUPS[stage])
    if not isinstance(groups, list) or not groups or not all(_is_flat(t) for t in groups):
        raise CorruptCheckpointError(f"{file}: {_FP32_GROUPS[stage]} is not a list of flat float32 tensors")
    per_group = _group_states(optimizer.get("optimizer_state_dict" if stage == 3 else "base_optimizer_state"),
                              len(groups), file)

    def flats(refs: list) -> tuple[Flat, ...]:
        if stage == 3:
            return (Flat(archive.part, tuple(refs), archive.offsets),)
        return tuple(Flat(archive.part, (ref,), archive.offsets) for ref in refs)

    states = {name: flats([state.get(name) for state in per_group]) for name in MOMENTS
              if all(_is_flat(state.get(name)) for state in per_group)}
    step = next((state["step"] for state in per_group if "step" in state), optimizer.get("base_optimizer_state_step"))
    return Rank(file, flats(groups), states, step, optimizer)


def _group_states(inner: Any, groups: int, file: Path) -> list[dict]:
    """The optimizer's state of each group's (sub-group's) flat tensor: from a torch optimizer
    state dict (``state`` by index) or an elastic checkpoint's list of lean states."""
    if isinstance(inner, list):
        states = inner
    elif isinstance(inner, dict) and isinstance(inner.get("state"), dict):
        states = [inner["state"].get(index, {}) for index in range(groups)]
    else:
        return [{} for _ in range(groups)]
    if len(states) != groups or not all(isinstance(state, dict) for state in states):
        raise CorruptCheckpointError(f"{file}: optimizer state for {len(states)} group(s), but {groups} fp32 "
                                     "partition(s)")
    return states


def _is_flat(value: Any) -> bool:
    return isinstance(value, TensorRef) and len(value.shape) == 1 and value.storage.dtype == "float32"


def _shapes(value: Any, what: str, step: Path) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` as saved: ``torch.Size`` values, or plain tuples of sizes (an engine with
    MoE layers saves those)."""
    if not isinstance(value, dict) or not all(type(k) is str and _is_shape(v) for k, v in value.items()):
        raise CorruptCheckpointError(f"{step}: {what} is not a mapping of parameter names to shapes")
    return {name: tuple(shape) for name, shape in value.items()}


def _is_shape(value: Any) -> bool:
    return isinstance(value, torch_globals.Size) or (type(value) is tuple and all(type(d) is int and d >= 0
                                                                                  for d in value))


def _entries(step: Path, models: dict[int, _Archive], layout: _Layout) -> list[Entry]:
    """The inventory in ``get_fp32_state_dict_from_zero_checkpoint``'s order, and every check of
    the partitions' sizes against the shapes (metadata only)."""
    first = models[min(models)]
    module = first.tree.get("module") if isinstance(first.tree.get("module"), dict) else {}
    entries: list[Entry] = []
    buffers = set(first.tree.get("buffer_names") or ())
    for name, ref in module.items():  # in the module's order, as zero_to_fp32 takes them
        if name in buffers and isinstance(ref, TensorRef):
            layout.whole[name] = [(first.part, ref)]
            floating = ref.storage.dtype.startswith(("float", "bfloat"))
            entries.append(Entry(split_key(name), ref.shape, "float32" if floating else ref.storage.dtype,
                                 ("whole", name)))
    for name, shape in _shapes(first.tree.get("frozen_param_shapes") or {}, "frozen_param_shapes", step).items():
        pieces = _frozen_pieces(name, shape, models, layout)
        if pieces:
            layout.whole[name] = [(piece.part, piece.refs[0]) for piece in pieces]
            entries.append(Entry(split_key(name), shape, pieces[0].refs[0].storage.dtype, ("whole", name)))
            if layout.stage == 3:
                layout.frozen[name], layout.frozen_pieces[name] = entries[-1], tuple(pieces)
    groups = first.tree.get("param_shapes")
    if not isinstance(groups, list):
        raise CorruptCheckpointError(f"{step}: the model states hold no param_shapes; not a ZeRO checkpoint")
    groups = [_shapes(group, "param_shapes", step) for group in groups]
    names = [name for group in groups for name in group]
    if len(set(names)) != len(names):
        raise CorruptCheckpointError(f"{step}: param_shapes names a parameter in more than one group; "
                                     "DeepSpeed saves each once")
    if layout.stage == 3:
        _place_zero3(groups, layout)
    else:
        _place_zero12(groups, layout)
    entries += [Entry(split_key(slot.name), slot.shape, "float32", ("master", slot.name))
                for slot in layout.slots.values()]
    shared = first.tree.get("shared_params") or {}
    by_name = {entry.location[1]: entry for entry in entries}
    for alias, held in shared.items() if isinstance(shared, dict) else ():
        if held in by_name:
            entries.append(Entry(split_key(alias), by_name[held].shape, by_name[held].dtype, by_name[held].location))
    return entries


def _place_zero12(groups: list[dict[str, tuple[int, ...]]], layout: _Layout) -> None:
    """Each parameter at its offset in its group's flat vector (``param_alignment_paddings``
    after each), and the ranks' partitions checked against the group's length as DeepSpeed
    checks them: equal once both are rounded up to a multiple of twice the world size."""
    paddings = _alignment_paddings(groups, layout)
    for group, shapes in enumerate(groups):
        offset = 0
        for index, (name, shape) in enumerate(shapes.items()):
            layout.slots[name] = slot = Slot(name, shape, group, offset)
            offset += slot.numel + paddings[group][index]
        if len(layout.ranks) != layout.world:
            continue  # the missing files are the problem
        if any(group >= len(rank.fp32) for rank in layout.ranks.values()):
            layout.problems.append(f"group {group} of param_shapes has no fp32 partition in the optimizer states")
            continue
        held = sum(rank.fp32[group].numel for rank in layout.ranks.values())
        align = 2 * layout.world
        if held < offset or -(-held // align) != -(-offset // align):
            layout.problems.append(f"group {group}: its parameters need {offset} elements, but the ranks' fp32 "
                                   f"partitions hold {held}; the partitions are not those of these param_shapes")


def _alignment_paddings(groups: list[dict], layout: _Layout) -> list[list[int]]:
    """Per group, the elements DeepSpeed put after each parameter (``param_alignment_paddings``;
    none where the optimizer states do not say, as before DeepSpeed wrote them)."""
    found = layout.ranks[min(layout.ranks)].optimizer.get("param_alignment_paddings") if layout.ranks else None
    if found is None:
        return [[0] * len(group) for group in groups]
    if not (isinstance(found, list) and len(found) == len(groups) and all(
            isinstance(p, list) and len(p) == len(g) and all(type(n) is int and n >= 0 for n in p)
            for p, g in zip(found, groups))):
        raise CorruptCheckpointError("param_alignment_paddings does not give one padding per parameter of each "
                                     "group of param_shapes; the files are of different runs")
    return found


def _place_zero3(groups: list[dict[str, tuple[int, ...]]], layout: _Layout) -> None:
    """Each parameter's ``ceil(numel / world)`` piece at the same offset of every rank's flat
    partition, in ``param_shapes`` order across groups; every rank's partition checked to hold
    exactly the pieces (DeepSpeed's own check)."""
    offset = 0
    for shapes in groups:
        for name, shape in shapes.items():
            layout.slots[name] = slot = Slot(name, shape, 0, offset)
            offset += -(-slot.numel // layout.world)
    for rank, found in sorted(layout.ranks.items()):
        if found.fp32[0].numel != offset:
            layout.problems.append(f"rank {rank}: its fp32 partition holds {found.fp32[0].numel} elements, but the "
                                   f"parameters' pieces need {offset}; the partitions are not those of these "
                                   "param_shapes")


def _frozen_pieces(name: str, shape: tuple[int, ...], models: dict[int, _Archive], layout: _Layout) -> list[Flat]:
    """Where a frozen parameter's values are: whole in dp rank 0's fragments (ZeRO-2), or one
    flat ``ceil(numel / world)`` piece in each rank's (ZeRO-3). Empty (and a problem) if a piece
    is missing; a missing ZeRO-3 model file is already listed as missing."""
    numel = math.prod(shape)
    ranks, want = (range(layout.world), -(-numel // layout.world)) if layout.stage == 3 else ((0,), numel)
    pieces = []
    for rank in ranks:
        model = models.get(rank)
        if model is None:
            return []
        fragments = model.tree.get("frozen_param_fragments")
        ref = fragments.get(name) if isinstance(fragments, dict) else None
        if not isinstance(ref, TensorRef) or math.prod(ref.shape) != want or \
                (layout.stage == 3 and len(ref.shape) != 1):
            layout.problems.append(f"{model.info.path}: frozen_param_fragments holds no {want}-element piece of {name}")
            return []
        pieces.append(Flat(model.part, (ref,), model.offsets))
    return pieces


def _with_pieces(info: FileInfo, layout: _Layout) -> FileInfo:
    """An optimizer partition file with what it holds of each trainable parameter, so that a
    completeness report says what a missing or damaged rank costs."""
    match = _OPTIM_FILE.fullmatch(Path(info.path).name)
    if match is None or int(match[2]) >= layout.world:
        return info
    rank = int(match[2])
    if layout.stage == 3:
        pieces = tuple(Piece(slot.name, f"piece {rank} of {layout.world}") for slot in layout.slots.values())
    else:
        ranges = {g: _rank_ranges(layout.ranks, g, layout.world)[rank] for g in {s.group for s in layout.slots.values()}}
        pieces = tuple(Piece(slot.name, f"[{max(lo, slot.offset) - slot.offset}:{min(lo + n, slot.offset + slot.numel) - slot.offset}]")
                       for slot in layout.slots.values()
                       for _, lo, n in (ranges[slot.group],) if lo < slot.offset + slot.numel and slot.offset < lo + n)
    return replace(info, pieces=pieces)


def _training(config: Any) -> str:
    """``"bf16 training"``, ``"fp16 training"`` or ``"fp32 training"``, from the saved ds_config."""
    if isinstance(config, dict):
        for key, name in (("bf16", "bf16"), ("bfloat16", "bf16"), ("fp16", "fp16")):
            section = config.get(key)
            if isinstance(section, dict) and section.get("enabled"):
                return f"{name} training"
    return "fp32 training"
