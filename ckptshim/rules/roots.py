"""Root prefixes: one side's keys are all the other side's under one more leading name.

Lightning saves a ``LightningModule``'s state dict, so every key carries the attribute that
holds the model (``model.`` for a plain module; ``model.model.*`` and ``model.lm_head.*`` for a
Hugging Face Llama inside it); Hugging Face heads add or remove their ``base_model_prefix``.

A root prefix is read off the two key sets (wrapper components set aside, as the planner sets
them aside at any depth): the leading names every key of one side shares beyond those every key
of the other shares. That is only a candidate. The planner takes it only where it is exact:
where the prefix alone makes the key sets one (with the same shapes), or where the plan without
it leaves keys unmatched and the plan with it -- the checkpoint's keys re-keyed, every other
rule (wrapper prefixes, a conversion table, stacking) applied as usual -- matches every key on
both sides. Anything less is not a root prefix (a model that merely has a
``model.`` submodule keeps its keys), and the planner reports what does not match instead.

A training loop's file holds the model beside an optimizer's state (``litgpt pretrain``'s
``{"model", "optimizer", ...}``): the checkpoint's top-level entries that *are* an optimizer's
``state_dict()`` (:mod:`ckptshim.rules.training_state`) are set aside before the prefix is read
off, said in the plan's note, and never planned into the target.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

from ckptshim.inventory import Inventory, KeyPath, join_key
from ckptshim.rules.prefixes import WRAPPER_SEGMENTS, strip_wrappers
from ckptshim.rules.training_state import optimizer_entries


@dataclass(frozen=True)
class RootPrefix:
    """A candidate root prefix: ``side`` (``"checkpoint"`` or ``"target"``) has every key of the
    other under ``prefix``; ``aside``: the checkpoint's top-level entries beside it that are an
    optimizer's state, not weights."""

    side: str
    prefix: KeyPath
    aside: frozenset[str] = frozenset()

    def sets_aside(self, key: KeyPath) -> bool:
        """Whether the checkpoint ``key`` is in an entry set aside (never planned)."""
        return key[0] in self.aside

    def rekey(self, key: KeyPath) -> KeyPath | None:
        """The checkpoint ``key`` as the target would spell it with the prefix set aside (removed
        from a checkpoint key, or added to it); ``None`` for a key outside the prefix."""
        if self.side == "target":
            return self.prefix + key
        bare = strip_wrappers(key)
        cut = len(self.prefix)
        return bare[cut:] if bare[:cut] == self.prefix and len(bare) > cut else None

    def exact(self, source: Inventory, target: Inventory) -> bool:
        """Whether the prefix alone makes the two sides one: the re-keyed checkpoint keys are the
        target's (wrapper components set aside), one for one, with the same shapes."""
        rekeyed = [(self.rekey(key), entry.shape) for key, entry in source.items() if not self.sets_aside(key)]
        if len(rekeyed) != len(target):
            return False
        shapes = {strip_wrappers(key): entry.shape for key, entry in target.items()}
        return len(shapes) == len(target) and all(
            key is not None and shapes.get(strip_wrappers(key)) == shape for key, shape in rekeyed) \
            and len({key for key, _ in rekeyed}) == len(rekeyed)

    def heads(self, source: Inventory) -> set[str]:
        """The first components of the checkpoint's keys once re-keyed (wrapper components set
        aside); keys outside the prefix have none."""
        if self.side == "target":
            return {self.prefix[0]}
        return heads(source, len(self.prefix), self.aside)

    @property
    def note(self) -> str:
        change = "removed from" if self.side == "checkpoint" else "added to"
        aside = "".join(f"; '{name}' set aside: an optimizer's state, not weights" for name in sorted(self.aside))
        return f"root prefix '{join_key(self.prefix)}.' {change} every checkpoint key{aside}"


def root_prefix(source: Inventory, target: Inventory) -> RootPrefix | None:
    """The candidate root prefix between the two sides (see the module docstring), or ``None``.

    Time linear in the keys' total length: each side's shared leading names are found in one
    pass over its keys.
    """
    if not len(source) or not len(target):
        return None
    aside = frozenset()
    if len(heads(source)) > 1:  # a training loop's file: its optimizer's state beside the model
        aside = optimizer_entries(source, heads(target))
    shared = _common_prefix(key for key in source if key[0] not in aside), _common_prefix(target)
    for side, (longer, shorter) in (("checkpoint", shared), ("target", shared[::-1])):
        cut = len(longer) - len(shorter)
        if cut >= 1 and longer[cut:] == shorter:
            return RootPrefix(side, longer[:cut], aside if side == "checkpoint" else frozenset())
    return None


def heads(inventory: Inventory, at: int = 0, aside: frozenset[str] = frozenset()) -> set[str]:
    """The components at position ``at`` of the keys (wrapper components set aside), for keys
    long enough to have one and outside the top-level entries ``aside``: worked out on the few
    distinct leading paths where none holds a wrapper component, key by key otherwise."""
    leading = {key[:at + 1] for key in inventory if key[0] not in aside}
    if WRAPPER_SEGMENTS.isdisjoint(part for lead in leading for part in lead):
        return {lead[at] for lead in leading if len(lead) > at}
    return {bare[at] for key in inventory if key[0] not in aside for bare in (strip_wrappers(key),) if len(bare) > at}


def _common_prefix(keys: Iterable[KeyPath]) -> KeyPath:
    """The leading components every key shares once wrapper components are set aside, short of
    any key's leaf: worked out on the few distinct parent paths, the shared prefix of the
    smallest and largest of them (in C)."""
    parents = {key[:-1] for key in keys}
    if not WRAPPER_SEGMENTS.isdisjoint(part for parent in parents for part in parent):
        parents = {tuple(part for part in parent if part not in WRAPPER_SEGMENTS) for parent in parents}
    return tuple(os.path.commonprefix(list(parents)))
