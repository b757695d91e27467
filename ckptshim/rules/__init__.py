"""The knowledge ckptshim plans with, as data: one frozen :class:`Rules` value per load.

Hooks start from :data:`DEFAULT_RULES` and add what only they know (a module's non-persistent
buffers, a model family's profile) with :meth:`Rules.extend`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from ckptshim.inventory import Inventory, KeyPath
from ckptshim.rules.aliases import Alias
from ckptshim.rules.buffers import DERIVABLE_BUFFERS
from ckptshim.rules.layers import LAYER_LIST_NAMES, ScanAxis
from ckptshim.rules.prefixes import WRAPPER_SEGMENTS

if TYPE_CHECKING:
    from ckptshim.planner.ops import Producer

__all__ = ["Alias", "DEFAULT_RULES", "Layout", "Paired", "Rules", "ScanAxis"]


@dataclass(frozen=True)
class Paired:
    """What a :class:`Layout` decided: producer ops for the keys it maps, and the target keys it
    recognises but the checkpoint cannot fill, each with a hint naming what it would need."""

    ops: tuple[Producer, ...] = ()
    missing: Mapping[KeyPath, str] = field(default_factory=dict)


class Layout(Protocol):
    """A model profile that pairs some keys itself, with ops names alone cannot find.

    Renames, stacks and unstacks fall out of matching names; a transpose or the slice of a fused
    array does not, so a profile whose rows need them (PaxML GPT-3 -> MaxText) maps those keys
    itself. The planner matches the keys it leaves as usual.
    """

    def pair(self, source: Inventory, target: Inventory, rules: Rules) -> Paired: ...



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
    - ``layouts``: profiles that pair keys themselves (see :class:`Layout`).
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
    layouts: tuple[Layout, ...] = ()

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
