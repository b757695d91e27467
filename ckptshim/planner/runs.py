"""Runs of keys that share a parent path: what the planner's bulk passes work on.

Checkpoints list the keys of one module together, and a key's canonical name and layer splits
follow from its parent path (:mod:`ckptshim.planner.names`). Cut into runs of consecutive keys with
one parent, a million keys of 1,000 layers x 1,000 leaves are 1,000 runs; the passes then pair
whole runs (position by position when their leaves agree) and transpose runs of layers into
columns to stack, instead of handling a million keys one at a time in Python. Each step gives
what the per-key passes in :mod:`ckptshim.planner.match` would; where it cannot be sure of that
(two runs of one name, one layer claimed twice) it returns None and leaves the work to them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import groupby, islice
from operator import attrgetter, itemgetter

from ckptshim.inventory import Entry, KeyPath
from ckptshim.planner.names import Names, leaf_of, parent_of

key_of = attrgetter("key")

#: Average keys per run below which the bulk passes give way to the per-key ones: each run costs
#: a few Python-level steps, each key in a per-key pass a few dict operations. Measured on
#: renames, the two break even at about 4 keys a run; stacking gains from runs even at 3.
MIN_RUN = 4


@dataclass
class Group:
    """Per-layer entries (by layer index) that stack into, or unstack from, one ``whole`` entry."""

    whole: Entry             # the stacked entry (source for unstack, target for stack)
    layers: dict[int, Entry]
    stacking: bool           # True: per-layer sources -> stacked target
    axes: tuple[int, ...] = ()


class Run:
    """Consecutive entries of one side whose keys share a parent ``path``.

    ``canonical`` is that path's canonical name, so each key's canonical name is ``canonical +
    (leaf,)``. Leaves and the leaf index are built on first use: most runs never need them.
    """

    __slots__ = ("path", "canonical", "keys", "entries", "_leaves", "_by_leaf")

    def __init__(self, path: KeyPath, canonical: KeyPath, keys: list[KeyPath], entries: list[Entry]) -> None:
        self.path, self.canonical, self.keys, self.entries = path, canonical, keys, entries
        self._leaves: list[str] | None = None
        self._by_leaf: dict[str, Entry] | None = None

    @property
    def leaves(self) -> list[str]:
        if self._leaves is None:
            self._leaves = list(map(leaf_of, self.keys))
        return self._leaves

    @property
    def by_leaf(self) -> dict[str, Entry]:
        if self._by_leaf is None:
            self._by_leaf = dict(zip(self.leaves, self.entries))
        return self._by_leaf

    def subset(self, entries: list[Entry]) -> Run:
        """The same run holding only ``entries`` (which must be some of its own)."""
        return Run(self.path, self.canonical, list(map(key_of, entries)), entries)

    def canonical_items(self) -> list[tuple[KeyPath, Entry]]:
        """``(canonical key, entry)`` for each entry, in order."""
        return [(self.canonical + (leaf,), entry) for leaf, entry in zip(self.leaves, self.entries)]


def split_runs(entries: list[Entry], names: Names, keys: list[KeyPath] | None = None) -> list[Run] | None:
    """``entries`` (whose ``keys`` the caller may have at hand) cut into runs; None unless each
    key's canonical name is its canonical parent plus its leaf and the runs hold
    :data:`MIN_RUN` keys on average (on shorter runs, key by key is quicker)."""
    if keys is None:
        keys = list(map(key_of, entries))
    if not names.parent_only(keys):
        return None
    most = len(keys) // MIN_RUN  # stop counting runs as soon as there are too many
    lengths = [(path, len(list(same))) for path, same in islice(groupby(map(parent_of, keys)), most + 1)]
    if len(lengths) > most:
        return None
    paths = [path for path, _ in lengths]
    runs: list[Run] = []
    start = 0
    for path, canonical, (_, length) in zip(paths, names.canonical_parents(paths), lengths):
        stop = start + length
        runs.append(Run(path, canonical, keys[start:stop], entries[start:stop]))
        start = stop
    return runs


def entries_of(runs: list[Run]) -> list[Entry]:
    return [entry for run in runs for entry in run.entries]


@dataclass
class RunMatch:
    """What pairing runs found: pairs in target order, and what is left in inventory order."""

    sources: list[Entry] = field(default_factory=list)   # paired with targets, position by position
    targets: list[Entry] = field(default_factory=list)
    unused: list[Run] = field(default_factory=list)      # source runs
    unmatched: list[Run] = field(default_factory=list)   # target runs


def match(sources: list[Run], targets: list[Run], by: str) -> RunMatch | None:
    """Pair each target key with the source key of the same name, run by run.

    ``by="path"`` pairs exact names (pass 1), ``by="canonical"`` canonical names (pass 2). When
    no two runs on one side share that parent name, no two keys on one side share a name, and a
    target run's keys can only pair with keys of the one source run of the same parent name: with
    the same leaves in the same order, position by position. Returns None when two runs do share
    one; the per-key passes then pair them (and name any two keys that clash).
    """
    name = attrgetter(by)
    by_parent = dict(zip(map(name, sources), sources))
    if len(by_parent) != len(sources) or len(set(map(name, targets))) != len(targets):
        return None
    found = RunMatch()
    for run in targets:
        parent = name(run)
        source = by_parent.get(parent)
        if source is None:
            found.unmatched.append(run)
        elif source.leaves == run.leaves:
            found.sources += source.entries
            found.targets += run.entries
            del by_parent[parent]
        else:
            left = _match_leaves(source, run, found)
            if left is None:
                del by_parent[parent]
            else:
                by_parent[parent] = left
    found.unused = list(by_parent.values())
    return found


def _match_leaves(source: Run, target: Run, found: RunMatch) -> Run | None:
    """Pair the keys of two runs of one parent name whose leaves differ, leaf by leaf; what is
    left of ``source`` (None for nothing)."""
    hits = list(map(source.by_leaf.get, target.leaves))
    found.sources += [hit for hit in hits if hit is not None]
    found.targets += [entry for entry, hit in zip(target.entries, hits) if hit is not None]
    rest = [entry for entry, hit in zip(target.entries, hits) if hit is None]
    if rest:
        found.unmatched.append(target.subset(rest))
    taken = {leaf for leaf, hit in zip(target.leaves, hits) if hit is not None}
    left = [entry for entry, leaf in zip(source.entries, source.leaves) if leaf not in taken]
    return source.subset(left) if left else None


def layer_groups(sources: list[Run], targets: list[Run],
                 names: Names) -> tuple[list[Group], list[Entry]] | None:
    """Pass 3 run by run: the stack and unstack groups, in the order the per-key pass makes them
    (that of each group's first target key), and the targets left unmatched (in target order).

    Returns None wherever the per-key pass might refuse instead (two source runs claiming one
    layer, two target runs naming one layer, a target run whose keys could come from a stacked
    and a per-layer source at once): it finds out for sure and words the error.
    """
    whole = {run.canonical: run for run in sources}  # pass 2 made sure parents are distinct
    layered: dict[KeyPath, dict[int, Run]] = {}   # stacked parent -> per-layer source runs
    for run in sources:
        for stacked, index in names.splits[run.canonical]:
            runs = layered.setdefault(stacked, {})
            if index in runs:
                return None
            runs[index] = run
    ordered: list[tuple[tuple[int, int], Group]] = []  # (where its first target is, group)
    families: dict[KeyPath, _Family] = {}
    unmatched: list[Entry] = []
    for position, run in enumerate(targets):
        stacking = layered.get(run.canonical)
        unstacking = [(stacked, index) for stacked, index in names.splits[run.canonical] if stacked in whole]
        if (stacking and unstacking) or len(unstacking) > 1:
            return None
        if stacking:
            unmatched += _stack_groups(run, position, stacking, ordered)
        elif unstacking:
            stacked, index = unstacking[0]
            family = families.setdefault(stacked, _Family(whole[stacked]))
            if index in family.runs:
                return None
            family.runs[index] = (position, run)
            source = whole[stacked].by_leaf
            unmatched += [entry for entry, leaf in zip(run.entries, run.leaves) if leaf not in source]
        else:
            unmatched += run.entries
    for family in families.values():
        ordered += family.groups()
    ordered.sort(key=itemgetter(0))
    return [group for _, group in ordered], unmatched


def _stack_groups(run: Run, position: int, layers: dict[int, Run],
                  ordered: list[tuple[tuple[int, int], Group]]) -> list[Entry]:
    """Stack groups for the stacked target keys of ``run``; returns the keys no layer has.

    ``layers`` are the per-layer source runs in source order, the order each group lists them.
    """
    indices, runs = list(layers), list(layers.values())
    unmatched: list[Entry] = []
    if all(other.leaves == runs[0].leaves for other in runs):  # one column of layers per leaf
        columns = dict(zip(runs[0].leaves, zip(*(other.entries for other in runs))))
        for offset, (entry, leaf) in enumerate(zip(run.entries, run.leaves)):
            column = columns.get(leaf)
            if column is None:
                unmatched.append(entry)
            else:
                ordered.append(((position, offset), Group(entry, dict(zip(indices, column)), True)))
        return unmatched
    for offset, (entry, leaf) in enumerate(zip(run.entries, run.leaves)):
        found = {index: hit for index, other in layers.items()
                 if (hit := other.by_leaf.get(leaf)) is not None}
        if found:
            ordered.append(((position, offset), Group(entry, found, True)))
        else:
            unmatched.append(entry)
    return unmatched


class _Family:
    """Per-layer target runs (by layer index, in target order) that unstack from one source run."""

    def __init__(self, source: Run) -> None:
        self.source = source
        self.runs: dict[int, tuple[int, Run]] = {}  # layer index -> (target position, run)

    def groups(self) -> list[tuple[tuple[int, int], Group]]:
        """One unstack group per leaf of the source run that the target runs hold."""
        indices = list(self.runs)
        positions, runs = zip(*self.runs.values())
        source = self.source.by_leaf
        if all(run.leaves == runs[0].leaves for run in runs):  # one column of layers per leaf
            return [((positions[0], offset), Group(source[leaf], dict(zip(indices, column)), False))
                    for offset, (leaf, column) in enumerate(zip(runs[0].leaves, zip(*(run.entries for run in runs))))
                    if leaf in source]
        groups: dict[str, tuple[tuple[int, int], Group]] = {}
        for index, position, run in zip(indices, positions, runs):
            for offset, (entry, leaf) in enumerate(zip(run.entries, run.leaves)):
                if leaf in source:
                    if leaf not in groups:
                        groups[leaf] = ((position, offset), Group(source[leaf], {}, False))
                    groups[leaf][1].layers[index] = entry
        return list(groups.values())
