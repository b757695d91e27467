"""Buffers a target computes itself, on real tensors: whether a value is one, and rebuilding one.

:class:`OwnBuffers` is what a live target computes itself, described once by the loading layer
and handed to the torch executor, which asks it whether a checkpoint's copy of a buffer may be
dropped (the executor decides nothing about buffers itself).

:data:`ckptshim.rules.buffers.HOLDS` says what each derivable buffer holds; this module checks it
on a tensor, for the torch executor (a checkpoint's copy of such a buffer is dropped only when
:func:`mismatch` finds nothing) and for the loading layer (a state dict's entry may keep its own
value only when it holds what its rule derives). A value computed from settings the buffer does
not carry (``inv_freq`` from the rotary base) is checked against the target's own recomputed
buffers of the same rule, bit for bit: dtype, shape and contents. A copy of one of the target's
non-persistent buffers, saved under the same name when an older version persisted it, must have
its shape and dtype (the target recomputes the contents, which may have changed since); one
whose name holds wrapper components must equal it outright, since the name's other reading may
belong to another tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from ckptshim.inventory import KeyPath
from ckptshim.ops import NOT_PERSISTENT
from ckptshim.rules.buffers import (CAUSAL_MASK, FAMILY_CONSTANT, HOLDS, MASKED_BIAS_VALUES, POSITIONS, TARGETS_OWN,
                                    derivable_rule)
from ckptshim.rules.prefixes import strip_wrappers


def _positions(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.arange(shape[-1], dtype=dtype, device=device).expand(shape).contiguous()


def _causal_mask(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.ones(shape[-2:], dtype=torch.bool, device=device).tril().to(dtype).expand(shape)


def mismatch(rule: str, value: torch.Tensor, own: Sequence[torch.Tensor] = ()) -> str | None:
    """``None`` when ``value`` is what ``rule``'s buffer holds; else what it is not, in words.

    ``own`` are the target's own buffers of the same rule (its non-persistent ones, which it
    recomputes itself): the reference for a rule whose value follows from settings, and for
    :data:`~ckptshim.ops.NOT_PERSISTENT` the buffer of the same name (see :func:`not_equal`
    for one named the same only without wrapper components).
    """
    holds = HOLDS.get(rule)
    if value.is_meta:
        return "on the meta device, so it holds no value to check"
    if type(value) not in (torch.Tensor, torch.nn.Parameter):
        return f"a {type(value).__name__}, whose value ckptshim does not gather to check"
    if rule == NOT_PERSISTENT:
        same = any(o.dtype == value.dtype and o.shape == value.shape for o in own)
        return None if same else (f"{value.dtype}{list(value.shape)}, not the shape and dtype of the "
                                  f"target's own buffer ({_describe(own) or 'none'})")
    if holds == CAUSAL_MASK:
        if value.dim() < 2 or value.shape[-1] != value.shape[-2] or value.is_complex():
            return f"shaped {list(value.shape)}, not a square causal mask"
        return None if torch.equal(value, _causal_mask(value.shape, value.dtype, value.device)) \
            else "not a lower-triangular mask of ones (a causal mask)"
    if holds == POSITIONS:
        if value.dim() < 1 or value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            return f"a {value.dtype} of shape {list(value.shape)}, not integer positions"
        return None if torch.equal(value, _positions(value.shape, value.dtype, value.device)) \
            else f"not the positions 0..{value.shape[-1] - 1}"
    if holds == FAMILY_CONSTANT:
        if value.numel() != 1 or not value.is_floating_point():
            return f"a {value.dtype} of shape {list(value.shape)}, not one number"
        constants = [torch.tensor(c, dtype=value.dtype).item() for c in MASKED_BIAS_VALUES]
        return None if value.item() in constants else \
            f"{value.item()}, none of the constants models keep there ({', '.join(map(str, MASKED_BIAS_VALUES))})"
    if holds == TARGETS_OWN:
        if not own:
            return ("a value computed from settings the checkpoint does not carry, and the target has "
                    "no buffer of its own to compare it with")
        return not_equal(value, own, f"the target's own {rule}")
    return f"a {rule!r} buffer, whose value ckptshim has no way to check"


def not_equal(value: torch.Tensor, own: Sequence[torch.Tensor], what: str) -> str | None:
    """``None`` when ``value`` equals one of ``own`` bit for bit (dtype, shape and contents)."""
    same = any(o.dtype == value.dtype and o.shape == value.shape and not o.is_meta
               and torch.equal(o, value.to(o.device)) for o in own)
    return None if same else f"not equal to {what} ({_describe(own) or 'none'})"


def _describe(tensors: Sequence[torch.Tensor]) -> str:
    return ", ".join(f"{t.dtype}{list(t.shape)}" for t in tensors)


#: Derivable buffers whose value follows from their shape and dtype alone, so that a buffer on
#: the meta device (which holds no value to keep) can be rebuilt. The others depend on settings
#: the buffer does not carry -- ``inv_freq`` on the rotary base, ``masked_bias`` on the model
#: family, ``attention.bias`` on a possible attention window -- and are refused instead.
REBUILDABLE: Mapping[str, Callable[[torch.Size, torch.dtype, torch.device], torch.Tensor]] = {
    rule: _positions for rule, holds in HOLDS.items() if holds == POSITIONS
}


class OwnBuffers:
    """The buffers a target computes itself and does not load (a module's non-persistent
    buffers, by key), and the one question the executor asks of them: is a checkpoint's value,
    planned as a drop of ``rule`` (:class:`~ckptshim.ops.DropIfDerived`), that buffer?"""

    def __init__(self, recomputed: Mapping[KeyPath, torch.Tensor] | None = None) -> None:
        self.recomputed = dict(recomputed or {})
        self._by_rule: dict[str, list[torch.Tensor]] = {}  # rule -> the target's own buffers of that rule
        self._by_name: dict[KeyPath, list[torch.Tensor]] = {}  # wrapper-free key, or leaf -> buffers
        for key, tensor in self.recomputed.items():
            rule = derivable_rule(key)
            if rule is not None:
                self._by_rule.setdefault(rule, []).append(tensor)
            self._by_name.setdefault(strip_wrappers(key), []).append(tensor)
            self._by_name.setdefault(key[-1:], []).append(tensor)

    def problem(self, rule: str, source: KeyPath, value: torch.Tensor) -> str | None:
        """``None`` when the checkpoint's ``value`` at ``source`` is the buffer ``rule`` says;
        else what it is not, in words."""
        if rule != NOT_PERSISTENT:
            return mismatch(rule, value, self._by_rule.get(rule, ()))
        if source in self.recomputed and strip_wrappers(source) == source:
            # the very buffer (its name has one reading), as an older version persisted it
            return mismatch(rule, value, [self.recomputed[source]])
        # a name with wrapper components has two readings: the other may be another tensor's
        return not_equal(value, self._named(source), "the target's own buffer")

    def _named(self, source: KeyPath) -> list[torch.Tensor]:
        """The target's non-persistent buffer the planner took ``source`` for: the one of the same
        name without wrapper components, else (a name an alias changed) those of the same leaf."""
        return self._by_name.get(strip_wrappers(source)) or self._by_name.get(source[-1:], [])


NO_OWN_BUFFERS = OwnBuffers()
