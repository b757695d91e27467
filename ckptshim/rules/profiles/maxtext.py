"""MaxText (and other Flax decoders named ``decoder/layers``): scan axes and rng state.

With ``scan_layers=True`` MaxText stacks every per-layer parameter, and the optimizer moments
that mirror it, along ``param_scan_axis`` (default 1: ``decoder/layers/mlp/wi_0/kernel`` is
``[emb, layers, mlp]``), while NNX rng state (``.../rngs/<stream>/{count,key}``) is stacked on
axis 0. The planner reads the axis off the shapes; these rules only break ties, when a shape
fits more than one axis (``[L, L]`` kernels, or norms whose width equals the layer count).

Rng state has one more quirk: an unscanned MaxText run keeps NNX rng state for ``layers_0``
only, a scanned one for every layer, so a scanned target's rng state cannot come from an
unscanned checkpoint and the restore refuses, naming the missing layers. Rng state only seeds
dropout and similar noise, so a user may opt in (``CKPTSHIM_RNG_FROM_TARGET=1``) to keep the
target's own rng state whenever the checkpoint's does not fit; the target must then be
concrete arrays (an initialised state), not abstract shapes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckptshim import config
from ckptshim.errors import PlanError
from ckptshim.inventory import Inventory, KeyPath, join_key
from ckptshim.rules import OwnWhenUnfit
from ckptshim.rules.context import LoadContext, MarkedProfile
from ckptshim.rules.layers import ScanAxis, layer_splits

#: First match wins: rng state on axis 0, everything else under a layer list on axis 1.
SCAN_AXES: tuple[ScanAxis, ...] = (ScanAxis("rngs", 0), ScanAxis("layers", 1))

RNG_COMPONENT = "rngs"
#: MaxText's default ``param_scan_axis``, used where every stacked array's shape fits several axes.
DEFAULT_SCAN_AXIS = 1


def applies(*inventories: Inventory) -> bool:
    """Whether a tree is laid out like MaxText's decoder: ``decoder/layers`` or ``decoder/layers_N``."""
    names = frozenset({"layers"})
    for inventory in inventories:
        for key in inventory:
            if "decoder" not in key:
                continue
            at = key.index("decoder")
            if key[at + 1:at + 2] == ("layers",) or any(
                    stacked[at + 1:at + 2] == ("layers",) for stacked, _ in layer_splits(key, names)):
                return True
    return False


def is_rng_state(key: KeyPath) -> bool:
    return RNG_COMPONENT in key[:-1]


def common_scan_axis(fits: Mapping[KeyPath, set[int]], strict: bool) -> int:
    """The one ``param_scan_axis`` of a converter's stacked targets, given the axes each target's
    shape fits (none empty: a profile refuses those first, in its own words). MaxText stacks every
    layer variable on one axis; where the shapes leave several, its default 1 -- refused under
    ``CKPTSHIM_STRICT``."""
    common = set.intersection(*fits.values())
    if len(common) == 1:
        return common.pop()
    if not common:
        shown = "; ".join(f"{join_key(k, '/')} fits axis {sorted(a)}" for k, a in list(fits.items())[:6])
        raise PlanError(f"the target's stacked layer arrays do not agree on one param_scan_axis ({shown}); "
                        "MaxText stacks every layer variable on the same axis. Build the target with one.")
    if DEFAULT_SCAN_AXIS in common and not strict:
        return DEFAULT_SCAN_AXIS
    raise PlanError(f"every stacked target array fits the layer axis at {' or '.join(map(str, sorted(common)))} "
                    "(some dimensions equal the layer count), so the shapes do not say which is "
                    "param_scan_axis" + (" and CKPTSHIM_STRICT=1 forbids assuming MaxText's default 1" if strict else "")
                    + ". Build the target with distinct dimensions, or unset CKPTSHIM_STRICT.")


@dataclass(frozen=True)
class RngFromTarget:
    """By the user's opt-in (``CKPTSHIM_RNG_FROM_TARGET=1``), rng state the checkpoint's cannot
    fill keeps the target's own (see the module docstring)."""

    name: str = "rng state from the target"

    def applies(self, context: LoadContext) -> bool:
        return context.backend == "jax" and config.rng_from_target() and any(map(is_rng_state, context.target))

    def rules(self, context: LoadContext) -> Mapping[str, Any]:
        return {"own_when_unfit": OwnWhenUnfit(frozenset(filter(is_rng_state, context.target)),
                                               frozenset(filter(is_rng_state, context.source)))}


#: MaxText's scan axes, for trees laid out like its decoder.
PROFILE = MarkedProfile("MaxText", "jax", applies, {"scan_axes": SCAN_AXES})
RNG_PROFILE = RngFromTarget()
