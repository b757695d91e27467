"""Plan operations: small frozen records of what happens to which key, each with its inverse.

Ops name keys only; they never hold tensor bytes. Executors give them meaning: a ``Stack``
writes each source into a view of the target, an ``Unstack`` reads a slice of the source. The
inverse of every op is the op that undoes it, so a plan for A -> B inverts into a plan B -> A.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

from ckptshim.inventory import KeyPath


@dataclass(frozen=True, slots=True)
class Rename:
    """The target array is the source array under another name (identity when both agree)."""

    source: KeyPath
    target: KeyPath

    @property
    def sources(self) -> tuple[KeyPath, ...]:
        return (self.source,)

    @property
    def targets(self) -> tuple[KeyPath, ...]:
        return (self.target,)

    def inverse(self) -> Rename:
        return Rename(self.target, self.source)


@dataclass(frozen=True, slots=True)
class Stack:
    """Per-layer sources (in layer order) become one target stacked along ``axis``."""

    sources: tuple[KeyPath, ...]
    target: KeyPath
    axis: int

    @property
    def targets(self) -> tuple[KeyPath, ...]:
        return (self.target,)

    def inverse(self) -> Unstack:
        return Unstack(self.target, self.sources, self.axis)


@dataclass(frozen=True, slots=True)
class Unstack:
    """One source stacked along ``axis`` becomes per-layer targets (in layer order)."""

    source: KeyPath
    targets: tuple[KeyPath, ...]
    axis: int

    @property
    def sources(self) -> tuple[KeyPath, ...]:
        return (self.source,)

    def inverse(self) -> Stack:
        return Stack(self.targets, self.source, self.axis)


@dataclass(frozen=True, slots=True)
class Synthesize:
    """The checkpoint lacks ``target``; the target keeps (or recomputes) its value by ``rule``."""

    target: KeyPath
    rule: str

    @property
    def sources(self) -> tuple[KeyPath, ...]:
        return ()

    @property
    def targets(self) -> tuple[KeyPath, ...]:
        return (self.target,)

    def inverse(self) -> Drop:
        return Drop(self.target, self.rule)


@dataclass(frozen=True, slots=True)
class Drop:
    """The checkpoint's ``source`` is not loaded: the target derives it by ``rule`` or lacks it."""

    source: KeyPath
    rule: str

    @property
    def sources(self) -> tuple[KeyPath, ...]:
        return (self.source,)

    @property
    def targets(self) -> tuple[KeyPath, ...]:
        return ()

    def inverse(self) -> Synthesize:
        return Synthesize(self.source, self.rule)


@dataclass(frozen=True, slots=True)
class Cast:
    """The value written to ``target`` changes dtype (after the op that produces it)."""

    target: KeyPath
    source_dtype: str
    target_dtype: str

    @property
    def sources(self) -> tuple[KeyPath, ...]:
        return ()

    @property
    def targets(self) -> tuple[KeyPath, ...]:
        return (self.target,)

    def inverse(self) -> Cast:
        return Cast(self.target, self.target_dtype, self.source_dtype)


Op: TypeAlias = Rename | Stack | Unstack | Synthesize | Drop | Cast
#: Ops that put a value into target keys (as opposed to ``Drop`` and ``Cast``).
Producer: TypeAlias = Rename | Stack | Unstack | Synthesize
