"""The ``torch.nn.Module.load_state_dict`` hook.

``model.load_state_dict(sd)`` is patched so that a state dict saved from another wrapping of
the same model (``torch.compile``'s ``_orig_mod.``, DDP's ``module.``, activation
checkpointing's ``_checkpoint_wrapped_module.``, at any depth), from an older version of its
code (buffers that became non-persistent or persistent), with layers stacked the other way, or
under names the model's framework renames on load, loads as if it had been saved from this
model -- or fails, before anything is written, with an error that names the keys.

**Rewrite, not execute.** Once the plan is checked, the hook calls torch's own
``load_state_dict`` with a rewritten state dict whose keys are exactly the ones the module
accepts: renamed sources under their target names, ``select`` views for unstacked layers, the
module's own tensor for synthesized buffers, drops left out. Executing the plan ourselves would
bypass what modules do in their loading code -- ``_load_from_state_dict`` overrides, load
pre-/post-hooks (the checkpoint wrapper re-adds its prefix in one), version upgrades keyed by
``state_dict._metadata`` (carried over to the new names), ``assign=True`` and swap semantics --
and torch's own ``_IncompatibleKeys``. The one op a dict cannot express without a second full
copy is stacking, so stacked targets are written through ``select`` views of the destination by
:mod:`ckptshim.execute.torch`, right before the call, and passed as themselves.

**Transactional.** All checks -- plan completeness, shapes, castable dtypes, tensors present --
run in :func:`ckptshim.execute.torch.prepare` before the first write. The rewritten dict then
matches the module exactly, so torch's copy loop has nothing left to refuse.

Only calls that need help are planned: when the state dict's keys already are the module's, the
original runs at once. Modules ckptshim cannot see through are left to torch: lazy parameters,
``_extra_state``, and FSDP1 (flat parameters whose shapes are not the checkpoint's). And when a
strict load does not fit but a module transforms its own state dict on load (a load hook or
``_load_from_state_dict`` override, e.g. BatchNorm filling in ``num_batches_tracked`` for old
checkpoints), torch decides, with its own error if it fails.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ckptshim import config
from ckptshim.errors import PlanError
from ckptshim.execute.torch import prepare
from ckptshim.hooks.seam import Patches, Seam, guarded
from ckptshim.inventory import Entry, Inventory, KeyPath, dtype_name, join_key, split_key
from ckptshim.log import logger, report_load
from ckptshim.planner import plan as make_plan
from ckptshim.rules import DEFAULT_RULES, Rules
from ckptshim.rules.buffers import derivable_rule
from ckptshim.rules.layers import TORCH_SCAN_AXES
from ckptshim.rules.profiles import neox
from ckptshim.rules.prefixes import WRAPPER_SEGMENTS, strip_wrappers
from ckptshim.rules.profiles.transformers_mapping import aliases_for

HOOK = "torch.nn.Module.load_state_dict"
SEAM = Seam("torch", HOOK, falls_back=True)

#: A wrapper hop that the wrapper's own state-dict hooks remove on save and put back on load
#: (``CheckpointWrapper``), so the names the module accepts do not contain it.
TRANSPARENT_HOP = "_checkpoint_wrapped_module"
#: FSDP1's hop: below it parameters are flat shards, which no checkpoint names or shapes match.
FSDP_HOP = "_fsdp_wrapped_module"

_BASE_LOAD = nn.Module._load_from_state_dict
_BASE_SET_EXTRA_STATE = nn.Module.set_extra_state

_patches = Patches()


def install() -> None:
    """Patch ``torch.nn.Module.load_state_dict`` (again a no-op when already patched)."""
    if not _patches.active:
        _patches.wrap(nn.Module, "load_state_dict", _load_state_dict)


def uninstall() -> None:
    """Put torch's own ``load_state_dict`` back."""
    _patches.restore()


@dataclass
class _Layout:
    """What a module's ``load_state_dict`` accepts, read off the live module tree."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # accepted key -> tensor
    buffers: list[str] = field(default_factory=list)                # persistent buffer keys
    non_persistent: list[str] = field(default_factory=list)
    module_paths: list[str] = field(default_factory=list)           # torch's metadata keys
    own_load_logic: bool = False
    unsupported: str | None = None                                  # why the hook stays out


def _layout(root: nn.Module) -> _Layout:
    """Walk the modules as torch's loader does (every path, shared modules included).

    Keys are the ones the module accepts: internal names minus transparent hops. ``module_paths``
    keep the internal names, which is what torch looks ``state_dict._metadata`` up by.
    """
    layout = _Layout()
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
        if TRANSPARENT_HOP not in children and (
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
                layout.non_persistent.append(accepted + name)
            else:
                layout.tensors[accepted + name] = buffer
                layout.buffers.append(accepted + name)
        for name, child in reversed(children.items()):
            if child is not None:
                hop = name if name != TRANSPARENT_HOP else None
                stack.append((f"{path}{'.' if path else ''}{name}",
                              accepted + (f"{hop}." if hop else ""), child))
    return layout


def _arguments(state_dict: Any, strict: bool = True, assign: bool = False) -> tuple[Any, bool, bool]:
    return state_dict, strict, assign


def _load_state_dict(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """The wrapper: the original at once when nothing needs remapping, else plan and load."""
    try:
        state_dict, strict, assign = _arguments(*args, **kwargs)
    except TypeError:
        return wrapped(*args, **kwargs)  # let torch report the bad call
    if not isinstance(instance, nn.Module) or not isinstance(state_dict, Mapping):
        return wrapped(*args, **kwargs)
    layout = _layout(instance)
    if _fits(state_dict, layout.tensors):
        return wrapped(*args, **kwargs)
    if layout.unsupported is not None:
        logger.debug("%s: %s; leaving the load to torch", HOOK, layout.unsupported)
        return wrapped(*args, **kwargs)

    def native() -> Any:
        return wrapped(*args, **kwargs)

    load = guarded(SEAM, lambda: _prepare(wrapped, native, instance, layout, state_dict, strict, assign),
                   lambda: native)
    return load()


def _fits(state_dict: Mapping[str, Any], tensors: dict[str, torch.Tensor]) -> bool:
    """Same keys and shapes: torch loads it as is (and, shapes agreeing, cannot half-load it)."""
    return state_dict.keys() == tensors.keys() and all(
        getattr(value, "shape", None) == tensors[key].shape for key, value in state_dict.items())


def _prepare(original: Callable[..., Any], native: Callable[[], Any], module: nn.Module,
             layout: _Layout, state_dict: Mapping[str, Any], strict: bool,
             assign: bool) -> Callable[[], Any]:
    """Plan and check everything; return the call that writes (nothing is written here).

    ``native`` is the caller's own call, unchanged, for loads that are torch's to decide.
    """
    source = _inventory(state_dict.items(), "state_dict")
    target = _inventory(layout.tensors.items(), f"{type(module).__name__} module")
    if source is None or target is None:
        logger.debug("%s: a dtype ckptshim does not know; leaving the load to torch", HOOK)
        return native
    rules = _rules(module, layout).extend(aliases=neox.aliases_between(source, target))
    plan = make_plan(source, target, rules)
    if strict and not plan.complete and layout.own_load_logic:
        logger.debug("%s: the state dict does not fit, but %s transforms its own state dict on "
                     "load; leaving the load to torch", HOOK, type(module).__name__)
        return native
    destinations = {split_key(key): tensor for key, tensor in layout.tensors.items()}
    prepared = prepare(plan, lambda key: state_dict[join_key(key)], destinations,
                       allow_missing=not strict, allow_unexpected=not strict)
    rewritten: OrderedDict[str, torch.Tensor] = OrderedDict(
        (join_key(key), value) for key, value in prepared.values.items())
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        rewritten._metadata = _remap_metadata(metadata, layout.module_paths)  # type: ignore[attr-defined]
    unexpected = [join_key(key) for key in plan.unexpected]
    report_load(f"load_state_dict({type(module).__name__})", plan)

    def load() -> Any:
        prepared.write_stacked()
        result = original(rewritten, strict=strict, assign=assign)
        return type(result)(result.missing_keys, result.unexpected_keys + unexpected)

    return load


def _inventory(items: Iterable[tuple[str, Any]], source: str) -> Inventory | None:
    """Shapes and dtypes only; ``None`` when a dtype is one ckptshim has no name for."""
    entries = []
    for key, value in items:
        if not isinstance(value, torch.Tensor):
            raise PlanError(f"{source}[{key!r}] is a {type(value).__name__}, not a tensor; "
                            "load_state_dict loads tensors only. Remove it from the state dict.")
        try:
            entries.append(Entry(split_key(key), tuple(value.shape), dtype_name(value.dtype)))
        except ValueError:
            return None
    return Inventory(entries, source)


def _rules(module: nn.Module, layout: _Layout) -> Rules:
    """The defaults plus what only the live module knows."""
    return DEFAULT_RULES.extend(
        drop=[strip_wrappers(split_key(key)) for key in layout.non_persistent],
        synthesize=[split_key(key) for key in layout.buffers
                    if derivable_rule(strip_wrappers(split_key(key))) is not None],
        aliases=aliases_for(module),
        scan_axes=TORCH_SCAN_AXES,
        strict=config.strict(),
    )


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
