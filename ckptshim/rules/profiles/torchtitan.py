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

The profile fires only when the key sets prove it: one side has Hugging Face names this table
knows and no torchtitan ones, the other torchtitan names and no Hugging Face ones
(:func:`applies`). Which of Llama or Qwen3 it is, the key sets say too (``q_norm``/``k_norm``
are Qwen3's), and a ``config.json`` naming another model type is refused.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckptshim.errors import PlanError
from ckptshim.inventory import Entry, Inventory, KeyPath, join_key
from ckptshim.ops import Op, Rename, Reorder
from ckptshim.rules import Paired, Rules
from ckptshim.rules.context import LoadContext
from ckptshim.rules.prefixes import strip_wrappers

HF_LAYERS: KeyPath = ("model", "layers")
TT_LAYERS: KeyPath = ("layers",)
#: Per layer: Hugging Face name under ``model.layers.{i}`` -> torchtitan name under ``layers.{i}``
#: (``from_hf_map`` of both adapters; Qwen3's adds ``q_norm``/``k_norm``).
LAYER_ROWS: tuple[tuple[KeyPath, KeyPath], ...] = (
    (("self_attn", "q_proj", "weight"), ("attention", "qkv_linear", "wq", "weight")),
    (("self_attn", "k_proj", "weight"), ("attention", "qkv_linear", "wk", "weight")),
    (("self_attn", "v_proj", "weight"), ("attention", "qkv_linear", "wv", "weight")),
    (("self_attn", "o_proj", "weight"), ("attention", "wo", "weight")),
    (("self_attn", "q_norm", "weight"), ("attention", "q_norm", "weight")),
    (("self_attn", "k_norm", "weight"), ("attention", "k_norm", "weight")),
    (("mlp", "gate_proj", "weight"), ("feed_forward", "w1", "weight")),
    (("mlp", "up_proj", "weight"), ("feed_forward", "w3", "weight")),
    (("mlp", "down_proj", "weight"), ("feed_forward", "w2", "weight")),
    (("input_layernorm", "weight"), ("attention_norm", "weight")),
    (("post_attention_layernorm", "weight"), ("ffn_norm", "weight")),
)
#: Outside the layers.
TOP_ROWS: tuple[tuple[KeyPath, KeyPath], ...] = (
    (("model", "embed_tokens", "weight"), ("tok_embeddings", "weight")),
    (("model", "norm", "weight"), ("norm", "weight")),
    (("lm_head", "weight"), ("lm_head", "weight")),
)
#: Qwen3's per-head norms: their presence on both sides is what marks a Qwen3.
QK_NORMS = frozenset({("attention", "q_norm", "weight"), ("attention", "k_norm", "weight")})
#: The rows Llama permutes for its rotary embedding, with the ``config.json`` entry giving their
#: head count (``n_heads``, ``n_kv_heads`` in ``Llama3StateDictAdapter.from_hf``).
ROPE_HEADS: Mapping[KeyPath, str] = {("attention", "qkv_linear", "wq", "weight"): "num_attention_heads",
                                     ("attention", "qkv_linear", "wk", "weight"): "num_key_value_heads"}
#: ``config.json``'s ``model_type`` -> whether torchtitan's model of it permutes wq/wk.
FAMILIES: Mapping[str, bool] = {"llama": True, "qwen3": False}

_LAYER_TO_TT = dict(LAYER_ROWS)
_LAYER_TO_HF = {tt: hf for hf, tt in LAYER_ROWS}
_TOP_TO_TT = dict(TOP_ROWS)
_TOP_TO_HF = {tt: hf for hf, tt in TOP_ROWS}
_INDEX = re.compile(r"\d+")


def torchtitan_name(key: KeyPath) -> KeyPath | None:
    """The torchtitan name of a Hugging Face key (wrapper components left out), or ``None``."""
    key = strip_wrappers(key)
    if key[:2] == HF_LAYERS and len(key) > 3 and _INDEX.fullmatch(key[2]) and key[3:] in _LAYER_TO_TT:
        return TT_LAYERS + (key[2],) + _LAYER_TO_TT[key[3:]]
    return _TOP_TO_TT.get(key)


def hf_name(key: KeyPath) -> KeyPath | None:
    """The Hugging Face name of a torchtitan key (wrapper components left out), or ``None``."""
    key = strip_wrappers(key)
    if key[:1] == TT_LAYERS and len(key) > 2 and _INDEX.fullmatch(key[1]) and key[2:] in _LAYER_TO_HF:
        return HF_LAYERS + (key[1],) + _LAYER_TO_HF[key[2:]]
    return _TOP_TO_HF.get(key)


def _marks(inventory: Inventory) -> tuple[bool, bool]:
    """Whether ``inventory`` has Hugging Face names the table renames, and torchtitan ones
    (``lm_head.weight``, the same on both sides, marks neither)."""
    hf = tt = False
    for key in inventory:
        named = torchtitan_name(key)
        hf = hf or (named is not None and named != strip_wrappers(key))
        named = hf_name(key)
        tt = tt or (named is not None and named != strip_wrappers(key))
        if hf and tt:
            break
    return hf, tt


#: Keys looked up (not searched for) before any scan, so that loads of other models pay a few
#: dict lookups for this profile: the embeddings, and layer 0's query, on either side.
MARKS: tuple[KeyPath, ...] = (TOP_ROWS[0][0], TOP_ROWS[0][1], HF_LAYERS + ("0",) + LAYER_ROWS[0][0],
                              TT_LAYERS + ("0",) + LAYER_ROWS[0][1])


def applies(source: Inventory, target: Inventory) -> bool:
    """One side holds Hugging Face Llama/Qwen3 names and no torchtitan ones, the other torchtitan
    names and no Hugging Face ones; a side with both (or neither) is left to the name matcher."""
    if not any(mark in side for mark in MARKS for side in (source, target)):
        return False
    sides = _marks(source), _marks(target)
    return sides in (((True, False), (False, True)), ((False, True), (True, False)))


@dataclass(frozen=True, eq=False)  # holds the config dict
class TorchtitanLayout:
    """The :class:`~ckptshim.rules.Layout` pairing Hugging Face and torchtitan keys.

    ``config`` is the Hugging Face folder's ``config.json`` (``None`` when the load has none);
    ``origin`` names it in messages.
    """

    config: Mapping[str, Any] | None
    origin: str

    def pair(self, source: Inventory, target: Inventory, rules: Rules) -> Paired:
        forward = _marks(source)[0]  # Hugging Face names into torchtitan's
        hf, tt = (source, target) if forward else (target, source)
        hf_keys = _by_name(hf, torchtitan_name)
        tt_keys = _by_name(tt, strip_wrappers)
        permuted = self._permutes(hf_keys, tt_keys)
        ops: list[Op] = []
        missing: dict[KeyPath, str] = {}
        for name, tt_entry in tt_keys.items():
            hf_entry = hf_keys.get(name)
            if hf_entry is None:
                continue  # left to the name matcher, which reports it
            layer_row = name[2:] if name[:1] == TT_LAYERS else ()
            if permuted and layer_row in ROPE_HEADS:
                op = self._reorder(hf_entry, tt_entry, ROPE_HEADS[layer_row])
                if isinstance(op, str):
                    missing[(tt_entry if forward else hf_entry).key] = op
                    continue
            else:
                op = Rename(hf_entry.key, tt_entry.key)
            ops.append(op if forward else op.inverse())
        family = "Llama (wq/wk permuted per head)" if permuted else "Qwen3"
        return Paired(tuple(ops), missing, (f"Hugging Face {family} <-> torchtitan names",))

    def _permutes(self, hf_keys: Mapping[KeyPath, Entry], tt_keys: Mapping[KeyPath, Entry]) -> bool:
        """Whether this is a Llama (wq/wk permuted) or a Qwen3, as the key sets say; a
        ``config.json`` naming another model, or the other of the two, is refused."""
        norms = {side: any(name[2:] in QK_NORMS for name in keys if name[:1] == TT_LAYERS)
                 for side, keys in (("checkpoint", hf_keys), ("torchtitan", tt_keys))}
        if norms["checkpoint"] != norms["torchtitan"]:
            have = [side for side, found in norms.items() if found]
            raise PlanError(f"only the {have[0]} side has Qwen3's attention.q_norm/k_norm; torchtitan's "
                            "Llama and Qwen3 models differ in them, so these are different models. Build the "
                            "torchtitan model of the checkpoint's family.")
        qwen3 = norms["checkpoint"]
        model_type = self.config.get("model_type") if self.config is not None else None
        if model_type is not None:
            if model_type not in FAMILIES:
                raise PlanError(f"{self.origin} names model_type {model_type!r:.60}; ckptshim maps Hugging Face "
                                f"names onto torchtitan's for {' and '.join(FAMILIES)} only (torchtitan 0.3.0's "
                                "llama3 and qwen3 adapters). Convert it with torchtitan's own adapter.")
            if (model_type == "qwen3") != qwen3:
                raise PlanError(f"{self.origin} names model_type {model_type!r}, but the keys are "
                                f"{'Qwen3' if qwen3 else 'Llama'}'s (q_norm/k_norm {'present' if qwen3 else 'absent'});"
                                " the config is not this checkpoint's. Keep the folder's own config.json.")
        return not qwen3

    def _reorder(self, hf_entry: Entry, tt_entry: Entry, heads_key: str) -> Reorder | str:
        """Hugging Face's halves -> torchtitan's interleaved pairs for one wq/wk; where no
        config says the head count, the hint for the missing key instead."""
        name = join_key(hf_entry.key)
        if self.config is None:
            return (f"torchtitan's Llama takes {name} permuted per head for its rotary embedding, and the head "
                    "count comes from the Hugging Face folder's config.json, which this load has none of; load "
                    "the folder itself (dcp.load(..., checkpoint_id=<folder>)) or keep config.json beside it")
        query_heads = _positive(self.config, "num_attention_heads", self.origin)
        heads = _positive(self.config, heads_key, self.origin, query_heads)
        fallback = None if self.config.get("head_dim") is not None else \
            _positive(self.config, "hidden_size", self.origin) // query_heads  # transformers' own default
        head_dim = _positive(self.config, "head_dim", self.origin, fallback)
        rows = hf_entry.shape[0] if hf_entry.shape else 0
        if rows != heads * head_dim or head_dim % 2 or hf_entry.shape != tt_entry.shape:
            raise PlanError(f"{name} {list(hf_entry.shape)}: {self.origin} says {heads} heads ({heads_key}) of "
                            f"head_dim {head_dim}, which do not divide its {rows} rows into rotary halves (or the "
                            f"torchtitan model's {join_key(tt_entry.key)} is {list(tt_entry.shape)}); the config is "
                            "not this checkpoint's. Keep the folder's own config.json.")
        return Reorder(hf_entry.key, tt_entry.key, 0, (heads, 2, head_dim // 2), (0, 2, 1))


def _by_name(inventory: Inventory, name) -> dict[KeyPath, Entry]:
    """Each entry by its torchtitan name; two entries of one name are left to the planner."""
    found: dict[KeyPath, Entry] = {}
    clashes: set[KeyPath] = set()
    for key, entry in inventory.items():
        named = name(key)
        if named is not None and found.setdefault(named, entry) is not entry:
            clashes.add(named)
    for named in clashes:
        del found[named]
    return found


def _positive(config: Mapping[str, Any], key: str, origin: str, default: int | None = None) -> int:
    """``config[key]`` (``default`` where it is absent or null), which must be a positive whole number."""
    value = config.get(key)
    if value is None:
        value = default
    if type(value) is not int or value < 1:
        raise PlanError(f"{origin}: {key} is {value!r:.40}, not a positive whole number; torchtitan's converter "
                        "needs it to permute wq/wk per head. Keep the folder's own config.json.")
    return value


@dataclass(frozen=True)
class TorchtitanProfile:
    """Hugging Face Llama/Qwen3 names <-> torchtitan's, when one side is each (heads from the
    Hugging Face folder's config.json)."""

    name: str = "torchtitan"

    def applies(self, context: LoadContext) -> bool:
        return context.backend == "torch" and applies(context.source, context.target)

    def rules(self, context: LoadContext) -> Mapping[str, Any]:
        return {"layouts": (TorchtitanLayout(context.model_config, "the Hugging Face folder's config.json"),)}


PROFILE = TorchtitanProfile()
