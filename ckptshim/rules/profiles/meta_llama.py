"""Meta's original Llama layout: the names of llama-models' ``Transformer`` (``consolidated.NN.pth``
beside ``params.json``), onto the canonical decoder (:mod:`ckptshim.rules.decoder`).

Its rotary embedding takes each head's pairs interleaved, so a load into Hugging Face's names
permutes ``wq``/``wk`` per head with ``params.json``'s ``n_heads``/``n_kv_heads``, as
transformers' ``convert_llama_weights_to_hf.py`` does (``permute``); into torchtitan's, which
interleaves alike, each is a rename. The model-parallel shards are merged by the format
(:mod:`ckptshim.formats.meta_llama`), as llama-models' ``reshard_mp`` merges them.
"""

from __future__ import annotations

from ckptshim.rules.decoder import PAIRS, Naming

NAMES = Naming(
    "Meta Llama", ("layers",),
    rows={"q": (("attention", "wq", "weight"),), "k": (("attention", "wk", "weight"),),
          "v": (("attention", "wv", "weight"),), "o": (("attention", "wo", "weight"),),
          "gate": (("feed_forward", "w1", "weight"),), "up": (("feed_forward", "w3", "weight"),),
          "down": (("feed_forward", "w2", "weight"),), "attn_norm": (("attention_norm", "weight"),),
          "mlp_norm": (("ffn_norm", "weight"),)},
    top={"embed": ("tok_embeddings", "weight"), "norm": ("norm", "weight"), "head": ("output", "weight")},
    rotary=PAIRS)
