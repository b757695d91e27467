"""Wrapper prefixes: path components that wrappers insert without changing the model.

``torch.compile`` adds ``_orig_mod``, DDP adds ``module``, FSDP1 ``_fsdp_wrapped_module`` and
activation checkpointing ``_checkpoint_wrapped_module`` -- at the top or at any depth (a layer
compiled inside a checkpoint wrapper keeps ``layer._checkpoint_wrapped_module._orig_mod.w``).
"""

from __future__ import annotations

from ckptshim.inventory import KeyPath

WRAPPER_SEGMENTS: frozenset[str] = frozenset(
    {"_orig_mod", "module", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"}
)


def strip_wrappers(key: KeyPath, segments: frozenset[str] = WRAPPER_SEGMENTS) -> KeyPath:
    """The key with every wrapper component removed; the leaf name itself is never removed."""
    if segments.isdisjoint(key[:-1]):
        return key
    return tuple(part for part in key[:-1] if part not in segments) + key[-1:]
