"""A plan: the ops that turn a source inventory into a target one, and what is left over."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from ckptshim.errors import PlanError
from ckptshim.inventory import Inventory, KeyPath, join_key
from ckptshim.planner.ops import Cast, Drop, Join, Op, Producer, Rename, Split, Stack, Synthesize, Transpose, Unstack

#: How many keys an error message lists before it summarises the rest.
MAX_LISTED = 12


@dataclass(frozen=True, slots=True)
class Mismatch:
    """A source and target that name the same array but disagree on shape (or on dtype)."""

    source: KeyPath
    target: KeyPath
    source_shape: tuple[int, ...]
    target_shape: tuple[int, ...]
    why: str = "shape"

    def describe(self, sep: str) -> str:
        return (f"{join_key(self.target, sep)}: target {self.why} {self.target_shape} but "
                f"checkpoint {join_key(self.source, sep)} has {self.source_shape}")


@dataclass(frozen=True)
class Plan:
    """Ops in target order, plus the keys no op accounts for.

    ``missing`` are target keys nothing provides, ``unexpected`` source keys nothing uses,
    ``mismatched`` pairs that match by name but not by shape. A plan with none of those is
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
    _producers: dict[KeyPath, Producer] | None = field(default=None, repr=False, compare=False)

    @property
    def complete(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)

    def producer(self, target_key: KeyPath) -> Producer | None:
        """The op that gives ``target_key`` its value (``None`` when nothing does)."""
        return self._producer_index().get(target_key)

    def _producer_index(self) -> dict[KeyPath, Producer]:
        """Target key -> producing op, built on first use.

        Only some executors ask (torch's walks the ops instead), and for a million-key plan the
        index costs a sizeable share of planning, so a plan does not build it up front.
        """
        if self._producers is None:
            producers: dict[KeyPath, Producer] = {}
            for op in self.ops:
                if isinstance(op, (Unstack, Split)):
                    producers.update(dict.fromkeys(op.targets, op))
                elif not isinstance(op, (Cast, Drop)):  # the other producers have one target
                    producers[op.target] = op
            object.__setattr__(self, "_producers", producers)  # a cache on a frozen dataclass
        return self._producers

    def casts(self) -> dict[KeyPath, Cast]:
        return {op.target: op for op in self.ops if isinstance(op, Cast)}

    def of_type(self, *kinds: type) -> Iterator[Op]:
        return (op for op in self.ops if isinstance(op, kinds))

    @property
    def is_identity(self) -> bool:
        """True when loading needs no help: every op is a same-name rename."""
        return self.complete and all(
            isinstance(op, Rename) and op.source == op.target for op in self.ops)

    def inverse(self) -> Plan:
        """The plan that maps the target back onto the source."""
        ops: list[Op] = []
        cast: set[KeyPath] = set()  # an Unstack's per-layer casts invert into one cast
        for op in self.ops:
            if isinstance(op, Cast):
                for key in self._producer_index()[op.target].sources:
                    if key not in cast:
                        cast.add(key)
                        ops.append(Cast(key, op.target_dtype, op.source_dtype))
            else:
                ops.append(op.inverse())
        mismatched = tuple(Mismatch(m.target, m.source, m.target_shape, m.source_shape, m.why)
                           for m in self.mismatched)
        return Plan(self.target, self.source, tuple(ops), missing=self.unexpected,
                    unexpected=self.missing, mismatched=mismatched)

    def counts(self) -> Counter[str]:
        """How many keys each kind of op touches (identity renames are not counted)."""
        counts: Counter[str] = Counter()
        for op in self.ops:
            if isinstance(op, Rename):
                if op.source != op.target:
                    counts["renamed"] += 1
            elif isinstance(op, Stack):
                counts["stacked"] += len(op.sources)
            elif isinstance(op, Unstack):
                counts["unstacked"] += len(op.targets)
            elif isinstance(op, Transpose):
                counts["transposed"] += 1
            elif isinstance(op, Split):
                counts["split"] += len(op.targets)
            elif isinstance(op, Join):
                counts["joined"] += len(op.sources)
            elif isinstance(op, Synthesize):
                counts["synthesized"] += 1
            elif isinstance(op, Drop):
                counts["dropped"] += 1
            elif isinstance(op, Cast):
                counts["cast"] += 1
        return counts

    def require_complete(self, sep: str = ".", *, allow_missing: bool = False,
                         allow_unexpected: bool = False) -> None:
        """Raise a :class:`PlanError` listing what does not match, with the nearest candidates."""
        from ckptshim.planner.explain import nearest

        lines: list[str] = []
        if self.mismatched:
            lines.append(f"{len(self.mismatched)} key(s) match by name but not by shape:")
            lines += [f"  {m.describe(sep)}" for m in self.mismatched[:MAX_LISTED]]
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
        if not lines:
            return
        more = [] if all(len(group) <= MAX_LISTED for group in (self.missing, self.unexpected, self.mismatched)) \
            else [f"(lists cut at {MAX_LISTED}; `ckptshim plan` shows every key)"]
        raise PlanError("\n".join(
            [f"checkpoint {self.source.source or '(source)'} does not fit target "
             f"{self.target.source or '(target)'}:"] + lines + more +
            ["Fix the names (or add a rule), or load non-strictly to accept the difference."]))
