"""``set_model_state_dict``/``set_state_dict`` loads of state dicts saved under another wrapping.

torch's ``set_model_state_dict`` expects the model's canonical keys, which it derives by walking
the model -- and which keep ``_orig_mod.`` when ``torch.compile`` sits inside an activation
checkpoint wrapper, so a plain model's state dict is refused there, and a stacked-layer one
anywhere. :func:`prepare` plans the given keys against the keys ``get_model_state_dict``
reports for the model and returns a re-keyed dict for torch's own call: renamed entries are the
same tensors, unstacked layers and parts of fused ones views, synthesized buffers the model's own
values, and assembled targets (stacked layers, fused experts) the model's own tensors, written
source by source through views (no second copy) by
:meth:`~ckptshim.execute.torch.Prepared.write_assembled` -- all checked by the torch executor
before anything is written. Optimizer state follows renamed keys (:func:`renamed_optimizer`).
A strict load that does not fit is torch's to refuse (:class:`~ckptshim.errors.NoPlan`: the
hook runs torch's own call, with ckptshim's diagnosis as a note on its error); a non-strict one
leaves missing and unexpected keys -- tied twins and kept buffers included -- for torch to report.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ckptshim.execute.torch import Prepared, prepare as prepare_writes
from ckptshim.inventory import Inventory, KeyPath, join_key, split_key
from ckptshim.loading.report import report_load
from ckptshim.loading.torch import TORCH_REPORTS, module_facts, recomputed_buffers, tensor_inventory, tied_groups
from ckptshim.loading.torch_layout import ModuleLayout, module_layout
from ckptshim.log import logger
from ckptshim.ops import Rename
from ckptshim.planner import Plan
from ckptshim.planner import plan as make_plan
from ckptshim.rules import TargetFacts
from ckptshim.rules.context import LoadContext
from ckptshim.rules.prefixes import strip_wrappers
from ckptshim.rules.profiles import rules_for
from ckptshim.targets.derived import OwnBuffers


@dataclass(frozen=True)
class Rekeyed:
    """A checked ``set_model_state_dict`` load: the plan, the state dict under the model's keys,
    and the writes of assembled targets to make right before torch's own call."""

    plan: Plan
    state_dict: dict[str, Any]
    writes: Prepared


def prepare(model: nn.Module, state_dict: Mapping[str, Any], strict: bool = True) -> Rekeyed | None:
    """Plan and check the whole load (nothing is written); ``None`` when nothing needs doing, or
    when the load is torch's to decide.

    ``strict`` is the caller's ``StateDictOptions.strict``: a strict load that does not fit raises
    :class:`~ckptshim.errors.NoPlan` here, before anything is written (the hook then runs torch's
    own call), unless the model completes its own state dict on load (a load hook or
    ``_load_from_state_dict`` override): torch then decides (``None``). A non-strict one leaves
    missing and unexpected keys for torch to report.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    if not state_dict or any(isinstance(key, nn.Module) for key in state_dict):
        return None  # per-submodule dicts: torch prefixes them itself
    try:
        current = get_model_state_dict(model)
    except (RuntimeError, AttributeError) as error:  # a model torch cannot name the state dict of
        logger.debug("set_model_state_dict: get_model_state_dict fails (%s); torch's own call will "
                     "say why", error)
        return None
    if current.keys() == state_dict.keys():
        return None
    tensors = {k: v for k, v in current.items() if isinstance(v, torch.Tensor)}
    target = tensor_inventory(tensors.items(), f"{type(model).__name__} model")
    source = tensor_inventory(((k, v) for k, v in state_dict.items() if isinstance(v, torch.Tensor)),
                              "the given model state dict")
    layout = module_layout(model)
    facts = _model_facts(model, layout, target, {split_key(k): v for k, v in tensors.items()})
    plan = make_plan(source, target, rules_for(LoadContext(source, target, "torch", facts)))
    if plan.is_identity or (strict and not plan.complete and layout.own_load_logic):
        return None
    writes = prepare_writes(plan, lambda key: state_dict[join_key(key)],
                            {split_key(k): v for k, v in tensors.items()},
                            allow_missing=not strict, allow_unexpected=not strict,
                            own_buffers=OwnBuffers(recomputed_buffers(layout)))
    plan = plan.undropped(writes.unexpected)  # left for torch to report (a non-strict load)
    if not strict:
        plan = plan.left_undone(TORCH_REPORTS)
        if not plan.counts():
            return None
    used = {join_key(key) for op in plan.ops for key in op.sources}
    missing = frozenset(plan.missing)
    rekeyed = {key: value for key, value in state_dict.items() if key not in used}
    rekeyed.update((join_key(key), value) for key, value in writes.values.items() if key not in missing)
    report_load(f"set_model_state_dict({type(model).__name__})", plan)
    return Rekeyed(plan, rekeyed, writes)


def _model_facts(model: nn.Module, layout: ModuleLayout, target: Inventory,
                 tensors: Mapping[KeyPath, torch.Tensor]) -> TargetFacts:
    """The model's own facts (:func:`~ckptshim.loading.torch.module_facts`), named as
    ``get_model_state_dict`` names its ``tensors`` (without wrapper hops): its persistent
    derivable buffers, and its tied weights."""
    facts = module_facts(layout, model)
    buffers = {strip_wrappers(key) for key in facts.synthesize}
    return dataclasses.replace(facts, synthesize=frozenset(k for k in target if strip_wrappers(k) in buffers),
                               tied=tied_groups(tensors.items()))


def renamed_optimizer(plan: Plan, optim_state_dict: Any) -> Any:
    """The optimizer state dict with parameter keys renamed as the model's were."""
    names = {join_key(op.source): join_key(op.target) for op in plan.ops
             if op.kind == Rename.kind and op.source != op.target}
    if not names or not isinstance(optim_state_dict, Mapping):
        return optim_state_dict
    out = dict(optim_state_dict)
    if isinstance(out.get("state"), Mapping):
        out["state"] = {names.get(k, k): v for k, v in out["state"].items()}
    if isinstance(out.get("param_groups"), list):
        out["param_groups"] = [
            {**group, "params": [names.get(p, p) for p in group["params"]]} if isinstance(group, Mapping)
            and isinstance(group.get("params"), list) else group for group in out["param_groups"]]
    return out
