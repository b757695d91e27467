"""torchtune 0.6's names for the canonical decoder (:mod:`ckptshim.rules.decoder`): what its
``TransformerDecoder`` holds and ``FullModelTorchTuneCheckpointer`` writes (``tok_embeddings``,
``layers.N.attn.{q,k,v,output}_proj``, ``mlp.w1/w2/w3``, ``sa_norm.scale``, ``norm.scale``,
``output``), as ``convert_weights.tune_to_hf`` maps them onto Hugging Face's.

torchtune has one set of names for every family, but not one rotary convention: its Llama
(``RotaryPositionalEmbeddings``) takes each head's pairs interleaved, so ``tune_to_hf`` permutes
``q_proj``/``k_proj`` per head; its Qwen2 (``Qwen2RotaryPositionalEmbeddings``) keeps the halves,
so ``qwen2_tune_to_hf`` only renames (and carries the q/k/v biases). Which one a checkpoint is,
only its model's config says (``config.json``'s ``model_type``, which torchtune's checkpointers
copy beside the weights; else the target model's own): without a family this module knows, the
names carry no convention, and the query and key rows stay missing with a hint -- Llama's
permutation applied to a Qwen2 would load without an error and compute garbage.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckptshim.rules.decoder import HALVES, PAIRS, Naming

NAMES = Naming(
    "torchtune", ("layers",),
    rows={"q": (("attn", "q_proj", "weight"),), "k": (("attn", "k_proj", "weight"),),
          "v": (("attn", "v_proj", "weight"),), "o": (("attn", "output_proj", "weight"),),
          "q_bias": (("attn", "q_proj", "bias"),), "k_bias": (("attn", "k_proj", "bias"),),
          "v_bias": (("attn", "v_proj", "bias"),),
          "gate": (("mlp", "w1", "weight"),), "up": (("mlp", "w3", "weight"),), "down": (("mlp", "w2", "weight"),),
          "attn_norm": (("sa_norm", "scale"),), "mlp_norm": (("mlp_norm", "scale"),)},
    top={"embed": ("tok_embeddings", "weight"), "norm": ("norm", "scale"), "head": ("output", "weight")},
    rotary=None)
#: ``config.json``'s ``model_type`` -> the rotary convention of torchtune's model of that family
#: (``convert_weights.tune_to_hf`` permutes; ``qwen2_tune_to_hf`` does not).
FAMILIES: Mapping[str, str] = {"llama": PAIRS, "qwen2": HALVES}


def variants(source_names: Naming, target_names: Naming, config: Mapping[str, Any] | None,
             target_config: Mapping[str, Any] | None) -> tuple[Naming, Naming]:
    """The two sides' names, torchtune's with the rotary convention of the family the
    checkpoint's config names (the target's where the checkpoint has none); left without one for
    any other family or none."""
    if NAMES not in (source_names, target_names):
        return source_names, target_names
    model_type = next((found.get("model_type") for found in (config, target_config) if found is not None), None)
    rotary = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if rotary is None:
        return source_names, target_names
    tune = NAMES.with_rotary(rotary)
    return (tune if source_names is NAMES else source_names), (tune if target_names is NAMES else target_names)
