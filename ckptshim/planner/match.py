"""The planner: a pure function from two inventories and rules to a :class:`Plan`.

Matching runs in passes over keys that are still unmatched, cheapest first, so that a checkpoint
that already fits costs one dict lookup per key:

1. exact names, refusing a key matched so that, without its wrapper components, reads as another
   checkpoint key does: DDP's ``module.weight`` is a submodule ``module``'s ``weight`` by name
   and the top-level ``weight`` without the wrapper, while ``module.module.weight`` claims the
   first reading -- two readings, and nothing to choose by;
2. canonical names (wrapper components stripped, aliases applied), refusing any two keys on one
   side that collapse onto the same canonical name;
3. layer lists, stacking per-layer sources into a stacked target or unstacking a stacked source
   into per-layer targets, with the axis read off the shapes;
4. drops of keys the target computes itself (its non-persistent buffers; buffers named like
   derivable ones), which the executor makes only once the values check out; and syntheses;

and last, a target key still missing whose live tensor shares its storage with one the plan
fills (a tied ``lm_head.weight``) is tied to it.

Everything here is linear in the number of keys and touches no tensor bytes. Passes 1 to 3 work
on runs of keys that share a parent path where runs are long (:mod:`ckptshim.planner.runs`), and key
by key otherwise, with the per-key work done in bulk (``map`` over lists, dicts built whole) so
that it runs in C; both ways give the same plan, and the same error.
"""

from __future__ import annotations

import dataclasses
from itertools import repeat
from operator import attrgetter

from ckptshim.errors import AmbiguousNameError, MetadataConflict, PlanError
from ckptshim.inventory import DTYPE_SIZES, Entry, Inventory, KeyPath, gc_paused, join_key
from ckptshim.keytext import ranges
from ckptshim.ops import (NOT_PERSISTENT, OWN_VALUE, Cast, DropIfDerived, Op, Rename, Scale, Stack, Synthesize, Tie,
                          Unstack, renames, with_sources)
from ckptshim.planner import runs
from ckptshim.planner.names import Names, parent_of
from ckptshim.planner.plan import DTYPE, Mismatch, Plan
from ckptshim.planner.runs import Group, Run, key_of
from ckptshim.rules import DEFAULT_RULES, RootPrefix, Rules
from ckptshim.rules.buffers import derivable_rule
from ckptshim.rules.layers import stack_root
from ckptshim.rules.roots import heads

_FLOATS = frozenset({"float16", "bfloat16", "float32", "float64"})
_shape_of = attrgetter("shape")
_dtype_of = attrgetter("dtype")


def plan(source: Inventory, target: Inventory, rules: Rules = DEFAULT_RULES) -> Plan:
    """Work out how ``source`` (a checkpoint) loads into ``target`` (what the caller wants).

    Raises :class:`PlanError` for anything ambiguous (two keys that could both be the one
    wanted, a stacking axis the shapes and rules leave open); anything that simply does not
    match ends up in the plan's ``missing``/``unexpected``/``mismatched``.
    """
    if rules.root is not None:
        return _rooted(source, target, rules)
    if rules.own_when_unfit is not None:
        return _own_when_unfit(source, target, rules)
    # Planning allocates about one small, acyclic object per key; with a million keys the
    # collector's passes over everything alive would take a third of the time and free nothing.
    with gc_paused():
        found = _with_layouts(source, target, rules) if rules.layouts else _Planner(source, target, rules).run()
    return _tied(found, rules) if rules.tied and found.missing else found


def _rooted(source: Inventory, target: Inventory, rules: Rules) -> Plan:
    """The plan with the root prefix set aside where the prefix alone makes the two key sets
    one (the plan then is the root's renames); else the plan without it where that is complete;
    else the plan with it (every other rule applied to the re-keyed checkpoint) where that one
    is; else, where the two sides' model descriptions disagree (:class:`MetadataConflict`), that
    refusal: no key naming makes such a load right; else the plan without it, whose answer names
    what does not match."""
    plain = dataclasses.replace(rules, root=None)
    if rules.root.exact(source, target):
        rooted = _under_root(source, target, plain, rules.root)
        if isinstance(rooted, Plan) and rooted.complete:
            return rooted
        return plan(source, target, plain)
    try:
        found = plan(source, target, plain)
    except PlanError as error:
        found, failure = None, error
    else:
        if found.complete:
            return found
    rooted = _under_root(source, target, plain, rules.root) if _may_fit(source, target, rules) else None
    if isinstance(rooted, MetadataConflict):
        raise rooted
    if rooted is not None and rooted.complete:
        return rooted
    if found is None:
        raise failure
    return found


def _may_fit(source: Inventory, target: Inventory, rules: Rules) -> bool:
    """Whether the plan of the checkpoint re-keyed by ``rules.root`` can be complete at all: with
    no layout or alias to rename a key's first component, name matching keeps it, so both sides
    must have the same first components (wrapper components set aside). Saves a partial load
    whose sides merely share other leading names a second plan."""
    if rules.layouts or rules.aliases:
        return True
    return rules.root.heads(source) == heads(target)


def _under_root(source: Inventory, target: Inventory, rules: Rules,
                root: RootPrefix) -> Plan | MetadataConflict | None:
    """The plan of the checkpoint re-keyed by ``root``, its ops naming the checkpoint's own keys;
    ``None`` where a key falls outside the prefix, two keys become one, or planning fails; the
    refusal where the two sides' model descriptions disagree."""
    original: dict[KeyPath, KeyPath] = {}
    entries = []
    for entry in source.values():
        if root.sets_aside(entry.key):
            continue  # an optimizer's state beside the model (the root's note says so)
        key = root.rekey(entry.key)
        if key is None or original.setdefault(key, entry.key) != entry.key:
            return None
        entries.append(Entry(key, entry.shape, entry.dtype, entry.location))
    try:
        found = plan(Inventory(entries, source.source), target, rules)
    except MetadataConflict as error:
        return error
    except PlanError:
        return None
    if all(type(op) is Rename for op in found.ops):  # a million renames: in bulk
        ops = tuple(renames([original[op.source] for op in found.ops], [op.target for op in found.ops]))
    else:
        ops = tuple(with_sources(op, original) for op in found.ops)
    return Plan(source, target, ops, missing=found.missing,
                unexpected=tuple(original[key] for key in found.unexpected),
                mismatched=tuple(dataclasses.replace(m, source=original[m.source]) for m in found.mismatched),
                hints=found.hints, notes=(root.note, *found.notes), warnings=found.warnings)


def _own_when_unfit(source: Inventory, target: Inventory, rules: Rules) -> Plan:
    """The plan as usual where it fits ``rules.own_when_unfit``'s targets; else the plan with the
    checkpoint's copies of them set aside and the targets keeping their own values."""
    own = rules.own_when_unfit
    plain = dataclasses.replace(rules, own_when_unfit=None)
    try:
        found = plan(source, target, plain)
        if not (own.targets.intersection(found.missing) or any(m.target in own.targets for m in found.mismatched)):
            return found
    except PlanError:
        pass
    rest = Inventory((entry for entry in source.values() if entry.key not in own.sources), source.source)
    return plan(rest, target, plain.extend(synthesize=own.targets))


def _tied(plan: Plan, rules: Rules) -> Plan:
    """``plan`` with each missing key that shares its storage with a key the plan fills tied to it."""
    ties: list[Tie] = []
    for key in plan.missing:
        group = next((group for group in rules.tied if key in group), ())
        twin = next((other for other in plan.target if other in group and plan.producer(other) is not None), None)
        if twin is not None:
            ties.append(Tie(key, twin))
    if not ties:
        return plan
    tied = {tie.target for tie in ties}
    return dataclasses.replace(plan, ops=plan.ops + tuple(ties), missing=tuple(k for k in plan.missing if k not in tied),
                               _producers=None)


def _with_layouts(source: Inventory, target: Inventory, rules: Rules) -> Plan:
    """The layouts' ops for the keys they map, then the name matcher's plan for the rest."""
    ops: list[Op] = []
    hints: dict[KeyPath, str] = {}
    notes: list[str] = []
    warnings: list[str] = []
    mismatched: list[Mismatch] = []
    used: set[KeyPath] = set()
    taken: set[KeyPath] = set()
    for layout in rules.layouts:
        paired = layout.pair(Inventory([e for e in source.values() if e.key not in used], source.source),
                             Inventory([e for e in target.values() if e.key not in taken], target.source),
                             rules)
        hints.update(paired.missing)
        taken.update(paired.missing)
        notes += paired.notes
        warnings += paired.warnings
        for op in paired.ops:
            used.update(op.sources)
            taken.update(op.targets)
            ops.append(op)
            if not op.produces:  # a Scale of values another op produces
                _require_expected(op, rules)
                continue
            first = source[op.sources[0]]
            for key in op.targets:
                found = cast_or_mismatch(first, target[key], rules)
                if isinstance(found, Cast):
                    ops.append(found)
                elif found is not None:
                    mismatched.append(found)
    if not taken:  # the layouts recognised nothing here
        return _Planner(source, target, rules).run()
    rest = _Planner(Inventory([e for e in source.values() if e.key not in used], source.source),
                    Inventory([e for e in target.values() if e.key not in taken], target.source),
                    rules).run()
    return Plan(source, target, tuple(ops) + rest.ops, missing=tuple(hints) + rest.missing,
                unexpected=rest.unexpected, mismatched=tuple(mismatched) + rest.mismatched, hints=hints,
                notes=tuple(notes), warnings=tuple(warnings))


def _require_expected(op: Op, rules: Rules) -> None:
    """Under ``CKPTSHIM_STRICT``, a value-changing op only where its profile says the target expects it."""
    if op.kind == Scale.kind and rules.strict and not op.expected:
        raise PlanError(f"{join_key(op.targets[0])}: the plan's step `{op.describe()}` changes the "
                        "values, and nothing says the target expects that; CKPTSHIM_STRICT=1 refuses it. "
                        "Unset CKPTSHIM_STRICT to accept the change, or load with a profile that knows the "
                        "target's convention.")


def cast_or_mismatch(src: Entry, tgt: Entry, rules: Rules) -> Cast | Mismatch | None:
    """The ``Cast`` a dtype difference needs, or a ``Mismatch`` where the rules forbid it
    (casts off, or a narrowing cast under ``strict``); ``None`` when the dtypes agree."""
    if src.dtype == tgt.dtype:
        return None
    narrowing = (DTYPE_SIZES[tgt.dtype] < DTYPE_SIZES[src.dtype]
                 or (src.dtype in _FLOATS) != (tgt.dtype in _FLOATS))
    if not rules.allow_cast or (rules.strict and narrowing):
        return Mismatch(src.key, tgt.key, (src.dtype,), (tgt.dtype,), DTYPE)
    return Cast(tgt.key, src.dtype, tgt.dtype)


class _Planner:
    def __init__(self, source: Inventory, target: Inventory, rules: Rules) -> None:
        self.source, self.target, self.rules = source, target, rules
        self.names = Names(rules)
        self.canonical = self.names.canonical_key
        self.produced: list[list[Op]] = []             # each pass's producers, in target order
        self.casts: dict[KeyPath, Cast] = {}
        self.mismatched: list[Mismatch] = []
        self.used: set[KeyPath] = set()                # source keys the layer pass consumed
        self.exact: list[KeyPath] = []                 # keys pass 1 matched

    def run(self) -> Plan:
        leftover, unmatched = self._match()
        drops = self._drops(leftover)
        synthesized: list[Op] = []
        missing: list[KeyPath] = []
        for key in map(key_of, unmatched):
            if key in self.rules.synthesize:
                synthesized.append(Synthesize(key, derivable_rule(key, self.rules.derivable) or OWN_VALUE))
            else:
                missing.append(key)
        self.produced.append(synthesized)
        ops = self._ordered_ops()
        ops.extend(drops)
        dropped = {op.source for op in drops}
        unexpected = tuple(key for key in map(key_of, leftover) if key not in dropped)
        return Plan(self.source, self.target, tuple(ops), missing=tuple(missing),
                    unexpected=unexpected, mismatched=tuple(self.mismatched))

    def _ordered_ops(self) -> list[Op]:
        """The producers in target order, each listed once and before its target's cast.

        Every pass lists its producers in the order of their first target key, so when one pass
        produced them all (a checkpoint that fits, or one that only torch.compile renamed, or
        only a layout change), that list is the answer once each cast is put after its producer;
        only an ``Unstack``, whose targets' casts fall between later producers, needs the walk
        over every target key.
        """
        batches = [batch for batch in self.produced if batch]
        if len(batches) <= 1:
            ops = batches[0] if batches else []
            if not self.casts:
                return ops
            if all(len(op.targets) == 1 for op in ops):  # each cast follows its one producer
                return [op for producer in ops
                        for op in (producer, self.casts.get(producer.targets[0])) if op is not None]
        assigned: dict[KeyPath, Op] = {}
        for batch in batches:
            for op in batch:
                assigned.update(dict.fromkeys(op.targets, op))
        ops: list[Op] = []
        emitted: set[int] = set()
        for key in self.target:
            op = assigned.get(key)
            if op is not None and len(op.targets) > 1:  # a producer of several targets: list it once
                if id(op) not in emitted:
                    emitted.add(id(op))
                    ops.append(op)
            elif op is not None:
                ops.append(op)
            if key in self.casts:
                ops.append(self.casts[key])
        return ops

    # -- passes 1 to 3 ------------------------------------------------------------------------------

    def _match(self) -> tuple[list[Entry], list[Entry]]:
        """Passes 1 to 3; the sources left unused and the targets left unmatched, in inventory
        order. Run by run where runs give the per-key answer, key by key otherwise."""
        sources, targets = list(self.source.table.values()), list(self.target.table.values())
        source_keys, target_keys = list(self.source), list(self.target)
        if source_keys == target_keys:  # it fits as it is, in the same order
            self._pair_all(sources, targets)
            return [], []
        split = self._split(sources, targets, source_keys, target_keys)
        exact = split and runs.match(*split, by="path")
        if exact is None:  # short runs, or a parent path in several runs: look each key up
            sources, targets = self._match_exact(sources, targets)
            self._refuse_two_readings(sources)
            if not targets:
                return sources, []
            split = split and self._split(sources, targets)  # what is left may suit runs again
            if split is None:
                return self._match_renamed_by_key(sources, targets)
        else:
            self._pair_all(exact.sources, exact.targets)
            self.exact = list(map(key_of, exact.targets))
            self._refuse_two_readings(runs.entries_of(exact.unused))
            if not exact.unmatched:
                return runs.entries_of(exact.unused), []
            split = exact.unused, exact.unmatched
        return self._match_renamed(*split)

    def _split(self, sources: list[Entry], targets: list[Entry], source_keys: list[KeyPath] | None = None,
               target_keys: list[KeyPath] | None = None) -> tuple[list[Run], list[Run]] | None:
        """Both sides cut into runs, or None if either side does not suit runs."""
        source_runs = runs.split_runs(sources, self.names, source_keys)
        target_runs = None if source_runs is None else runs.split_runs(targets, self.names, target_keys)
        return None if target_runs is None else (source_runs, target_runs)

    def _match_exact(self, sources: list[Entry], targets: list[Entry]) -> tuple[list[Entry], list[Entry]]:
        """Pass 1 key by key: pair each target with the source of the same name."""
        table = self.source.table
        hits = list(map(table.get, map(key_of, targets)))
        found = list(filter(None, hits))  # the sources that matched (an Entry is never false)
        if not found:
            return sources, targets
        if len(found) == len(targets):
            unmatched = []
        else:
            unmatched = [entry for entry, hit in zip(targets, hits) if hit is None]
            targets = [entry for entry, hit in zip(targets, hits) if hit is not None]
        self._pair_all(found, targets)
        self.exact = list(map(key_of, targets))
        if len(found) == len(sources):  # target keys are distinct, so these are all the sources
            return [], unmatched
        taken = set(map(key_of, found))
        return [entry for entry in sources if entry.key not in taken], unmatched

    def _pair_all(self, sources: list[Entry], targets: list[Entry]) -> None:
        """Rename each source to the target at the same position; record those that differ.

        In a plan that loads at all, every pair agrees on shape, and most on dtype; comparing
        the lists says so at C speed, and only pairs that differ are looked at in Python.
        """
        if list(map(_shape_of, sources)) != list(map(_shape_of, targets)):
            self._pair_each(sources, targets)
            return
        self.produced.append(renames(list(map(key_of, sources)), list(map(key_of, targets))))
        source_dtypes, target_dtypes = list(map(_dtype_of, sources)), list(map(_dtype_of, targets))
        if source_dtypes != target_dtypes:
            for src, tgt, source_dtype, target_dtype in zip(sources, targets, source_dtypes, target_dtypes):
                if source_dtype != target_dtype:
                    self._cast(src, tgt)

    def _pair_each(self, sources: list[Entry], targets: list[Entry]) -> None:
        ops: list[Op] = []
        for src, tgt in zip(sources, targets):
            if src.shape != tgt.shape:
                self.mismatched.append(Mismatch(src.key, tgt.key, src.shape, tgt.shape))
                continue
            ops.append(Rename(src.key, tgt.key))
            if src.dtype != tgt.dtype:
                self._cast(src, tgt)
        self.produced.append(ops)

    def _match_renamed(self, sources: list[Run], targets: list[Run]) -> tuple[list[Entry], list[Entry]]:
        """Passes 2 and 3 run by run, handing over to the per-key passes where they must decide."""
        found = runs.match(sources, targets, by="canonical")
        if found is None:
            return self._match_renamed_by_key(runs.entries_of(sources), runs.entries_of(targets))
        self._pair_all(found.sources, found.targets)
        if not found.unmatched:
            return runs.entries_of(found.unused), []
        grouped = runs.layer_groups(found.unused, found.unmatched, self.names)
        if grouped is None:
            whole = {canon: entry for run in found.unused for canon, entry in run.canonical_items()}
            wanted = [(entry, canon) for run in found.unmatched for canon, entry in run.canonical_items()]
            grouped = self._layer_groups(whole, wanted)
        groups, unmatched = grouped
        self._resolve_axes(groups)
        return self._unused(runs.entries_of(found.unused)), unmatched

    def _match_renamed_by_key(self, sources: list[Entry], targets: list[Entry]) -> tuple[list[Entry], list[Entry]]:
        """Passes 2 and 3 key by key."""
        whole, wanted = self._match_canonical(sources, targets)
        if not wanted:
            return list(whole.values()), []
        groups, unmatched = self._layer_groups(whole, wanted)
        self._resolve_axes(groups)
        return self._unused(list(whole.values())), unmatched

    def _unused(self, sources: list[Entry]) -> list[Entry]:
        """``sources`` the layer pass did not consume (it only consumes some of these)."""
        if len(self.used) == len(sources):
            return []
        return [entry for entry in sources if entry.key not in self.used]

    def _match_canonical(self, sources: list[Entry], targets: list[Entry]) -> tuple[dict[KeyPath, Entry], list[tuple[Entry, KeyPath]]]:
        """Pass 2 key by key: pair by canonical name. Returns the unused sources by canonical
        name (in source order) and the unmatched targets with their canonical names."""
        by_canonical = self._by_canonical(sources, "checkpoint")
        names = self._canonical_names(targets)
        if len(set(names)) != len(names):
            _refuse_clash(targets, names, "target")
        hits = list(map(by_canonical.pop, names, repeat(None)))  # pop: what is left is unused
        found = list(filter(None, hits))  # (an Entry is never false)
        if len(found) == len(targets):
            unmatched = []
        else:
            unmatched = [(entry, name) for entry, name, hit in zip(targets, names, hits) if hit is None]
            targets = [entry for entry, hit in zip(targets, hits) if hit is not None]
        self._pair_all(found, targets)
        return by_canonical, unmatched

    def _refuse_two_readings(self, unused: list[Entry]) -> None:
        """Refuse a key pass 1 matched exactly that, once its own wrapper components are
        stripped, reads as one of the checkpoint keys pass 1 left ``unused`` does.

        Such a key has two readings that lead to different targets: DDP's ``module.weight`` is
        the target's ``module.weight`` (a submodule named ``module``) by its exact name, and the
        target's ``weight`` without the wrapper -- and ``module.module.weight`` is then the
        submodule's. Taking the exact name puts the top-level value in the submodule. A key
        without wrapper components has one reading, and a key whose other reading no other key
        shares loads by its exact name, as torch alone would load it: neither is ambiguous.
        """
        if not self.exact or not unused:
            return
        readings = self._readings_of_exact_keys()
        if not readings:
            return
        unused_by_name = dict(zip(self._canonical_names(unused), unused))
        for reading, key in readings.items():
            other = unused_by_name.get(reading)
            if other is not None:
                raise AmbiguousNameError(
                    f"checkpoint key {join_key(key)!r} has two readings: by its exact name it is "
                    f"target {join_key(key)!r}, and without wrapper components it is "
                    f"{join_key(reading)!r} -- which is also how checkpoint key "
                    f"{join_key(other.key)!r} reads. Loading either way puts different values "
                    "in different places, so ckptshim will not guess. Rename the keys so that one "
                    "reading fits (e.g. remove a DDP 'module.' prefix yourself), or load without "
                    "ckptshim (CKPTSHIM_DISABLE=1) if the exact names are right.")

    def _readings_of_exact_keys(self) -> dict[KeyPath, KeyPath]:
        """Canonical name -> the key pass 1 matched exactly, for each such key whose canonical name
        is not the key itself (it holds wrapper components or an alias applies), in match order.
        Worked out on the few distinct parent paths where a key's canonical name is its canonical
        parent plus its leaf."""
        exact = self.exact
        if self.names.parent_only(exact):
            parents = list(set(map(parent_of, exact)))
            changed = {parent for parent, canonical in zip(parents, self.names.canonical_parents(parents))
                       if canonical != parent}
            if not changed:
                return {}
            exact = [key for key in exact if key[:-1] in changed]
        return {reading: key for key, reading in zip(exact, self.names.canonical_keys(exact)) if reading != key}

    def _by_canonical(self, entries: list[Entry], side: str) -> dict[KeyPath, Entry]:
        names = self._canonical_names(entries)
        table = dict(zip(names, entries))
        if len(table) != len(entries):
            _refuse_clash(entries, names, side)
        return table

    def _canonical_names(self, entries: list[Entry]) -> list[KeyPath]:
        return self.names.canonical_keys(list(map(key_of, entries)))

    def _layer_groups(self, whole: dict[KeyPath, Entry],
                      targets: list[tuple[Entry, KeyPath]]) -> tuple[list[Group], list[Entry]]:
        """Pass 3 key by key: the stack and unstack groups ``targets`` (entry, canonical name)
        form with the unused sources ``whole`` (by canonical name), and the targets left over."""
        layered: dict[KeyPath, dict[int, Entry]] = {}
        for canon, entry in whole.items():
            for stacked, index in self.names.key_splits(canon):
                layer = layered.get(stacked)
                if layer is None:
                    layer = layered[stacked] = {}
                elif index in layer:
                    raise AmbiguousNameError(
                        f"checkpoint keys {join_key(layer[index].key)!r} and {join_key(entry.key)!r} "
                        f"are both layer {index} of {join_key(stacked)!r}; keep one of them.")
                layer[index] = entry

        groups: dict[tuple[str, KeyPath], Group] = {}
        unmatched: list[Entry] = []
        for entry, canon in targets:
            options: list[tuple[KeyPath, int | None]] = []
            if canon in layered:
                options.append((canon, None))
            options += [(stacked, index) for stacked, index in self.names.key_splits(canon)
                        if stacked in whole]
            if not options:
                unmatched.append(entry)
                continue
            if len(options) > 1:
                raise AmbiguousNameError(
                    f"target key {join_key(entry.key)!r} could come from "
                    + " or ".join(repr(join_key(s)) + (" (stacked)" if i is None else f" (layer {i})")
                                  for s, i in options)
                    + "; ckptshim will not guess. Add a rule that names the layer list.")
            stacked, index = options[0]
            if index is None:
                groups["stack", canon] = Group(entry, dict(layered[canon]), stacking=True)
                continue
            source = whole[stacked]
            group = groups.get(("unstack", stacked))
            if group is None:
                group = groups["unstack", stacked] = Group(source, {}, stacking=False)
            other = group.layers.setdefault(index, entry)
            if other is not entry:
                raise AmbiguousNameError(
                    f"target keys {join_key(other.key)!r} and {join_key(entry.key)!r} both name layer "
                    f"{index} of checkpoint key {join_key(source.key)!r}; ckptshim will not "
                    "load one layer twice. Rename one of them in the target.")
        return list(groups.values()), unmatched

    def _resolve_axes(self, groups: list[Group]) -> None:
        names = self.rules.layer_lists
        root_axes: dict[KeyPath, set[int]] = {}
        for group in groups:
            group.axes = self._candidate_axes(group)
            if len(group.axes) == 1:
                root_axes.setdefault(stack_root(self.canonical(group.whole.key), names), set()).update(group.axes)
        ops: list[Op] = []
        for group in groups:
            if not group.axes:
                continue  # already recorded as a mismatch
            axis = self._choose_axis(group, root_axes)
            layers = tuple(map(group.layers.__getitem__, range(len(group.layers))))
            keys = tuple(map(key_of, layers))
            if group.stacking:
                ops.append(Stack(keys, group.whole.key, axis))
                self.used.update(keys)
                self._cast(layers[0], group.whole)
            else:
                ops.append(Unstack(group.whole.key, keys, axis))
                self.used.add(group.whole.key)
                if layers[0].dtype != group.whole.dtype:  # the layers share one dtype
                    for entry in layers:
                        self._cast(group.whole, entry)
        self.produced.append(ops)

    def _candidate_axes(self, group: Group) -> tuple[int, ...]:
        """Axes along which the per-layer shape and the stacked shape agree."""
        count = len(group.layers)
        if max(group.layers) != count - 1:  # distinct indices from 0 are complete iff so
            have = sorted(group.layers)
            absent = sorted(set(range(count)) - set(group.layers))
            raise PlanError(
                f"{'checkpoint' if group.stacking else 'target'} has layers {_span(have)} of "
                f"{join_key(group.whole.key)!r} but not {_span(absent or [i for i in range(max(have) + 1) if i not in group.layers])}; "
                "the layer list must be complete to stack or unstack. Supply the missing layers "
                "(or, for state the target can rebuild, a documented synthesis rule).")
        entries = group.layers.values()
        dtypes = set(map(_dtype_of, entries))
        if len(dtypes) != 1:
            raise PlanError(f"the layers of {join_key(group.whole.key)!r} have different dtypes "
                            f"({sorted(dtypes)}); they cannot be stacked into one array.")
        shapes = set(map(_shape_of, entries))
        if len(shapes) != 1:
            raise PlanError(f"the layers of {join_key(group.whole.key)!r} have different shapes "
                            f"({sorted(shapes)}); they cannot be stacked along one axis.")
        (layer_shape,) = shapes
        whole = group.whole.shape
        axes = tuple(a for a in range(len(whole))
                     if whole[a] == count and whole[:a] + whole[a + 1:] == layer_shape)
        if not axes:
            example = next(iter(entries))
            src, tgt = (example, group.whole) if group.stacking else (group.whole, example)
            why = f"shape (as {count} stacked layers)" if group.stacking else f"shape (one of {count} layers)"
            self.mismatched.append(Mismatch(src.key, tgt.key, src.shape, tgt.shape, why))
            self.used.update(map(key_of, entries) if group.stacking else (group.whole.key,))
        return axes

    def _choose_axis(self, group: Group, root_axes: dict[KeyPath, set[int]]) -> int:
        if len(group.axes) == 1:
            return group.axes[0]
        canon = self.canonical(group.whole.key)
        ruled = self.rules.scan_axis(canon)
        if ruled is not None and ruled in group.axes:
            return ruled
        siblings = root_axes.get(stack_root(canon, self.rules.layer_lists), set())
        if len(siblings) == 1 and not self.rules.strict and next(iter(siblings)) in group.axes:
            return next(iter(siblings))
        raise PlanError(
            f"{join_key(group.whole.key)!r} could be stacked along axis {' or '.join(map(str, group.axes))}: "
            "its shape fits several" + (", and its sibling layers do not agree on one" if siblings else "")
            + (" (CKPTSHIM_STRICT=1 forbids taking the axis from siblings)" if self.rules.strict and siblings else "")
            + ". Add a scan-axis rule for it (Rules(scan_axes=(ScanAxis(component, axis),)).")

    # -- pass 4: drops and casts ---------------------------------------------------------------

    def _drops(self, leftover: list[Entry]) -> list[DropIfDerived]:
        """Keys that name one of the target's non-persistent buffers, or a derivable buffer: the
        executor drops them once it has checked their values (a name proves nothing)."""
        drops: list[DropIfDerived] = []
        derivable = self.rules.derivable if self.rules.drop_derivable else ()
        for key in map(key_of, leftover):
            canon = self.canonical(key)
            if canon in self.rules.drop or key in self.rules.drop:
                drops.append(DropIfDerived(key, NOT_PERSISTENT))
            elif (rule := derivable_rule(canon, derivable)) is not None:
                drops.append(DropIfDerived(key, rule))
        return drops

    def _cast(self, src: Entry, tgt: Entry) -> None:
        found = cast_or_mismatch(src, tgt, self.rules)
        if isinstance(found, Cast):
            self.casts[tgt.key] = found
        elif found is not None:
            self.mismatched.append(found)


def _refuse_clash(entries: list[Entry], names: list[KeyPath], side: str) -> None:
    """Raise for the first of ``entries`` whose canonical name an earlier one already has."""
    table: dict[KeyPath, Entry] = {}
    for entry, name in zip(entries, names):
        other = table.setdefault(name, entry)
        if other is not entry:
            raise AmbiguousNameError(
                f"{side} keys {join_key(other.key)!r} and {join_key(entry.key)!r} both mean "
                f"{join_key(name)!r} once wrapper prefixes and aliases are removed, so "
                "ckptshim cannot tell which one to use. Remove one of them, or load without "
                "ckptshim (CKPTSHIM_DISABLE=1) if the names already match exactly.")


def _span(indices: list[int]) -> str:
    return "{" + ranges(indices) + "}" if indices else "{}"
