"""The op protocol: small frozen records of what a load does to which keys, each with its inverse.

An op names keys (``sources`` -> ``targets``) and carries the data an executor needs (an axis, a
permutation), never tensor bytes. Every op class declares what it is and how it explains itself:

- ``kind``: its name, in plans and in refusals;
- ``layout``: whether it only moves elements. A layout op says where each element of its
  targets comes from with :meth:`LayoutOp.pieces` -- its one geometric description
  (:mod:`ckptshim.geometry`) -- and every executor runs it through one primitive over pieces,
  with no handler of its own. Any other kind changes values or destinations and runs only in
  an executor with a handler for its kind; every other executor refuses it, naming the op,
  before anything is read (:func:`require_kinds`). So a new layout kind is one class here, and a
  new value-changing kind one class plus a handler in each executor that can run it;
- ``produces``: whether it gives its targets their values (``Cast`` changes the dtype of a value
  another op produced; ``Drop`` and ``DropIfDerived`` leave a source unloaded);
- ``inverse()``: the op that undoes it, so ops for A -> B invert into ops for B -> A;
- ``describe(sep)``: its line in ``ckptshim plan``; ``tally()`` and ``note(sep)``: what the
  one-line summary counts (``None`` for an op that changes nothing) and shows in parentheses.

Dropping a checkpoint key the target computes itself -- a buffer it does not persist, or one
named like a derivable buffer -- is a kind of its own (``DropIfDerived``) for the same reason: a
name proves nothing (a trained ``attention.bias`` is no causal mask), so an executor drops such a
key only after checking its value, and one that cannot check refuses the plan. ``Drop`` is the
unchecked inverse of keeping the target's own value.

Layout changes -- a permutation of axes (``Transpose``), slicing or filling with one
(``Split``, ``Join``), arrays side by side along an axis (``Concat``, ``Chunk``), a permutation
of the indices along one axis (``Reorder``) and copies of one array (``Replicate``) -- are kinds
of their own rather than an optional field of ``Rename``, ``Stack`` or ``Unstack``, so that a
plan says what it does and each kind's geometry stays small.

``Reshape`` is the layout kind that composes the others: its arrays are read row-major as
factors (splitting an axis, ``[heads * head_dim, emb]`` as ``[heads, head_dim, emb]``), the
factors permuted (a transpose, a ``Reorder`` of one axis's factors, layers stacked on any axis)
and merged into the target's axes. A converter's chain of steps for one key -- transpose,
reshape, RoPE reorder, stack the layers -- is one ``Reshape``, so an executor reads each block
of the target straight from the source bytes it needs, with no intermediate array. ``Scale``
multiplies what another op produced by a constant; ``Sum``, ``Share`` and ``Replicated`` are
tensor-parallel merges and splits that add, divide or check their arrays.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
import struct
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import repeat
from typing import ClassVar, Protocol

from ckptshim.errors import InternalError, PlanError
from ckptshim.geometry import Piece, View, at, axis_groups, inverse_perm, tiles, unravel, whole
from ckptshim.inventory import KeyPath, join_key
from ckptshim.keytext import keys_text, runs_text

Shapes = Sequence[tuple[int, ...]]


class Op(Protocol):
    """What every op offers (see the module docstring)."""

    kind: ClassVar[str]
    produces: ClassVar[bool]
    #: the summary shows one example of this kind (``a -> b, ...``) rather than every note
    summary_by_example: ClassVar[bool]
    #: it only moves elements: :meth:`LayoutOp.pieces` says where each one goes
    layout: ClassVar[bool]

    @property
    def sources(self) -> tuple[KeyPath, ...]: ...

    @property
    def targets(self) -> tuple[KeyPath, ...]: ...

    def inverse(self) -> Op: ...

    def describe(self, sep: str = ".") -> str: ...

    def tally(self) -> tuple[str, int] | None: ...

    def note(self, sep: str = ".") -> str: ...


class LayoutOp(Op, Protocol):
    """An op that only moves elements (``layout`` is true): every executor runs it through its
    geometry, with no handler of its own."""

    def pieces(self, source_shapes: Shapes, target_shapes: Shapes) -> tuple[Piece, ...]:
        """Where each element of the targets comes from, for sources and targets of these
        shapes (in the order of ``sources`` and ``targets``): see :mod:`ckptshim.geometry`."""
        ...


def is_layout(op: Op) -> bool:
    """Whether ``op`` only moves elements, so that its geometry (``pieces``) says all it does."""
    return getattr(op, "layout", False) is True


def fits(op: LayoutOp, shape: Callable[[KeyPath], tuple[int, ...]]) -> bool:
    """Whether arrays of these shapes (``shape`` of each key) are what the layout op makes of each
    other: its pieces lie inside them, fill every target exactly and read all of every source."""
    sources, targets = [tuple(shape(key)) for key in op.sources], [tuple(shape(key)) for key in op.targets]
    try:
        return tiles(op.pieces(sources, targets), sources, targets)
    except (ValueError, IndexError):  # data that does not describe arrays of these shapes at all
        return False


def pieces_by_target(op: LayoutOp, source_shapes: Shapes, target_shapes: Shapes) -> list[list[Piece]]:
    """``op``'s pieces for arrays of these shapes, grouped by target (in ``targets`` order), each
    target's checked to hold as many elements as the target has: an op whose pieces left part of
    a target unwritten would load it silently wrong."""
    pieces = op.pieces(source_shapes, target_shapes)
    if len(pieces) == 1 == len(target_shapes) and pieces[0].target.is_whole(target_shapes[0]):
        return [list(pieces)]  # one array all of one array (a rename): nothing to group or count
    grouped: list[list[Piece]] = [[] for _ in target_shapes]
    for piece in pieces:
        grouped[piece.target.array].append(piece)
    for index, (pieces, shape) in enumerate(zip(grouped, target_shapes)):
        if sum(math.prod(piece.target.shape) for piece in pieces) != math.prod(shape):
            raise InternalError(f"the pieces of `{op.describe()}` do not fill {join_key(op.targets[index])!r} "
                                f"{list(shape)}; this is a bug in ckptshim: please report it.")
    return grouped


def require_kinds(ops: Iterable[Op], known: Collection[str], executor: str, *, sep: str = ".",
                  hint: str = "") -> None:
    """Refuse the first op ``executor`` cannot run, before anything is read: one that is not a
    layout op and whose kind it has no handler for."""
    for op in ops:
        if op.kind not in known and not is_layout(op):
            key = (op.targets or op.sources)[0]
            raise PlanError(
                f"{join_key(key, sep)!r}: the plan's step `{op.describe(sep)}` is a {op.kind!r} op, "
                f"which the {executor} does not run (it runs every layout kind and "
                f"{', '.join(sorted(known))}); ckptshim will not load without that step."
                f"{' ' + hint if hint else ''}")


class _Defaults:
    """The protocol's class attributes as most ops have them; an op overrides what differs."""

    __slots__ = ()
    produces: ClassVar[bool] = True
    summary_by_example: ClassVar[bool] = False
    layout: ClassVar[bool] = False


class _Moves:
    """A layout op: it runs through :meth:`pieces` alone (see :mod:`ckptshim.geometry`)."""

    __slots__ = ()
    layout: ClassVar[bool] = True


@lru_cache(maxsize=64)
def _identity(rank: int) -> tuple[int, ...]:
    return tuple(range(rank))


@lru_cache(maxsize=4096)
def _same(source_shape: tuple[int, ...], target_shape: tuple[int, ...]) -> Piece:
    """The whole target is the whole source as it is (a rename's one piece)."""
    return Piece(whole(0, source_shape), whole(0, target_shape), _identity(len(source_shape)))


def _inverted(inverse: LayoutOp, source_shapes: Shapes, target_shapes: Shapes) -> tuple[Piece, ...]:
    """An op's pieces as its ``inverse``'s, read the other way."""
    return tuple(piece.inverse() for piece in inverse.pieces(target_shapes, source_shapes))


class _FromSource:
    """An op read from one ``source`` key."""

    __slots__ = ()

    @property
    def sources(self) -> tuple[KeyPath, ...]:
        return (self.source,)


class _IntoTarget:
    """An op that gives one ``target`` key its value (or, for ``Cast``, its dtype)."""

    __slots__ = ()

    @property
    def targets(self) -> tuple[KeyPath, ...]:
        return (self.target,)


class _OneAxis:
    """``Stack``/``Unstack`` spell their layout as ``Join``/``Split`` do -- ``axes`` and ``perm`` --
    so an executor reads both kinds with one routine."""

    __slots__ = ()

    @property
    def axes(self) -> tuple[int, ...]:
        return (self.axis,)

    @property
    def perm(self) -> None:
        return None


@dataclass(frozen=True, slots=True, init=False)
class Rename(_Moves, _Defaults, _FromSource, _IntoTarget):
    """The target array is the source array under another name (identity when both agree)."""

    kind: ClassVar[str] = "rename"
    summary_by_example: ClassVar[bool] = True

    source: KeyPath
    target: KeyPath

    def __init__(self, source: KeyPath, target: KeyPath) -> None:
        # A plan for a checkpoint that fits (or one torch.compile renamed) holds one Rename per
        # key. Assigning through the slots' own descriptors costs half of what the generated
        # frozen __init__ pays (object.__setattr__ looks each slot up by name); as in Entry.
        _set_source(self, source)
        _set_target(self, target)

    def pieces(self, source_shapes: Shapes, target_shapes: Shapes) -> tuple[Piece, ...]:
        return (_same(source_shapes[0], target_shapes[0]),)

    def inverse(self) -> Rename:
        return Rename(self.target, self.source)

    def describe(self, sep: str = ".") -> str:
        return f"{join_key(self.source, sep)} -> rename -> {join_key(self.target, sep)}"

    def tally(self) -> tuple[str, int] | None:
        return None if self.source == self.target else ("renamed", 1)

    def note(self, sep: str = ".") -> str:
        return f"{join_key(self.source, sep)} -> {join_key(self.target, sep)}"


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


def with_sources(op: Op, names: Mapping[KeyPath, KeyPath]) -> Op:
    """``op`` reading each source key under the name ``names`` gives it (a key it lacks keeps its
    own): the op planned against a re-keyed checkpoint, naming the checkpoint's keys. Every op
    names what it reads in a ``source`` or ``sources`` field."""
    if "source" in op.__dataclass_fields__:
        return dataclasses.replace(op, source=names.get(op.source, op.source))
    if "sources" in op.__dataclass_fields__:
        return dataclasses.replace(op, sources=tuple(names.get(key, key) for key in op.sources))
    return op


@dataclass(frozen=True, slots=True)
class Stack(_Moves, _Defaults, _IntoTarget, _OneAxis):
    """Per-layer sources (in layer order) become one target stacked along ``axis``: the one-axis
    :class:`Join` without a permutation."""

    kind: ClassVar[str] = "stack"

    sources: tuple[KeyPath, ...]
    target: KeyPath
    axis: int

    def pieces(self, source_shapes: Shapes, target_shapes: Shapes) -> tuple[Piece, ...]:
        """Source ``i`` is the target at index ``i`` of ``axis``."""
        return tuple(Piece(whole(i, shape), at(0, target_shapes[0], {self.axis: i}), _identity(len(shape)))
                     for i, shape in enumerate(source_shapes))

    def inverse(self) -> Unstack:
        return Unstack(self.target, self.sources, self.axis)

    def describe(self, sep: str = ".") -> str:
        return f"{keys_text(self.sources, sep)} -> stack(axis={self.axis}) -> {join_key(self.target, sep)}"

    def tally(self) -> tuple[str, int]:
        return "stacked", len(self.sources)

    def note(self, sep: str = ".") -> str:
        return f"axis {self.axis}"


@dataclass(frozen=True, slots=True)
class Unstack(_Moves, _Defaults, _FromSource, _OneAxis):
    """One source stacked along ``axis`` becomes per-layer targets (in layer order): the one-axis
    :class:`Split` without a permutation."""

    kind: ClassVar[str] = "unstack"

    source: KeyPath
    targets: tuple[KeyPath, ...]
    axis: int

    def pieces(self, source_shapes: Shapes, target_shapes: Shapes) -> tuple[Piece, ...]:
        return _inverted(self.inverse(), source_shapes, target_shapes)

    def inverse(self) -> Stack:
        return Stack(self.targets, self.source, self.axis)

    def describe(self, sep: str = ".") -> str:
        return f"{join_key(self.source, sep)} -> unstack(axis={self.axis}) -> {keys_text(self.targets, sep)}"

    def tally(self) -> tuple[str, int]:
        return "unstacked", len(self.targets)

    def note(self, sep: str = ".") -> str:
        return f"axis {self.axis}"


#: The rule of a synthesis the target asks for outright (a key a profile or the caller lets it
#: keep), and of its unchecked inverse ``Drop``.
OWN_VALUE = "target's own value"
#: The rule of a ``DropIfDerived`` of the target's own non-persistent buffer, saved by an older
#: version of the model; every other rule names a derivable-buffer rule.
NOT_PERSISTENT = "not persistent in target"


@dataclass(frozen=True, slots=True)
class Synthesize(_Defaults, _IntoTarget):
    """The checkpoint lacks ``target``; the target keeps (or recomputes) its value by ``rule``.

    Planned only where the target says the key is its own to compute (a buffer of the live
    module, a value checked to be what its rule derives), never from a name alone.
    """

    kind: ClassVar[str] = "synthesize"

    target: KeyPath
    rule: str

    @property
    def sources(self) -> tuple[KeyPath, ...]:
        return ()

    def inverse(self) -> Drop | DropIfDerived:
        if self.rule == OWN_VALUE:
            return Drop(self.target, self.rule)
        return DropIfDerived(self.target, self.rule)

    def describe(self, sep: str = ".") -> str:
        return f"(not in checkpoint) -> synthesize({self.rule}) -> {join_key(self.target, sep)}"

    def tally(self) -> tuple[str, int]:
        return "synthesized", 1

    def note(self, sep: str = ".") -> str:
        return self.rule


@dataclass(frozen=True, slots=True)
class _Dropping(_Defaults, _FromSource):
    """A checkpoint key that is not loaded, and the rule that says why; going back, the target
    gets its own value by that rule."""

    produces: ClassVar[bool] = False

    source: KeyPath
    rule: str

    @property
    def targets(self) -> tuple[KeyPath, ...]:
        return ()

    def inverse(self) -> Synthesize:
        return Synthesize(self.source, self.rule)

    def tally(self) -> tuple[str, int]:
        return "dropped", 1

    def note(self, sep: str = ".") -> str:
        return self.rule


@dataclass(frozen=True, slots=True)
class Drop(_Dropping):
    """The checkpoint's ``source`` is not loaded, unchecked: the inverse of a ``Synthesize`` by
    :data:`OWN_VALUE` (going back, the value the target kept has no place)."""

    kind: ClassVar[str] = "drop"

    def describe(self, sep: str = ".") -> str:
        return f"{join_key(self.source, sep)} -> drop({self.rule})"


@dataclass(frozen=True, slots=True)
class DropIfDerived(_Dropping):
    """The checkpoint's ``source`` is a buffer the target computes itself; it is not loaded once
    its value is checked to be that buffer.

    ``rule`` says which: a derivable-buffer rule (``inv_freq``, a causal ``attention.bias``: the
    value must be what the rule derives, :data:`ckptshim.rules.buffers.HOLDS`), or
    :data:`NOT_PERSISTENT` (the target's own buffer of that name, which it does not persist: the
    value must have its shape and dtype). The executor that runs it reads the value and checks
    it; where it is not what the rule says, the key is the target's no more than any other:
    unexpected (a strict load refuses it).
    """

    kind: ClassVar[str] = "drop-if-derived"

    def describe(self, sep: str = ".") -> str:
        return f"{join_key(self.source, sep)} -> drop({self.rule}) once its value is checked"


@dataclass(frozen=True, slots=True)
class Cast(_Defaults, _IntoTarget):
    """The value written to ``target`` changes dtype (after the op that produces it)."""

    kind: ClassVar[str] = "cast"
    produces: ClassVar[bool] = False

    target: KeyPath
    source_dtype: str
    target_dtype: str

    @property
    def sources(self) -> tuple[KeyPath, ...]:
        return ()

    def inverse(self) -> Cast:
        return Cast(self.target, self.target_dtype, self.source_dtype)

    def describe(self, sep: str = ".") -> str:
        return f"{join_key(self.target, sep)}: cast {self.source_dtype} -> {self.target_dtype}"

    def tally(self) -> tuple[str, int]:
        return "cast", 1

    def note(self, sep: str = ".") -> str:
        return f"{self.source_dtype} -> {self.target_dtype}"


def _check_perm(perm: tuple[int, ...]) -> None:
    if sorted(perm) != list(range(len(perm))):
        raise ValueError(f"{perm} is not a permutation of the axes 0..{len(perm) - 1}")


def _check_axes(axes: tuple[int, ...]) -> None:
    if not axes or list(axes) != sorted(set(axes)) or axes[0] < 0:
        raise ValueError(f"axes {axes} must be distinct, ascending, non-negative and at least one")


def _perm_text(perm: tuple[int, ...]) -> str:
    return "perm " + ",".join(map(str, perm))


def _layout_text(axes: tuple[int, ...], perm: tuple[int, ...]) -> str:
    """``axes 0,1; perm 1,0``: the layout of a split or join."""
    return f"axes {','.join(map(str, axes))}; {_perm_text(perm)}"


@dataclass(frozen=True, slots=True)
class Transpose(_Moves, _Defaults, _FromSource, _IntoTarget):
    """The target is the source with its axes permuted: ``target = source.transpose(perm)``.

    Target axis ``i`` is source axis ``perm[i]``. Moving a stacked layer axis (PaxML keeps layers
    on axis 0, MaxText on ``param_scan_axis``) is one such permutation; so is ``x.T``.
    """

    kind: ClassVar[str] = "transpose"

    source: KeyPath
    target: KeyPath
    perm: tuple[int, ...]

    def __post_init__(self) -> None:
        _check_perm(self.perm)

    def pieces(self, source_shapes: Shapes, target_shapes: Shapes) -> tuple[Piece, ...]:
        return (Piece(whole(0, source_shapes[0]), whole(0, target_shapes[0]), self.perm),)

    def inverse(self) -> Transpose:
        return Transpose(self.target, self.source, inverse_perm(self.perm))

    def describe(self, sep: str = ".") -> str:
        return f"{join_key(self.source, sep)} -> transpose({self.note()}) -> {join_key(self.target, sep)}"

    def tally(self) -> tuple[str, int]:
        return "transposed", 1

    def note(self, sep: str = ".") -> str:
        return _perm_text(self.perm)


@dataclass(frozen=True, slots=True)
class Split(_Moves, _Defaults, _FromSource):
    """One source cut at every index of ``axes`` into targets, each then transposed by ``perm``.

    Targets are in row-major order of the indices along ``axes`` (ascending): with ``axes``
    ``(0, 1)`` of a ``[layers, 3, ...]`` array, target ``3 * i + j`` is ``source[i, j]``. Each
    target is ``source[index].transpose(perm)``, ``perm`` over the axes left after indexing.
    PaxML's fused ``combined_qkv`` (``[layers, 3, embed, heads, head_dim]``) splits so into
    MaxText's ``query``/``key``/``value``. ``Unstack`` is the one-axis case without a permutation.
    """

    kind: ClassVar[str] = "split"

    source: KeyPath
    targets: tuple[KeyPath, ...]
    axes: tuple[int, ...]
    perm: tuple[int, ...]

    def __post_init__(self) -> None:
        _check_axes(self.axes)
        _check_perm(self.perm)

    def pieces(self, source_shapes: Shapes, target_shapes: Shapes) -> tuple[Piece, ...]:
        return _inverted(self.inverse(), source_shapes, target_shapes)

    def inverse(self) -> Join:
        return Join(self.targets, self.source, self.axes, inverse_perm(self.perm))

    def describe(self, sep: str = ".") -> str:
        return f"{join_key(self.source, sep)} -> split({self.note()}) -> {keys_text(self.targets, sep)}"

    def tally(self) -> tuple[str, int]:
        return "split", len(self.targets)

    def note(self, sep: str = ".") -> str:
        return _layout_text(self.axes, self.perm)


@dataclass(frozen=True, slots=True)
class Join(_Moves, _Defaults, _IntoTarget):
    """Sources, each transposed by ``perm``, fill ``target`` at every index of ``axes``.

    ``target[index_k] = sources[k].transpose(perm)``, the indices in row-major order as in
    :class:`Split`, whose inverse this is. ``Stack`` is the one-axis case without a permutation.
    """

    kind: ClassVar[str] = "join"

    sources: tuple[KeyPath, ...]
    target: KeyPath
    axes: tuple[int, ...]
    perm: tuple[int, ...]

    def __post_init__(self) -> None:
        _check_axes(self.axes)
        _check_perm(self.perm)

    def pieces(self, source_shapes: Shapes, target_shapes: Shapes) -> tuple[Piece, ...]:
        """Source ``k`` is the target at the ``k``-th index of ``axes`` (row-major), its axes permuted."""
        target = target_shapes[0]
        sizes = [target[axis] for axis in self.axes] if max(self.axes) < len(target) else [0] * len(self.axes)
        return tuple(Piece(whole(k, shape), at(0, target, dict(zip(self.axes, unravel(k, sizes)))), self.perm)
                     for k, shape in enumerate(source_shapes))

    def inverse(self) -> Split:
        return Split(self.target, self.sources, self.axes, inverse_perm(self.perm))

    def describe(self, sep: str = ".") -> str:
        return f"{keys_text(self.sources, sep)} -> join({self.note()}) -> {join_key(self.target, sep)}"

    def tally(self) -> tuple[str, int]:
        return "joined", len(self.sources)

    def note(self, sep: str = ".") -> str:
        return _layout_text(self.axes, self.perm)


class _Parts:
    """``Concat``/``Chunk``: where each of the many keys lies in the one fused array.

    The fused array is ``len(sizes)`` parts side by side along ``axis``, part ``p`` spanning
    ``sizes[p]`` indices there. A part is one array, or with ``stack_axis`` the next run of
    ``len(keys) // len(sizes)`` arrays stacked along that (new) axis of the fused array.
    """

    __slots__ = ()

    def _check_parts(self, count: int) -> None:
        if not self.sizes or any(size < 1 for size in self.sizes) or self.axis < 0:
            raise ValueError(f"sizes {self.sizes} must be positive and at least one, axis {self.axis} non-negative")
        if self.stack_axis is None and count != len(self.sizes):
            raise ValueError(f"{count} arrays for {len(self.sizes)} parts: without a stack axis each part is one array")
        if self.stack_axis is not None and (count % len(self.sizes) or self.stack_axis == self.axis
                                            or self.stack_axis < 0):
            raise ValueError(f"{count} arrays do not make {len(self.sizes)} equal stacks on axis "
                             f"{self.stack_axis} beside axis {self.axis}")

    def slot(self, index: int, count: int) -> tuple[int | None, int, int]:
        """Where the ``index``-th of ``count`` arrays lies in the fused one: its index along
        ``stack_axis`` (``None`` without one), and its start and extent along ``axis``."""
        part, member = divmod(index, count // len(self.sizes))
        return (None if self.stack_axis is None else member), sum(self.sizes[:part]), self.sizes[part]

    def parts_text(self, keys: Sequence[KeyPath], sep: str) -> str:
        """The many keys, part by part (each part's run of stacked keys compressed to a range)."""
        per_part = len(keys) // len(self.sizes)
        return runs_text([keys[start:start + per_part] for start in range(0, len(keys), per_part)], sep)

    def note(self, sep: str = ".") -> str:
        stacked = "" if self.stack_axis is None else f", each part stacked on axis {self.stack_axis}"
        return f"axis {self.axis}, sizes {','.join(map(str, self.sizes))}{stacked}"


@dataclass(frozen=True, slots=True)
class Concat(_Moves, _Defaults, _IntoTarget, _Parts):
    """Sources side by side along ``axis`` fill ``target``: ``target = cat(parts, axis)``.

    ``sizes`` are the parts' extents along ``axis`` (so the op alone knows its inverse). With
    ``stack_axis``, each part is a run of sources stacked first: transformers 5 keeps a Mixtral
    layer's experts fused, ``gate_up_proj`` ``[E, 2I, H]`` being every expert's ``w1`` stacked on
    axis 0 beside every expert's ``w3`` (``MergeModulelist(0)`` then ``Concatenate(1)``).
    """

    kind: ClassVar[str] = "concat"

    sources: tuple[KeyPath, ...]
    target: KeyPath
    axis: int
    sizes: tuple[int, ...]
    stack_axis: int | None = None

    def __post_init__(self) -> None:
        self._check_parts(len(self.sources))

    def pieces(self, source_shapes: Shapes, target_shapes: Shapes) -> tuple[Piece, ...]:
        """Each source is its slot of the target: a range of ``axis``, one index of ``stack_axis``."""
        count, out = len(source_shapes), []
        for k, shape in enumerate(source_shapes):
            member, start, size = self.slot(k, count)
            place: dict[int, int | range] = {self.axis: range(start, start + size)}
            if member is not None:
                place[self.stack_axis] = member
            out.append(Piece(whole(k, shape), at(0, target_shapes[0], place), _identity(len(shape))))
        return tuple(out)

    def inverse(self) -> Chunk:
        return Chunk(self.target, self.sources, self.axis, self.sizes, self.stack_axis)

    def describe(self, sep: str = ".") -> str:
        return f"{self.parts_text(self.sources, sep)} -> concat({self.note()}) -> {join_key(self.target, sep)}"

    def tally(self) -> tuple[str, int]:
        return "concatenated", len(self.sources)


@dataclass(frozen=True, slots=True)
class Chunk(_Moves, _Defaults, _FromSource, _Parts):
    """One source cut along ``axis`` into parts of ``sizes``, each part one target (or, with
    ``stack_axis``, unstacked along it into a run of targets): the inverse of :class:`Concat`,
    transformers' ``Chunk``/``Split`` (a fused ``qkv`` into ``q``, ``k``, ``v``) and the way back
    from fused experts to per-expert weights."""

    kind: ClassVar[str] = "chunk"

    source: KeyPath
    targets: tuple[KeyPath, ...]
    axis: int
    sizes: tuple[int, ...]
    stack_axis: int | None = None

    def __post_init__(self) -> None:
        self._check_parts(len(self.targets))

    def pieces(self, source_shapes: Shapes, target_shapes: Shapes) -> tuple[Piece, ...]:
        return _inverted(self.inverse(), source_shapes, target_shapes)

    def inverse(self) -> Concat:
        return Concat(self.targets, self.source, self.axis, self.sizes, self.stack_axis)

    def describe(self, sep: str = ".") -> str:
        return f"{join_key(self.source, sep)} -> chunk({self.note()}) -> {self.parts_text(self.targets, sep)}"

    def tally(self) -> tuple[str, int]:
        return "chunked", len(self.targets)


@dataclass(frozen=True, slots=True)
class Reorder(_Moves, _Defaults, _FromSource, _IntoTarget):
    """The target is the source with the indices along ``axis`` permuted.

    ``axis`` is read as the row-major ``factors`` (their product is its length) and those are
    permuted by ``order``: target factor ``i`` is source factor ``order[i]``. transformers'
    ``Interleave`` is factors ``(n/2, 2)``, order ``(1, 0)``; ``PermuteForRope`` (rotary pairs
    interleaved per head -> each head's two halves) is ``(heads, d/2, 2)``, order ``(0, 2, 1)``.
    Every such permutation is a view of either side, so executors copy it without a gather.
    """

    kind: ClassVar[str] = "reorder"

    source: KeyPath
    target: KeyPath
    axis: int
    factors: tuple[int, ...]
    order: tuple[int, ...]

    def __post_init__(self) -> None:
        _check_perm(self.order)
        if len(self.factors) != len(self.order) or any(f < 1 for f in self.factors) or self.axis < 0:
            raise ValueError(f"factors {self.factors} must be positive, one per entry of order {self.order}")

    @property
    def target_factors(self) -> tuple[int, ...]:
        """The factors of ``axis`` in the target's order."""
        return tuple(self.factors[o] for o in self.order)

    def pieces(self, source_shapes: Shapes, target_shapes: Shapes) -> tuple[Piece, ...]:
        """Both sides with ``axis`` split into their factors; the factors permuted by ``order``."""
        source, target, axis = source_shapes[0], target_shapes[0], self.axis
        factored = (source[:axis] + self.factors + source[axis + 1:],
                    target[:axis] + self.target_factors + target[axis + 1:])
        perm = tuple(range(axis)) + tuple(axis + o for o in self.order) + tuple(
            range(axis + len(self.order), len(factored[0])))
        return (Piece(whole(0, factored[0]), whole(0, factored[1]), perm),)

    def inverse(self) -> Reorder:
        return Reorder(self.target, self.source, self.axis, self.target_factors, inverse_perm(self.order))

    def describe(self, sep: str = ".") -> str:
        return f"{join_key(self.source, sep)} -> reorder({self.note()}) -> {join_key(self.target, sep)}"

    def tally(self) -> tuple[str, int]:
        return "reordered", 1

    def note(self, sep: str = ".") -> str:
        return f"axis {self.axis} as {'x'.join(map(str, self.factors))}, {_perm_text(self.order)}"


class _Groups:
    """``JoinGroups``/``SplitGroups``: where each part of each query group lies in a fused array.

    The fused rows are ``groups`` query groups one after another, each group its ``heads`` heads
    of every part in turn (``(4, 1, 1)``: four query heads, then one key and one value head),
    each head ``head_dim`` rows. A part whose ``pairs`` entry is set holds its heads' rotary
    dimensions as interleaved pairs (Meta, torchtitan) where the fused array holds them as two
    halves (Megatron-Core, Hugging Face). With a leading axis more than the parts, the fused
    array stacks the layers, the parts running layer by layer.
    """

    __slots__ = ()

    def _check_groups(self, count: int) -> None:
        if not (self.groups > 0 and self.head_dim > 0 and self.heads and min(self.heads) > 0
                and len(self.parts) == len(self.heads) == len(self.pairs) and count % len(self.heads) == 0):
            raise ValueError(f"{count} arrays in {self.groups} groups of heads {self.heads} ({self.parts}), "
                             f"head_dim {self.head_dim}: every part needs a positive head count, a name and a rotary flag")
        if any(self.pairs) and self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} has no rotary halves to interleave")

    def group_pieces(self, part_shapes: Shapes, fused_shape: tuple[int, ...]) -> tuple[Piece, ...]:
        """Part array ``k`` (layer ``k // parts``, part ``k % parts``) as its slice of the fused one."""
        stacked = len(fused_shape) == len(part_shapes[0]) + 1
        per_group, half = sum(self.heads), self.head_dim // 2
        out = []
        for k, shape in enumerate(part_shapes):
            layer, part = divmod(k, len(self.heads))
            heads, start, rest = self.heads[part], sum(self.heads[:part]), shape[1:]
            dims = (half, 2) if self.pairs[part] else (self.head_dim,)
            fused_dims = (2, half) if self.pairs[part] else (self.head_dim,)
            factors = (self.groups, heads) + dims + rest
            fused = ((fused_shape[0],) if stacked else ()) + (self.groups, per_group) + fused_dims + rest
            index = ((layer,) if stacked else ()) + (range(self.groups), range(start, start + heads)) + tuple(
                range(size) for size in fused_dims + rest)
            order = (0, 1, 3, 2) if self.pairs[part] else (0, 1, 2)
            perm = order + tuple(range(len(order), len(order) + len(rest)))
            out.append(Piece(whole(k, factors), View(0, fused, index), perm))
        return tuple(out)

    def groups_text(self) -> str:
        parts = ", ".join(f"{heads} {name}" for heads, name in zip(self.heads, self.parts))
        rotary = [name for name, pairs in zip(self.parts, self.pairs) if pairs]
        return f"{self.groups} × [{parts}]" + (f"; {', '.join(rotary)} rotary pairs <-> halves" if rotary else "")

    def note(self, sep: str = ".") -> str:
        return self.groups_text()


@dataclass(frozen=True, slots=True)
class JoinGroups(_Moves, _Defaults, _IntoTarget, _Groups):
    """Per-head parts (a layer's query, key and value) fused query group by query group into
    ``target``: Megatron-Core's ``linear_qkv``, ``[q heads of group 0, k, v, q heads of group 1,
    k, v, ...]`` (see :class:`_Groups`). The inverse of :class:`SplitGroups`."""

    kind: ClassVar[str] = "join-groups"

    sources: tuple[KeyPath, ...]
    target: KeyPath
    groups: int
    heads: tuple[int, ...]
    parts: tuple[str, ...]
    head_dim: int
    pairs: tuple[bool, ...]

    def __post_init__(self) -> None:
        self._check_groups(len(self.sources))

    def pieces(self, source_shapes: Shapes, target_shapes: Shapes) -> tuple[Piece, ...]:
        return self.group_pieces(source_shapes, target_shapes[0])

    def inverse(self) -> SplitGroups:
        return SplitGroups(self.target, self.sources, self.groups, self.heads, self.parts, self.head_dim, self.pairs)

    def describe(self, sep: str = ".") -> str:
        return (f"{self.parts_text(self.sources, sep)} -> join by query group ({self.groups_text()}) -> "
                f"{join_key(self.target, sep)}")

    def parts_text(self, keys: Sequence[KeyPath], sep: str) -> str:
        return runs_text([keys[part::len(self.heads)] for part in range(len(self.heads))], sep)

    def tally(self) -> tuple[str, int]:
        return "joined by query group", len(self.sources)


@dataclass(frozen=True, slots=True)
class SplitGroups(_Moves, _Defaults, _FromSource, _Groups):
    """A fused array cut query group by query group into its per-head parts (Megatron-Core's
    ``linear_qkv`` into a layer's query, key and value; stacked, into every layer's): the inverse
    of :class:`JoinGroups`."""

    kind: ClassVar[str] = "split-groups"

    source: KeyPath
    targets: tuple[KeyPath, ...]
    groups: int
    heads: tuple[int, ...]
    parts: tuple[str, ...]
    head_dim: int
    pairs: tuple[bool, ...]

    def __post_init__(self) -> None:
        self._check_groups(len(self.targets))

    def pieces(self, source_shapes: Shapes, target_shapes: Shapes) -> tuple[Piece, ...]:
        return _inverted(self.inverse(), source_shapes, target_shapes)

    def inverse(self) -> JoinGroups:
        return JoinGroups(self.targets, self.source, self.groups, self.heads, self.parts, self.head_dim, self.pairs)

    def describe(self, sep: str = ".") -> str:
        return (f"{join_key(self.source, sep)} -> split by query group ({self.groups_text()}) -> "
                f"{self.inverse().parts_text(self.targets, sep)}")

    def tally(self) -> tuple[str, int]:
        return "split by query group", len(self.targets)


class _Gathers(_Defaults, _IntoTarget):
    """Several sources made into one target, said ``a, b -> <word> -> t``."""

    __slots__ = ()
    word: ClassVar[str]
    counted: ClassVar[str]

    def describe(self, sep: str = ".") -> str:
        return f"{keys_text(self.sources, sep)} -> {self.word} -> {join_key(self.target, sep)}"

    def tally(self) -> tuple[str, int]:
        return self.counted, len(self.sources)


class _Spreads(_Defaults, _FromSource):
    """One source made into several targets, said ``s -> <word> -> a, b``."""

    __slots__ = ()
    word: ClassVar[str]
    counted: ClassVar[str]

    def describe(self, sep: str = ".") -> str:
        return f"{join_key(self.source, sep)} -> {self.word} -> {keys_text(self.targets, sep)}"

    def tally(self) -> tuple[str, int]:
        return self.counted, len(self.targets)


@dataclass(frozen=True, slots=True)
class Replicate(_Moves, _Spreads):
    """Every target is a copy of the one source: a tensor each tensor-parallel rank holds whole
    (a layer norm), given to every rank."""

    kind: ClassVar[str] = "replicate"
    word: ClassVar[str] = "replicate"
    counted: ClassVar[str] = "replicated"

    source: KeyPath
    targets: tuple[KeyPath, ...]

    def pieces(self, source_shapes: Shapes, target_shapes: Shapes) -> tuple[Piece, ...]:
        whole_source = whole(0, source_shapes[0])
        return tuple(Piece(whole_source, whole(k, shape), _identity(len(shape))) for k, shape in enumerate(target_shapes))

    def inverse(self) -> Replicated:
        return Replicated(self.targets, self.source)

    def note(self, sep: str = ".") -> str:
        return f"{len(self.targets)} copies"


@dataclass(frozen=True, slots=True)
class Replicated(_Gathers):
    """The sources are copies of one value (one per tensor-parallel rank); the target is that
    value, once every copy is checked to hold the same bits as the first.

    Not a layout op: its executor reads every copy and refuses copies that differ (shards from
    different runs or steps), where taking the first would load one rank's value silently.
    """

    kind: ClassVar[str] = "replicated"
    word: ClassVar[str] = "one of the equal copies"
    counted: ClassVar[str] = "deduplicated"

    sources: tuple[KeyPath, ...]
    target: KeyPath

    def inverse(self) -> Replicate:
        return Replicate(self.target, self.sources)

    def note(self, sep: str = ".") -> str:
        return "checked equal"


@dataclass(frozen=True, slots=True)
class Sum(_Gathers):
    """The target is the sum of its sources, added one by one in the target's precision
    (bfloat16 through float32, rounded to nearest even after each add, as torch rounds).

    GPT-NeoX's row-parallel output biases: with the parallel residual each tensor-parallel rank
    adds its own before the all-reduce, so the whole bias is their sum (NeoX's converter sums
    them). The inverse, :class:`Share`, gives each rank an equal part, as NeoX's splitter does:
    exact for a power-of-two count, but not the original per-rank biases.
    """

    kind: ClassVar[str] = "sum"
    word: ClassVar[str] = "sum"
    counted: ClassVar[str] = "summed"

    sources: tuple[KeyPath, ...]
    target: KeyPath

    def inverse(self) -> Share:
        return Share(self.target, self.sources)

    def note(self, sep: str = ".") -> str:
        return f"{len(self.sources)} terms"


@dataclass(frozen=True, slots=True)
class Share(_Spreads):
    """Every target is the source divided by the number of targets, in its precision (rounded
    as :class:`Sum` rounds): the inverse of a :class:`Sum`."""

    kind: ClassVar[str] = "share"
    word: ClassVar[str] = "share"
    counted: ClassVar[str] = "shared"

    source: KeyPath
    targets: tuple[KeyPath, ...]

    def inverse(self) -> Sum:
        return Sum(self.targets, self.source)

    def note(self, sep: str = ".") -> str:
        return f"1/{len(self.targets)} each"


@dataclass(frozen=True, slots=True)
class Tie(_Defaults, _IntoTarget):
    """``target`` shares its storage with ``twin`` in the live target, and the checkpoint holds
    only ``twin``'s value (a tied ``lm_head.weight`` that ``save_model`` or transformers 4 left
    out): that one value fills both. Only a target whose tensors really share storage gets it."""

    kind: ClassVar[str] = "tie"

    target: KeyPath
    twin: KeyPath

    @property
    def sources(self) -> tuple[KeyPath, ...]:
        return ()

    def inverse(self) -> Drop:
        return Drop(self.target, f"tied to {join_key(self.twin)}")

    def describe(self, sep: str = ".") -> str:
        return f"(tied to {join_key(self.twin, sep)}) -> tie -> {join_key(self.target, sep)}"

    def tally(self) -> tuple[str, int]:
        return "tied", 1

    def note(self, sep: str = ".") -> str:
        return f"{join_key(self.target, sep)} = {join_key(self.twin, sep)}"


def _shape_text(shape: Sequence[int]) -> str:
    return "x".join(map(str, shape)) or "scalar"


@dataclass(frozen=True, slots=True)
class Reshape(_Moves, _Defaults):
    """Arrays regrouped: ``target = source.reshape(factors).transpose(perm).reshape(shape)``.

    ``source`` is the one source array, or the several sources stacked on a new leading axis
    (``source_shape[0]`` is then their count, a factor of its own); ``shape`` is the one target,
    or the several targets stacked on a new leading axis (target ``k`` is ``[k]`` of it); one
    side is always one array. The
    ``factors`` split each source axis row-major (they must group into ``source_shape``, and,
    permuted, into ``shape``). So one op says what a converter does in several steps: a
    ``q_proj`` ``[heads * head_dim, emb]`` becomes MaxText's ``[emb, heads, head_dim]`` kernel as
    factors ``(heads, head_dim, emb)``, perm ``(2, 0, 1)``; split ``head_dim`` further into its
    rotary halves ``(2, head_dim / 2)`` and the perm also interleaves them (``Reorder``'s
    ``PermuteForRope``); per-layer sources stack on MaxText's scan axis by where the perm puts the
    leading count. Every element's place is an index permutation: no value changes.
    """

    kind: ClassVar[str] = "reshape"

    sources: tuple[KeyPath, ...]
    targets: tuple[KeyPath, ...]
    source_shape: tuple[int, ...]
    factors: tuple[int, ...]
    perm: tuple[int, ...]
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        _check_perm(self.perm)
        if len(self.perm) != len(self.factors) or any(f < 1 for f in self.factors):
            raise ValueError(f"factors {self.factors} must be positive, one per entry of perm {self.perm}")
        if len(self.sources) > 1 and len(self.targets) > 1:
            raise ValueError("one side of a reshape is one array: several sources make one target, or one "
                             "source several targets")
        for side, count, shape, factors in (("source", len(self.sources), self.source_shape, self.factors),
                                            ("target", len(self.targets), self.shape, self.target_factors)):
            groups = axis_groups(factors, shape)
            if groups is None:
                raise ValueError(f"factors {factors} do not split the {side} shape {shape} row-major")
            if count > 1 and (not shape or shape[0] != count or len(groups[0]) != 1):
                raise ValueError(f"{count} {side}s must be the leading axis of {shape}, one factor of its own")

    @property
    def target_factors(self) -> tuple[int, ...]:
        """The factors in the target's order."""
        return tuple(self.factors[p] for p in self.perm)

    def pieces(self, source_shapes: Shapes, target_shapes: Shapes) -> tuple[Piece, ...]:
        """One piece from the sources' factors to the targets'; several sources (targets) are
        one index each of the leading factor their stacked shape has."""
        if len(self.targets) > 1:
            return _inverted(self.inverse(), source_shapes, target_shapes)
        target = self.target_factors
        if len(self.sources) == 1:
            return (Piece(whole(0, self.factors), whole(0, target), self.perm),)
        count_at = self.perm.index(0)  # where the sources' count lands among the target's factors
        perm = tuple(p - 1 for p in self.perm if p != 0)
        return tuple(Piece(whole(i, self.factors[1:]), at(0, target, {count_at: i}), perm)
                     for i in range(len(self.sources)))

    def inverse(self) -> Reshape:
        return Reshape(self.targets, self.sources, self.shape, self.target_factors, inverse_perm(self.perm),
                       self.source_shape)

    def simplified(self) -> LayoutOp:
        """The same op as the plainest kind that says it, so a plan reads as what it does: where
        no axis is split or merged, a ``Rename`` or ``Transpose`` of one array, or a ``Stack``
        of several that only gain an axis (an ``Unstack`` of one that loses it); a ``Reorder``
        where one axis's factors are permuted among themselves; else this ``Reshape``."""
        sources, targets = len(self.sources), len(self.targets)
        if targets > 1:
            inverse = self.inverse().simplified()
            return Unstack(inverse.target, inverse.sources, inverse.axis) if isinstance(inverse, Stack) else self
        whole_axes = (self.factors == self.source_shape and self.target_factors == self.shape)
        if not whole_axes:
            return self._reorder() or self
        if sources == 1:
            if self.perm == tuple(range(len(self.perm))):
                return Rename(self.sources[0], self.targets[0])
            return Transpose(self.sources[0], self.targets[0], self.perm)
        axis = self.perm.index(0)
        if tuple(p for p in self.perm if p != 0) == tuple(range(1, len(self.perm))):
            return Stack(self.sources, self.targets[0], axis)
        return self

    def _reorder(self) -> Reorder | None:
        """This op as a :class:`Reorder`: one array into one of its shape, each axis keeping its
        own factors, those of one axis permuted among themselves."""
        if len(self.sources) != 1 or self.source_shape != self.shape:
            return None
        groups = axis_groups(self.factors, self.source_shape)
        moved = [group for group in groups if tuple(self.perm[i] for i in group) != tuple(group)]
        if len(moved) != 1 or any(sorted(self.perm[i] for i in group) != list(group) for group in groups):
            return None
        (group,) = moved
        return Reorder(self.sources[0], self.targets[0], groups.index(group), tuple(self.factors[i] for i in group),
                       tuple(self.perm[i] - group.start for i in group))

    def describe(self, sep: str = ".") -> str:
        return f"{keys_text(self.sources, sep)} -> reshape({self.note()}) -> {keys_text(self.targets, sep)}"

    def tally(self) -> tuple[str, int]:
        return "reshaped", len(self.targets)

    def note(self, sep: str = ".") -> str:
        return (f"{_shape_text(self.source_shape)} as {_shape_text(self.factors)}, {_perm_text(self.perm)}, "
                f"to {_shape_text(self.shape)}")


def float32(value: float) -> float:
    """``value`` rounded to the nearest float32 (as ``numpy.float32(value)``), as a Python float."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


def rsqrt_float32(n: int) -> float:
    """``float32(1 / sqrt(n))``: MaxText's query scale for head_dim ``n``, computed as its converter
    computes it (in float64, then rounded to float32)."""
    return float32(1 / math.sqrt(n))


@dataclass(frozen=True, slots=True)
class Scale(_Defaults):
    """The values another op produces for ``targets`` (from ``sources``) multiplied by ``factor``.

    The one value-changing kind, applied exactly as the converter it mirrors does: the value in
    ``compute_dtype`` times ``factor`` (a ``compute_dtype`` number), rounded to ``dtype`` (the
    dtype the converter holds the array in), then cast to the target's dtype. ``expected`` says
    why the target expects the change (a profile that knows its model sets it); a plan with a
    scale nobody expects is refused under ``CKPTSHIM_STRICT``. The inverse multiplies by
    ``inverse_factor`` -- the converter's own way back (MaxText's ``to_huggingface`` multiplies by
    ``float32(sqrt(head_dim))``). Rounding happens each way, so a bfloat16 value scaled and scaled
    back is not always the value it was.
    """

    kind: ClassVar[str] = "scale"
    produces: ClassVar[bool] = False

    sources: tuple[KeyPath, ...]
    targets: tuple[KeyPath, ...]
    factor: float
    inverse_factor: float
    dtype: str
    expected: str = ""
    compute_dtype: str = "float32"

    def inverse(self) -> Scale:
        return Scale(self.targets, self.sources, self.inverse_factor, self.factor, self.dtype, self.expected,
                     self.compute_dtype)

    def describe(self, sep: str = ".") -> str:
        return f"{keys_text(self.targets, sep)}: scale({self.note()})"

    def tally(self) -> tuple[str, int]:
        return "scaled", len(self.targets)

    def note(self, sep: str = ".") -> str:
        return (f"x {self.factor!r} in {self.compute_dtype}, rounded to {self.dtype}"
                + (f": {self.expected}" if self.expected else ""))
