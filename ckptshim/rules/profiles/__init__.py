"""Named model profiles, and :func:`rules_for`: the one place a load's rules are chosen.

Where a framework already publishes its own rename table (transformers' checkpoint conversion
mapping), the profile is read from it at load time rather than copied here, so it never goes
stale; see :mod:`.transformers_mapping`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckptshim import config
from ckptshim.inventory import Inventory
from ckptshim.rules import DEFAULT_RULES, NO_FACTS, Rules, TargetFacts
from ckptshim.rules.flax_names import LINEN_NNX
from ckptshim.rules.layers import TORCH_SCAN_AXES
from ckptshim.rules.profiles import (hf_maxtext, maxtext, megatron_core, neox, paxml, paxml_gpt3, torchtitan,
                                     transformers_mapping)
from ckptshim.rules.roots import root_prefix

#: What :func:`rules_for` plans for: torch state dicts (``.`` keys) or JAX pytrees (``/`` keys).
BACKENDS = ("torch", "jax")


def rules_for(source: Inventory, target: Inventory, backend: str, facts: TargetFacts = NO_FACTS,
              model_config: Mapping[str, Any] | None = None, *, producer: str | None = None) -> Rules:
    """The rules for loading ``source`` into ``target`` through ``backend``'s load calls.

    The defaults (wrapper prefixes, layer lists, derivable buffers) and ``CKPTSHIM_STRICT``;
    then the target's own ``facts``; then each profile whose marks the two inventories carry,
    or that the checkpoint's own metadata names as its ``producer`` (the loading layer reads it):

    - ``"torch"``: torch modules stack layer lists on axis 0; Megatron-Core's stored names (its
      local-spec layer norms; the target's ``_extra_state`` kept) when ``producer`` is
      :data:`megatron_core.PRODUCER <ckptshim.rules.profiles.megatron_core.PRODUCER>`; an exact root prefix on one side
      (Lightning's ``model.``) is set aside; transformers' conversion mapping of each
      transformers model in the target, or, where the target is none, of the model the
      checkpoint's own ``model_config`` (its ``config.json``) names; GPT-NeoX's pipeline names
      <-> its Hugging Face names, when one side is each; Hugging Face Llama/Qwen3 names <->
      torchtitan's, when one side is each (heads from ``model_config``);
    - ``"jax"``: Linen/NNX spellings; MaxText's scan axes; PaxML ``Repeat`` stacks; the PaxML
      GPT-3 -> MaxText layout; a Hugging Face Llama 3 / Qwen3 <-> MaxText, by the checkpoint's
      (or, going back, the Hugging Face side's) ``model_config``. A JAX restore leaves every
      checkpoint key the target does not ask for on disk and reads no value it could check, so
      nothing is dropped as derivable.
    """
    rules = DEFAULT_RULES.extend(strict=config.strict(), drop=facts.drop, synthesize=facts.synthesize,
                                 aliases=facts.aliases, tied=facts.tied)
    if backend == "torch":
        rules = rules.extend(scan_axes=TORCH_SCAN_AXES, aliases=neox.aliases_between(source, target))
        if producer == megatron_core.PRODUCER:
            rules = rules.extend(aliases=megatron_core.LAYER_NORMS, synthesize=megatron_core.kept(target))
        root = root_prefix(source, target)
        if root is not None:
            return rules.extend(layouts=(root,))
        if torchtitan.applies(source, target):
            return rules.extend(layouts=(torchtitan.TorchtitanLayout(model_config, "the Hugging Face folder's config.json"),))
        conversions = facts.conversions
        if not conversions and model_config is not None:
            found = transformers_mapping.from_config(model_config, f"config.json of {source.source}")
            conversions = (found,) if found is not None else ()
        return rules.extend(layouts=tuple(map(transformers_mapping.ConversionLayout, conversions)))
    if backend != "jax":
        raise ValueError(f"no rules for backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    rules = rules.extend(aliases=LINEN_NNX, drop_derivable=False)
    if maxtext.applies(source, target):
        rules = rules.extend(scan_axes=maxtext.SCAN_AXES)
    if paxml.applies(source, target):
        rules = rules.extend(aliases=paxml.ALIASES, scan_axes=paxml.SCAN_AXES)
    if paxml_gpt3.applies(source, target):
        rules = rules.extend(layouts=(paxml_gpt3.GPT3_LAYOUT,))
    for reverse, (hf, mt) in ((False, (source, target)), (True, (target, source))):
        if hf_maxtext.applies(hf, mt):
            layout = hf_maxtext.HfMaxTextLayout(model_config, f"config.json of {hf.source}", reverse)
            rules = rules.extend(layouts=(layout,))
    return rules
