"""The knowledge ckptshim plans with, as data: one frozen :class:`Rules` value per load.

Every load gets its rules from one place, :func:`ckptshim.rules.profiles.rules_for`: the
defaults, the backend's conventions, the model profiles that apply to the two inventories, and
what only the live target knows (:class:`TargetFacts`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from ckptshim.inventory import Inventory, KeyPath
from ckptshim.ops import Op
from ckptshim.rules.aliases import Alias
from ckptshim.rules.buffers import DERIVABLE_BUFFERS
from ckptshim.rules.layers import LAYER_LIST_NAMES, ScanAxis
from ckptshim.rules.prefixes import WRAPPER_SEGMENTS

if TYPE_CHECKING:  # a profile built on these rules; imported for its type only
    from ckptshim.rules.profiles.transformers_mapping import Conversions

__all__ = ["Alias", "DEFAULT_RULES", "Layout", "NO_FACTS", "Paired", "Rules", "ScanAxis", "TargetFacts"]


@dataclass(frozen=True)
class Paired:
    """What a :class:`Layout` decided: producer ops for the keys it maps, the target keys it
    recognises but the checkpoint cannot fill (each with a hint naming what it would need), and
    what the load's summary should say about the pairing as a whole."""

    ops: tuple[Op, ...] = ()
    missing: Mapping[KeyPath, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()


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
      that the target does not want is dropped once the executor has checked its value
      (``DropIfDerived``), when ``drop_derivable``.
    - ``drop_derivable``: off for loads that check no values and leave every checkpoint key the
      target does not ask for unread anyway (DCP, JAX restores): there such keys are unexpected.
    - ``drop``: exact (canonical) keys of the target's non-persistent buffers: a checkpoint's copy
      is dropped once the executor has checked it against the target's own buffer.
    - ``synthesize``: exact target keys the target may keep its own value for when the
      checkpoint lacks them (persistent derivable buffers); never parameters.
    - ``allow_cast``: whether a dtype difference becomes a ``Cast`` or an error.
    - ``strict``: every guess (an axis taken from siblings, a narrowing cast) becomes an error.
    - ``layouts``: profiles that pair keys themselves (see :class:`Layout`).
    - ``tied``: groups of target keys whose live tensors share one storage; a key of a group
      that the checkpoint lacks is filled by another of the group that it has.
    """

    wrappers: frozenset[str] = WRAPPER_SEGMENTS
    layer_lists: frozenset[str] = LAYER_LIST_NAMES
    aliases: tuple[Alias, ...] = ()
    scan_axes: tuple[ScanAxis, ...] = ()
    derivable: tuple[KeyPath, ...] = DERIVABLE_BUFFERS
    drop_derivable: bool = True
    drop: frozenset[KeyPath] = frozenset()
    synthesize: frozenset[KeyPath] = frozenset()
    allow_cast: bool = True
    strict: bool = False
    layouts: tuple[Layout, ...] = ()
    tied: frozenset[frozenset[KeyPath]] = frozenset()

    def extend(self, **more) -> Rules:
        """A copy with collections extended (not replaced; an entry already there is not added
        twice) and scalar fields overridden."""
        changes = {}
        for name, value in more.items():
            current = getattr(self, name)
            if isinstance(current, frozenset):
                changes[name] = current | frozenset(value)
            elif isinstance(current, tuple):
                changes[name] = current + tuple(v for v in dict.fromkeys(value) if v not in current)
            else:
                changes[name] = value
        return dataclasses.replace(self, **changes)

    def scan_axis(self, stacked: KeyPath) -> int | None:
        for rule in self.scan_axes:
            if rule.component in stacked:
                return rule.axis
        return None


DEFAULT_RULES = Rules()


@dataclass(frozen=True)
class TargetFacts:
    """What a live load target knows beyond its inventory, as rules.

    - ``drop``: (canonical) keys the target keeps as non-persistent buffers, so a checkpoint's
      copy has no place;
    - ``synthesize``: target keys that may keep their own value when the checkpoint lacks them
      (persistent buffers a framework can recompute);
    - ``aliases``: spellings the target's own names stand for (a GPT-NeoX pipeline stage cannot
      tell from its own keys which naming the checkpoint has);
    - ``tied``: groups of target keys whose live tensors share one storage (tied weights);
    - ``conversions``: the conversion mapping transformers publishes for each transformers model
      in the target (:mod:`ckptshim.rules.profiles.transformers_mapping`).
    """

    drop: frozenset[KeyPath] = frozenset()
    synthesize: frozenset[KeyPath] = frozenset()
    aliases: tuple[Alias, ...] = ()
    tied: frozenset[frozenset[KeyPath]] = frozenset()
    conversions: tuple[Conversions, ...] = ()


NO_FACTS = TargetFacts()
