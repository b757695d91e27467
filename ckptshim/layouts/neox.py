"""GPT-NeoX's own layout: its pipeline layer order, and how it spreads tensors over
tensor-parallel ranks -- what a NeoX pipeline checkpoint's files hold, for the format that reads
them (:mod:`ckptshim.formats.deepspeed_pipeline`), the merges and splits
(:mod:`ckptshim.formats.tensor_parallel`) and NeoX's names on the decoder hub
(:mod:`ckptshim.rules.profiles.neox`) alike.

Transcribed from GPT-NeoX itself (commit ea7aefd8; sources in ``docs/gpt-neox.md``) --
``megatron/model/gpt2_model.py`` (pipeline layer order), ``megatron/model/transformer.py``
(which linears are column- or row-parallel, parallel residual) and
``megatron/tokenizer/tokenizer.py`` (vocab padding).

Pipeline layer order for ``L`` transformer layers: ``0`` embedding (``word_embeddings``), ``1`` a
function (no state), ``2 .. L+1`` transformer layers, ``L+2`` a function, ``L+3`` the final norm
(``norm``), ``L+4`` the output layer (``final_linear``). A NeoX state dict names them
``sequential.<index>.<name>``; the pipeline checkpoint stores ``<name>`` in
``layer_<index>-model_<tp rank>-model_states.pt``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ckptshim.errors import PlanError
from ckptshim.inventory import KeyPath, join_key
from ckptshim.ops import Chunk, Concat, Op, Replicate, Replicated, Share, Sum

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


class _Spread(Protocol):
    """How one NeoX tensor is spread over tensor-parallel ranks, as the ops between its shards
    (one per rank, in rank order) and the whole tensor."""

    def merge(self, shards: tuple[KeyPath, ...], key: KeyPath, shard: tuple[int, ...]) -> tuple[Op, tuple[int, ...]]:
        """The op that makes ``key`` whole from ``shards`` of shape ``shard``, and the whole shape."""
        ...

    def split(self, key: KeyPath, shards: tuple[KeyPath, ...], whole: tuple[int, ...]) -> tuple[Op, tuple[int, ...]]:
        """The op that cuts ``key`` of shape ``whole`` into ``shards``, and a shard's shape."""
        ...


@dataclass(frozen=True)
class _Along:
    """Each rank holds an equal slice along ``axis``: column-parallel outputs, the fused
    ``query_key_value`` (interleaved per head, so a contiguous slice is a set of whole heads),
    vocab-parallel embeddings; row-parallel weights on axis 1."""

    axis: int

    def merge(self, shards: tuple[KeyPath, ...], key: KeyPath, shard: tuple[int, ...]) -> tuple[Op, tuple[int, ...]]:
        whole = shard[:self.axis] + (shard[self.axis] * len(shards),) + shard[self.axis + 1:]
        return Concat(shards, key, self.axis, (shard[self.axis],) * len(shards)), whole

    def split(self, key: KeyPath, shards: tuple[KeyPath, ...], whole: tuple[int, ...]) -> tuple[Op, tuple[int, ...]]:
        size, degree = whole[self.axis], len(shards)
        if size % degree:
            raise PlanError(f"{join_key(key)}: axis {self.axis} has {size} entries, which do not split evenly over "
                            f"{degree} tensor-parallel ranks; the model's sizes do not match this checkpoint.")
        shard = whole[:self.axis] + (size // degree,) + whole[self.axis + 1:]
        return Chunk(key, shards, self.axis, (size // degree,) * degree), shard


class _Summed:
    """The row-parallel output biases: each rank adds its own before the all-reduce (GPT-J
    parallel residual), so the whole bias is their :class:`~ckptshim.ops.Sum`."""

    def merge(self, shards: tuple[KeyPath, ...], key: KeyPath, shard: tuple[int, ...]) -> tuple[Op, tuple[int, ...]]:
        return Sum(shards, key), shard

    def split(self, key: KeyPath, shards: tuple[KeyPath, ...], whole: tuple[int, ...]) -> tuple[Op, tuple[int, ...]]:
        return Share(key, shards), whole


class _Replicated:
    """Norms and rotary buffers: every rank holds the whole tensor, checked equal on a merge."""

    def merge(self, shards: tuple[KeyPath, ...], key: KeyPath, shard: tuple[int, ...]) -> tuple[Op, tuple[int, ...]]:
        return Replicated(shards, key), shard

    def split(self, key: KeyPath, shards: tuple[KeyPath, ...], whole: tuple[int, ...]) -> tuple[Op, tuple[int, ...]]:
        return Replicate(key, shards), whole


_ROWS, _COLUMNS = _Along(0), _Along(1)
_SUMMED, REPLICATED = _Summed(), _Replicated()

_SPREADS: dict[KeyPath, _Spread] = {
    ("word_embeddings", "weight"): _ROWS,
    ("final_linear", "weight"): _ROWS,
    ("attention", "query_key_value", "weight"): _ROWS,
    ("attention", "query_key_value", "bias"): _ROWS,
    ("attention", "dense", "weight"): _COLUMNS,
    ("attention", "dense", "bias"): _SUMMED,
    ("attention", "rotary_emb", "inv_freq"): REPLICATED,
    ("norm", "weight"): REPLICATED,
    ("norm", "bias"): REPLICATED,
}
for _ln in ("input_layernorm", "post_attention_layernorm"):
    _SPREADS[(_ln, "weight")] = _SPREADS[(_ln, "bias")] = REPLICATED
for _hf, _neox in MLP_RENAMES:
    _column = _hf == "dense_h_to_4h"
    for _name in (_hf, _neox):
        _SPREADS[("mlp", _name, "weight")] = _ROWS if _column else _COLUMNS
        _SPREADS[("mlp", _name, "bias")] = _ROWS if _column else _SUMMED


def spread(key: KeyPath) -> _Spread | None:
    """How the NeoX tensor ``key`` (``sequential.<i>.<name>``) is spread over tensor-parallel
    ranks; ``None`` for a tensor NeoX does not lay out so (not one of its own layers').
    :data:`REPLICATED` is what a caller takes for a tensor each rank holds whole."""
    return _SPREADS.get(key[2:]) if key[:1] == (SEQUENTIAL,) and len(key) > 2 else None


def shard_keys(key: KeyPath, degree: int) -> tuple[KeyPath, ...]:
    """The names of ``key``'s shards in ops: ``<key>.model_<rank>``, as NeoX names the files
    (``layer_<i>-model_<rank>-model_states.pt``)."""
    return tuple(key + (f"model_{rank:02d}",) for rank in range(degree))

