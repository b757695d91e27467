"""``set_model_state_dict``/``set_state_dict`` for state dicts saved under another wrapping.

torch's ``set_model_state_dict`` expects the model's canonical keys, which it derives by walking
the model -- and which keep ``_orig_mod.`` when ``torch.compile`` sits inside an activation
checkpoint wrapper, so a plain model's state dict is refused there, and a stacked-layer one
anywhere. These wrappers plan the given keys against the keys ``get_model_state_dict`` reports
for the model and call the original with a re-keyed dict: renamed entries are the same tensors,
unstacked layers are ``select`` views, synthesized buffers the model's own values, and stacked
targets are written layer by layer into views of the model's own tensors (no second copy), all
checked by the torch executor before anything is written. Optimizer state follows renamed keys.
Missing and unexpected keys are left for torch to report under the caller's ``strict`` option.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ckptshim import config
from ckptshim.execute.torch import Prepared, prepare
from ckptshim.hooks.seam import Seam, guarded
from ckptshim.inventory import Entry, Inventory, dtype_name, join_key, split_key
from ckptshim.log import report_load
from ckptshim.planner import Plan, Rename
from ckptshim.planner import plan as make_plan
from ckptshim.rules import DEFAULT_RULES, Rules
from ckptshim.rules.buffers import derivable_rule
from ckptshim.rules.layers import TORCH_SCAN_AXES
from ckptshim.rules.prefixes import strip_wrappers

HOOK = "torch.distributed.checkpoint.state_dict.set_model_state_dict"
SEAM = Seam("torch-dcp", HOOK, falls_back=True)


def _inventory(values: Mapping[str, Any], source: str) -> Inventory:
    return Inventory([Entry(split_key(k), tuple(v.size()), dtype_name(v.dtype))
                      for k, v in values.items() if isinstance(v, torch.Tensor)], source)


def _rules(target: Inventory) -> Rules:
    return DEFAULT_RULES.extend(
        synthesize=[k for k in target if derivable_rule(strip_wrappers(k)) is not None],
        scan_axes=TORCH_SCAN_AXES, strict=config.strict())


def _plan(model: nn.Module, state_dict: Mapping[str, Any]) -> tuple[Plan, dict[str, Any]] | None:
    """The plan from ``state_dict``'s keys to the model's, or ``None`` when nothing needs doing."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    if not state_dict or any(isinstance(key, nn.Module) for key in state_dict):
        return None  # per-submodule dicts: torch prefixes them itself
    current = get_model_state_dict(model)
    if current.keys() == state_dict.keys():
        return None
    target = _inventory(current, f"{type(model).__name__} model")
    plan = make_plan(_inventory(state_dict, "the given model state dict"), target, _rules(target))
    if plan.is_identity:
        return None
    plan.require_complete(allow_missing=True, allow_unexpected=True)
    return plan, current


def _rekeyed(plan: Plan, state_dict: Mapping[str, Any], current: Mapping[str, Any]) -> tuple[dict[str, Any], Prepared]:
    """The state dict under the model's keys, and the checked load that fills stacked targets.

    Values come from the torch executor: renamed entries are the same tensors, unstacked layers
    ``select`` views, synthesized buffers the model's own values, stacked targets the model's own
    tensors (filled through views by ``Prepared.write_stacked``). Keys the plan does not use
    pass through, for torch to report under the caller's ``strict`` option.
    """
    destinations = {split_key(k): v for k, v in current.items() if isinstance(v, torch.Tensor)}
    prepared = prepare(plan, lambda key: state_dict[join_key(key)], destinations,
                       allow_missing=True, allow_unexpected=True)
    used = {join_key(key) for op in plan.ops for key in op.sources}
    out = {key: value for key, value in state_dict.items() if key not in used}
    out.update((join_key(key), value) for key, value in prepared.values.items())
    return out, prepared


def _renamed_optimizer(plan: Plan, optim_state_dict: Any) -> Any:
    """The optimizer state dict with parameter keys renamed as the model's were."""
    names = {join_key(op.source): join_key(op.target) for op in plan.ops
             if isinstance(op, Rename) and op.source != op.target}
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


def _model_arguments(model, model_state_dict, *, options=None) -> tuple:
    return model, model_state_dict, options


def _state_arguments(model, optimizers, *, model_state_dict, optim_state_dict, options=None) -> tuple:
    return model, optimizers, model_state_dict, optim_state_dict, options


def _prepare(model: nn.Module, state_dict: Mapping[str, Any]) -> tuple[Plan, dict[str, Any], Prepared] | None:
    """Plan and check the whole load (nothing is written); ``None`` when nothing needs doing."""
    planned = _plan(model, state_dict)
    if planned is None:
        return None
    plan, current = planned
    return (plan, *_rekeyed(plan, state_dict, current))


def _remap(model: nn.Module, state_dict: Any) -> tuple[Plan, dict[str, Any], Prepared] | None:
    if not isinstance(model, nn.Module) or not isinstance(state_dict, Mapping):
        return None
    remapped = guarded(SEAM, lambda: _prepare(model, state_dict), lambda: None)
    if remapped is not None:
        report_load(HOOK.rsplit(".", 1)[1] + f"({type(model).__name__})", remapped[0])
    return remapped


def set_model_state_dict(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    try:
        model, state_dict, options = _model_arguments(*args, **kwargs)
    except TypeError:
        return wrapped(*args, **kwargs)
    remapped = _remap(model, state_dict)
    if remapped is None:
        return wrapped(*args, **kwargs)
    _, rekeyed, prepared = remapped
    prepared.write_stacked()
    return wrapped(model, rekeyed, options=options)


def set_state_dict(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    try:
        model, optimizers, state_dict, optim_state_dict, options = _state_arguments(*args, **kwargs)
    except TypeError:
        return wrapped(*args, **kwargs)
    remapped = _remap(model, state_dict)
    if remapped is None:
        return wrapped(*args, **kwargs)
    plan, rekeyed, prepared = remapped
    prepared.write_stacked()
    return wrapped(model, optimizers, model_state_dict=rekeyed,
                   optim_state_dict=_renamed_optimizer(plan, optim_state_dict), options=options)
