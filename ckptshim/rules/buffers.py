"""Buffers that frameworks can always recompute, so a checkpoint may carry them or not.

Each entry is a key-path *suffix*. Hugging Face made GPT-NeoX ``attention.bias`` (the causal
mask) and ``attention.masked_bias`` non-persistent in transformers 4.31 and
``rotary_emb.inv_freq`` in 4.35; ``position_ids`` (BERT-style models) and ``freqs_cis``
(Llama/torchtitan) are the same kind of derived constant.
"""

from __future__ import annotations

from ckptshim.inventory import KeyPath

DERIVABLE_BUFFERS: tuple[KeyPath, ...] = (
    ("inv_freq",),
    ("attention", "bias"),
    ("attention", "masked_bias"),
    ("masked_bias",),
    ("position_ids",),
    ("freqs_cis",),
)


def derivable_rule(key: KeyPath, suffixes: tuple[KeyPath, ...] = DERIVABLE_BUFFERS) -> str | None:
    """The name of the derivable-buffer rule ``key`` falls under (e.g. ``"attention.bias"``)."""
    for suffix in suffixes:
        if key[-len(suffix):] == suffix:
            return ".".join(suffix)
    return None
