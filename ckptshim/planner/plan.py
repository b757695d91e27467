"""A plan: the ops that turn a source inventory into a target one, and what is left over."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

from ckptshim.inventory import Inventory, KeyPath, join_key
from ckptshim.planner.diagnosis import refusal
from ckptshim.ops import Cast, DropIfDerived, Op

#: The ``why`` of a :class:`Mismatch` in dtype alone.
DTYPE = "dtype"


@dataclass(frozen=True, slots=True)
class Mismatch:
    """A source and target that name the same array but disagree on shape, or on dtype.

    A dtype mismatch (``why == "dtype"``: a cast the rules forbid, such as a narrowing one under
    ``CKPTSHIM_STRICT``) holds the two dtypes as one-element tuples in place of the shapes.
    """

    source: KeyPath
    target: KeyPath
    source_shape: tuple[int, ...]
    target_shape: tuple[int, ...]
    why: str = "shape"

    @property
    def of_dtype(self) -> bool:
        return self.why == DTYPE

    def describe(self, sep: str) -> str:
        target, source = self.target_shape, self.source_shape
        if self.of_dtype:
            (target,), (source,) = target, source
        return (f"{join_key(self.target, sep)}: target {self.why} {target} but "
                f"checkpoint {join_key(self.source, sep)} has {source}")


@dataclass(frozen=True)
class Plan:
    """Ops in target order, plus the keys no op accounts for.

    ``missing`` are target keys nothing provides, ``unexpected`` source keys nothing uses,
    ``mismatched`` pairs that match by name but not by shape (or not by dtype). A plan with none of those is
    *complete*; :meth:`require_complete` turns the rest into one actionable error.
    """

    source: Inventory
    target: Inventory
    ops: tuple[Op, ...]
    missing: tuple[KeyPath, ...] = ()
    unexpected: tuple[KeyPath, ...] = ()
    mismatched: tuple[Mismatch, ...] = ()
    #: for some missing keys, what a profile knows they would be made from (instead of guessing)
    hints: Mapping[KeyPath, str] = field(default_factory=dict, compare=False)
    #: what a rule decided for the load as a whole (a root prefix set aside), said in its summary
    notes: tuple[str, ...] = ()
    #: what a rule says the load loses (variables the target has no place for), logged as warnings
    warnings: tuple[str, ...] = ()
    _producers: dict[KeyPath, Op] | None = field(default=None, repr=False, compare=False)

    @property
    def complete(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)

    def producer(self, target_key: KeyPath) -> Op | None:
        """The op that gives ``target_key`` its value (``None`` when nothing does)."""
        return self._producer_index().get(target_key)

    def _producer_index(self) -> dict[KeyPath, Op]:
        """Target key -> producing op, built on first use.

        Only some executors ask (torch's walks the ops instead), and for a million-key plan the
        index costs a sizeable share of planning, so a plan does not build it up front.
        """
        if self._producers is None:
            producers: dict[KeyPath, Op] = {}
            for op in self.ops:
                if op.produces:
                    producers.update(dict.fromkeys(op.targets, op))
            object.__setattr__(self, "_producers", producers)  # a cache on a frozen dataclass
        return self._producers

    def undropped(self, keys: Collection[KeyPath]) -> Plan:
        """This plan with the ``DropIfDerived`` of ``keys`` undone, those keys unexpected instead:
        the plan as an executor ran it, having found their values not what their rules derive."""
        return self._undoing(lambda op: op.kind == DropIfDerived.kind and op.source in keys)

    def left_undone(self, kinds: Collection[str]) -> Plan:
        """This plan without its ops of ``kinds``: what they would give a value is missing, what
        they would drop unexpected. A framework's non-strict load reports those itself, as it
        would had the checkpoint been saved from the target (see the ``load_state_dict`` hook)."""
        return self._undoing(lambda op: op.kind in kinds)

    def _undoing(self, undone: Callable[[Op], bool]) -> Plan:
        gone = [op for op in self.ops if undone(op)]
        if not gone:
            return self
        sources = {key for op in gone for key in op.sources}
        targets = {key for op in gone if op.produces for key in op.targets}
        return dataclasses.replace(
            self, ops=tuple(op for op in self.ops if not undone(op)), _producers=None,
            missing=self.missing + tuple(key for key in self.target if key in targets),
            unexpected=self.unexpected + tuple(key for key in self.source if key in sources))

    def casts(self) -> dict[KeyPath, Cast]:
        return {op.target: op for op in self.ops if op.kind == Cast.kind}

    @property
    def is_identity(self) -> bool:
        """True when loading needs no help: every op changes nothing (a same-name rename)."""
        return self.complete and all(op.tally() is None for op in self.ops)

    def counts(self) -> Counter[str]:
        """How many keys each kind of op touches (ops that change nothing are not counted)."""
        counts: Counter[str] = Counter()
        for op in self.ops:
            tally = op.tally()
            if tally is not None:
                counts[tally[0]] += tally[1]
        return counts

    def require_complete(self, sep: str = ".", *, allow_missing: bool = False,
                         allow_unexpected: bool = False, lenient: str = "") -> None:
        """Raise :class:`~ckptshim.errors.NoPlan` saying why the plan does not fit (a hook turns
        it into a note on the framework's own error) -- or, where ``CKPTSHIM_STRICT`` forbids a
        cast, a :class:`~ckptshim.errors.PlanError`: a refusal the user asked for, of a load the
        framework would carry out with the cast. ``lenient`` names the caller's non-strict load,
        offered in the advice where it helps (:func:`ckptshim.planner.diagnosis.refusal`)."""
        found = refusal(self, sep, allow_missing=allow_missing, allow_unexpected=allow_unexpected,
                        lenient=lenient)
        if found is not None:
            raise found.error(found.message)
