"""Buffers that frameworks can always recompute, so a checkpoint may carry them or not.

Each entry is a key-path *suffix*. Hugging Face made GPT-NeoX ``attention.bias`` (the causal
mask) and ``attention.masked_bias`` non-persistent in transformers 4.31 and
``rotary_emb.inv_freq`` in 4.35; ``position_ids`` (BERT-style models) and ``freqs_cis``
(Llama/torchtitan) are the same kind of derived constant.

A name proves nothing: ``attention.bias`` is also the trained bias of a linear layer named
``attention``. So each rule also says what its buffer *holds* (:data:`HOLDS`), and a checkpoint's
copy is dropped only once its value is checked to be that (see ``DropIfDerived`` in
:mod:`ckptshim.ops`).
"""

from __future__ import annotations

from collections.abc import Mapping

from ckptshim.inventory import KeyPath

DERIVABLE_BUFFERS: tuple[KeyPath, ...] = (
    ("inv_freq",),
    ("attention", "bias"),
    ("attention", "masked_bias"),
    ("masked_bias",),
    ("position_ids",),
    ("freqs_cis",),
)

#: What a buffer holds when it follows from its shape: a lower-triangular mask of ones over its
#: last two (equal) axes, the same for every leading index (GPT-2/GPT-NeoX/GPT-J ``bias``).
CAUSAL_MASK = "causal mask"
#: ``0, 1, ..., n-1`` along the last axis, the same for every leading index.
POSITIONS = "positions"
#: One number, the constant the model families that keep the buffer use (:data:`MASKED_BIAS_VALUES`).
FAMILY_CONSTANT = "family constant"
#: A value computed from settings the buffer does not carry (the rotary base, the context
#: length): only the target's own recomputed buffer of the same rule can say what it must be.
TARGETS_OWN = "the target's own value"

#: Rule name -> what its buffer holds (one of the four kinds above).
HOLDS: Mapping[str, str] = {
    "inv_freq": TARGETS_OWN,
    "attention.bias": CAUSAL_MASK,
    "attention.masked_bias": FAMILY_CONSTANT,
    "masked_bias": FAMILY_CONSTANT,
    "position_ids": POSITIONS,
    "freqs_cis": TARGETS_OWN,
}

#: ``masked_bias`` as the families that keep one set it: GPT-NeoX, GPT-J and CodeGen -1e9,
#: GPT-2 -1e4 (each as stored in the buffer's own dtype).
MASKED_BIAS_VALUES: tuple[float, ...] = (-1e9, -1e4)


def derivable_rule(key: KeyPath, suffixes: tuple[KeyPath, ...] = DERIVABLE_BUFFERS) -> str | None:
    """The name of the derivable-buffer rule ``key`` falls under (e.g. ``"attention.bias"``)."""
    for suffix in suffixes:
        if key[-len(suffix):] == suffix:
            return ".".join(suffix)
    return None
