"""MaxText (and other Flax decoders named ``decoder/layers``): scan axes, rng state, and
MaxText's names for the canonical decoder.

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

MaxText's Llama 3 and Qwen3 names are two :class:`~ckptshim.rules.decoder.Naming` of the decoder
hub (:mod:`ckptshim.rules.profiles.decoders`), transcribed from MaxText 0.2.5's own converter
(``checkpoint_conversion/utils/param_mapping.py``: ``LLAMA31_MAXTEXT_TO_HF_PARAM_MAPPING`` and its
hooks, ``QWEN_...``; ``docs/maxtext.md`` cites each): every kernel is ``[in, out]``, the query,
key and value ``[in, heads, head_dim]``, the output ``[heads, head_dim, out]``; scanned params
stack each layer on ``param_scan_axis`` (:func:`common_scan_axis`), unscanned ones name
``decoder/layers_{i}``. A Llama's query and key heads hold their rotary dimensions as interleaved
pairs, and its attention expects the query pre-multiplied by ``float32(1/sqrt(head_dim))``
(:data:`QUERY_SCALE`); Qwen3 keeps the halves and the scale out, and has per-head query/key norms.
The model family and the head counts come from the Hugging Face side's ``config.json``
(MaxText's converter takes them from a built-in table of full-size models).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckptshim import config
from ckptshim.errors import PlanError, docs_page
from ckptshim.inventory import Inventory, KeyPath, join_key
from ckptshim.rules import OwnWhenUnfit
from ckptshim.rules.context import LoadContext, MarkedProfile
from ckptshim.rules.decoder import HALVES, PAIRS, Naming
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


#: Why the scaled query is what a MaxText Llama expects (the plan summary says it).
QUERY_SCALE = ("MaxText's Llama attention expects the query kernel pre-scaled by 1/sqrt(head_dim), "
               "as to_maxtext scales it")
_KERNEL = (("in",), ("out",))
_HEADS_IN = (("in",), ("heads",), ("head_dim",))
_ROWS = {"q": (("self_attention", "query", "kernel"),), "k": (("self_attention", "key", "kernel"),),
         "v": (("self_attention", "value", "kernel"),), "o": (("self_attention", "out", "kernel"),),
         "gate": (("mlp", "wi_0", "kernel"),), "up": (("mlp", "wi_1", "kernel"),), "down": (("mlp", "wo", "kernel"),),
         "attn_norm": (("pre_self_attention_layer_norm", "scale"),),
         "mlp_norm": (("post_self_attention_layer_norm", "scale"),)}
_TOP = {"embed": ("token_embedder", "embedding"), "norm": ("decoder", "decoder_norm", "scale"),
        "head": ("decoder", "logits_dense", "kernel")}
_AXES = {"q": _HEADS_IN, "k": _HEADS_IN, "v": _HEADS_IN, "o": (("heads",), ("head_dim",), ("out",)),
         "gate": _KERNEL, "up": _KERNEL, "down": _KERNEL, "head": _KERNEL}
#: MaxText's Llama (``model_type`` ``llama``): rotary pairs, the query pre-scaled.
NAMES = Naming("MaxText", ("decoder", "layers"), _ROWS, _TOP, PAIRS, stacked=True, scan=common_scan_axis,
               axes=_AXES, roots=(("params", "params"), ("params",), ()), joined=True, query_scale=QUERY_SCALE)
#: MaxText's Qwen3: rotary halves, no scale, per-head query/key norms.
QWEN3 = Naming("MaxText", NAMES.layers, {**_ROWS, "q_norm": (("self_attention", "query_norm", "scale"),),
                                         "k_norm": (("self_attention", "key_norm", "scale"),)},
               _TOP, HALVES, stacked=True, scan=common_scan_axis, axes=_AXES, roots=NAMES.roots, joined=True)
#: ``config.json``'s ``model_type`` -> MaxText's names for that family.
FAMILIES: Mapping[str, Naming] = {"llama": NAMES, "qwen3": QWEN3}


def variants(source_names: Naming, target_names: Naming, source: Inventory, target: Inventory,
             model_config: Mapping[str, Any] | None) -> tuple[Naming, Naming]:
    """The two sides' names, MaxText's as the family the Hugging Face side's ``config.json``
    names; without one, or for a family MaxText's converter does not map, refused."""
    if NAMES not in (source_names, target_names):
        return source_names, target_names
    other = target if source_names is NAMES else source
    if model_config is None:
        raise PlanError(f"config.json of {other.source}: a Hugging Face checkpoint into a MaxText tree needs the "
                        "model's config.json (heads, head_dim, layers) beside the weights, and there is none. "
                        "Copy the model's config.json into the folder.")
    model_type = model_config.get("model_type")
    names = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if names is None:
        raise PlanError(f"config.json of {other.source}: model_type {model_type!r:.60} has no MaxText profile in "
                        f"ckptshim (it has {', '.join(sorted(FAMILIES))}); see {docs_page('maxtext')}.")
    return (names if source_names is NAMES else source_names), (names if target_names is NAMES else target_names)
