"""Named model profiles: renames a model family needs, as ckptshim rules.

Where a framework already publishes its own rename table (transformers' checkpoint conversion
mapping), the profile is read from it at load time rather than copied here, so it never goes
stale; see :mod:`.transformers_mapping`.
"""

from __future__ import annotations

from ckptshim import config
from ckptshim.inventory import Inventory
from ckptshim.rules import DEFAULT_RULES, Rules
from ckptshim.rules.flax_names import LINEN_NNX
from ckptshim.rules.profiles import maxtext, paxml, paxml_gpt3


def rules_for_trees(source: Inventory, target: Inventory) -> Rules:
    """The rules for a JAX tree pair: Linen/NNX spellings, MaxText scan axes, PaxML ``Repeat``
    stacks and the PaxML GPT-3 -> MaxText layout where they apply."""
    rules = DEFAULT_RULES.extend(aliases=LINEN_NNX, strict=config.strict())
    if maxtext.applies(source, target):
        rules = rules.extend(scan_axes=maxtext.SCAN_AXES)
    if paxml.applies(source, target):
        rules = rules.extend(aliases=paxml.ALIASES, scan_axes=paxml.SCAN_AXES)
    if paxml_gpt3.applies(source, target):
        rules = rules.extend(layouts=(paxml_gpt3.GPT3_LAYOUT,))
    return rules
