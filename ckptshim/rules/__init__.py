"""The knowledge ckptshim plans with, as data: one frozen :class:`Rules` value per load.

Every load gets its rules from one place, :func:`ckptshim.rules.profiles.rules_for`, given one
:class:`~ckptshim.rules.context.LoadContext`: the defaults, then every
:class:`~ckptshim.rules.context.Profile` that applies to it (the call's conventions, the model
families), and what only the live target knows (:class:`TargetFacts`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from ckptshim.inventory import Inventory, KeyPath
from ckptshim.ops import Op
from ckptshim.rules.aliases import Alias
from ckptshim.rules.buffers import DERIVABLE_BUFFERS
from ckptshim.rules.layers import LAYER_LIST_NAMES, ScanAxis
from ckptshim.rules.prefixes import WRAPPER_SEGMENTS
from ckptshim.rules.roots import RootPrefix

__all__ = ["Alias", "DEFAULT_RULES", "Layout", "NO_FACTS", "OwnWhenUnfit", "Paired", "RootPrefix", "Rules",
           "ScanAxis", "TargetFacts"]


@dataclass(frozen=True)
class Paired:
    """What a :class:`Layout` decided: producer ops for the keys it maps, the target keys it
    recognises but the checkpoint cannot fill (each with a hint naming what it would need), what
    the load's summary should say about the pairing as a whole, and what the load loses that the
    user should be warned of (the profile refuses it itself under ``CKPTSHIM_STRICT``)."""

    ops: tuple[Op, ...] = ()
    missing: Mapping[KeyPath, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()


class Layout(Protocol):
    """A model profile that pairs some keys itself, with ops names alone cannot find.

    Renames, stacks and unstacks fall out of matching names; a transpose or the slice of a fused
    array does not, so a profile whose rows need them (PaxML GPT-3 -> MaxText) maps those keys
    itself. The planner matches the keys it leaves as usual.
    """

    def pair(self, source: Inventory, target: Inventory, rules: Rules) -> Paired: ...


@dataclass(frozen=True)
class OwnWhenUnfit:
    """Target keys that keep the target's own value when the checkpoint's copies do not fit them.

    The planner first plans as usual; only where that fails, or leaves one of ``targets`` missing
    or mismatched, it plans again with ``sources`` (the checkpoint's copies) set aside and
    ``targets`` synthesized (MaxText's rng state, by the user's opt-in).
    """

    targets: frozenset[KeyPath]
    sources: frozenset[KeyPath]


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
    - ``root``: a root prefix one side may carry over the other (:class:`RootPrefix`), taken
      only where the plan with it is complete and the plan without it is not.
    - ``own_when_unfit``: target keys that keep their own value when the checkpoint's copies do
      not fit (:class:`OwnWhenUnfit`).
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
    root: RootPrefix | None = None
    own_when_unfit: OwnWhenUnfit | None = None

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
    - ``tied``: groups of target keys whose live tensors share one storage (tied weights);
    - ``layouts``: layouts the target's own model publishes (transformers' conversion mapping of
      each transformers model in it, :mod:`ckptshim.rules.profiles.transformers_mapping`); where
      it publishes none, a profile may find them from the checkpoint's model config.
    """

    drop: frozenset[KeyPath] = frozenset()
    synthesize: frozenset[KeyPath] = frozenset()
    tied: frozenset[frozenset[KeyPath]] = frozenset()
    layouts: tuple[Layout, ...] = ()


NO_FACTS = TargetFacts()
