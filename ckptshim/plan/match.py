"""The planner: a pure function from two inventories and rules to a :class:`Plan`.

Matching runs in passes over keys that are still unmatched, cheapest first, so that a checkpoint
that already fits costs one dict lookup per key:

1. exact names;
2. canonical names (wrapper components stripped, aliases applied), refusing any two keys on one
   side that collapse onto the same canonical name;
3. layer lists, stacking per-layer sources into a stacked target or unstacking a stacked source
   into per-layer targets, with the axis read off the shapes;
4. drops (derivable buffers, the target's non-persistent buffers) and syntheses.

Everything here is linear in the number of keys and touches no tensor bytes.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ckptshim.errors import PlanError
from ckptshim.inventory import DTYPE_SIZES, Entry, Inventory, KeyPath, join_key
from ckptshim.plan.ops import Cast, Drop, Op, Rename, Stack, Synthesize, Unstack
from ckptshim.plan.plan import Mismatch, Plan
from ckptshim.rules import DEFAULT_RULES, Rules
from ckptshim.rules.buffers import derivable_rule
from ckptshim.rules.layers import layer_splits, stack_root
from ckptshim.rules.prefixes import strip_wrappers

_FLOATS = frozenset({"float16", "bfloat16", "float32", "float64"})


def plan(source: Inventory, target: Inventory, rules: Rules = DEFAULT_RULES) -> Plan:
    """Work out how ``source`` (a checkpoint) loads into ``target`` (what the caller wants).

    Raises :class:`PlanError` for anything ambiguous (two keys that could both be the one
    wanted, a stacking axis the shapes and rules leave open); anything that simply does not
    match ends up in the plan's ``missing``/``unexpected``/``mismatched``.
    """
    with _gc_paused():
        return _Planner(source, target, rules).run()


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while planning.

    Planning allocates about one small, acyclic object per key; with a million keys the
    collector's full passes over everything alive (the inventories alone hold millions of
    tuples) would otherwise take a third of the time, and free nothing.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclass
class _Group:
    """Per-layer keys (by layer index) that stack into, or unstack from, one ``whole`` key."""

    whole: KeyPath          # the stacked key (source for unstack, target for stack)
    layers: dict[int, KeyPath]
    stacking: bool           # True: per-layer sources -> stacked target
    axes: tuple[int, ...] = ()


class _Planner:
    def __init__(self, source: Inventory, target: Inventory, rules: Rules) -> None:
        self.source, self.target, self.rules = source, target, rules
        self.canonical = _canonicalizer(rules)
        self.assigned: dict[KeyPath, Op] = {}         # target key -> producing op
        self.casts: dict[KeyPath, Cast] = {}
        self.mismatched: list[Mismatch] = []
        self.used: set[KeyPath] = set()               # source keys consumed
        self.source_canonical: dict[KeyPath, KeyPath] = {}  # canonical -> source key (pass 2)

    def run(self) -> Plan:
        unmatched: list[KeyPath] = []
        for key in self.target:
            if key in self.source:
                self._pair(key, key)
            else:
                unmatched.append(key)
        if unmatched:
            unmatched_canonical = self._match_canonical(unmatched)
            unmatched = self._match_layers(unmatched_canonical) if unmatched_canonical else []
        leftover_sources = [key for key in self.source if key not in self.used]
        drops = self._drops(leftover_sources)
        missing: list[KeyPath] = []
        for key in unmatched:
            if key in self.rules.synthesize:
                self.assigned[key] = Synthesize(key, derivable_rule(key, self.rules.derivable)
                                                or "target's own value")
            else:
                missing.append(key)
        ops: list[Op] = []
        emitted: set[int] = set()
        for key in self.target:  # target order, each producer once and before its casts
            op = self.assigned.get(key)
            if isinstance(op, Unstack):  # the only producer with several targets: list it once
                if id(op) not in emitted:
                    emitted.add(id(op))
                    ops.append(op)
            elif op is not None:
                ops.append(op)
            if key in self.casts:
                ops.append(self.casts[key])
        ops.extend(drops)
        dropped = {op.source for op in drops}
        unexpected = tuple(k for k in leftover_sources if k not in dropped)
        return Plan(self.source, self.target, tuple(ops), missing=tuple(missing),
                    unexpected=unexpected, mismatched=tuple(self.mismatched))

    # -- pass 1 and 2: one source per target ------------------------------------------------

    def _pair(self, source_key: KeyPath, target_key: KeyPath) -> None:
        """Match a source key (which the source has) to one target key."""
        src, tgt = self.source[source_key], self.target[target_key]
        self.used.add(source_key)
        if src.shape != tgt.shape:
            self.mismatched.append(Mismatch(source_key, target_key, src.shape, tgt.shape))
            return
        self.assigned[target_key] = Rename(source_key, target_key)
        if src.dtype != tgt.dtype:
            self._cast(src, tgt)

    def _match_canonical(self, targets: list[KeyPath]) -> dict[KeyPath, KeyPath]:
        """Pair targets and sources by canonical name; the unmatched targets -> their canonical."""
        by_canonical = self._unique_canonical((k for k in self.source if k not in self.used), "checkpoint")
        self.source_canonical = by_canonical
        wanted = self._unique_canonical(targets, "target")
        unmatched: dict[KeyPath, KeyPath] = {}
        for canon, target_key in wanted.items():
            source_key = by_canonical.get(canon)
            if source_key is None:
                unmatched[target_key] = canon
            else:
                self._pair(source_key, target_key)
        return unmatched

    def _unique_canonical(self, keys, side: str) -> dict[KeyPath, KeyPath]:
        table: dict[KeyPath, KeyPath] = {}
        for key in keys:
            canon = self.canonical(key)
            other = table.setdefault(canon, key)
            if other != key:
                raise PlanError(
                    f"{side} keys {join_key(other)!r} and {join_key(key)!r} both mean "
                    f"{join_key(canon)!r} once wrapper prefixes and aliases are removed, so "
                    "ckptshim cannot tell which one to use. Remove one of them, or load without "
                    "ckptshim (CKPTSHIM_DISABLE=1) if the names already match exactly.")
        return table

    # -- pass 3: layer lists ---------------------------------------------------------------

    def _match_layers(self, targets: dict[KeyPath, KeyPath]) -> list[KeyPath]:
        """Stack or unstack ``targets`` (target key -> canonical); return those still unmatched."""
        splits = _layer_splitter(self.rules.layer_lists)
        whole_sources = {canon: key for canon, key in self.source_canonical.items()
                         if key not in self.used}  # in source order
        layered_sources: dict[KeyPath, dict[int, KeyPath]] = {}
        for canon, key in whole_sources.items():
            for stacked, index in splits(canon):
                layer = layered_sources.get(stacked)
                if layer is None:
                    layer = layered_sources[stacked] = {}
                elif index in layer:
                    raise PlanError(
                        f"checkpoint keys {join_key(layer[index])!r} and {join_key(key)!r} are "
                        f"both layer {index} of {join_key(stacked)!r}; keep one of them.")
                layer[index] = key

        groups: dict[tuple[str, KeyPath], _Group] = {}
        unmatched: list[KeyPath] = []
        for key, canon in targets.items():
            options: list[tuple[KeyPath, int | None]] = []
            if canon in layered_sources:
                options.append((canon, None))
            options += [(stacked, index) for stacked, index in splits(canon)
                        if stacked in whole_sources]
            if not options:
                unmatched.append(key)
                continue
            if len(options) > 1:
                raise PlanError(
                    f"target key {join_key(key)!r} could come from "
                    + " or ".join(repr(join_key(s)) + (" (stacked)" if i is None else f" (layer {i})")
                                  for s, i in options)
                    + "; ckptshim will not guess. Add a rule that names the layer list.")
            stacked, index = options[0]
            if index is None:
                groups["stack", canon] = _Group(key, dict(layered_sources[canon]), stacking=True)
            else:
                source_key = whole_sources[stacked]
                group = groups.get(("unstack", stacked))
                if group is None:
                    group = groups["unstack", stacked] = _Group(source_key, {}, stacking=False)
                other = group.layers.setdefault(index, key)
                if other != key:
                    raise PlanError(
                        f"target keys {join_key(other)!r} and {join_key(key)!r} both name layer "
                        f"{index} of checkpoint key {join_key(source_key)!r}; ckptshim will not "
                        "load one layer twice. Rename one of them in the target.")
        self._resolve_axes(list(groups.values()))
        return unmatched

    def _resolve_axes(self, groups: list[_Group]) -> None:
        names = self.rules.layer_lists
        root_axes: dict[KeyPath, set[int]] = {}
        for group in groups:
            group.axes = self._candidate_axes(group)
            if len(group.axes) == 1:
                root_axes.setdefault(stack_root(self.canonical(group.whole), names), set()).update(group.axes)
        for group in groups:
            if not group.axes:
                continue  # already recorded as a mismatch
            axis = self._choose_axis(group, root_axes)
            layers = tuple(map(group.layers.__getitem__, range(len(group.layers))))
            if group.stacking:
                self.assigned[group.whole] = Stack(layers, group.whole, axis)
                self.used.update(layers)
                self._cast(self.source[layers[0]], self.target[group.whole])
            else:
                op = Unstack(group.whole, layers, axis)
                self.used.add(group.whole)
                self.assigned.update(dict.fromkeys(layers, op))
                src = self.source[group.whole]
                if self.target[layers[0]].dtype != src.dtype:  # the layers share one dtype
                    for key in layers:
                        self._cast(src, self.target[key])

    def _candidate_axes(self, group: _Group) -> tuple[int, ...]:
        """Axes along which the per-layer shape and the stacked shape agree."""
        per_layer_inv, whole_inv = (self.source, self.target) if group.stacking else (self.target, self.source)
        count = len(group.layers)
        absent = sorted(set(range(count)) - set(group.layers))
        if absent or max(group.layers) != count - 1:
            have = sorted(group.layers)
            raise PlanError(
                f"{'checkpoint' if group.stacking else 'target'} has layers {_span(have)} of "
                f"{join_key(group.whole)!r} but not {_span(absent or [i for i in range(max(have) + 1) if i not in group.layers])}; "
                "the layer list must be complete to stack or unstack. Supply the missing layers "
                "(or, for state the target can rebuild, a documented synthesis rule).")
        entries = [per_layer_inv[k] for k in group.layers.values()]
        dtypes = {entry.dtype for entry in entries}
        if len(dtypes) != 1:
            raise PlanError(f"the layers of {join_key(group.whole)!r} have different dtypes "
                            f"({sorted(dtypes)}); they cannot be stacked into one array.")
        shapes = {entry.shape for entry in entries}
        whole = whole_inv[group.whole].shape
        example = next(iter(group.layers.values()))
        if len(shapes) != 1:
            raise PlanError(f"the layers of {join_key(group.whole)!r} have different shapes "
                            f"({sorted(shapes)}); they cannot be stacked along one axis.")
        (layer_shape,) = shapes
        axes = tuple(a for a in range(len(whole))
                     if whole[a] == count and whole[:a] + whole[a + 1:] == layer_shape)
        if not axes:
            src, tgt = (example, group.whole) if group.stacking else (group.whole, example)
            why = f"shape (as {count} stacked layers)" if group.stacking else f"shape (one of {count} layers)"
            self.mismatched.append(Mismatch(src, tgt, self.source[src].shape, self.target[tgt].shape, why))
            self.used.update(group.layers.values() if group.stacking else (group.whole,))
        return axes

    def _choose_axis(self, group: _Group, root_axes: dict[KeyPath, set[int]]) -> int:
        if len(group.axes) == 1:
            return group.axes[0]
        canon = self.canonical(group.whole)
        ruled = self.rules.scan_axis(canon)
        if ruled is not None and ruled in group.axes:
            return ruled
        siblings = root_axes.get(stack_root(canon, self.rules.layer_lists), set())
        if len(siblings) == 1 and not self.rules.strict and next(iter(siblings)) in group.axes:
            return next(iter(siblings))
        raise PlanError(
            f"{join_key(group.whole)!r} could be stacked along axis {' or '.join(map(str, group.axes))}: "
            "its shape fits several" + (", and its sibling layers do not agree on one" if siblings else "")
            + (" (CKPTSHIM_STRICT=1 forbids taking the axis from siblings)" if self.rules.strict and siblings else "")
            + ". Add a scan-axis rule for it (Rules(scan_axes=(ScanAxis(component, axis),)).")

    # -- pass 4: drops and casts ---------------------------------------------------------------

    def _drops(self, leftover_sources: list[KeyPath]) -> list[Drop]:
        drops = []
        for key in leftover_sources:
            canon = self.canonical(key)
            if canon in self.rules.drop or key in self.rules.drop:
                drops.append(Drop(key, "not persistent in target"))
            elif (rule := derivable_rule(canon, self.rules.derivable)) is not None:
                drops.append(Drop(key, rule))
        return drops

    def _cast(self, src: Entry, tgt: Entry) -> None:
        if src.dtype == tgt.dtype:
            return
        narrowing = (DTYPE_SIZES[tgt.dtype] < DTYPE_SIZES[src.dtype]
                     or (src.dtype in _FLOATS) != (tgt.dtype in _FLOATS))
        if not self.rules.allow_cast or (self.rules.strict and narrowing):
            self.mismatched.append(Mismatch(src.key, tgt.key, (src.dtype,), (tgt.dtype,), "dtype"))
            return
        self.casts[tgt.key] = Cast(tgt.key, src.dtype, tgt.dtype)


def _span(indices: list[int]) -> str:
    from ckptshim.plan.explain import _ranges
    return "{" + _ranges(indices) + "}" if indices else "{}"


def _canonicalizer(rules: Rules) -> Callable[[KeyPath], KeyPath]:
    wrappers, aliases = rules.wrappers, rules.aliases
    bare_parents: dict[KeyPath, KeyPath] = {}  # parent path -> the same without wrappers

    def canonical(key: KeyPath) -> KeyPath:
        parent = key[:-1]
        if not wrappers.isdisjoint(parent):  # wrapped keys share a few parents: strip each once
            bare = bare_parents.get(parent)
            if bare is None:
                bare = bare_parents[parent] = strip_wrappers(key, wrappers)[:-1]
            key = bare + key[-1:]
        for alias in aliases:
            key = alias.rewrite(key)
        return key

    return canonical


def _layer_splitter(names: frozenset[str]) -> Callable[[KeyPath], list[tuple[KeyPath, int]]]:
    """:func:`layer_splits` for many keys: a key's splits depend only on its parent path (the
    leaf is never a list component and stays last), and keys share a few thousand parents."""
    by_parent: dict[KeyPath, list[tuple[KeyPath, int]]] = {}

    def splits(key: KeyPath) -> list[tuple[KeyPath, int]]:
        parent, leaf = key[:-1], key[-1:]
        found = by_parent.get(parent)
        if found is None:
            found = by_parent[parent] = [(stacked[:-1], index) for stacked, index in layer_splits(key, names)]
        return [(stacked + leaf, index) for stacked, index in found]

    return splits
