"""A plan: the ops that turn a source inventory into a target one, and what is left over."""

from __future__ import annotations

import dataclasses
import difflib
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from ckptshim.errors import NoPlan, PlanError
from ckptshim.inventory import Inventory, KeyPath, join_key
from ckptshim.ops import Cast, DropIfDerived, Op

#: How many keys an error message lists before it summarises the rest.
MAX_LISTED = 12
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
                         allow_unexpected: bool = False) -> None:
        """Raise :class:`~ckptshim.errors.NoPlan` listing what does not match, with the nearest
        candidates (a hook turns it into a note on the framework's own error) -- or, where
        ``CKPTSHIM_STRICT`` forbids a cast, a :class:`~ckptshim.errors.PlanError`: a refusal the
        user asked for, of a load the framework would carry out with the cast."""
        lines: list[str] = []
        shapes = [m for m in self.mismatched if not m.of_dtype]
        dtypes = [m for m in self.mismatched if m.of_dtype]
        if shapes:
            lines.append(f"{len(shapes)} key(s) match by name but not by shape:")
            lines += [f"  {m.describe(sep)}" for m in shapes[:MAX_LISTED]]
        if self.missing and not allow_missing:
            lines.append(f"{len(self.missing)} key(s) the target needs are not in the checkpoint:")
            for key in self.missing[:MAX_LISTED]:
                if key in self.hints:
                    lines.append(f"  {join_key(key, sep)} ({self.hints[key]})")
                    continue
                near = nearest(key, self.unexpected or tuple(self.source))
                hint = f" (nearest in checkpoint: {', '.join(join_key(k, sep) for k in near)})" if near else ""
                lines.append(f"  {join_key(key, sep)}{hint}")
        if self.unexpected and not allow_unexpected:
            lines.append(f"{len(self.unexpected)} checkpoint key(s) the target has no place for:")
            lines += [f"  {join_key(key, sep)}" for key in self.unexpected[:MAX_LISTED]]
        advice = []
        if shapes:
            advice.append("A key whose shape differs loads in no mode, strict or not: build the target with "
                          "the checkpoint's configuration, or leave that key out.")
        if (self.missing and not allow_missing) or (self.unexpected and not allow_unexpected):
            advice.append("Fix the names (or add a rule), or load non-strictly to accept the difference.")
        if dtypes:
            lines.append(f"{len(dtypes)} key(s) match by name and shape but not by dtype, and the "
                         "cast is not allowed (CKPTSHIM_STRICT=1 refuses every narrowing cast):")
            lines += [f"  {m.describe(sep)}" for m in dtypes[:MAX_LISTED]]
            advice.append("Save the checkpoint in the model's dtypes or build the model in the "
                          "checkpoint's, or unset CKPTSHIM_STRICT to let the values be cast.")
        if not lines:
            return
        more = [] if all(len(group) <= MAX_LISTED for group in (self.missing, self.unexpected, shapes, dtypes)) \
            else [f"(lists cut at {MAX_LISTED}; `ckptshim plan` shows every key)"]
        # a cast CKPTSHIM_STRICT forbids is the user's own refusal, made where the framework would
        # cast silently; the rest is the framework's to load or refuse
        refusal = PlanError if dtypes else NoPlan
        raise refusal("\n".join(
            [f"checkpoint {self.source.source or '(source)'} does not fit target "
             f"{self.target.source or '(target)'}:"] + lines + more + advice))


_MAX_CANDIDATES = 5000


def nearest(key: KeyPath, candidates: Sequence[KeyPath], n: int = 3) -> list[KeyPath]:
    """The candidate keys most like ``key``: same leaf name first, then by text similarity."""
    same_leaf = [c for c in candidates if c and c[-1] == key[-1]]
    pool = same_leaf if same_leaf else list(candidates[:_MAX_CANDIDATES])
    if len(pool) > _MAX_CANDIDATES:
        pool = pool[:_MAX_CANDIDATES]
    text = {join_key(c, "/"): c for c in pool}
    return [text[t] for t in difflib.get_close_matches(join_key(key, "/"), list(text), n=n, cutoff=0.4)]
