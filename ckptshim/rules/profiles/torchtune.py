"""torchtune 0.6's names for the canonical decoder (:mod:`ckptshim.rules.decoder`): what its
``TransformerDecoder`` holds and ``FullModelTorchTuneCheckpointer`` writes (``tok_embeddings``,
``layers.N.attn.{q,k,v,output}_proj``, ``mlp.w1/w2/w3``, ``sa_norm.scale``, ``norm.scale``,
``output``), as ``convert_weights.tune_to_hf`` maps them onto Hugging Face's.

torchtune has one set of names for every family, but not one rotary convention: its Llama
(``RotaryPositionalEmbeddings``) takes each head's pairs interleaved, so ``tune_to_hf`` permutes
``q_proj``/``k_proj`` per head; its Qwen2 (``Qwen2RotaryPositionalEmbeddings``) keeps the halves,
so ``qwen2_tune_to_hf`` only renames (and carries the q/k/v biases). Which one a checkpoint is,
only its model's config says (``config.json``'s ``model_type``, which torchtune's checkpointers
copy beside the weights; else the target model's own, where the checkpoint's q/k/v biases agree
with it): without a family this module knows, the names carry no convention, and the query and
key rows stay missing with a hint -- Llama's permutation applied to a Qwen2 would load without an
error and compute garbage.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from ckptshim.inventory import Inventory
from ckptshim.rules.decoder import HALVES, PAIRS, Naming

#: What a load says of the query and key rows where no config names a family.
NO_FAMILY = ("torchtune lays out {source}'s rotary dimensions as its model family does (interleaved pairs for a "
             "Llama, halves for a Qwen2), and no config of this load names a family whose convention ckptshim "
             "knows (config.json's model_type); keep the checkpoint's own config.json beside it, or convert it "
             "with the producer's own converter")
NAMES = Naming(
    "torchtune", ("layers",),
    rows={"q": (("attn", "q_proj", "weight"),), "k": (("attn", "k_proj", "weight"),),
          "v": (("attn", "v_proj", "weight"),), "o": (("attn", "output_proj", "weight"),),
          "q_bias": (("attn", "q_proj", "bias"),), "k_bias": (("attn", "k_proj", "bias"),),
          "v_bias": (("attn", "v_proj", "bias"),),
          "gate": (("mlp", "w1", "weight"),), "up": (("mlp", "w3", "weight"),), "down": (("mlp", "w2", "weight"),),
          "attn_norm": (("sa_norm", "scale"),), "mlp_norm": (("mlp_norm", "scale"),)},
    top={"embed": ("tok_embeddings", "weight"), "norm": ("norm", "scale"), "head": ("output", "weight")},
    rotary=None, no_rotary=NO_FAMILY)
BIASES = ("q_bias", "k_bias", "v_bias")


@dataclass(frozen=True)
class Family:
    """What torchtune's model of one family does that its names do not say: its rotary
    convention, and whether its query, key and value projections have biases."""

    rotary: str
    biases: bool


#: ``config.json``'s ``model_type`` -> torchtune's model of that family: ``llama3`` (no biases;
#: ``convert_weights.tune_to_hf`` permutes), ``qwen2`` (q/k/v biases; ``qwen2_tune_to_hf`` does not).
FAMILIES: Mapping[str, Family] = {"llama": Family(PAIRS, biases=False), "qwen2": Family(HALVES, biases=True)}


def variants(source_names: Naming, target_names: Naming, config: Mapping[str, Any] | None,
             target_config: Mapping[str, Any] | None, source: Inventory) -> tuple[Naming, Naming]:
    """The two sides' names, torchtune's with the rotary convention of the family the
    checkpoint's config names; left without one for any other family or none.

    Where the checkpoint has no config, the target's family is taken only if the checkpoint's
    torchtune weights agree with it on q/k/v biases: a Qwen2's (biases) into a ``LlamaForCausalLM``
    built with ``attention_bias=True`` would otherwise be permuted as a Llama's, without an error.
    """
    if NAMES not in (source_names, target_names):
        return source_names, target_names
    own = config is not None
    found = config if own else target_config
    model_type = found.get("model_type") if found is not None else None
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        return source_names, target_names
    tune = NAMES.with_rotary(family.rotary)
    if not own and source_names is NAMES:
        biases = any(part in BIASES for _, part in NAMES.units(source))
        if biases != family.biases:
            tune = replace(NAMES, no_rotary=_other_family(model_type, family, biases))
    return (tune if source_names is NAMES else source_names), (tune if target_names is NAMES else target_names)


def _other_family(model_type: str, family: Family, biases: bool) -> str:
    """The hint where the checkpoint's q/k/v biases say it is not of the target's family."""
    disagree = (f"the checkpoint lacks the q/k/v biases that torchtune's model of the target's family "
                f"(model_type {model_type!r}) has" if family.biases else
                f"the checkpoint carries q/k/v biases, which torchtune's model of the target's family "
                f"(model_type {model_type!r}) has none of")
    return (disagree + "; with no config.json of the checkpoint's own, the rotary layout of {source} (a Llama's "
            "interleaved pairs, a Qwen2's halves) is not guessed. Put the producer's config.json (torchtune copies "
            "it into each epoch_N/ folder) beside the weights, or convert them with torchtune's own convert_weights")
