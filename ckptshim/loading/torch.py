"""Loading into torch modules and state dicts: the target side, its rules, and module loads.

Every torch load -- ``load_state_dict``, ``set_model_state_dict``, ``dcp.load``, a DeepSpeed
stage -- builds its target here: :func:`~ckptshim.loading.torch_layout.module_layout` reads what
a module's ``load_state_dict`` accepts off the live module tree, :func:`tensor_inventory` turns named
tensors into an inventory, and :func:`module_facts` / :func:`state_dict_facts` say what the
target knows beyond names and shapes (non-persistent buffers, derivable buffers, tied weights,
transformers' conversion mapping) for :func:`ckptshim.rules.profiles.rules_for`.

:func:`prepare_module_load` is the ``load_state_dict`` load. **Rewrite, not execute.** Once the
plan is checked, torch's own ``load_state_dict`` is called with a rewritten state dict whose
keys are the ones the module accepts: renamed sources under their target names, ``select``
views for unstacked layers, the module's own tensor for synthesized buffers, drops left out --
and, in a non-strict load, whatever the plan leaves unused (unexpected keys, non-tensor
values) as given, so that torch reports them as it would without ckptshim. A non-strict load
also leaves to torch what changes no value (:data:`TORCH_REPORTS`: tied twins, kept buffers,
dropped keys), which torch then lists as missing or unexpected as it would had the checkpoint
been saved from the module; one the plan does not otherwise change goes to torch untouched.
Where no plan makes the state dict fit, :class:`~ckptshim.errors.NoPlan` is raised before
anything is written, and the hook runs torch's own call. Executing the plan ourselves would
bypass what modules do in their loading code -- ``_load_from_state_dict`` overrides, load pre-/post-hooks (the checkpoint wrapper re-adds its
prefix in one), version upgrades keyed by ``state_dict._metadata`` (carried over to the new
names), ``assign=True`` and swap semantics -- and torch's own ``_IncompatibleKeys``. What a dict
cannot express without a second full copy -- a target assembled from several sources (stacked
layers, fused experts) or reordered along an axis -- is written through views of the
destination by :mod:`ckptshim.execute.torch`, right before the call, and passed as itself. All
checks run before the first write (see that module).

Modules ckptshim cannot see through are left to torch: lazy parameters, ``_extra_state``, and
FSDP1 (flat parameters whose shapes are not the checkpoint's). And when a strict load does not
fit but a module transforms its own state dict on load (a load hook or
``_load_from_state_dict`` override, e.g. BatchNorm filling in ``num_batches_tracked`` for old
checkpoints), torch decides, with its own error if it fails. What a module's ``load_state_dict``
accepts, and whether a state dict already fits, is :mod:`ckptshim.loading.torch_layout`'s
(all an idle hook needs).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from ckptshim.errors import NoPlan
from ckptshim.execute.torch import prepare
from ckptshim.inventory import Entry, Inventory, KeyPath, dtype_name, join_key, split_key
from ckptshim.loading.report import report_load
from ckptshim.loading.torch_layout import ModuleLayout
from ckptshim.log import logger
from ckptshim.ops import Drop, DropIfDerived, Synthesize, Tie
from ckptshim.planner import plan as make_plan
from ckptshim.rules import TargetFacts
from ckptshim.rules.buffers import derivable_rule
from ckptshim.rules.context import LoadContext
from ckptshim.rules.prefixes import WRAPPER_SEGMENTS, strip_wrappers
from ckptshim.rules.profiles import rules_for
from ckptshim.rules.profiles.transformers_mapping import ConversionLayout, from_module
from ckptshim.targets.derived import OwnBuffers, mismatch
from ckptshim.targets.tensors import values_of

def tensor_inventory(items: Iterable[tuple[str, torch.Tensor]], source: str, prefix: KeyPath = ()) -> Inventory:
    """The inventory of named tensors (dotted names split into key paths, under ``prefix``).

    Raises ``ValueError`` for a dtype ckptshim has no name for (see :func:`dtype_name`).
    """
    return Inventory([Entry(prefix + split_key(name), tuple(tensor.shape), dtype_name(tensor.dtype))
                      for name, tensor in items], source)


def module_facts(layout: ModuleLayout, module: nn.Module | None = None, prefix: KeyPath = ()) -> TargetFacts:
    """What a live module knows: its non-persistent buffers (a checkpoint's copy is dropped), its
    persistent derivable buffers (kept when the checkpoint lacks them), its tied weights, and,
    for a transformers model, the conversion mapping transformers publishes for it."""
    keys = [prefix + split_key(key) for key in layout.buffers]
    return TargetFacts(
        drop=frozenset(prefix + strip_wrappers(split_key(key)) for key in layout.non_persistent),
        synthesize=frozenset(key for key in keys if derivable_rule(strip_wrappers(key)) is not None),
        tied=tied_groups((prefix + split_key(key), tensor) for key, tensor in layout.tensors.items()),
        layouts=_published_layouts(module))


def model_config_of(module: nn.Module) -> dict | None:
    """A transformers model's own config, as its ``config.json`` would say it (the head counts a
    decoder's layout depends on); ``None`` for any other module."""
    to_dict = getattr(getattr(module, "config", None), "to_dict", None)
    config = to_dict() if callable(to_dict) else None
    return config if isinstance(config, dict) else None


def _published_layouts(module: nn.Module | None) -> tuple[ConversionLayout, ...]:
    """The layouts a live module publishes for its own checkpoints: transformers' conversion
    mapping of each transformers model in it."""
    return tuple(map(ConversionLayout, from_module(module))) if module is not None else ()


def recomputed_buffers(layout: ModuleLayout, prefix: KeyPath = ()) -> dict[KeyPath, torch.Tensor]:
    """The module's non-persistent buffers by key: what it computes itself, which a checkpoint's
    copy of a buffer derived from settings (``inv_freq``) must equal to be dropped."""
    return {prefix + split_key(key): tensor for key, tensor in layout.non_persistent.items()}


def state_dict_facts(tensors: Mapping[KeyPath, torch.Tensor], model: nn.Module | None = None) -> TargetFacts:
    """What a state dict knows: nothing says which entries are buffers. So an entry named like a
    derivable buffer may keep its own value when the checkpoint lacks it only where that value is
    what its rule derives (a causal mask, positions, a family constant); one derived from settings
    (``inv_freq``) looks like any trained tensor, and stays missing. Entries that are one tensor
    under two names are tied weights; and where the ``model`` the state dict belongs to is known,
    transformers' conversion mapping for it applies."""
    return TargetFacts(
        synthesize=frozenset(key for key, tensor in tensors.items()
                             if (rule := derivable_rule(strip_wrappers(key))) is not None
                             and mismatch(rule, tensor) is None),
        tied=tied_groups(tensors.items()),
        layouts=_published_layouts(model))


def tied_groups(named: Iterable[tuple[KeyPath, torch.Tensor]]) -> frozenset[frozenset[KeyPath]]:
    """The keys that name one tensor: one parameter under two names, or the same elements of one
    storage (what ``state_dict()`` gives for tied weights). Tensors without storage (on the meta
    device, or empty) are tied only when they are the same object: names alone never tie."""
    groups: dict[object, set[KeyPath]] = {}
    for key, tensor in named:
        groups.setdefault(_identity(tensor), set()).add(key)
    return frozenset(frozenset(keys) for keys in groups.values() if len(keys) > 1)


def _identity(tensor: torch.Tensor) -> object:
    """What two tensors share exactly when they are one tensor: the memory of the plain tensor
    behind it (a DTensor's shard, a float8 weight's high-precision tensor). A subclass ckptshim
    does not know, like a tensor without storage, is only ever itself."""
    local = values_of(tensor)
    if type(local) is not torch.Tensor or local.is_meta or not local.numel():
        return id(tensor)
    return (local.device, local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape),
            local.stride(), local.dtype)


#: What a non-strict load leaves to torch, as torch would treat it had the checkpoint been saved
#: from this module: a tied twin (its value is the key it shares storage with), a buffer the
#: module keeps (synthesized), a key not loaded (dropped). None changes a value torch leaves,
#: and torch lists each among the missing or unexpected keys -- which callers rely on:
#: ``safetensors.torch.load_model`` checks the missing keys against the model's shared tensors.
TORCH_REPORTS = frozenset({Tie.kind, Synthesize.kind, Drop.kind, DropIfDerived.kind})


def prepare_module_load(original: Callable[..., Any], native: Callable[[], Any], module: nn.Module,
                        layout: ModuleLayout, state_dict: Mapping[str, Any], strict: bool,
                        assign: bool) -> Callable[[], Any]:
    """Plan and check ``module.load_state_dict(state_dict)``; return the call that writes
    (nothing is written here): torch's ``original`` with the rewritten state dict, or ``native``
    (the caller's own call, unchanged) for loads that are torch's to decide, and for those the
    plan would not change at all."""
    tensors = {key: value for key, value in state_dict.items() if isinstance(value, torch.Tensor)}
    others = [key for key in state_dict if key not in tensors]
    if others and layout.own_load_logic:
        logger.debug("load_state_dict: %s transforms its own state dict on load, which holds "
                     "non-tensor values; leaving the load to torch", type(module).__name__)
        return native
    _require_tensors_where_torch_does(others, state_dict, layout, strict)
    try:
        source = tensor_inventory(tensors.items(), "state_dict")
        target = tensor_inventory(layout.tensors.items(), f"{type(module).__name__} module")
    except ValueError:
        logger.debug("load_state_dict: a dtype ckptshim does not know; leaving the load to torch")
        return native
    plan = make_plan(source, target, rules_for(LoadContext(source, target, "torch", module_facts(layout, module),
                                                           target_config=model_config_of(module))))
    if strict and not plan.complete and layout.own_load_logic:
        logger.debug("load_state_dict: the state dict does not fit, but %s transforms its own state "
                     "dict on load; leaving the load to torch", type(module).__name__)
        return native
    destinations = {split_key(key): tensor for key, tensor in layout.tensors.items()}
    prepared = prepare(plan, lambda key: state_dict[join_key(key)], destinations,
                       allow_missing=not strict, allow_unexpected=not strict,
                       own_buffers=OwnBuffers(recomputed_buffers(layout)), lenient="load_state_dict(..., strict=False)")
    plan = plan.undropped(prepared.unexpected)
    if not strict:
        plan = plan.left_undone(TORCH_REPORTS)
        if not plan.counts():
            return native  # every tensor keeps its name: torch's own non-strict load is this plan
    missing = frozenset(plan.missing)
    rewritten: OrderedDict[str, Any] = OrderedDict(
        (join_key(key), value) for key, value in prepared.values.items() if key not in missing)
    # what the plan leaves unused goes to torch as it is, which reports it as it would alone
    rewritten.update((key, state_dict[key]) for key in [*map(join_key, plan.unexpected), *others])
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        rewritten._metadata = _remap_metadata(metadata, layout.module_paths)  # type: ignore[attr-defined]
    report_load(f"load_state_dict({type(module).__name__})", plan)

    def load() -> Any:
        prepared.write_assembled()
        return original(rewritten, strict=strict, assign=assign)

    return load


def _require_tensors_where_torch_does(others: list[str], state_dict: Mapping[str, Any],
                                      layout: ModuleLayout, strict: bool) -> None:
    """The non-tensor entries torch refuses make a load ckptshim has no plan for
    (:class:`~ckptshim.errors.NoPlan`: torch's own call then raises its own error, with this as
    a note): any of them in a strict load (torch calls it unexpected), and one under a name the
    module loads a tensor into (torch cannot copy it). A non-strict load passes the others on to
    torch, which lists them among the unexpected keys, as it does without ckptshim."""
    refused = [key for key in others if strict or key in layout.tensors]
    if refused:
        key = refused[0]
        raise NoPlan(
            f"state_dict[{key!r}] is a {type(state_dict[key]).__name__}, not a tensor; "
            + (f"the module loads a tensor into {key!r}. Put a tensor there, or remove the entry."
               if key in layout.tensors else
               "a strict load_state_dict loads tensors only. Remove it from the state dict, or load "
               "with strict=False: torch then lists it among the unexpected keys."))


def _remap_metadata(metadata: Mapping[str, Any], module_paths: list[str]) -> OrderedDict:
    """Give each module the version metadata its source-side twin was saved with.

    torch looks ``state_dict._metadata`` up by module path; a module whose checkpoint was saved
    under another wrapping would otherwise read no version and be treated as the oldest one.
    """
    by_bare: dict[KeyPath, str] = {}
    for path in metadata:
        by_bare.setdefault(_bare(path), path)
    remapped = OrderedDict(metadata)
    for path in module_paths:
        twin = by_bare.get(_bare(path))
        if path not in remapped and twin is not None:
            remapped[path] = metadata[twin]
    return remapped


def _bare(path: str) -> KeyPath:
    return tuple(part for part in split_key(path) if part not in WRAPPER_SEGMENTS)
