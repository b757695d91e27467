"""Flax NNX states as flax before 0.9 split them: every variable's array at ``.../raw_value``.

Until flax 0.9, ``nnx.split`` gave a ``State`` of ``VariableState`` leaves that flatten to their
``raw_value``, so Orbax recorded each leaf of an NNX state at ``<path>/raw_value``. flax 0.9
renamed the field: today's ``nnx.split`` state asks Orbax for ``<path>/value``, and Orbax alone
refuses the old checkpoint ("Target path ... 'value' not found").

The profile fires only where the checkpoint *is* such a state -- every array it records ends in
``raw_value``, as every leaf of an NNX state of that era does -- and the target is an NNX state
of today, every leaf ending in ``value``. Then ``raw_value`` and ``value`` are one spelling of a
variable's array. A tree with a ``raw_value`` key among other names is not a state of that era
and keeps its names; what the two states hold is still matched key by key, so a params-only
state restored into a full one (BatchNorm statistics absent) stays refused, as natively.
"""

from __future__ import annotations

from ckptshim.inventory import Inventory
from ckptshim.rules.aliases import Alias
from ckptshim.rules.context import MarkedProfile

#: The field a flax < 0.9 ``VariableState`` kept its array in, spelled as today's ``value``.
RAW_VALUE = Alias((), ("raw_value",), "suffix")


def _every_leaf_ends_in(inventory: Inventory, name: str) -> bool:
    return bool(inventory) and all(key[-1] == name for key in inventory)


def flax_08_state_into_today(source: Inventory, target: Inventory) -> bool:
    """A checkpoint of an NNX state of flax < 0.9 restored into an NNX state of today."""
    return _every_leaf_ends_in(source, "raw_value") and _every_leaf_ends_in(target, "value")


PROFILE = MarkedProfile("flax < 0.9 NNX state", "jax", flax_08_state_into_today, {"aliases": (RAW_VALUE,)})
