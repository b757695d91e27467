"""Root prefixes: one side's keys are all the other side's under one more leading name.

Lightning saves a ``LightningModule``'s state dict, so every key carries the attribute that
holds the model (``model.`` for a plain module; ``model.model.*`` and ``model.lm_head.*`` for a
Hugging Face Llama inside it); Hugging Face heads add or remove their ``base_model_prefix``. A
prefix like that is decided from the two key sets alone, and only when it is exact: every key of
one side starts with it, and without it that side has exactly the other's keys, each with the
same shape. Anything less is not a root prefix (a model that merely has a ``model.`` submodule
keeps its keys), and the planner reports what does not match instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptshim.inventory import Inventory, KeyPath, join_key
from ckptshim.ops import renames
from ckptshim.rules import Paired, Rules
from ckptshim.rules.prefixes import WRAPPER_SEGMENTS


@dataclass(frozen=True)
class RootPrefix:
    """The :class:`~ckptshim.rules.Layout` of an exact root prefix: ``side`` (``"checkpoint"``
    or ``"target"``) has every key of the other under ``prefix``."""

    side: str
    prefix: KeyPath

    def pair(self, source: Inventory, target: Inventory, rules: Rules) -> Paired:
        cut = len(self.prefix)
        if self.side == "checkpoint":
            sources = [key for key in source if key[:cut] == self.prefix and key[cut:] in target]
            ops = renames(sources, [key[cut:] for key in sources])
        else:
            targets = [key for key in target if key[:cut] == self.prefix and key[cut:] in source]
            ops = renames([key[cut:] for key in targets], targets)
        change = "removed from" if self.side == "checkpoint" else "added to"
        return Paired(tuple(ops), notes=(f"root prefix '{join_key(self.prefix)}.' {change} every checkpoint key",))


def root_prefix(source: Inventory, target: Inventory) -> RootPrefix | None:
    """The exact root prefix between the two sides (see the module docstring), or ``None``.

    Time linear in the keys' total length (their components): the prefix's length is not
    searched for but read off the shortest key of each side -- with ``cut`` names removed from
    every key of one side giving the other's keys, its shortest key must be the other's
    shortest plus ``cut`` -- and then checked once per key.
    """
    if len(source) != len(target) or not len(source):
        return None
    for side, longer, shorter in (("checkpoint", source, target), ("target", target, source)):
        prefix = _common_prefix(longer)
        cut = min(map(len, longer)) - min(map(len, shorter))
        if 1 <= cut <= len(prefix) and all(
                shorter.get(key[cut:]) is not None and shorter[key[cut:]].shape == entry.shape
                for key, entry in longer.items()):
            return RootPrefix(side, prefix[:cut])
    return None


def _common_prefix(inventory: Inventory) -> KeyPath:
    """The leading components every key shares, short of any key's leaf and of wrapper names
    (those are set aside at any depth by the planner itself); each key is compared once, up to
    the prefix shared so far."""
    keys = iter(inventory)
    prefix = next(keys)[:-1]
    for at, part in enumerate(prefix):
        if part in WRAPPER_SEGMENTS:
            prefix = prefix[:at]
            break
    length = len(prefix)
    for key in keys:
        length = min(length, len(key) - 1)
        if key[:length] != prefix[:length]:  # compared in C; the loop finds where they part
            length = next(at for at in range(length) if key[at] != prefix[at])
        if not length:
            break
    return prefix[:length]
