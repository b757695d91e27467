"""PaxML layer stacks: ``Repeat`` keeps layers stacked on axis 0 under ``repeat/sub/x_layers_0``.

Praxis' ``Repeat`` layer (``praxis/layers/repeats.py``) wraps one ``sub`` layer and scans it,
so each of its variables gains a leading layer axis; inside a ``StackedTransformerRepeated``
the sub layer is a one-layer ``StackedTransformer`` whose only layer is ``x_layers_0``. The
same model built unrepeated (``StackedTransformer``) names its layers ``x_layers_{i}``. The
alias makes ``repeat/sub/x_layers_0/<param>`` the stacked form of ``x_layers_{i}/<param>``, on
axis 0, so either checkpoint restores into either model.
"""

from __future__ import annotations

from ckptshim.inventory import Inventory
from ckptshim.rules.aliases import Alias
from ckptshim.rules.context import MarkedProfile
from ckptshim.rules.layers import ScanAxis

REPEAT = ("repeat", "sub", "x_layers_0")
ALIASES: tuple[Alias, ...] = (Alias(("x_layers",), REPEAT),)
SCAN_AXES: tuple[ScanAxis, ...] = (ScanAxis("x_layers", 0),)


def applies(*inventories: Inventory) -> bool:
    """Whether a tree holds a PaxML ``Repeat`` stack (``.../repeat/sub/x_layers_0/...``)."""
    return any(key[i:i + 3] == REPEAT for inventory in inventories for key in inventory
               for i in range(len(key) - 2) if key[i] == "repeat")


#: PaxML ``Repeat`` stacks, where either tree holds one.
PROFILE = MarkedProfile("PaxML Repeat", "jax", applies, {"aliases": ALIASES, "scan_axes": SCAN_AXES})
