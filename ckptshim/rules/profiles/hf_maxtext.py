"""Hugging Face Llama 3 / Qwen3 <-> MaxText: the rows of MaxText 0.2.5's own converter.

Transcribed from ``maxtext/checkpoint_conversion/utils/param_mapping.py`` (its
``LLAMA31_MAXTEXT_TO_HF_PARAM_MAPPING``/``_HOOK_FN`` and ``QWEN_...``) and the order
``to_maxtext.py`` applies the hooks in; ``docs/maxtext.md`` cites each. A row names a MaxText
parameter (under the params root, in its stacked form ``decoder/layers/...``), the Hugging Face
tensor it comes from (``{i}`` the layer), and how one layer's array is laid out, as factors of
the Hugging Face shape and their permutation:

- ``_as_is``: as it is (norm scales, the embedding);
- ``_transposed``: a Linear ``[out, in]`` becomes a kernel ``[in, out]``;
- ``_heads_in``: ``q/k/v_proj`` ``[heads * head_dim, emb]`` becomes ``[emb, heads, head_dim]``;
- ``_heads_out``: ``o_proj`` ``[emb, heads * head_dim]`` becomes ``[heads, head_dim, emb]``.

For Llama the query and key heads also go from Hugging Face's half-split rotary layout to
MaxText's interleaved pairs, and the query is multiplied by ``float32(1 / sqrt(head_dim))`` in
float32 and rounded to the stored dtype (MaxText's Llama attention does not scale it) -- in that
order, after the reshape. Qwen3 has neither; its ``q_norm``/``k_norm`` are kept as they are.

Heads, KV heads, head_dim and the layer count come from the checkpoint folder's own
``config.json`` (MaxText's converter takes them from a built-in table of full-size models).
Scanned targets (``decoder/layers/...``) stack every layer's array on ``param_scan_axis``, read
off the target's shapes (MaxText's default 1 where they leave it open); unscanned targets name
``decoder/layers_{i}``. Each key is one op -- a ``Reshape`` composing transpose, head split,
rotary interleave and the layer stack, said as the plainest kind that says it
(:meth:`~ckptshim.ops.Reshape.simplified`: a rename, a transpose, a stack) -- so each device
reads only its own slice.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ckptshim.errors import PlanError, docs_page
from ckptshim.inventory import Entry, Inventory, KeyPath, join_key, split_key
from ckptshim.ops import Op, Reshape, Scale, axis_groups, float32, rsqrt_float32
from ckptshim.rules import Paired, Rules
from ckptshim.rules.context import LoadContext
from ckptshim.rules.profiles import maxtext

_LAYER = re.compile(r"layers_(\d+)")
_LAYERS: KeyPath = ("decoder", "layers")
#: Why the scaled query is what a MaxText Llama expects (the plan summary says it).
QUERY_SCALE = ("MaxText's Llama attention expects the query kernel pre-scaled by 1/sqrt(head_dim), "
               "as to_maxtext scales it")


@dataclass(frozen=True)
class _LayerLayout:
    """One layer's array: its Hugging Face shape read as ``factors``, permuted by ``perm``,
    grouped into MaxText's ``shape``."""

    factors: tuple[int, ...]
    perm: tuple[int, ...]
    shape: tuple[int, ...]


# -- how a row lays out one layer's array (MaxText's hooks, as factors and their permutation) ----


def _as_is(row: Row, source: Entry, dims: Dims) -> _LayerLayout:
    """As it is (norm scales, the embedding)."""
    return _LayerLayout(source.shape, tuple(range(len(source.shape))), source.shape)


def _transposed(row: Row, source: Entry, dims: Dims) -> _LayerLayout:
    """A Linear ``[out, in]`` as a kernel ``[in, out]``."""
    if len(source.shape) != 2:
        raise PlanError(f"{join_key(source.key, '.')} has shape {source.shape}, not the [out, in] of a Linear "
                        "weight MaxText transposes into a kernel. Check that the checkpoint is this model's.")
    return _LayerLayout(source.shape, (1, 0), source.shape[::-1])


def _heads_in(row: Row, source: Entry, dims: Dims) -> _LayerLayout:
    """``q/k/v_proj`` ``[heads * head_dim, emb]`` as ``[emb, heads, head_dim]``; with ``rope``,
    each head's half-split rotary halves as interleaved pairs."""
    count, head_dim = _heads(row, source, dims, 0)
    emb = source.shape[1]
    if not row.rope:  # [N*D, E] -> [E, N, D]
        return _LayerLayout((count, head_dim, emb), (2, 0, 1), (emb, count, head_dim))
    if head_dim % 2:
        raise PlanError(f"{join_key(source.key, '.')}: head_dim {head_dim} is odd, so it has no rotary "
                        "halves to interleave. Check config.json.")
    # [N*D, E] as [N, 2, D/2, E] -> [E, N, D/2, 2]: half-split rotary halves to interleaved pairs
    return _LayerLayout((count, 2, head_dim // 2, emb), (3, 0, 2, 1), (emb, count, head_dim))


def _heads_out(row: Row, source: Entry, dims: Dims) -> _LayerLayout:
    """``o_proj`` ``[emb, heads * head_dim]`` as ``[heads, head_dim, emb]``."""
    count, head_dim = _heads(row, source, dims, 1)
    emb = source.shape[0]
    return _LayerLayout((emb, count, head_dim), (1, 2, 0), (count, head_dim, emb))


def _heads(row: Row, source: Entry, dims: Dims, fused: int) -> tuple[int, int]:
    """The head count and head_dim axis ``fused`` of a 2-D ``source`` holds, checked against it."""
    count, head_dim, shape = dims.count(row), dims.head_dim, source.shape
    if len(shape) != 2 or shape[fused] != count * head_dim:
        raise PlanError(
            f"{join_key(source.key, '.')} has shape {shape}: its axis {fused} is not config.json's "
            f"{'num_attention_heads' if row.heads == 'q' else 'num_key_value_heads'} {count} x head_dim "
            f"{head_dim} = {count * head_dim}, the [heads, head_dim] MaxText splits it into. Check that "
            "config.json belongs to these weights.")
    return count, head_dim


@dataclass(frozen=True)
class Row:
    target: KeyPath           # under MaxText's params root; layer rows in stacked form
    source: str               # Hugging Face name, ``{i}`` for the layer
    layout: Callable[[Row, Entry, Dims], _LayerLayout] = _as_is  # one layer's array in MaxText's layout
    heads: str = "q"          # heads_in/heads_out: "q" (attention heads) or "kv"
    rope: bool = False        # half-split rotary halves -> interleaved pairs (Llama q, k)
    scale: bool = False       # times float32(1/sqrt(head_dim)) (Llama q)

    @property
    def layered(self) -> bool:
        return self.target[:2] == _LAYERS


def _rows(llama: bool) -> tuple[Row, ...]:
    attention, layer = _LAYERS + ("self_attention",), "model.layers.{i}."
    rows = [Row(("token_embedder", "embedding"), "model.embed_tokens.weight"),
            Row(("decoder", "decoder_norm", "scale"), "model.norm.weight"),
            Row(("decoder", "logits_dense", "kernel"), "lm_head.weight", _transposed),
            Row(_LAYERS + ("pre_self_attention_layer_norm", "scale"), layer + "input_layernorm.weight"),
            Row(_LAYERS + ("post_self_attention_layer_norm", "scale"), layer + "post_attention_layernorm.weight"),
            Row(attention + ("query", "kernel"), layer + "self_attn.q_proj.weight", _heads_in, "q", llama, llama),
            Row(attention + ("key", "kernel"), layer + "self_attn.k_proj.weight", _heads_in, "kv", llama),
            Row(attention + ("value", "kernel"), layer + "self_attn.v_proj.weight", _heads_in, "kv"),
            Row(attention + ("out", "kernel"), layer + "self_attn.o_proj.weight", _heads_out, "q")]
    if not llama:
        rows += [Row(attention + ("query_norm", "scale"), layer + "self_attn.q_norm.weight"),
                 Row(attention + ("key_norm", "scale"), layer + "self_attn.k_norm.weight")]
    rows += [Row(_LAYERS + ("mlp", name, "kernel"), layer + f"mlp.{hf}.weight", _transposed)
             for name, hf in (("wi_0", "gate_proj"), ("wi_1", "up_proj"), ("wo", "down_proj"))]
    return tuple(rows)


#: config.json ``model_type`` -> its rows (whether it is Llama: rotary interleave and query scale)
FAMILIES: Mapping[str, tuple[Row, ...]] = {"llama": _rows(True), "qwen3": _rows(False)}


def applies(source: Inventory, target: Inventory) -> bool:
    """A Hugging Face decoder (``model.layers.N...``, ``model.embed_tokens``) and a MaxText tree."""
    return _is_hf(source) and maxtext.applies(target)


def _is_hf(inventory: Inventory) -> bool:
    return any(key[:2] in (("model", "layers"), ("model", "embed_tokens")) for key in inventory)


@dataclass(frozen=True)
class Dims:
    """What the rows need of the model, from its ``config.json``."""

    heads: int
    kv_heads: int
    head_dim: int
    layers: int

    @classmethod
    def of(cls, config: Mapping[str, Any], origin: str) -> Dims:
        def number(name: str, default: Any = None) -> int:
            value = config.get(name, default)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanError(f"{origin}: {name} is {value!r}, not a positive whole number; MaxText's "
                                "layout needs it. Fix config.json.")
            return value

        heads = number("num_attention_heads")
        hidden = number("hidden_size")
        head_dim = config.get("head_dim") or (hidden // heads if hidden % heads == 0 else None)
        return cls(heads, number("num_key_value_heads", heads), number("head_dim", head_dim),
                   number("num_hidden_layers"))

    def count(self, row: Row) -> int:
        return self.heads if row.heads == "q" else self.kv_heads


@dataclass(frozen=True, eq=False)
class HfMaxTextLayout:
    """The :class:`ckptshim.rules.Layout` for a Hugging Face folder into a MaxText tree (and, with
    ``reverse``, MaxText params into a Hugging Face layout: the same ops inverted)."""

    config: Mapping[str, Any] | None
    origin: str
    reverse: bool = False

    def pair(self, source: Inventory, target: Inventory, rules: Rules) -> Paired:
        hf, mt = (target, source) if self.reverse else (source, target)
        if self.config is None:
            raise PlanError(f"{self.origin}: a Hugging Face checkpoint into a MaxText tree needs the model's "
                            "config.json (heads, head_dim, layers) beside the weights, and there is none. "
                            "Copy the model's config.json into the folder.")
        model_type = self.config.get("model_type")
        rows = FAMILIES.get(model_type)
        if rows is None:
            raise PlanError(f"{self.origin}: model_type {model_type!r} has no MaxText profile in ckptshim "
                            f"(it has {', '.join(sorted(FAMILIES))}); see {docs_page('maxtext')}.")
        dims = Dims.of(self.config, self.origin)
        ops, missing = _pair(hf, mt, rows, dims, rules.strict)
        if self.reverse:
            ops = [op.inverse() for op in ops]
            missing = {}
        return Paired(tuple(ops), missing)


@dataclass(frozen=True)
class HfMaxTextProfile:
    """A Hugging Face Llama 3 / Qwen3 into a MaxText tree, or back, by the model config (the
    checkpoint's, or, going back, the Hugging Face side's)."""

    name: str = "Hugging Face <-> MaxText"

    def applies(self, context: LoadContext) -> bool:
        return context.backend == "jax" and bool(self._directions(context))

    def rules(self, context: LoadContext) -> Mapping[str, Any]:
        return {"layouts": tuple(HfMaxTextLayout(context.model_config, f"config.json of {hf.source}", reverse)
                                 for reverse, hf in self._directions(context))}

    @staticmethod
    def _directions(context: LoadContext) -> list[tuple[bool, Inventory]]:
        """``(reverse, the Hugging Face side)`` for each way round this pairing applies."""
        return [(reverse, hf) for reverse, (hf, mt) in ((False, (context.source, context.target)),
                                                         (True, (context.target, context.source)))
                if applies(hf, mt)]


PROFILE = HfMaxTextProfile()


def _recognise(entry: Entry, rows: Mapping[KeyPath, Row]) -> tuple[Row, int | None] | None:
    """The row of a MaxText target key and its layer (``None``: stacked or not a layer), if any."""
    key = entry.key
    at = next((i for i, part in enumerate(key) if part in ("decoder", "token_embedder")), None)
    if at is None or any(part != "params" for part in key[:at]):  # parameters, not optimizer moments
        return None
    rest, layer = key[at:], None
    if len(rest) > 2 and rest[0] == "decoder" and (match := _LAYER.fullmatch(rest[1])):
        rest, layer = _LAYERS + rest[2:], int(match.group(1))
    row = rows.get(rest)
    if row is None or (layer is not None and not row.layered):
        return None
    return row, layer


def _pair(hf: Inventory, mt: Inventory, rows: tuple[Row, ...], dims: Dims, strict: bool
          ) -> tuple[list[Op], dict[KeyPath, str]]:
    by_target = {row.target: row for row in rows}
    wants = [(entry, *found) for entry in mt.values() if (found := _recognise(entry, by_target))]
    ops: list[Op] = []
    missing: dict[KeyPath, str] = {}
    scanned = []
    for entry, row, layer in wants:
        layers = [layer] if layer is not None else (range(dims.layers) if row.layered else [None])
        keys = [split_key(row.source.format(i=i), ".") for i in layers]
        absent = [key for key in keys if key not in hf]
        if absent:
            missing[entry.key] = (f"MaxText's converter takes it from {join_key(absent[0], '.')}, which the "
                                  "checkpoint lacks")
            continue
        sources = [hf[key] for key in keys]
        layout = row.layout(row, sources[0], dims)
        if layer is None and row.layered:
            scanned.append((entry, row, sources, layout))
            continue
        ops += _single(entry, row, sources[0], layout, dims)
    if scanned:
        axis = _scan_axis(scanned, strict)
        for entry, row, sources, layout in scanned:
            ops += _stacked(entry, row, sources, layout, axis, dims)
    return ops, missing


def _scale(row: Row, sources: list[Entry], target: Entry, dims: Dims) -> list[Op]:
    if not row.scale:
        return []
    return [Scale(tuple(s.key for s in sources), (target.key,), rsqrt_float32(dims.head_dim),
                  float32(math.sqrt(dims.head_dim)), sources[0].dtype, QUERY_SCALE)]


def _single(entry: Entry, row: Row, source: Entry, layout: _LayerLayout, dims: Dims) -> list[Op]:
    """A key that is one Hugging Face tensor (an unscanned layer, or not a layer)."""
    _require_shape(entry, layout.shape, source)
    op = Reshape((source.key,), (entry.key,), source.shape, layout.factors, layout.perm, layout.shape)
    return [op.simplified()] + _scale(row, [source], entry, dims)


def _scanned_shape(layout: _LayerLayout, layers: int, axis: int) -> tuple[int, ...]:
    return layout.shape[:axis] + (layers,) + layout.shape[axis:]


def _stacked(entry: Entry, row: Row, sources: list[Entry], layout: _LayerLayout, axis: int, dims: Dims
             ) -> list[Op]:
    """Every layer's tensor stacked on ``axis``: one op from all of them."""
    count = len(sources)
    keys = tuple(s.key for s in sources)
    _require_shape(entry, _scanned_shape(layout, count, axis), sources[0])
    # the layer count is source factor 0; it lands before the factors of target axis ``axis``
    groups = axis_groups(tuple(layout.factors[p] for p in layout.perm), layout.shape)
    at = sum(len(group) for group in groups[:axis])
    perm = tuple(p + 1 for p in layout.perm)
    op = Reshape(keys, (entry.key,), (count,) + sources[0].shape, (count,) + layout.factors,
                 perm[:at] + (0,) + perm[at:], _scanned_shape(layout, count, axis))
    return [op.simplified()] + _scale(row, sources, entry, dims)


def _scan_axis(scanned: list, strict: bool) -> int:
    """The one ``param_scan_axis`` every scanned target's shape fits (see
    :func:`~ckptshim.rules.profiles.maxtext.common_scan_axis`); refuses a target that fits none."""
    fits: dict[KeyPath, set[int]] = {}
    for entry, _, sources, layout in scanned:
        fits[entry.key] = {a for a in range(len(layout.shape) + 1)
                           if _scanned_shape(layout, len(sources), a) == entry.shape}
    for (entry, _, sources, layout), axes in zip(scanned, fits.values()):
        if not axes:
            expected = ", ".join(f"{_scanned_shape(layout, len(sources), a)} (axis {a})"
                                 for a in range(len(layout.shape) + 1))
            raise PlanError(
                f"target {join_key(entry.key, '/')} has shape {entry.shape}, but the checkpoint's "
                f"{len(sources)} layers of {join_key(sources[0].key, '.')} {sources[0].shape} give {expected} "
                "in MaxText's layout; it fits none. Build the target with the checkpoint's model dimensions.")
    return maxtext.common_scan_axis(fits, strict)


def _require_shape(entry: Entry, expected: tuple[int, ...], source: Entry) -> None:
    if entry.shape != expected:
        raise PlanError(f"target {join_key(entry.key, '/')} has shape {entry.shape}, but Hugging Face "
                        f"{join_key(source.key, '.')} {source.shape} gives {expected} in MaxText's layout. "
                        "Build the target with the checkpoint's model dimensions (config.json).")
