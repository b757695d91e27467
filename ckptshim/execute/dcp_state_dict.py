"""``set_model_state_dict``/``set_state_dict`` for state dicts saved under another wrapping.

torch's ``set_model_state_dict`` expects the model's canonical keys, which it derives by walking
the model -- and which keep ``_orig_mod.`` when ``torch.compile`` sits inside an activation
checkpoint wrapper, so a plain model's state dict is refused there, and a stacked-layer one
anywhere. These wrappers plan the given keys against the keys ``get_model_state_dict`` reports
for the model and call the original with a re-keyed dict: renamed entries are the same tensors,
unstacked layers are ``select`` views, synthesized buffers the model's own values. Stacked
targets are built with ``torch.stack`` (a copy of those tensors only): the values are already in
memory and torch's own loader then copies them in. Optimizer state follows renamed keys.
Missing and unexpected keys are left for torch to report under the caller's ``strict`` option.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ckptshim import config
from ckptshim.hooks.seam import guarded
from ckptshim.hooks.torch_module import TORCH_SCAN_AXES
from ckptshim.inventory import Entry, Inventory, dtype_name, join_key, split_key
from ckptshim.log import report_load
from ckptshim.plan import Plan, Rename, Stack, Synthesize, Unstack
from ckptshim.plan import plan as make_plan
from ckptshim.rules import DEFAULT_RULES, Rules
from ckptshim.rules.buffers import derivable_rule
from ckptshim.rules.prefixes import strip_wrappers

HOOK = "torch.distributed.checkpoint.state_dict.set_model_state_dict"


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


def _rekeyed(plan: Plan, state_dict: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, Any]:
    """The state dict under the model's keys; keys the plan does not use pass through."""
    used = {join_key(key) for op in plan.ops for key in op.sources}
    out = {key: value for key, value in state_dict.items() if key not in used}
    for op in plan.ops:
        if isinstance(op, Rename):
            out[join_key(op.target)] = state_dict[join_key(op.source)]
        elif isinstance(op, Unstack):
            whole = state_dict[join_key(op.source)]
            out.update((join_key(key), whole.select(op.axis, i)) for i, key in enumerate(op.targets))
        elif isinstance(op, Stack):
            out[join_key(op.target)] = torch.stack([state_dict[join_key(k)] for k in op.sources], op.axis)
        elif isinstance(op, Synthesize):
            out[join_key(op.target)] = current[join_key(op.target)]
    return out


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


def _remap(model: nn.Module, state_dict: Any) -> tuple[Plan, dict[str, Any]] | None:
    if not isinstance(model, nn.Module) or not isinstance(state_dict, Mapping):
        return None
    planned = guarded(HOOK, lambda: _plan(model, state_dict), lambda: None)
    if planned is not None:
        report_load(HOOK.rsplit(".", 1)[1] + f"({type(model).__name__})", planned[0])
    return planned


def set_model_state_dict(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    try:
        model, state_dict, options = _model_arguments(*args, **kwargs)
    except TypeError:
        return wrapped(*args, **kwargs)
    planned = _remap(model, state_dict)
    if planned is None:
        return wrapped(*args, **kwargs)
    return wrapped(model, _rekeyed(planned[0], state_dict, planned[1]), options=options)


def set_state_dict(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    try:
        model, optimizers, state_dict, optim_state_dict, options = _state_arguments(*args, **kwargs)
    except TypeError:
        return wrapped(*args, **kwargs)
    planned = _remap(model, state_dict)
    if planned is None:
        return wrapped(*args, **kwargs)
    plan, current = planned
    return wrapped(model, optimizers, model_state_dict=_rekeyed(plan, state_dict, current),
                   optim_state_dict=_renamed_optimizer(plan, optim_state_dict), options=options)
