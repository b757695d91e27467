"""litgpt's names for the canonical decoder (:mod:`ckptshim.rules.decoder`): what its ``GPT``
holds for a Llama-style config and ``litgpt finetune`` saves (``lit_model.pth``, ``{"model":
state_dict}`` through Lightning Fabric), as ``convert_lit_checkpoint`` maps them onto Hugging
Face's (``copy_weights_llama``). ``mlp.fc_1`` is the gate, ``fc_2`` the up projection; the
rotary embedding takes each head's two halves, as Hugging Face's does, so nothing is permuted.
The head counts are ``model_config.yaml``'s (``n_head``, ``n_query_groups``, ``head_size``),
which litgpt saves beside the weights.

The attention's query, key and value rows are one array, in one of two layouts, and its name says
which (litgpt itself tells them apart so, in ``CausalSelfAttention._load_from_state_dict``):

- :data:`NAMES`, litgpt 0.5.5 on: ``attn.qkv``, ``[all q; all k; all v]``, which the converter
  cuts by their sizes;
- :data:`LEGACY`, lit-gpt's layout up to litgpt 0.5.4: ``attn.attn``, by query group (each
  group's query heads, then its key and value head), which 0.5.4's ``forward`` views as
  ``(groups, q_per_kv + 2, head_size)`` and its converter's ``qkv_split`` cuts group by group;
  litgpt 0.5.5 on still loads it (``qkv_reassemble``). Cutting it needs the head counts, and two
  sides' counts that disagree for the same shapes are refused.
"""

from __future__ import annotations

from ckptshim.rules.decoder import HALVES, Fused, Naming

_ROWS = {"o": (("attn", "proj", "weight"),), "gate": (("mlp", "fc_1", "weight"),), "up": (("mlp", "fc_2", "weight"),),
         "down": (("mlp", "proj", "weight"),), "attn_norm": (("norm_1", "weight"),),
         "mlp_norm": (("norm_2", "weight"),)}
_TOP = {"embed": ("transformer", "wte", "weight"), "norm": ("transformer", "ln_f", "weight"),
        "head": ("lm_head", "weight")}

NAMES = Naming("litgpt", ("transformer", "h"), {"qkv": (("attn", "qkv", "weight"),), **_ROWS}, _TOP, HALVES,
               fused={"qkv": Fused(("q", "k", "v"), by_group=False)})
LEGACY = Naming("litgpt <= 0.5.4 (attn.attn)", ("transformer", "h"), {"qkv": (("attn", "attn", "weight"),), **_ROWS},
                _TOP, HALVES, fused={"qkv": Fused(("q", "k", "v"), by_group=True)})
