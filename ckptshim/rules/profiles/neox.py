"""GPT-NeoX's names for the canonical decoder (:mod:`ckptshim.rules.decoder`): Hugging Face's
``GPTNeoXForCausalLM`` and NeoX's own sequential/pipeline model, today's and before 2024's.

GPT-NeoX is not a Llama: LayerNorm with biases, biases on every linear layer, an ungated MLP
(``up`` and ``down`` without a gate), and a parallel residual (a setting, not a weight). Its fused
``query_key_value`` holds each head's query, key and value rows in turn (``[h0 q, k, v | h1 q, k,
v | ...]``: transformers' ``GPTNeoXAttention`` views it as ``[heads, 3 x head_dim]``), which is
the canonical split by query group with one group per head -- so a load between its two namings
renames it, and any other layout of it would need the head counts. Its rotary embedding turns
two halves of the first ``rotary_pct`` of each head.

The rows are transcribed from GPT-NeoX's ``tools/ckpts/convert_neox_to_hf.py`` (commit ea7aefd8;
sources in ``docs/gpt-neox.md``): ``sequential.0.word_embeddings`` = ``gpt_neox.embed_in``,
``sequential.<i+2>`` = ``gpt_neox.layers.<i>``, ``sequential.<L+3>.norm`` =
``gpt_neox.final_layer_norm``, ``sequential.<L+4>.final_linear`` = ``embed_out``; the pipeline
order is NeoX's own layout (:mod:`ckptshim.layouts.neox`). Since 2024 NeoX names the MLP
``mlp.linear1``/``linear2`` (:data:`NEOX`), before it as Hugging Face does (:data:`NEOX_LEGACY`).
transformers 5 models call the output layer ``lm_head`` and rename ``embed_out`` on load
(:data:`HF_LM_HEAD`, taken where the model has it: :func:`variants`).

The buffers transformers 4.30 saved beside the weights (``attention.bias``, ``masked_bias``) are
the planner's derivable buffers; a saved ``rotary_emb.inv_freq`` is the canonical ``inv_freq``
slot, so a NeoX layer that persists its own gets the checkpoint's.
"""

from __future__ import annotations

from dataclasses import replace

from ckptshim.inventory import Inventory, KeyPath
from ckptshim.layouts.neox import FIRST_BLOCK, MLP_RENAMES, SEQUENTIAL, final_norm_index, output_index
from ckptshim.rules.decoder import HALVES, Fused, Naming

#: The fused query/key/value rows and biases, each head's in turn (one query group per head).
_FUSED = {"qkv": Fused(("q", "k", "v"), by_group=True), "qkv_bias": Fused(("q_bias", "k_bias", "v_bias"), by_group=True)}


def _rows(up: str, down: str) -> dict[str, tuple[KeyPath, ...]]:
    """One layer's rows, the MLP's up projection first: layer 0's first row is what
    :meth:`~ckptshim.rules.decoder.Naming.marks` looks up, and the MLP names tell NeoX's two
    namings apart."""
    return {"up": (("mlp", up, "weight"),), "up_bias": (("mlp", up, "bias"),),
            "down": (("mlp", down, "weight"),), "down_bias": (("mlp", down, "bias"),),
            "qkv": (("attention", "query_key_value", "weight"),), "qkv_bias": (("attention", "query_key_value", "bias"),),
            "o": (("attention", "dense", "weight"),), "o_bias": (("attention", "dense", "bias"),),
            "inv_freq": (("attention", "rotary_emb", "inv_freq"),),
            "attn_norm": (("input_layernorm", "weight"),), "attn_norm_bias": (("input_layernorm", "bias"),),
            "mlp_norm": (("post_attention_layernorm", "weight"),),
            "mlp_norm_bias": (("post_attention_layernorm", "bias"),)}


(_HF_UP, _HF_DOWN), (_NEOX_UP, _NEOX_DOWN) = zip(*MLP_RENAMES)

#: ``GPTNeoXForCausalLM`` (every checkpoint transformers writes, and transformers 4 models).
HF = Naming(
    "Hugging Face GPT-NeoX", ("gpt_neox", "layers"), _rows(_HF_UP, _HF_DOWN),
    top={"embed": ("gpt_neox", "embed_in", "weight"), "norm": ("gpt_neox", "final_layer_norm", "weight"),
         "norm_bias": ("gpt_neox", "final_layer_norm", "bias"), "head": ("embed_out", "weight")},
    rotary=HALVES, fused=_FUSED)
#: ``GPTNeoXForCausalLM`` of transformers 5, whose output layer is ``lm_head``.
HF_LM_HEAD = replace(HF, top={**HF.top, "head": ("lm_head", "weight")})

#: Where NeoX's pipeline holds the final norm and the output layer: how many places past the last
#: layer (of none, at index ``FIRST_BLOCK - 1``).
_NORM, _HEAD = final_norm_index(0) - (FIRST_BLOCK - 1), output_index(0) - (FIRST_BLOCK - 1)
_AFTER = {"norm": (_NORM, ("norm", "weight")), "norm_bias": (_NORM, ("norm", "bias")),
          "head": (_HEAD, ("final_linear", "weight"))}
#: NeoX's ``sequential.<i>`` names (``to_sequential()``, and ``layer_<i>-model_<r>-model_states.pt``).
NEOX = Naming("GPT-NeoX", (SEQUENTIAL,), _rows(_NEOX_UP, _NEOX_DOWN),
              top={"embed": (SEQUENTIAL, "0", "word_embeddings", "weight")}, rotary=HALVES, fused=_FUSED,
              first=FIRST_BLOCK, after=_AFTER)
#: NeoX before 2024, whose MLP had Megatron's (and Hugging Face's) names.
NEOX_LEGACY = replace(NEOX, name="GPT-NeoX (mlp.dense_h_to_4h)", rows=_rows(_HF_UP, _HF_DOWN))

#: Every GPT-NeoX naming, in the order a side is recognised.
NAMINGS: tuple[Naming, ...] = (HF, NEOX, NEOX_LEGACY)


def side(inventory: Inventory) -> Naming | None:
    """The GPT-NeoX naming ``inventory`` holds (layer 0's MLP up projection), else ``None``."""
    found = [naming for naming in NAMINGS if naming.marks(inventory)]
    return found[0] if len(found) == 1 else None


def stage_names(stage: Inventory) -> Naming:
    """The NeoX naming of a pipeline stage's tensors (under ``sequential.<index>``): a stage need
    not hold layer 0, so any layer's MLP names say which; a stage without a transformer layer has
    nothing either naming spells otherwise."""
    legacy = any(part in ("up", "down") for _, part in NEOX_LEGACY.units(stage))
    return NEOX_LEGACY if legacy else NEOX


def variants(source_names: Naming, target_names: Naming, source: Inventory,
             target: Inventory) -> tuple[Naming, Naming]:
    """Hugging Face GPT-NeoX names with the output layer a side holds (``lm_head``: a
    transformers 5 model)."""
    def own(names: Naming, inventory: Inventory) -> Naming:
        return HF_LM_HEAD if names is HF and HF_LM_HEAD.key((None, "head")) in inventory else names

    return own(source_names, source), own(target_names, target)


def layer_count(names: Naming, inventory: Inventory) -> int:
    """How many layers ``inventory`` holds under ``names`` (counted, layer 0 on)."""
    return len({layer for layer, _ in names.units(inventory) if layer is not None})


def pipeline_key(key: KeyPath, names: Naming, layers: int) -> KeyPath:
    """``key`` of a checkpoint under ``names`` (of ``layers`` layers) as NeoX's pipeline names
    it: a slot's under :data:`NEOX`, any other tensor of a layer (a buffer) under the layer's
    pipeline index; ``key`` itself where it is neither."""
    if names in (NEOX, NEOX_LEGACY):
        return key
    unit = names.locate(key)
    if unit is not None:
        return NEOX.key(unit, layers)
    within = names.within(key)
    return key if within is None else (*NEOX.layer_key(within[0]), *within[1])


def vocab_slot(key: KeyPath) -> str | None:
    """``"embed"`` or ``"head"`` for a NeoX pipeline key of a vocab-sized tensor, else ``None``."""
    unit = NEOX.locate(key)
    return unit[1] if unit is not None and unit[0] is None and unit[1] in ("embed", "head") else None
