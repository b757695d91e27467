"""Plan operations: small frozen records of what happens to which key, each with its inverse.

Ops name keys only; they never hold tensor bytes. Executors give them meaning: a ``Stack``
writes each source into a view of the target, an ``Unstack`` reads a slice of the source. The
inverse of every op is the op that undoes it, so a plan for A -> B inverts into a plan B -> A.

Layout changes -- a permutation of axes (``Transpose``), and slicing or filling with one
(``Split``, ``Join``) -- are ops of their own rather than an optional field of ``Rename``,
``Stack`` or ``Unstack``: an executor that has not been taught them then refuses the plan (it
meets an op it does not know) instead of running the old op and loading the axes in the wrong
order. The planner emits ``Unstack``/``Stack`` whenever no permutation is involved.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import TypeAlias

from ckptshim.inventory import KeyPath


@dataclass(frozen=True, slots=True, init=False)
class Rename:
    """The target array is the source array under another name (identity when both agree)."""

    source: KeyPath
    target: KeyPath

    def __init__(self, source: KeyPath, target: KeyPath) -> None:
        # A plan for a checkpoint that fits (or one torch.compile renamed) holds one Rename per
        # key. Assigning through the slots' own descriptors costs half of what the generated
        # frozen __init__ pays (object.__setattr__ looks each slot up by name); as in Entry.
        _set_source(self, source)
        _set_target(self, target)

    @property
    def sources(self) -> tuple[KeyPath, ...]:
        return (self.source,)

    @property
    def targets(self) -> tuple[KeyPath, ...]:
        return (self.target,)

    def inverse(self) -> Rename:
        return Rename(self.target, self.source)


_set_source, _set_target = Rename.source.__set__, Rename.target.__set__


def renames(sources: Sequence[KeyPath], targets: Sequence[KeyPath]) -> list[Rename]:
    """``list(map(Rename, sources, targets))``, in bulk: for a million keys, in half the time.

    Calling ``Rename`` runs ``__init__`` as one Python frame per op. Here all the instances are
    allocated first, then each slot is filled for all of them, every step a ``map`` that runs in
    C. The ops are the very ones ``Rename`` would make (equal, hashable, frozen).
    """
    if len(sources) != len(targets):
        raise ValueError(f"{len(sources)} sources but {len(targets)} targets")
    ops = list(map(object.__new__, repeat(Rename, len(sources))))
    deque(map(_set_source, ops, sources), maxlen=0)  # a deque of no length runs a map out
    deque(map(_set_target, ops, targets), maxlen=0)
    return ops


@dataclass(frozen=True, slots=True)
class Stack:
    """Per-layer sources (in layer order) become one target stacked along ``axis``."""

    sources: tuple[KeyPath, ...]
    target: KeyPath
    axis: int

    @property
    def targets(self) -> tuple[KeyPath, ...]:
        return (self.target,)

    @property
    def axes(self) -> tuple[int, ...]:
        """As :class:`Join` spells it: ``Stack`` is the one-axis ``Join`` without a permutation."""
        return (self.axis,)

    @property
    def perm(self) -> None:
        return None

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

    @property
    def axes(self) -> tuple[int, ...]:
        """As :class:`Split` spells it: ``Unstack`` is the one-axis ``Split`` without a permutation."""
        return (self.axis,)

    @property
    def perm(self) -> None:
        return None

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


def inverse_perm(perm: Sequence[int]) -> tuple[int, ...]:
    """The permutation that undoes ``perm`` (its argsort)."""
    out = [0] * len(perm)
    for position, axis in enumerate(perm):
        out[axis] = position
    return tuple(out)


def moved_axis_perm(rank: int, source_axis: int, target_axis: int) -> tuple[int, ...]:
    """The ``Transpose`` permutation of ``numpy.moveaxis(x, source_axis, target_axis)``."""
    rest = [a for a in range(rank) if a != source_axis]
    rest.insert(target_axis, source_axis)
    return tuple(rest)


def _check_perm(perm: tuple[int, ...]) -> None:
    if sorted(perm) != list(range(len(perm))):
        raise ValueError(f"{perm} is not a permutation of the axes 0..{len(perm) - 1}")


@dataclass(frozen=True, slots=True)
class Transpose:
    """The target is the source with its axes permuted: ``target = source.transpose(perm)``.

    Target axis ``i`` is source axis ``perm[i]``. Moving a stacked layer axis (PaxML keeps layers
    on axis 0, MaxText on ``param_scan_axis``) is one such permutation; so is ``x.T``.
    """

    source: KeyPath
    target: KeyPath
    perm: tuple[int, ...]

    def __post_init__(self) -> None:
        _check_perm(self.perm)

    @property
    def sources(self) -> tuple[KeyPath, ...]:
        return (self.source,)

    @property
    def targets(self) -> tuple[KeyPath, ...]:
        return (self.target,)

    def inverse(self) -> Transpose:
        return Transpose(self.target, self.source, inverse_perm(self.perm))


@dataclass(frozen=True, slots=True)
class Split:
    """One source cut at every index of ``axes`` into targets, each then transposed by ``perm``.

    Targets are in row-major order of the indices along ``axes`` (ascending): with ``axes``
    ``(0, 1)`` of a ``[layers, 3, ...]`` array, target ``3 * i + j`` is ``source[i, j]``. Each
    target is ``source[index].transpose(perm)``, ``perm`` over the axes left after indexing.
    PaxML's fused ``combined_qkv`` (``[layers, 3, embed, heads, head_dim]``) splits so into
    MaxText's ``query``/``key``/``value``. ``Unstack`` is the one-axis case without a permutation.
    """

    source: KeyPath
    targets: tuple[KeyPath, ...]
    axes: tuple[int, ...]
    perm: tuple[int, ...]

    def __post_init__(self) -> None:
        _check_axes(self.axes)
        _check_perm(self.perm)

    @property
    def sources(self) -> tuple[KeyPath, ...]:
        return (self.source,)

    def inverse(self) -> Join:
        return Join(self.targets, self.source, self.axes, inverse_perm(self.perm))


@dataclass(frozen=True, slots=True)
class Join:
    """Sources, each transposed by ``perm``, fill ``target`` at every index of ``axes``.

    ``target[index_k] = sources[k].transpose(perm)``, the indices in row-major order as in
    :class:`Split`, whose inverse this is. ``Stack`` is the one-axis case without a permutation.
    """

    sources: tuple[KeyPath, ...]
    target: KeyPath
    axes: tuple[int, ...]
    perm: tuple[int, ...]

    def __post_init__(self) -> None:
        _check_axes(self.axes)
        _check_perm(self.perm)

    @property
    def targets(self) -> tuple[KeyPath, ...]:
        return (self.target,)

    def inverse(self) -> Split:
        return Split(self.target, self.sources, self.axes, inverse_perm(self.perm))


def _check_axes(axes: tuple[int, ...]) -> None:
    if not axes or list(axes) != sorted(set(axes)) or axes[0] < 0:
        raise ValueError(f"axes {axes} must be distinct, ascending, non-negative and at least one")


Op: TypeAlias = Rename | Stack | Unstack | Transpose | Split | Join | Synthesize | Drop | Cast
#: Ops that put a value into target keys (as opposed to ``Drop`` and ``Cast``).
Producer: TypeAlias = Rename | Stack | Unstack | Transpose | Split | Join | Synthesize
