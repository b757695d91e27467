"""Canonical names and layer splits of keys, worked out per parent path and in bulk.

Wrapper stripping and layer splitting never look at a key's last component, and an alias only
does when its ``other`` spelling ends with it. Checkpoint keys share few parent paths (a million
keys of 1,000 layers x 1,000 leaves share 1,000), so a key's canonical name is built as its
parent's canonical name, worked out once, plus its leaf.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from itertools import chain, filterfalse, repeat
from operator import itemgetter

from ckptshim.inventory import KeyPath
from ckptshim.rules import Alias, Rules
from ckptshim.rules.layers import parent_splits
from ckptshim.rules.prefixes import strip_wrappers

parent_of = itemgetter(slice(None, -1))
leaf_of = itemgetter(-1)
leaf_path_of = itemgetter(slice(-1, None))  # the leaf as a path, to add to a parent path


class Names:
    """Canonical names (wrapper components stripped, aliases applied) and layer splits under
    one set of rules.

    A key's canonical name is its parent's canonical name plus its leaf unless an alias's
    ``other`` spelling ends with that leaf: only then can an alias reach the leaf (a suffix alias
    always ends at the leaf; a prefix or anywhere alias reaches it only when its spelling ends
    there). Such keys, and the empty key, are canonicalized whole.
    """

    def __init__(self, rules: Rules) -> None:
        self.rules = rules
        self._aliased_leaves = frozenset(alias.other[-1] for alias in rules.aliases if alias.other)
        # suffix aliases end at the leaf, so on a parent path (of a key whose leaf is not
        # aliased) only prefix and anywhere aliases apply
        self._path_aliases = tuple(alias for alias in rules.aliases if alias.where != "suffix")
        self._aliased = _PerPath(partial(_rewrite, self._path_aliases))
        self._bare_parents: dict[KeyPath, KeyPath] = {}
        #: canonical parent path -> every ``(stacked parent, layer index)`` reading of it
        self.splits = _PerPath(partial(_splits, rules.layer_lists))

    def canonical_key(self, key: KeyPath) -> KeyPath:
        """``key`` with wrapper components stripped and aliases applied: any key, one at a time."""
        parent = key[:-1]
        if not self.rules.wrappers.isdisjoint(parent):  # wrapped keys share a few parents
            bare = self._bare_parents.get(parent)
            if bare is None:
                bare = self._bare_parents[parent] = strip_wrappers(key, self.rules.wrappers)[:-1]
            key = bare + key[-1:]
        for alias in self.rules.aliases:
            key = alias.rewrite(key)
        return key

    def canonical_keys(self, keys: list[KeyPath]) -> list[KeyPath]:
        """The canonical name of each key: its parent's plus its leaf, except for keys whose leaf
        an alias may rewrite (and the empty key), which are canonicalized whole."""
        if self._aliased_leaves or () in keys:
            aliased = self._aliased_leaves
            whole = [not key or key[-1] in aliased for key in keys]
            if any(whole):
                rest = iter(self._through_parents([key for key, one in zip(keys, whole) if not one]))
                return [self.canonical_key(key) if one else next(rest) for key, one in zip(keys, whole)]
        return self._through_parents(keys)

    def _through_parents(self, keys: list[KeyPath]) -> list[KeyPath]:
        parents = list(map(parent_of, keys))
        canonical = self.canonical_parents(parents)
        if canonical is parents:  # no wrappers, no aliases: already canonical
            return keys
        return list(map(tuple.__add__, canonical, map(leaf_path_of, keys)))

    def canonical_parents(self, parents: list[KeyPath]) -> list[KeyPath]:
        """The canonical name of each parent path (of a key whose leaf is not aliased): wrapper
        components stripped, for all paths at once in C, then prefix and anywhere aliases
        applied, once per distinct path. Returns ``parents`` itself when nothing changes."""
        wrappers = self.rules.wrappers
        if not wrappers.isdisjoint(chain.from_iterable(parents)):
            parents = list(map(tuple, map(filterfalse, repeat(wrappers.__contains__), parents)))
        if self._path_aliases:
            parents = list(map(self._aliased.__getitem__, parents))
        return parents

    def parent_only(self, keys: list[KeyPath]) -> bool:
        """Whether each key's canonical name is its canonical parent plus its leaf (no key's leaf
        ends an alias's spelling, and no key is empty)."""
        return () not in keys and (
            not self._aliased_leaves or self._aliased_leaves.isdisjoint(map(leaf_of, keys)))

    def key_splits(self, key: KeyPath) -> list[tuple[KeyPath, int]]:
        """:func:`ckptshim.rules.layers.layer_splits` of a canonical key, through the cache."""
        leaf = key[-1:]
        return [(stacked + leaf, index) for stacked, index in self.splits[key[:-1]]]


def _rewrite(aliases: tuple[Alias, ...], path: KeyPath) -> KeyPath:
    for alias in aliases:
        path = alias.rewrite(path)
    return path


def _splits(names: frozenset[str], parent: KeyPath) -> list[tuple[KeyPath, int]]:
    return list(parent_splits(parent, names))


class _PerPath(dict):
    """A cache that computes each value it lacks with ``compute`` (once per distinct path);
    lookups that hit, even millions of them through ``map``, never leave C."""

    def __init__(self, compute: Callable[[KeyPath], object]) -> None:
        super().__init__()
        self.compute = compute

    def __missing__(self, path: KeyPath) -> object:
        value = self[path] = self.compute(path)
        return value
