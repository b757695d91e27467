"""The knowledge ckptshim plans with, as data: one frozen :class:`Rules` value per load.

Hooks start from :data:`DEFAULT_RULES` and add what only they know (a module's non-persistent
buffers, a model family's profile) with :meth:`Rules.extend`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ckptshim.inventory import KeyPath
from ckptshim.rules.aliases import Alias
from ckptshim.rules.buffers import DERIVABLE_BUFFERS
from ckptshim.rules.layers import LAYER_LIST_NAMES, ScanAxis
from ckptshim.rules.prefixes import WRAPPER_SEGMENTS

__all__ = ["Alias", "DEFAULT_RULES", "Rules", "ScanAxis"]


@dataclass(frozen=True)
class Rules:
    """Everything the planner may use beyond the two inventories.

    - ``wrappers``: path components to ignore when matching (``_orig_mod``, ``module``, ...).
    - ``layer_lists``: component names whose index marks one layer of a stackable list.
    - ``aliases``: alternative spellings of the same name (profiles, Linen vs NNX).
    - ``scan_axes``: the stacking axis for subtrees where shapes leave it open.
    - ``derivable``: key suffixes of buffers any framework can recompute; a checkpoint's copy
      that the target does not want is dropped.
    - ``drop``: exact (canonical) source keys to drop, e.g. the target's non-persistent buffers.
    - ``synthesize``: exact target keys the target may keep its own value for when the
      checkpoint lacks them (persistent derivable buffers); never parameters.
    - ``allow_cast``: whether a dtype difference becomes a ``Cast`` or an error.
    - ``strict``: every guess (an axis taken from siblings, a narrowing cast) becomes an error.
    """

    wrappers: frozenset[str] = WRAPPER_SEGMENTS
    layer_lists: frozenset[str] = LAYER_LIST_NAMES
    aliases: tuple[Alias, ...] = ()
    scan_axes: tuple[ScanAxis, ...] = ()
    derivable: tuple[KeyPath, ...] = DERIVABLE_BUFFERS
    drop: frozenset[KeyPath] = frozenset()
    synthesize: frozenset[KeyPath] = frozenset()
    allow_cast: bool = True
    strict: bool = False

    def extend(self, **more) -> Rules:
        """A copy with collections extended (not replaced) and scalar fields overridden."""
        changes = {}
        for name, value in more.items():
            current = getattr(self, name)
            if isinstance(current, frozenset):
                changes[name] = current | frozenset(value)
            elif isinstance(current, tuple):
                changes[name] = current + tuple(value)
            else:
                changes[name] = value
        return dataclasses.replace(self, **changes)

    def scan_axis(self, stacked: KeyPath) -> int | None:
        for rule in self.scan_axes:
            if rule.component in stacked:
                return rule.axis
        return None


DEFAULT_RULES = Rules()
