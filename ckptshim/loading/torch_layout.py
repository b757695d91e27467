"""What a module's ``load_state_dict`` accepts, read off the live module tree, and whether a state
dict already fits it -- all a ``load_state_dict`` hook needs when it has nothing to do.

Kept apart from :mod:`ckptshim.loading.torch` (the planning and checking of a load) so that a
process whose loads already fit imports none of the planner, rules or executors: an idle hook
costs one walk of the module tree and a comparison.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

#: A wrapper hop that the wrapper's own state-dict hooks remove on save and put back on load
#: (``CheckpointWrapper``), so the names the module accepts do not contain it -- below an
#: activation-checkpoint wrapper only: a plain submodule may have the same name.
TRANSPARENT_HOP = "_checkpoint_wrapped_module"
#: FSDP1's hop: below it parameters are flat shards, which no checkpoint names or shapes match.
FSDP_HOP = "_fsdp_wrapped_module"

_BASE_LOAD = nn.Module._load_from_state_dict
_BASE_SET_EXTRA_STATE = nn.Module.set_extra_state


@dataclass
class ModuleLayout:
    """What a module's ``load_state_dict`` accepts, read off the live module tree."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # accepted key -> tensor
    buffers: list[str] = field(default_factory=list)                # persistent buffer keys
    non_persistent: dict[str, torch.Tensor] = field(default_factory=dict)  # key -> buffer
    module_paths: list[str] = field(default_factory=list)           # torch's metadata keys
    own_load_logic: bool = False
    unsupported: str | None = None                                  # why ckptshim stays out


def module_layout(root: nn.Module) -> ModuleLayout:
    """Walk the modules as torch's loader does (every path, shared modules included).

    Keys are the ones the module accepts: internal names minus transparent hops. ``module_paths``
    keep the internal names, which is what torch looks ``state_dict._metadata`` up by.
    """
    layout = ModuleLayout()
    stack: list[tuple[str, str, nn.Module]] = [("", "", root)]
    while stack:
        path, accepted, module = stack.pop()
        layout.module_paths.append(path)
        children = module._modules
        if FSDP_HOP in children:
            layout.unsupported = "FSDP1 modules hold flat parameters"
        if type(module).set_extra_state is not _BASE_SET_EXTRA_STATE:
            layout.unsupported = f"{type(module).__name__} keeps _extra_state"
        if any(nn.parameter.is_lazy(t) for t in (*module._parameters.values(), *module._buffers.values())):
            layout.unsupported = "lazy modules have no shapes yet"
        transparent = TRANSPARENT_HOP in children and _is_activation_wrapper(module)
        if transparent and _holds_a_plain_hop(children[TRANSPARENT_HOP]):
            layout.unsupported = ("a submodule named like the activation-checkpoint wrapper's own hop, "
                                  "whose keys the wrapper's state-dict hooks rename too")
        if not transparent and (
                type(module)._load_from_state_dict is not _BASE_LOAD
                or module._load_state_dict_pre_hooks or module._load_state_dict_post_hooks):
            layout.own_load_logic = True
        for name, param in module._parameters.items():
            if param is not None:
                layout.tensors[accepted + name] = param
        for name, buffer in module._buffers.items():
            if buffer is None:
                continue
            if name in module._non_persistent_buffers_set:
                layout.non_persistent[accepted + name] = buffer
            else:
                layout.tensors[accepted + name] = buffer
                layout.buffers.append(accepted + name)
        for name, child in reversed(children.items()):
            if child is not None:
                hop = None if transparent and name == TRANSPARENT_HOP else name
                stack.append((f"{path}{'.' if path else ''}{name}",
                              accepted + (f"{hop}." if hop else ""), child))
    return layout


def _is_activation_wrapper(module: nn.Module) -> bool:
    """Whether ``module`` is torch's activation-checkpoint (or offload) wrapper, whose state-dict
    hooks hide its ``_checkpoint_wrapped_module`` hop. Such a wrapper exists only once its module
    is imported; a process that never did is not made to (as :func:`~ckptshim.targets.tensors.is_dtensor`)."""
    wrappers = sys.modules.get("torch.distributed.algorithms._checkpoint.checkpoint_wrapper")
    return wrappers is not None and isinstance(module, wrappers.ActivationWrapper)


def _holds_a_plain_hop(wrapped: nn.Module | None) -> bool:
    """Whether the module an activation-checkpoint wrapper wraps has a submodule of its own named
    ``_checkpoint_wrapped_module``: the wrapper's hooks add and remove that prefix on every key,
    so torch renames (and, on load, can overwrite) that submodule's keys as well."""
    inner = None if wrapped is None else wrapped._modules.get(TRANSPARENT_HOP)
    return inner is not None and not _is_activation_wrapper(wrapped)


def fits(state_dict: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> bool:
    """Same keys, shapes and dtypes: torch loads it as is (and, shapes agreeing, cannot half-load
    it). A dtype difference is planned, so that the cast is reported -- and refused when it
    narrows under ``CKPTSHIM_STRICT``."""
    return state_dict.keys() == tensors.keys() and all(
        getattr(value, "shape", None) == tensors[key].shape and getattr(value, "dtype", None) == tensors[key].dtype
        for key, value in state_dict.items())
