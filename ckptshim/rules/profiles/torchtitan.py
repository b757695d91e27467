"""Hugging Face Llama-3 and Qwen3 names <-> torchtitan 0.3.0's, both ways.

Transcribed from torchtitan 0.3.0's state-dict adapters, ``models/llama3/state_dict_adapter.py``
and ``models/qwen3/state_dict_adapter.py`` (their ``from_hf_map``; ``docs/torchtitan.md`` cites
each row): every tensor is renamed, none transposed; for Llama, torchtitan's rotary embedding
(``ComplexRoPE``) takes each head's rotary pairs interleaved, so ``wq`` and ``wk`` are permuted
per head from Hugging Face's two halves (``_reverse_permute``: rows as ``[heads, 2, head_dim/2]``
-> ``[heads, head_dim/2, 2]``), a :class:`~ckptshim.ops.Reorder` of axis 0; Qwen3's
(``CosSinRoPE``) keeps the halves, so its rows are renames only. The head counts come from the
Hugging Face folder's ``config.json`` (``num_attention_heads``, ``num_key_value_heads``), as
torchtitan's converter takes them from its own model config; without one, a Llama's ``wq``/``wk``
stay missing with a hint, never permuted on a guess. bf16 files into fp32 parameters are the
planner's casts; ``rotary_emb.inv_freq``, which torchtitan's map drops, is left to the planner's
derivable-buffer rule (dropped only where its value checks out, otherwise unexpected).

These are torchtitan's names for the canonical decoder (:mod:`ckptshim.rules.decoder`): the hub
(:mod:`ckptshim.rules.profiles.decoders`) composes a load between them and any other producer's.
A load with Hugging Face names fires only when the key sets prove it: one side has Hugging Face names this table
knows and no torchtitan ones, the other torchtitan names and no Hugging Face ones
(:func:`applies`). Which of Llama or Qwen3 it is, the key sets say too (``q_norm``/``k_norm``
are Qwen3's), and a ``config.json`` naming another model type is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckptshim.errors import PlanError
from ckptshim.inventory import Inventory, KeyPath
from ckptshim.rules.decoder import HALVES, HUGGING_FACE, PAIRS, Naming

_ROWS = {"q": (("attention", "qkv_linear", "wq", "weight"),), "k": (("attention", "qkv_linear", "wk", "weight"),),
         "v": (("attention", "qkv_linear", "wv", "weight"),), "o": (("attention", "wo", "weight"),),
         "gate": (("feed_forward", "w1", "weight"),), "up": (("feed_forward", "w3", "weight"),),
         "down": (("feed_forward", "w2", "weight"),), "attn_norm": (("attention_norm", "weight"),),
         "mlp_norm": (("ffn_norm", "weight"),)}
_TOP = {"embed": ("tok_embeddings", "weight"), "norm": ("norm", "weight"), "head": ("lm_head", "weight")}
#: torchtitan's Llama (``from_hf_map`` of ``Llama3StateDictAdapter``): wq/wk as interleaved pairs.
NAMES = Naming("torchtitan", ("layers",), _ROWS, _TOP, PAIRS)
#: torchtitan's Qwen3 (``Qwen3StateDictAdapter``): its per-head norms, and the rotary halves kept.
QWEN3 = Naming("torchtitan", ("layers",), {**_ROWS, "q_norm": (("attention", "q_norm", "weight"),),
                                          "k_norm": (("attention", "k_norm", "weight"),)}, _TOP, HALVES)
#: ``config.json``'s ``model_type`` -> whether torchtitan's model of it permutes wq/wk.
FAMILIES: Mapping[str, bool] = {"llama": True, "qwen3": False}
#: What a torchtitan load that needs head counts says where it has no config (``{source}``: the
#: key laid out per head).
NO_CONFIG = ("torchtitan's Llama takes {source} permuted per head for its rotary embedding, and the head count "
             "comes from the Hugging Face folder's config.json, which this load has none of; load the folder "
             "itself (dcp.load(..., checkpoint_id=<folder>)) or keep config.json beside it")


def torchtitan_name(key: KeyPath) -> KeyPath | None:
    """The torchtitan name of a Hugging Face Llama/Qwen3 key (wrapper components left out), or
    ``None``."""
    unit = HUGGING_FACE.locate(key)
    return QWEN3.key(unit) if unit is not None and (unit[0] is None or unit[1] in QWEN3.rows) else None


def applies(source: Inventory, target: Inventory) -> bool:
    """One side holds Hugging Face Llama/Qwen3 names and no torchtitan ones, the other torchtitan
    names and no Hugging Face ones; a side with both (or neither) is left to the name matcher."""
    def side(inventory: Inventory) -> tuple[bool, bool]:
        return HUGGING_FACE.marks(inventory), NAMES.marks(inventory)

    return {side(source), side(target)} == {(True, False), (False, True)}


def variants(source_names: Naming, target_names: Naming, source: Inventory, target: Inventory,
             config: Mapping[str, Any] | None) -> tuple[Naming, Naming]:
    """The two sides' names, torchtitan's as its Llama (wq/wk permuted) or its Qwen3, as the key
    sets say; opposite Hugging Face names, a ``config.json`` naming another model, or the other
    of the two, is refused."""
    if NAMES not in (source_names, target_names):
        return source_names, target_names
    qwen3 = _qk_norms(source, source_names) or _qk_norms(target, target_names)
    if HUGGING_FACE in (source_names, target_names):
        norms = {"checkpoint": _qk_norms(source, source_names), "torchtitan": _qk_norms(target, target_names)}
        if source_names is NAMES:
            norms = {"checkpoint": norms["torchtitan"], "torchtitan": norms["checkpoint"]}
        if norms["checkpoint"] != norms["torchtitan"]:
            have = [side for side, found in norms.items() if found]
            raise PlanError(f"only the {have[0]} side has Qwen3's attention.q_norm/k_norm; torchtitan's "
                            "Llama and Qwen3 models differ in them, so these are different models. Build the "
                            "torchtitan model of the checkpoint's family.")
        model_type = config.get("model_type") if config is not None else None
        origin = "the Hugging Face folder's config.json"
        if model_type is not None:
            if model_type not in FAMILIES:
                raise PlanError(f"{origin} names model_type {model_type!r:.60}; ckptshim maps Hugging Face "
                                f"names onto torchtitan's for {' and '.join(FAMILIES)} only (torchtitan 0.3.0's "
                                "llama3 and qwen3 adapters). Convert it with torchtitan's own adapter.")
            if (model_type == "qwen3") != qwen3:
                raise PlanError(f"{origin} names model_type {model_type!r}, but the keys are "
                                f"{'Qwen3' if qwen3 else 'Llama'}'s (q_norm/k_norm {'present' if qwen3 else 'absent'});"
                                " the config is not this checkpoint's. Keep the folder's own config.json.")
    titan = QWEN3 if qwen3 else NAMES
    return (titan if source_names is NAMES else source_names), (titan if target_names is NAMES else target_names)


def _qk_norms(inventory: Inventory, names: Naming) -> bool:
    """Whether ``inventory`` holds per-head query/key norms under ``names`` (Qwen3's)."""
    return any(unit[1] in ("q_norm", "k_norm") for unit in QWEN3.units(inventory)) if names is NAMES else \
        any(unit[1] in ("q_norm", "k_norm") for unit in names.units(inventory))
