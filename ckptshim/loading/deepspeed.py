"""GPT-NeoX pipeline loads: the state dict each DeepSpeed pipeline layer expects, from any
checkpoint holding a GPT-NeoX model.

DeepSpeed's pipeline engine loads weights by calling ``PipelineModule.load_state_dir(load_dir,
checkpoint_engine, strict)``, which globs ``layer_<i>-*model_states.pt`` for each of its layers and
hands each layer's ``load_state_dict(strict=...)`` what it finds. That works only for a NeoX
checkpoint saved with the same names and the same tensor-parallel degree. When ``load_dir``
holds anything else ckptshim can read -- a Hugging Face GPT-NeoX/Pythia directory, a NeoX
checkpoint of another tensor-parallel degree, older MLP names, a saved or unsaved rotary
``inv_freq`` -- :func:`load_stage` gives each layer exactly the state dict it expects, built in
memory (no converted files): names mapped through the decoder hub (NeoX's and Hugging Face's
GPT-NeoX names, :mod:`ckptshim.rules.profiles.neox`),
tensor-parallel shards merged and re-split by the ops NeoX's layout gives each tensor
(``Concat``/``Chunk`` along an axis, ``Sum``/``Share``, ``Replicated``/``Replicate``;
:mod:`ckptshim.formats.tensor_parallel`), vocab rows padded or cut to the model's padded
vocab, derivable buffers kept from the module or dropped.

The whole stage is planned and checked before the first layer is written, so a refused load
leaves every layer untouched. A matching NeoX checkpoint, and any pipeline model that is not
GPT-NeoX, go to DeepSpeed's own loader.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ckptshim import config
from ckptshim.errors import NoPlan, PlanError, UnknownFormatError
from ckptshim.execute.destinations import as_tensor
from ckptshim.execute.torch import prepare
from ckptshim.formats import deepspeed_pipeline, tensor_parallel
from ckptshim.formats.base import Checkpoint
from ckptshim.formats.detect import open_checkpoint
from ckptshim.formats.hf_dir import config_of
from ckptshim.inventory import Entry, Inventory, KeyPath, join_key, split_key
from ckptshim.layouts import neox
from ckptshim.loading.report import report_load
from ckptshim.loading.torch import module_facts, recomputed_buffers, tensor_inventory
from ckptshim.loading.torch_layout import module_layout
from ckptshim.log import logger
from ckptshim.planner import plan as make_plan
from ckptshim.rules import TargetFacts
from ckptshim.rules.buffers import derivable_rule
from ckptshim.rules.context import LoadContext
from ckptshim.rules.decoder import Dims, read_dims
from ckptshim.rules.profiles import rules_for
from ckptshim.rules.profiles import neox as neox_names
from ckptshim.targets.derived import OwnBuffers

HOOK = "deepspeed PipelineModule.load_state_dir"


def load_stage(module: Any, load_dir: Path, strict: bool, native: Callable[[], Any]) -> Any:
    """``module.load_state_dir(load_dir, strict=strict)`` for a GPT-NeoX stage; ``native()`` for
    a checkpoint DeepSpeed loads as it is, or one that is not GPT-NeoX."""
    grid = module._grid
    rank, degree = grid.get_slice_parallel_rank(), grid.get_slice_parallel_world_size()
    layers = {index + module._local_start: layer for index, layer in enumerate(module.forward_funcs)
              if isinstance(layer, nn.Module) and hasattr(layer, "load_state_dict")}
    # what DeepSpeed's own call would unpickle: its layers' glob, which must find this folder's files
    unpickled = deepspeed_pipeline.files_deepspeed_reads(load_dir, (
        index + module._local_start for index, layer in enumerate(module.forward_funcs)
        if hasattr(layer, "load_state_dict")))
    try:
        source = open_checkpoint(load_dir, backend="torch")
    except UnknownFormatError:
        if unpickled:  # files no format claims: read as DeepSpeed's layers before DeepSpeed may
            deepspeed_pipeline.open_checkpoint(load_dir).close()
        return native()
    try:
        if not is_neox(source) or _native_fits(source, layers, degree):
            _read_layer_files(source)
            return native()
        try:
            states = layer_state_dicts(source, layers, rank, degree, strict)
        except NoPlan:  # the hook then runs DeepSpeed's own load, which unpickles the layer files
            _read_layer_files(source)
            raise
    finally:
        source.close()
    for index, layer in layers.items():
        layer.load_state_dict(states.get(index, OrderedDict()), strict=strict)
    module._synchronize_tied_weights()
    return None


def _read_layer_files(source: Checkpoint) -> None:
    """Before DeepSpeed's own load -- which unpickles every ``layer_*model_states.pt`` in the
    folder with ``torch.load(weights_only=False)`` -- read each of those files through ckptshim's
    allow-listed unpickler (refusing any that needs more), whatever format the folder was
    recognised as first (a Hugging Face folder may hold layer files too)."""
    if not isinstance(source, deepspeed_pipeline.DeepSpeedPipelineCheckpoint) and deepspeed_pipeline.sniff(source.path):
        deepspeed_pipeline.open_checkpoint(source.path).close()


def is_neox(source: Checkpoint) -> bool:
    """An HF GPT-NeoX checkpoint, or one whose every tensor is a GPT-NeoX layer's. Other
    pipeline models (Megatron-DeepSpeed's ``self_attention``...) are DeepSpeed's to load: its
    own loader re-shards Megatron names, and ckptshim knows only NeoX's."""
    if neox_names.HF.marks(source.inventory):
        return True
    keys = list(source.inventory)
    return bool(keys) and all(key[:1] == (neox.SEQUENTIAL,) and (
        neox.spread(key) is not None or derivable_rule(key) is not None) for key in keys)


def _native_fits(source: Checkpoint, layers: Mapping[int, nn.Module], degree: int) -> bool:
    """A NeoX checkpoint of this degree whose every layer file holds exactly what its layer wants."""
    if not isinstance(source, deepspeed_pipeline.DeepSpeedPipelineCheckpoint) or source.tp_degree != degree:
        return False
    for index, layer in layers.items():
        wanted = {(neox.SEQUENTIAL, str(index)) + split_key(k) for k in module_layout(layer).tensors}
        held = {k for k in source.shards if k[:2] == (neox.SEQUENTIAL, str(index))}
        if wanted != held:
            return False
    return True


def layer_state_dicts(source: Checkpoint, layers: Mapping[int, nn.Module], rank: int, degree: int,
                      strict: bool = True) -> dict[int, OrderedDict[str, torch.Tensor]]:
    """For each pipeline layer (by global index), the state dict it expects at tensor-parallel
    ``rank`` of ``degree``, from any checkpoint holding a GPT-NeoX model; nothing is written.

    Values are views of (or small arrays computed from) the checkpoint's bytes, the layer's own
    tensor for derivable buffers the checkpoint lacks; every check runs before this returns.
    """
    source.require_complete()
    model_config = config_of(source)
    _check_whole_heads(read_dims(model_config), degree)
    target, destinations, recomputed, facts = _targets(layers)
    target_names = neox_names.stage_names(target)
    names = neox_names.side(source.inventory) or target_names
    count = neox_names.layer_count(names, source.inventory)
    stage = {str(index) for index in layers}
    full_rows = {role: e.shape[0] * degree for e in target.values()
                 if (role := neox_names.vocab_slot(e.key)) is not None}
    reads: dict[KeyPath, tuple[int | None, KeyPath]] = {}  # rows to resize to, NeoX name
    entries = []
    for entry in source.inventory.values():
        key = neox_names.pipeline_key(entry.key, names, count)
        if key[:1] == (neox.SEQUENTIAL,) and len(key) > 1 and key[1] not in stage:
            continue  # another pipeline stage's layer
        shape = entry.shape
        rows = full_rows.get(neox_names.vocab_slot(key) or "")
        if rows is not None and shape[0] != rows:
            _check_cut(entry.key, shape[0], rows)
            shape = (rows, *shape[1:])
        reads[entry.key] = (rows if shape != entry.shape else None, key)
        entries.append(Entry(entry.key, _shard_shape(key, shape, degree), entry.dtype, entry.location))
    checkpoint = Inventory(entries, str(source.path))
    pairing = (names, target_names) if names is not target_names else None
    plan = make_plan(checkpoint, target, rules_for(LoadContext(checkpoint, target, "torch", facts, model_config,
                                                               names=pairing)))

    def fetch(key: KeyPath) -> torch.Tensor:
        entry = source.inventory[key]
        rows, name = reads[key]
        array = source.read(entry)
        if rows is not None:
            array = tensor_parallel.resize_rows(array, rows)
        shard = tensor_parallel.split(name, array, rank, degree, entry.dtype, join_key(key))
        return as_tensor(np.ascontiguousarray(shard).reshape(shard.shape), getattr(torch, entry.dtype))  # 0-d stays 0-d

    prepared = prepare(plan, fetch, destinations, allow_missing=not strict, allow_unexpected=not strict,
                       own_buffers=OwnBuffers(recomputed))
    report_load(f"load_state_dir(tp rank {rank}/{degree})", plan.undropped(prepared.unexpected))
    resized = [f"{join_key(k)} -> {rows} rows" for k, (rows, _) in reads.items() if rows is not None]
    if resized:
        logger.info("%s: vocab padding changed to the model's: %s", HOOK, ", ".join(resized))
    states: dict[int, OrderedDict[str, torch.Tensor]] = {}
    for key, value in prepared.values.items():
        states.setdefault(int(key[1]), OrderedDict())[join_key(key[2:])] = value
    return states


def _check_whole_heads(dims: Dims | None, degree: int) -> None:
    """A rank's slice of the per-head ``query_key_value`` is a set of whole heads only where the
    heads divide over the ranks (NeoX's own condition); the rows dividing evenly does not say so.
    Checked where the checkpoint's metadata gives the head count."""
    if dims is not None and dims.heads % degree:
        raise PlanError(f"{dims.origin}: {dims.heads} heads do not divide over {degree} tensor-parallel ranks, so a "
                        "rank's slice of attention.query_key_value would cut a head in two. Load at a "
                        "tensor-parallel degree that divides the head count.")


def _check_cut(key: KeyPath, have: int, rows: int) -> None:
    """Cutting vocab rows is right only if they are padding, which the bytes cannot tell."""
    if have <= rows:
        return
    message = (f"{join_key(key)} has {have} vocab rows but the model's padded vocab is {rows}; rows "
               f"{rows}.. are dropped, which is right only if they are padding (check the model's "
               "vocab size and make-vocab-size-divisible-by)")
    if config.strict():
        raise PlanError(message + ". CKPTSHIM_STRICT=1 refuses this.")
    logger.warning("%s: %s", HOOK, message)


def _targets(layers: Mapping[int, nn.Module]) -> tuple[
        Inventory, dict[KeyPath, torch.Tensor], dict[KeyPath, torch.Tensor], TargetFacts]:
    """The stage's tensors under NeoX's ``sequential.<index>`` names, the live tensors, the
    buffers the layers recompute themselves, and what the layers know: buffers to drop
    (non-persistent) or keep (persistent, derivable)."""
    entries, destinations, recomputed = [], {}, {}
    drop, synthesize = set(), set()
    for index, layer in layers.items():
        layout = module_layout(layer)
        prefix = (neox.SEQUENTIAL, str(index))
        entries += tensor_inventory(layout.tensors.items(), "", prefix).values()
        destinations.update((prefix + split_key(name), tensor) for name, tensor in layout.tensors.items())
        recomputed.update(recomputed_buffers(layout, prefix))
        facts = module_facts(layout, prefix=prefix)
        drop |= facts.drop
        synthesize |= facts.synthesize
    return (Inventory(entries, "pipeline layers"), destinations, recomputed,
            TargetFacts(frozenset(drop), frozenset(synthesize)))


def _shard_shape(key: KeyPath, shape: tuple[int, ...], degree: int) -> tuple[int, ...]:
    """One rank's shape of NeoX tensor ``key`` of whole ``shape``, by the op that splits it
    (checked to split evenly); a tensor NeoX has no rule for is refused above degree 1, unless
    it is a derivable buffer (each rank holds it whole)."""
    if degree == 1:
        return shape
    spread = neox.spread(key)
    if spread is None and derivable_rule(key) is None:
        raise PlanError(f"{join_key(key)}: no tensor-parallel rule for this tensor, so ckptshim "
                        f"cannot tell how {degree} ranks split it; ckptshim knows GPT-NeoX's own layers.")
    return (spread or neox.REPLICATED).split(key, neox.shard_keys(key, degree), shape)[1]
