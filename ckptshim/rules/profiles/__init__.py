"""Named profiles, and :func:`rules_for`: the one place a load's rules are chosen.

Each profile is a :class:`~ckptshim.rules.context.Profile` -- ``applies(context)`` and
``rules(context)`` -- and :data:`PROFILES` lists them in the order they are folded over the
defaults. Where a framework already publishes its own rename table (transformers' checkpoint
conversion mapping), the profile reads it at load time rather than copying it here, so it never
goes stale; see :mod:`.transformers_mapping`.
"""

from __future__ import annotations

from ckptshim import config
from ckptshim.rules import DEFAULT_RULES, Rules
from ckptshim.rules.context import LoadContext, Profile
from ckptshim.rules.profiles import (conventions, decoders, flax_nnx, maxtext, megatron_core, paxml, paxml_gpt3,
                                     transformers_mapping)

#: Every profile, in the order :func:`rules_for` folds them: each call's conventions first, then
#: the model families (the decoder hub and transformers' mapping exclude each other).
PROFILES: tuple[Profile, ...] = (
    conventions.TORCH_MODULES,
    megatron_core.PROFILE,
    decoders.PROFILE,
    transformers_mapping.PROFILE,
    conventions.JAX_TREES,
    flax_nnx.PROFILE,
    maxtext.PROFILE,
    maxtext.RNG_PROFILE,
    paxml.PROFILE,
    paxml_gpt3.PROFILE,
)


def rules_for(context: LoadContext) -> Rules:
    """The rules for the load ``context`` describes: the defaults and ``CKPTSHIM_STRICT``, then
    what the live target knows (its facts), then each profile of :data:`PROFILES` that applies.

    - torch calls: torch modules stack layer lists on axis 0; Megatron-Core's stored names (its local-spec layer norms; the target's
      ``_extra_state`` kept) where the checkpoint's metadata names it as the producer; an exact root prefix on one side (Lightning's ``model.``) is set
      aside where the plan needs it; a decoder between two producers' names (Hugging Face,
      torchtitan, Meta's original Llama, Megatron-Core's GPTModel, torchtune, litgpt, GPT-NeoX's
      pipeline and Hugging Face GPT-NeoX) through the canonical model
      (heads from the model configs); else transformers' conversion mapping of each transformers model in the
      target, or, where the target is none, of the model the checkpoint's model config names;
    - JAX restores: Linen/NNX spellings (and flax < 0.9's ``raw_value``, for a state of that era); MaxText's scan axes (and its rng state kept from the
      target, by opt-in); PaxML ``Repeat`` stacks; the PaxML GPT-3 -> MaxText layout; a decoder
      between MaxText's names and another producer's (a Hugging Face Llama 3 / Qwen3) through
      the canonical model, by the model config. A JAX restore leaves every
      checkpoint key the target does not ask for on disk and reads no value it could check, so
      nothing is dropped as derivable.
    """
    facts = context.facts
    rules = DEFAULT_RULES.extend(strict=config.strict(), drop=facts.drop, synthesize=facts.synthesize,
                                 tied=facts.tied)
    for profile in PROFILES:
        if profile.applies(context):
            rules = rules.extend(**profile.rules(context))
    return rules
