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
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ckptshim.inventory import Inventory, KeyPath, join_key
from ckptshim.rules.prefixes import WRAPPER_SEGMENTS, strip_wrappers


@dataclass(frozen=True)
class RootPrefix:
    """A candidate root prefix: ``side`` (``"checkpoint"`` or ``"target"``) has every key of the
    other under ``prefix``."""

    side: str
    prefix: KeyPath

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
        if len(source) != len(target):
            return False
        shapes = {strip_wrappers(key): entry.shape for key, entry in target.items()}
        rekeyed = [(self.rekey(key), entry.shape) for key, entry in source.items()]
        return len(shapes) == len(target) and all(
            key is not None and shapes.get(strip_wrappers(key)) == shape for key, shape in rekeyed) \
            and len({key for key, _ in rekeyed}) == len(rekeyed)

    def heads(self, source: Inventory) -> set[str]:
        """The first components of the checkpoint's keys once re-keyed (wrapper components set
        aside); keys outside the prefix have none."""
        if self.side == "target":
            return {self.prefix[0]}
        return heads(source, len(self.prefix))

    @property
    def note(self) -> str:
        change = "removed from" if self.side == "checkpoint" else "added to"
        return f"root prefix '{join_key(self.prefix)}.' {change} every checkpoint key"


def root_prefix(source: Inventory, target: Inventory) -> RootPrefix | None:
    """The candidate root prefix between the two sides (see the module docstring), or ``None``.

    Time linear in the keys' total length: each side's shared leading names are found in one
    pass over its keys.
    """
    if not len(source) or not len(target):
        return None
    shared = _common_prefix(source), _common_prefix(target)
    for side, (longer, shorter) in (("checkpoint", shared), ("target", shared[::-1])):
        cut = len(longer) - len(shorter)
        if cut >= 1 and longer[cut:] == shorter:
            return RootPrefix(side, longer[:cut])
    return None


def heads(inventory: Inventory, at: int = 0) -> set[str]:
    """The components at position ``at`` of the keys (wrapper components set aside), for keys
    long enough to have one: worked out on the few distinct leading paths where none holds a
    wrapper component, key by key otherwise."""
    leading = {key[:at + 1] for key in inventory}
    if WRAPPER_SEGMENTS.isdisjoint(part for lead in leading for part in lead):
        return {lead[at] for lead in leading if len(lead) > at}
    return {bare[at] for bare in map(strip_wrappers, inventory) if len(bare) > at}


def _common_prefix(inventory: Inventory) -> KeyPath:
    """The leading components every key shares once wrapper components are set aside, short of
    any key's leaf: worked out on the few distinct parent paths, the shared prefix of the
    smallest and largest of them (in C)."""
    parents = {key[:-1] for key in inventory}
    if not WRAPPER_SEGMENTS.isdisjoint(part for parent in parents for part in parent):
        parents = {tuple(part for part in parent if part not in WRAPPER_SEGMENTS) for parent in parents}
    return tuple(os.path.commonprefix(list(parents)))
