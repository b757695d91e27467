"""Megatron-Core ``dist_checkpointing`` keys <-> the model's own ``GPTModel.state_dict()`` names.

Megatron-Core saves (``torch_dist`` and the legacy ``zarr`` backend alike, see
:mod:`ckptshim.formats.megatron_core`) each transformer-layer tensor stacked on a new axis 0,
under one key without the layer index: ``decoder.layers.self_attention.linear_qkv.weight``
``[L, 3h, h]``, the offset on that axis being the *global* layer index, also across pipeline
stages. A plain model names it per layer, ``decoder.layers.<i>.self_attention.linear_qkv.weight``.
Three differences, each mended here only when the checkpoint's own ``metadata.json`` says
Megatron-Core wrote it (``producer``: never from names alone):

- the layer axis: stacked keys unstack at their stored offsets, which the planner's layer-list
  matching does (``layers`` is a layer list, the axis read off the shapes) once the names agree;
- the local (non-Transformer-Engine) spec's layer norms, stored under the names of the fused TE
  modules they stand in for: ``input_layernorm.*`` as ``self_attention.linear_qkv.layer_norm_*``
  and ``pre_mlp_layernorm.*`` as ``mlp.linear_fc1.layer_norm_*`` (Megatron-Core's
  ``get_gpt_layer_local_spec`` ``sharded_state_dict_keys_map``). :data:`LAYER_NORMS` are aliases,
  so they hold both ways (a TE-spec model, whose own names are the fused ones, matches too);
- each linear layer's ``_extra_state`` (Transformer Engine's FP8 metadata; ``None`` under the
  local spec), a ``ShardedObject`` per layer stored as ``<module>._extra_state/shard_<i>_<L>``
  (the output layer's is never saved). These are left out, unread: ``torch_dist`` stores each
  as a pickled *list* of the saving rank's objects, which Megatron-Core unwraps on load, and
  ckptshim does not rewrite a pickled object's value. A target that has ``_extra_state`` keys
  keeps its own values for them (:func:`kept`; the load's summary counts them as synthesized),
  as ``GPTModel`` keeps its output layer's.

:func:`model_names` is the inventory a plain model has for such a checkpoint, which ``ckptshim
inspect`` lists and ``convert`` writes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckptshim.errors import CorruptCheckpointError
from ckptshim.inventory import DTYPE_SIZES, Entry, Inventory, KeyPath, join_key
from ckptshim.rules.aliases import Alias
from ckptshim.rules.context import LoadContext
from ckptshim.rules.decoder import HALVES, Fused, Naming

#: The :attr:`LoadContext.producer <ckptshim.rules.context.LoadContext.producer>` of a checkpoint whose
#: ``metadata.json`` names a Megatron-Core sharded backend.
PRODUCER = "megatron-core"
#: The component under which Megatron-Core stacks the transformer layers.
LAYERS = "layers"

#: The local spec's layer norms (canonical: the model's names) and the TE-fused names they are
#: stored under.
LAYER_NORMS: tuple[Alias, ...] = tuple(
    Alias((norm, param), (*fused, f"layer_norm_{param}"), "anywhere")
    for norm, fused in (("input_layernorm", ("self_attention", "linear_qkv")),
                        ("pre_mlp_layernorm", ("mlp", "linear_fc1")))
    for param in ("weight", "bias"))

#: ``GPTModel``'s names for the canonical decoder (a Llama-style model: RMSNorm, SwiGLU, rotary
#: halves): ``linear_qkv`` holds each query group's query heads, then its key and value head
#: (Megatron-Bridge's ``QKVMapping``); ``linear_fc1`` is ``[gate; up]`` (its ``GatedMLPMapping``).
#: Stored checkpoints stack every layer on axis 0 and keep the local spec's layer norms under the
#: fused modules' names; a model's own names are per layer, either spelling.
NAMES = Naming(
    "Megatron-Core GPTModel", ("decoder", "layers"),
    rows={"qkv": (("self_attention", "linear_qkv", "weight"),), "o": (("self_attention", "linear_proj", "weight"),),
          "q_norm": (("self_attention", "q_layernorm", "weight"),),
          "k_norm": (("self_attention", "k_layernorm", "weight"),),
          "fc1": (("mlp", "linear_fc1", "weight"),), "down": (("mlp", "linear_fc2", "weight"),),
          "attn_norm": (("input_layernorm", "weight"), ("self_attention", "linear_qkv", "layer_norm_weight")),
          "mlp_norm": (("pre_mlp_layernorm", "weight"), ("mlp", "linear_fc1", "layer_norm_weight"))},
    top={"embed": ("embedding", "word_embeddings", "weight"), "norm": ("decoder", "final_layernorm", "weight"),
         "head": ("output_layer", "weight")},
    rotary=HALVES, fused={"qkv": Fused(("q", "k", "v"), True), "fc1": Fused(("gate", "up"), False)}, stacked=True)

EXTRA_STATE = "_extra_state"
#: A stored ``ShardedObject`` key's last component: ``_extra_state/shard_<layer>_<layers>``.
_SHARD = re.compile(r"_extra_state/shard_(\d+)_(\d+)")


def _stacked(key: KeyPath) -> int | None:
    """Where ``layers`` is in a stacked key (not followed by a layer index), else ``None``."""
    for index, part in enumerate(key[:-1]):
        if part == LAYERS and not key[index + 1].isdigit():
            return index
    return None


def _model_key(key: KeyPath, at: int, layer: int) -> KeyPath:
    """The per-layer name of a stacked key, the layer norms under the model's own names."""
    rest = key[at + 1:]
    for alias in LAYER_NORMS:
        rest = alias.rewrite(rest)
    return (*key[:at + 1], str(layer), *rest)


def model_names(stored: Inventory, stored_bytes: int) -> tuple[Inventory, int]:
    """The tensors a plain model holds for a Megatron-Core checkpoint's ``stored`` inventory --
    per layer at the global index its offset on the stacked axis says, the layer norms under the
    model's names -- and how many stored ``_extra_state`` objects it leaves out. In the model's
    order: what precedes the layers, each layer's tensors, what follows them.

    The layer count is metadata's word, and listing a layer is work: the layers of every stacked
    key together may not need more than ``stored_bytes``, what the checkpoint's files hold (a
    layer of no elements counting as one byte), or the metadata lies -- a few KiB declaring
    10^12 layers -- and is refused before a layer is listed."""
    needed = 0
    for entry in stored.values():
        at = _stacked(entry.key)
        if at is not None and entry.shape and not _SHARD.fullmatch(entry.key[-1]):
            needed += entry.shape[0] * max(math.prod(entry.shape[1:]) * DTYPE_SIZES[entry.dtype], 1)
            if needed > stored_bytes:
                raise CorruptCheckpointError(
                    f"{stored.source}: {join_key(entry.key)} declares {entry.shape[0]:,} stacked layers; with "
                    f"the keys before it that is more than the {stored_bytes:,} bytes its files hold. The "
                    "metadata is damaged or built to exhaust time and memory; re-copy the checkpoint.")
    before: list[Entry] = []
    layers: dict[int, list[Entry]] = {}
    after: list[Entry] = []
    objects = 0
    for entry in stored.values():
        if _SHARD.fullmatch(entry.key[-1]):
            objects += 1
            continue
        at = _stacked(entry.key)
        if at is None or not entry.shape:
            (after if layers else before).append(Entry(entry.key, entry.shape, entry.dtype))
            continue
        for layer in range(entry.shape[0]):
            layers.setdefault(layer, []).append(Entry(_model_key(entry.key, at, layer), entry.shape[1:], entry.dtype))
    entries = before + [entry for layer in sorted(layers) for entry in layers[layer]] + after
    return Inventory(entries, f"{stored.source} as the model names it"), objects


@dataclass(frozen=True)
class MegatronCoreProfile:
    """A checkpoint Megatron-Core's ``dist_checkpointing`` wrote (its ``metadata.json`` says so):
    the local spec's layer norms under the TE-fused names they are stored under, and the target's
    ``_extra_state`` keeping its own values. The stacked layers need no rule of their own: the
    planner unstacks a layer list at the stored global offsets."""

    name: str = "Megatron-Core"

    def applies(self, context: LoadContext) -> bool:
        return context.backend == "torch" and context.producer == PRODUCER

    def rules(self, context: LoadContext) -> Mapping[str, Any]:
        return {"aliases": LAYER_NORMS, "synthesize": kept(context.target)}


def kept(target: Inventory) -> frozenset[KeyPath]:
    """The target's ``_extra_state`` keys: each keeps the model's own value (see the module
    docstring), as ``GPTModel`` keeps its output layer's, which Megatron-Core never saves."""
    return frozenset(key for key in target if key[-1] == EXTRA_STATE)


PROFILE = MegatronCoreProfile()
