"""litgpt 0.5's names for the canonical decoder (:mod:`ckptshim.rules.decoder`): what its ``GPT``
holds for a Llama-style config and ``litgpt finetune`` saves (``lit_model.pth``, ``{"model":
state_dict}`` through Lightning Fabric), as ``convert_lit_checkpoint`` maps them onto Hugging
Face's (``copy_weights_llama``).

Its attention keeps the query, key and value rows in one ``attn.qkv`` as ``[all q; all k; all
v]`` (not by query group), which the converter cuts by their sizes; its rotary embedding takes
each head's two halves, as Hugging Face's does, so nothing is permuted. ``mlp.fc_1`` is the gate,
``fc_2`` the up projection. The head counts are ``model_config.yaml``'s (``n_head``,
``n_query_groups``, ``head_size``), which litgpt saves beside the weights.
"""

from __future__ import annotations

from ckptshim.rules.decoder import HALVES, Fused, Naming

NAMES = Naming(
    "litgpt", ("transformer", "h"),
    rows={"qkv": (("attn", "qkv", "weight"),), "o": (("attn", "proj", "weight"),),
          "gate": (("mlp", "fc_1", "weight"),), "up": (("mlp", "fc_2", "weight"),),
          "down": (("mlp", "proj", "weight"),), "attn_norm": (("norm_1", "weight"),),
          "mlp_norm": (("norm_2", "weight"),)},
    top={"embed": ("transformer", "wte", "weight"), "norm": ("transformer", "ln_f", "weight"),
         "head": ("lm_head", "weight")},
    rotary=HALVES, fused={"qkv": Fused(("q", "k", "v"), by_group=False)})
