"""GPT-NeoX: Hugging Face ``GPTNeoX*`` names <-> NeoX's sequential/pipeline names.

Transcribed from GPT-NeoX's ``tools/ckpts/convert_neox_to_hf.py`` / ``convert_hf_to_sequential.py``
(commit ea7aefd8; sources in ``docs/gpt-neox.md``); the pipeline order and the tensor-parallel
spreads the names are built on are NeoX's own layout (:mod:`ckptshim.layouts.neox`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from ckptshim.inventory import KeyPath
from ckptshim.layouts.neox import FIRST_BLOCK, MLP_RENAMES, SEQUENTIAL, final_norm_index, output_index
from ckptshim.rules.aliases import Alias


def aliases(num_layers: int, head: str = "embed_out") -> tuple[Alias, ...]:
    """HF GPT-NeoX names (canonical) <-> NeoX ``sequential.<i>`` names, for ``num_layers`` layers.

    ``head`` is what the HF side calls the output layer: ``embed_out`` in every checkpoint and
    in transformers 4 models, ``lm_head`` in transformers 5 models (which rename on load).
    """
    seq = (SEQUENTIAL,)
    out = [Alias(("gpt_neox", "embed_in"), seq + ("0", "word_embeddings"), "prefix"),
           Alias(("gpt_neox", "final_layer_norm"), seq + (str(final_norm_index(num_layers)), "norm"), "prefix"),
           Alias((head,), seq + (str(output_index(num_layers)), "final_linear"), "prefix")]
    out += [Alias(("gpt_neox", "layers", str(i)), seq + (str(i + FIRST_BLOCK),), "prefix")
            for i in range(num_layers)]
    out += [Alias(("mlp", hf), ("mlp", neox), "anywhere") for hf, neox in MLP_RENAMES]
    return tuple(out)


#: Keys that mark each naming; looked up, not searched for, so that loads of other models pay
#: two dict lookups for this profile.
HF_MARK: KeyPath = ("gpt_neox", "embed_in", "weight")
NEOX_MARK: KeyPath = (SEQUENTIAL, "0", "word_embeddings", "weight")


def hf_num_layers(keys: Iterable[KeyPath]) -> int:
    """How many ``gpt_neox.layers.<i>`` an HF GPT-NeoX key set has."""
    return len({key[2] for key in keys if key[:2] == ("gpt_neox", "layers") and len(key) > 2})


def aliases_between(source: Collection[KeyPath], target: Collection[KeyPath]) -> tuple[Alias, ...]:
    """The NeoX <-> HF aliases when one side is a NeoX sequential state dict and the other an HF
    GPT-NeoX model (either way round), the MLP renames when both are NeoX; nothing otherwise,
    so other loads are unaffected."""
    if NEOX_MARK in source and NEOX_MARK in target:  # NeoX into NeoX: old and new MLP names
        return tuple(Alias(("mlp", hf), ("mlp", new), "anywhere") for hf, new in MLP_RENAMES)
    for neox_side, hf_side in ((source, target), (target, source)):
        if NEOX_MARK in neox_side and HF_MARK in hf_side:
            head = "lm_head" if ("lm_head", "weight") in hf_side else "embed_out"
            return aliases(hf_num_layers(hf_side), head)
    return ()


def aliases_into_neox(source: Collection[KeyPath]) -> tuple[Alias, ...]:
    """The aliases for loading ``source`` into NeoX layers that may be only one pipeline stage
    (so the target's keys cannot say which naming it is): HF names if ``source`` is an HF
    GPT-NeoX checkpoint, else the MLP renames between NeoX's old and new names."""
    if HF_MARK in source:
        head = "lm_head" if ("lm_head", "weight") in source else "embed_out"
        return aliases(hf_num_layers(source), head)
    return tuple(Alias(("mlp", hf), ("mlp", new), "anywhere") for hf, new in MLP_RENAMES)


def to_neox(key: KeyPath, rules: Iterable[Alias]) -> KeyPath:
    """``key`` in NeoX spelling under ``rules`` (from :func:`aliases`); NeoX keys come back as they are."""
    for alias in rules:
        n = len(alias.canonical)
        if alias.where == "prefix" and key[:n] == alias.canonical:
            return alias.other + key[n:]
    return key
