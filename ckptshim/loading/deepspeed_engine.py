"""``DeepSpeedEngine.load_checkpoint`` at another data-parallel size: the ZeRO partitions of N
ranks re-cut for the engine's M ranks, inside DeepSpeed's own load.

DeepSpeed refuses a ZeRO checkpoint written by another number of data-parallel ranks
(``ZeRORuntimeException: The checkpoint being loaded used a DP world size of N but the current
world size is M``); its way out is an offline conversion to a "universal" checkpoint. Here the
engine's own ``load_checkpoint`` runs as it would for N == M -- the module weights, the
learning-rate scheduler, ``global_steps`` and the client state come from DeepSpeed's own
reading of the model states -- except for the one step that refuses: ``_load_zero_checkpoint``.
In its place each rank hands its ZeRO optimizer's own ``load_state_dict`` the state dict that
DeepSpeed would have saved for this rank at M ranks: its fp32 partition and the Adam moments
(``exp_avg``, ``exp_avg_sq``) of exactly the elements its new partition holds, read by name from
the saved partitions that hold them (:meth:`ZeroCheckpoint.read_elements
<ckptshim.formats.deepspeed_zero.ZeroCheckpoint.read_elements>`, never the whole model), and
the optimizer's ``step``, hyperparameters and loss scaler as saved. DeepSpeed's own code then
pads, copies, re-links and (ZeRO-3) refreshes the 16-bit partitions as at any resume.

The partition geometry is the live engine's (``round_robin_bit16_groups`` and their alignment
paddings under ZeRO-1/2; each parameter's ``ceil(numel / M)`` piece under ZeRO-3), filled by
parameter name, so a world size that changes the padding or the round-robin order changes
nothing. Every value is computed before DeepSpeed's load starts: a checkpoint ckptshim cannot
re-cut raises before the engine is touched.

Trust boundary: DeepSpeed unpickles its files with ``weights_only=False``. Before it runs --
also where N == M and DeepSpeed's own load runs untouched -- every model- and optimizer-state
file of the tag folder is read through ckptshim's allow-listed unpickler, and one that needs any
other global is refused (:mod:`ckptshim.formats.deepspeed_zero`).
"""

from __future__ import annotations

import copy
import glob
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ckptshim.errors import NoPlan
from ckptshim.execute.destinations import as_tensor
from ckptshim.formats import deepspeed_pipeline, deepspeed_zero
from ckptshim.formats.deepspeed_zero import MOMENTS, ZeroCheckpoint
from ckptshim.formats.torch_globals import TensorRef, dtype_of
from ckptshim.log import logger

HOOK = "deepspeed DeepSpeedEngine.load_checkpoint"
#: Where DeepSpeed's engine would unpickle files of a tag folder (its own names).
_STATE_FILES = ("*model_states.pt", "*optim_states.pt")


def load_checkpoint(engine: Any, call: Mapping[str, Any], native: Callable[[], Any]) -> Any:
    """``engine.load_checkpoint(**call)``: DeepSpeed's own, after ckptshim has read every file it
    would unpickle; with the ZeRO partitions re-cut where the checkpoint's data-parallel size is
    not the engine's (:class:`~ckptshim.errors.NoPlan` where that cannot be done exactly)."""
    load_dir = Path(call["load_dir"])
    tag = _tag(engine, load_dir, call["tag"])
    if tag is None:
        return native()  # no ``latest``: DeepSpeed warns and returns (None, None), reading nothing
    folder = load_dir / tag
    source = deepspeed_zero.open_checkpoint(folder) if deepspeed_zero.sniff(folder) else None
    try:
        _read_other_files(engine, load_dir, tag, source)
        if source is None or not engine.zero_optimization() or source.world == engine.seq_dp_world_size:
            return native()
        reason = _why_not(engine, source, call)
        if reason:
            raise NoPlan(f"{HOOK}: the ZeRO checkpoint {folder} was written by {source.world} data-parallel "
                         f"ranks and the engine has {engine.seq_dp_world_size}; ckptshim re-cuts its partitions "
                         f"only {reason}.")
        source.require_complete()
        state = (_zero3_state if source.stage == 3 else _zero12_state)(engine.optimizer, source)
        frozen = _zero3_frozen(engine, source) if source.stage == 3 else {}
    finally:
        if source is not None:
            source.close()
    logger.info("%s: ZeRO-%d checkpoint of %d data-parallel ranks re-cut for %d (rank %d read only the "
                "elements of its own partition)", HOOK, source.stage, source.world, engine.seq_dp_world_size,
                _dp_rank(engine.optimizer))
    return _resume(engine, source.stage, state, frozen, native)


# -- which files, which tag --------------------------------------------------------------------------

def _tag(engine: Any, load_dir: Path, tag: Any) -> str | None:
    """The tag DeepSpeed loads: the caller's, or what ``latest`` (``latest_universal``) says."""
    if tag is not None:
        return str(tag)
    latest = load_dir / ("latest_universal" if engine.load_universal_checkpoint() else "latest")
    if not latest.is_file():
        return None
    try:  # as DeepSpeed reads it; what it cannot read, DeepSpeed fails on before it unpickles anything
        return deepspeed_pipeline.read_latest(latest).decode().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _read_other_files(engine: Any, load_dir: Path, tag: str, source: ZeroCheckpoint | None) -> None:
    """Read, through the allow-listed unpickler, every file DeepSpeed may unpickle that opening
    ``source`` has not: the tag folder's model- and optimizer-state files (a damaged partition
    ``source`` only listed as a problem included), those DeepSpeed's own glob for the model
    states finds (its pattern, metacharacters in ``load_dir`` included), and for universal
    checkpoints and MoE experts every ``.pt`` below the folder. A file that needs a global
    ckptshim does not allow is refused; so is one it cannot read."""
    folder = load_dir / tag
    found: set[Path] = set()
    if folder.is_dir():
        found |= {child for child in folder.iterdir() if any(fnmatch(child.name, p) for p in _STATE_FILES)}
        if engine.load_universal_checkpoint() or engine.has_moe_layers:
            found |= {Path(name) for name in glob.glob(glob.escape(str(folder)) + "/**/*.pt", recursive=True)}
    for rank in (None, "0"):  # this rank's model states, and dp rank 0's (a ZeRO-3 re-cut reads those)
        found |= {Path(name) for name in glob.glob(engine._get_ckpt_name(str(load_dir), tag, mp_placeholder="*",
                                                                          pp_placeholder=rank))}
    read = source.files_read if source is not None else frozenset()
    for file in sorted(found - read):
        if file.is_file():
            deepspeed_zero.read_state_file(file)


def _why_not(engine: Any, source: ZeroCheckpoint, call: Mapping[str, Any]) -> str:
    """Why this load is not one ckptshim re-cuts (``""`` when it is)."""
    if engine.optimizer is None or not hasattr(engine.optimizer, "load_state_dict"):
        return "into an engine with a ZeRO optimizer"
    if not call["load_optimizer_states"] or call["load_module_only"]:
        return "when the optimizer states are loaded (DeepSpeed's own load without them needs no re-cut)"
    if engine.load_universal_checkpoint() or engine.has_moe_layers or engine.zero_nvme_offload_optimizer():
        return "for an engine without universal checkpointing, MoE layers or NVMe offload"
    if getattr(engine.optimizer, "elastic_checkpoint", False):
        return "for an engine without zero_optimization.elastic_checkpoint"
    if engine.mp_world_size != 1:
        return "for an engine without model parallelism"
    if engine.zero_optimization_stage() != source.stage:
        return f"into an engine of the same ZeRO stage (the checkpoint's is {source.stage})"
    live = {name: tuple(shape) for group in engine._get_zero_param_shapes() for name, shape in group.items()}
    saved = {name: slot.shape for name, slot in source.slots.items()}
    if live != saved:
        return f"into an engine with the checkpoint's trainable parameters (they differ at {_differ(live, saved)})"
    frozen = {name: tuple(param.ds_shape) for name, param in _frozen_params(engine).items()}
    if source.frozen and frozen != {name: entry.shape for name, entry in source.frozen.items()}:
        return (f"into an engine with the checkpoint's frozen parameters (they differ at "
                f"{_differ(frozen, {name: entry.shape for name, entry in source.frozen.items()})})")
    extra = sorted({key for rank in source.ranks.values() for state in _group_states(source, rank)
                    for key, value in state.items() if _per_element(value) and key not in MOMENTS})
    if extra:
        return f"for the optimizer states {list(MOMENTS)} (the checkpoint also has {extra})"
    return ""


def _differ(live: Mapping[str, tuple], saved: Mapping[str, tuple]) -> list[str]:
    """The first few names where two ``{name: shape}`` mappings differ."""
    return (sorted(set(live) ^ set(saved)) or sorted(n for n in live if live[n] != saved[n]))[:5]


# -- this rank's state dict at M ranks -------------------------------------------------------------

def _dp_rank(optimizer: Any) -> int:
    import deepspeed.comm as dist

    return dist.get_rank(group=optimizer.dp_process_group)


def _group_states(source: ZeroCheckpoint, rank: Any) -> list[dict]:
    """The saved torch optimizer's state of each flat group (sub-group), as read."""
    inner = rank.optimizer.get("optimizer_state_dict" if source.stage == 3 else "base_optimizer_state")
    states = inner.get("state") if isinstance(inner, dict) else None
    return list(states.values()) if isinstance(states, dict) else []


def _per_element(value: Any) -> bool:
    return isinstance(value, TensorRef) and len(value.shape) > 0


def _cut(source: ZeroCheckpoint, layout: Sequence[tuple[str | None, int, int]], state: str | None) -> torch.Tensor:
    """A flat float32 partition laid out as ``layout`` says: ``(parameter, first element, elements)``
    per run (``None``: padding, zeros), each run read from the saved partitions."""
    runs = [np.zeros(count, np.float32) if name is None else source.read_elements(name, state, start, start + count)
            for name, start, count in layout]
    return torch.from_numpy(np.concatenate(runs) if runs else np.zeros(0, np.float32))


def _zero12_layout(optimizer: Any, group: int) -> list[tuple[str | None, int, int]]:
    """This rank's partition of ZeRO-1/2 group ``group`` in the live engine: the round-robin
    ordered parameters with their alignment paddings, cut into equal ``partition_size`` pieces."""
    import deepspeed.comm as dist

    size = int(optimizer.partition_size[group])
    start = dist.get_rank(group=optimizer.real_dp_process_group[group]) * size
    stop, layout, offset = start + size, [], 0
    for param, padding in zip(optimizer.round_robin_bit16_groups[group], optimizer.round_robin_bit16_padding[group]):
        for name, length in ((optimizer.param_names[param], param.numel()), (None, padding)):
            lo, hi = max(start, offset), min(stop, offset + length)
            if lo < hi:
                layout.append((name, lo - offset, hi - lo) if name is not None else (None, 0, hi - lo))
            offset += length
    if offset < stop:
        layout.append((None, 0, stop - max(start, offset)))
    return layout


def _zero3_layout(optimizer: Any, sub_group: int) -> list[tuple[str | None, int, int]]:
    """This rank's partition of ZeRO-3 sub-group ``sub_group``: each parameter's ``rank``-th
    piece of ``partition_numel()`` elements (the last piece padded with zeros)."""
    rank = _dp_rank(optimizer)
    layout = []
    for param in optimizer.fp16_groups[sub_group]:
        piece = param.partition_numel()
        layout.append((optimizer.param_names[param], rank * piece, piece))
    found = sum(count for _, _, count in layout)
    if found != optimizer.fp32_partitioned_groups_flat[sub_group].numel():
        raise NoPlan(f"{HOOK}: ZeRO-3 sub-group {sub_group} holds {optimizer.fp32_partitioned_groups_flat[sub_group].numel()} "
                     f"elements on this rank but its parameters' pieces {found}; ckptshim does not know this layout.")
    return layout


def _torch_state(source: ZeroCheckpoint, saved: Mapping[str, Any], key: str, layouts: Sequence[list],
                 held_in: Sequence[Sequence[int]], param_groups: Sequence[Sequence[int]]) -> dict:
    """The torch optimizer's state dict for this rank. Per live flat group (``layouts``), the
    moments re-cut to its layout and the other states (``step``) of the saved flat groups that
    held its parameters (``held_in``), which must agree: a flat group only buckets per-parameter
    states. The saved hyperparameters, param group ``g`` listing the flat groups
    ``param_groups[g]``."""
    rank = source.ranks[min(source.ranks)]
    states = _group_states(source, rank)
    groups = saved[key].get("param_groups") if isinstance(saved[key], dict) else None  # an elastic one: a list
    if not isinstance(groups, list) or len(groups) != len(param_groups):
        raise NoPlan(f"{HOOK}: the checkpoint's optimizer has {len(groups) if isinstance(groups, list) else 'no'} "
                     f"param group(s), the engine's {len(param_groups)}; ckptshim re-cuts only the same groups.")
    out = {}
    for index, (layout, held) in enumerate(zip(layouts, held_in)):
        scalars = [{name: _value(rank, value, name) for name, value in states[old].items() if name not in MOMENTS}
                   for old in held]
        if len({tuple(states[old]) for old in held}) > 1 or any(not _same(other, scalars[0]) for other in scalars):
            raise NoPlan(f"{HOOK}: the checkpoint's flat groups {list(held)} hold flat group {index}'s parameters "
                         "with different optimizer states besides the moments; ckptshim re-cuts only equal ones.")
        out[index] = {name: _cut(source, layout, name) if name in MOMENTS else scalars[0][name]
                      for name in (states[held[0]] if held else ())}
    return {"state": out, "param_groups": [{**_plain(group, "param_groups"), "params": list(members)}
                                           for group, members in zip(groups, param_groups)]}


def _zero12_state(optimizer: Any, source: ZeroCheckpoint) -> dict:
    """What ``DeepSpeedZeroOptimizer.state_dict()`` would have saved on this rank at M ranks
    (one flat group per param group, at any world size)."""
    saved = source.ranks[min(source.ranks)].optimizer
    layouts = [_zero12_layout(optimizer, group) for group in range(len(optimizer.round_robin_bit16_groups))]
    if len(_group_states(source, source.ranks[min(source.ranks)])) != len(layouts):
        raise NoPlan(f"{HOOK}: the checkpoint's optimizer has other flat groups than the engine's "
                     f"{len(layouts)}; ckptshim re-cuts only the same groups.")
    groups = [[group] for group in range(len(layouts))]
    return {
        **_globals(optimizer, saved),
        "clip_grad": _plain(saved.get("clip_grad", optimizer.clip_grad), "clip_grad"),
        "base_optimizer_state": _torch_state(source, saved, "base_optimizer_state", layouts, groups, groups),
        "single_partition_of_fp32_groups": [_cut(source, layout, None) for layout in layouts],
        "param_alignment_paddings": optimizer.round_robin_bit16_padding,  # the layout the cut follows
    }


def _zero3_state(optimizer: Any, source: ZeroCheckpoint) -> dict:
    """What ``DeepSpeedZeroOptimizer_Stage3.state_dict()`` would have saved on this rank at M
    ranks. Its sub-groups are the engine's (``sub_group_size`` buckets each param group by the
    elements of a rank's partition, so their number changes with the world size); each is filled
    from the saved sub-groups holding its parameters, which must be of the same param group."""
    saved = source.ranks[min(source.ranks)].optimizer
    if saved.get("ds_zero_partition_groups") is not None:
        raise NoPlan(f"{HOOK}: the checkpoint records AutoEP partition groups, which ckptshim does not re-cut.")
    layouts = [_zero3_layout(optimizer, group) for group in range(len(optimizer.fp16_groups))]
    held_in = [sorted({source.flat_group_of(name) for name, _, _ in layout}) for layout in layouts]
    members = [[sub for sub, group in sorted(optimizer.sub_group_to_group_id.items()) if group == index]
               for index in range(len(optimizer.optimizer.param_groups))]
    saved_groups = saved["optimizer_state_dict"].get("param_groups")
    saved_members = [group.get("params") if isinstance(group, dict) else None for group in saved_groups] \
        if isinstance(saved_groups, list) else []
    for index, subs in enumerate(members):
        stray = [old for sub in subs for old in held_in[sub]
                 if index >= len(saved_members) or old not in (saved_members[index] or ())]
        if stray:
            raise NoPlan(f"{HOOK}: the engine's param group {index} holds parameters the checkpoint kept in "
                         f"another param group (its flat groups {sorted(set(stray))}); ckptshim re-cuts only the "
                         "same param groups.")
    return {
        **_globals(optimizer, saved),
        "optimizer_state_dict": _torch_state(source, saved, "optimizer_state_dict", layouts, held_in, members),
        "fp32_flat_groups": [_cut(source, layout, None) for layout in layouts],
    }


def _frozen_params(engine: Any) -> dict[str, Any]:
    """The engine's ZeRO-3 parameters its optimizer does not own, by name: those DeepSpeed saves
    in ``frozen_param_fragments`` (``_get_zero_frozen_param_attributes``)."""
    from deepspeed.runtime.utils import is_optimized_parameter

    return {engine.param_names[param]: param for param in engine.module.parameters()
            if hasattr(param, "ds_id") and not is_optimized_parameter(param)}


def _zero3_frozen(engine: Any, source: ZeroCheckpoint) -> dict[str, torch.Tensor]:
    """What ``frozen_param_fragments`` would hold on this rank at M ranks: each frozen
    parameter's ``ceil(numel / M)`` piece (``ds_tensor``), in the dtype it was saved in, read
    from the saved ranks' pieces that hold it."""
    rank, out = _dp_rank(engine.optimizer), {}
    for name, param in _frozen_params(engine).items():
        if name in source.frozen:
            piece = param.ds_tensor.numel()
            values = source.read_frozen_elements(name, rank * piece, (rank + 1) * piece)
            out[name] = as_tensor(values, getattr(torch, source.frozen[name].dtype))
    return out


def _globals(optimizer: Any, saved: Mapping[str, Any]) -> dict:
    """The optimizer's saved scalars, and its loss scaler: the engine's own object with the saved
    attributes (the file holds them as inert data, never as a DeepSpeed object)."""
    scaler = copy.copy(optimizer.loss_scaler)
    record = saved.get("loss_scaler")
    if isinstance(record, dict):
        if set(record) != set(vars(scaler)):
            raise NoPlan(f"{HOOK}: the checkpoint's loss scaler has the attributes {sorted(record)}, the engine's "
                         f"{type(scaler).__name__} {sorted(vars(scaler))}; ckptshim restores only the same kind.")
        vars(scaler).update(_plain(dict(record), "loss_scaler"))
    return {"loss_scaler": scaler, "ds_version": _plain(saved.get("ds_version"), "ds_version"),
            **{key: _plain(saved[key], key) for key in ("dynamic_loss_scale", "overflow") if key in saved}}


def _same(one: Mapping[str, Any], other: Mapping[str, Any]) -> bool:
    """Whether two flat groups' scalar states (``step``...) are equal, tensors bit for bit."""
    return one.keys() == other.keys() and all(
        torch.equal(a, b) if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) else
        type(a) is type(b) and a == b for a, b in ((one[k], other[k]) for k in one))


def _value(rank: Any, value: Any, name: str) -> Any:
    """A saved scalar state (``step``): a 0-d tensor read from the rank's file, or plain data."""
    if isinstance(value, TensorRef):
        if math.prod(value.shape) != 1:
            raise NoPlan(f"{HOOK}: optimizer state {name!r} of shape {list(value.shape)} is not a scalar ckptshim knows")
        return torch.from_numpy(np.array(rank.read(value))).reshape(value.shape)
    return _plain(value, name)


def _plain(value: Any, name: str) -> Any:
    """``value`` if it is plain data (numbers, strings, containers of them; a torch dtype, as a
    dynamic loss scaler keeps one), else :class:`NoPlan`."""
    if value is None or type(value) in (bool, int, float, str):
        return value
    dtype = dtype_of(value)
    if dtype is not None:
        return getattr(torch, dtype)
    if type(value) in (list, tuple):
        return type(value)(_plain(item, name) for item in value)
    if type(value) is dict:
        return {key: _plain(item, name) for key, item in value.items()}
    raise NoPlan(f"{HOOK}: the checkpoint's {name} holds a {type(value).__name__}, which ckptshim does not carry over")


# -- DeepSpeed's own load, with the re-cut state -----------------------------------------------------

def _resume(engine: Any, stage: int, state: dict, frozen: Mapping[str, torch.Tensor], native: Callable[[], Any]) -> Any:
    """DeepSpeed's own ``load_checkpoint``, its ZeRO step handed ``state`` for this rank; under
    ZeRO-3 every rank reads dp rank 0's model states (as DeepSpeed's universal load does: they
    hold placeholders and whole buffers, and an added rank has no file of its own), and its
    ``load_module_state_dict`` copies this rank's pieces of the frozen parameters (``frozen``)
    where dp rank 0's file has its own."""
    optimizer = engine.optimizer

    def load_zero_checkpoint(load_dir: str, tag: str, load_optimizer_states: bool = True) -> bool:
        states: list[dict | None] = [None] * engine.seq_dp_world_size
        states[_dp_rank(optimizer)] = state
        optimizer.load_state_dict(state_dict_list=states, load_optimizer_states=load_optimizer_states,
                                  load_from_fp32_weights=engine.zero_load_from_fp32_weights())
        return True

    overrides: dict[str, Any] = {"_load_zero_checkpoint": load_zero_checkpoint}
    if stage == 3:
        def model_state_files(checkpoints_path: str, tag: str) -> list[str]:
            return sorted(glob.glob(engine._get_ckpt_name(checkpoints_path, tag, mp_placeholder="*",
                                                          pp_placeholder="0")))
        overrides["_get_all_ckpt_names"] = model_state_files

        def load_module_state_dict(checkpoint: dict, *args: Any, **kwargs: Any) -> Any:
            if checkpoint.get("frozen_param_fragments") is not None:
                checkpoint = {**checkpoint, "frozen_param_fragments": frozen}
            return type(engine).load_module_state_dict(engine, checkpoint, *args, **kwargs)
        overrides["load_module_state_dict"] = load_module_state_dict
    with _instance_overrides(engine, overrides):
        return native()


@contextmanager
def _instance_overrides(instance: Any, overrides: Mapping[str, Any]) -> Iterator[None]:
    """``overrides`` as attributes of ``instance`` (shadowing its class's methods) for one call;
    afterwards the instance's own attributes are as they were."""
    saved = {name: vars(instance)[name] for name in overrides if name in vars(instance)}
    for name, value in overrides.items():
        setattr(instance, name, value)
    try:
        yield
    finally:
        for name in overrides:
            delattr(instance, name)
        for name, value in saved.items():
            setattr(instance, name, value)
