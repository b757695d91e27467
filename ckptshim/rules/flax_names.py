"""Flax Linen and Flax NNX spell the same parameter differently; these aliases join them.

A Linen train state restored through Orbax names a kernel ``params/params/decoder/.../kernel``
(the ``params`` field of the state, then Linen's ``params`` collection); NNX state names it
``decoder/.../kernel/value`` (each ``nnx.Param`` holds its array in ``value``). MaxText's own
param-only conversion tool writes the NNX spelling, its training checkpoints the Linen one.
Both spellings canonicalise to ``decoder/.../kernel``; a tree that uses both at once is
ambiguous and the planner refuses it rather than pick one.
"""

from __future__ import annotations

from ckptshim.rules.aliases import Alias

LINEN_NNX: tuple[Alias, ...] = (
    Alias((), ("params", "params"), "prefix"),
    Alias((), ("value",), "suffix"),
)
