"""GPT-NeoX: Hugging Face ``GPTNeoX*`` names <-> NeoX's sequential/pipeline names, and how NeoX
lays tensors out across tensor-parallel ranks.

Everything here is transcribed from GPT-NeoX itself (commit ea7aefd8; sources in
``docs/gpt-neox.md``) -- ``megatron/model/gpt2_model.py`` (pipeline layer order),
``megatron/model/transformer.py`` (which linears are column- or row-parallel, parallel residual),
``megatron/tokenizer/tokenizer.py`` (vocab padding) and ``tools/ckpts/convert_neox_to_hf.py`` /
``convert_hf_to_sequential.py`` (the HF names and the merge rule for each tensor).

Pipeline layer order for ``L`` transformer layers: ``0`` embedding (``word_embeddings``), ``1`` a
function (no state), ``2 .. L+1`` transformer layers, ``L+2`` a function, ``L+3`` the final norm
(``norm``), ``L+4`` the output layer (``final_linear``). A NeoX state dict names them
``sequential.<index>.<name>``; the pipeline checkpoint stores ``<name>`` in
``layer_<index>-model_<tp rank>-model_states.pt``.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Literal

from ckptshim.inventory import KeyPath
from ckptshim.rules.aliases import Alias

#: NeoX's MLP names since 2024 (``mlp.linear1``/``linear2``) and before (Megatron's, as HF uses).
MLP_RENAMES: tuple[tuple[str, str], ...] = (("dense_h_to_4h", "linear1"), ("dense_4h_to_h", "linear2"))

SEQUENTIAL = "sequential"
#: Pipeline index of transformer layer 0 (index 1 is a function without state).
FIRST_BLOCK = 2


def final_norm_index(num_layers: int) -> int:
    return num_layers + 3


def output_index(num_layers: int) -> int:
    return num_layers + 4


def state_layer_indices(num_layers: int) -> tuple[int, ...]:
    """The pipeline indices that own a ``layer_XX`` file (the others are plain functions)."""
    return (0, *range(FIRST_BLOCK, FIRST_BLOCK + num_layers), final_norm_index(num_layers),
            output_index(num_layers))


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


@dataclass(frozen=True)
class TPRule:
    """How one NeoX tensor is spread over tensor-parallel ranks.

    ``cat``: each rank holds a contiguous slice along ``axis`` (column-parallel outputs, fused
    ``query_key_value`` -- whose per-head interleaving makes a contiguous slice a set of whole
    heads -- vocab-parallel embeddings; row-parallel weights on axis 1). ``sum``: the row-parallel
    output biases; with GPT-J parallel residual each rank adds its own before the all-reduce, so
    the full bias is their sum (NeoX's converter sums them; its splitter divides by the degree).
    ``replicate``: norms and rotary buffers, equal on every rank.
    """

    kind: Literal["cat", "sum", "replicate"]
    axis: int = 0


_CAT0, _CAT1 = TPRule("cat", 0), TPRule("cat", 1)
_SUM, _REPLICATE = TPRule("sum"), TPRule("replicate")

_RULES: dict[KeyPath, TPRule] = {
    ("word_embeddings", "weight"): _CAT0,
    ("final_linear", "weight"): _CAT0,
    ("attention", "query_key_value", "weight"): _CAT0,
    ("attention", "query_key_value", "bias"): _CAT0,
    ("attention", "dense", "weight"): _CAT1,
    ("attention", "dense", "bias"): _SUM,
    ("attention", "rotary_emb", "inv_freq"): _REPLICATE,
    ("norm", "weight"): _REPLICATE,
    ("norm", "bias"): _REPLICATE,
}
for _ln in ("input_layernorm", "post_attention_layernorm"):
    _RULES[(_ln, "weight")] = _RULES[(_ln, "bias")] = _REPLICATE
for _hf, _neox in MLP_RENAMES:
    _column = _hf == "dense_h_to_4h"
    for _name in (_hf, _neox):
        _RULES[("mlp", _name, "weight")] = _CAT0 if _column else _CAT1
        _RULES[("mlp", _name, "bias")] = _CAT0 if _column else _SUM


def tp_rule(name: KeyPath) -> TPRule | None:
    """The rule for a tensor named ``name`` inside one pipeline layer (``sequential.<i>`` cut off)."""
    return _RULES.get(name)


#: Tensors whose first axis is the (padded) vocabulary.
VOCAB_NAMES: frozenset[KeyPath] = frozenset({
    ("word_embeddings", "weight"), ("final_linear", "weight"),
    ("gpt_neox", "embed_in", "weight"), ("embed_out", "weight"), ("lm_head", "weight")})


def vocab_role(key: KeyPath) -> str | None:
    """``"embed"`` or ``"head"`` for a vocab-sized tensor in either naming, else ``None``."""
    for size in (3, 2):
        if key[-size:] in VOCAB_NAMES:
            tail = key[-size:]
            return "embed" if tail[-2] in ("word_embeddings", "embed_in") else "head"
    return None


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
