"""PaxML GPT-3 -> MaxText GPT-3: names, the layer axis, fused attention projections.

Transcribed from MaxText's own converter, ``convert_gpt3_ckpt_from_paxml.py`` (its
``keystr_map`` and ``state_map``), checked against MaxText's GPT-3 model (``layers/gpt3.py``);
``docs/paxml-gpt3.md`` cites each row. A row names a MaxText parameter (under the params root,
in its stacked form ``decoder/layers/...``), the PaxML variable it comes from (under
``params/lm``), and how one layer's array is laid out differently:

- ``part``: the index along a fused axis of one layer (``combined_qkv`` is ``[3, ...]`` per
  layer: query, key, value);
- ``perm``: the permutation from PaxML's per-layer axes to MaxText's (``post.w`` is
  ``[embed, heads, head_dim]``, MaxText's ``out`` kernel ``[heads, head_dim, embed]``).

PaxML stacks every layer variable on axis 0 (praxis ``Repeat``); MaxText either stacks on
``param_scan_axis`` (read off the target's shapes, one axis for the whole model, MaxText's
default 1 where shapes leave it open) or keeps ``decoder/layers_{i}`` unscanned. Optimizer
moments follow their parameters: MaxText ``.../mu/params/<row>`` (``nu``) <- PaxML
``opt_states_0/<prefix>/m/params/lm/<row>`` (``v``), ``<prefix>`` being ``p#<L>#i-1_2`` in the
converter and ``p_<L>_i-1_2`` in PaxML 1.4 checkpoints for layer variables, ``no_prefix_2``
otherwise; MaxText's ``count`` <- ``opt_states_0/no_prefix_0/count``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import product

from ckptshim.errors import PlanError, docs_page
from ckptshim.inventory import Entry, Inventory, KeyPath, join_key
from ckptshim.ops import Rename, Split, Transpose, Unstack
from ckptshim.rules import Paired, Rules
from ckptshim.rules.context import MarkedProfile
from ckptshim.rules.profiles import maxtext

LAYERS: KeyPath = ("decoder", "layers")
REPEAT: KeyPath = ("transformer", "repeat", "sub", "x_layers_0")
PAX_PARAMS: KeyPath = ("params", "lm")
#: PaxML Adam state prefixes: ``p#<layers>#i-1_<k>`` (converter), ``p_<layers>_i-1_<k>`` (PaxML 1.4),
#: ``no_prefix_<k>`` for variables outside the layer stack.
_OPT_PREFIX = re.compile(r"p[#_]\d+[#_]i-1_\d+|no_prefix_\d+")
_LAYER_INDEX = re.compile(r"layers_(\d+)")
COUNT_SOURCE: KeyPath = ("opt_states_0", "no_prefix_0", "count")
#: MaxText subtree -> PaxML subtree of the same state (parameters, first and second moments)
KINDS = {"params": "mdl_vars", "mu": "m", "nu": "v"}


@dataclass(frozen=True)
class Row:
    target: KeyPath              # under MaxText's params root; layer rows in stacked form
    source: KeyPath              # under PaxML's params/lm
    part: int | None = None      # index along one layer's fused axis 0
    perm: tuple[int, ...] | None = None  # one layer, PaxML axes -> MaxText axes (None: same)

    @property
    def layered(self) -> bool:
        return self.target[:2] == LAYERS


def _rows() -> tuple[Row, ...]:
    qkv_w, qkv_b = REPEAT + ("self_attention", "combined_qkv", "w"), REPEAT + ("self_attention", "combined_qkv", "b")
    attention = LAYERS + ("self_attention",)
    rows = [Row(("token_embedder", "embedding"), ("softmax", "logits_ffn", "linear", "w"), perm=(1, 0)),
            Row(("decoder", "position_embedder", "embedding"), ("position_emb", "emb_var"))]
    for leaf in ("scale", "bias"):
        rows.append(Row(LAYERS + ("pre_self_attention_norm", leaf), REPEAT + ("layer_norm", leaf)))
    for part, name in enumerate(("query", "key", "value")):
        rows += [Row(attention + (name, "kernel"), qkv_w, part=part),
                 Row(attention + (name, "bias"), qkv_b, part=part)]
    rows += [Row(attention + ("qkv_proj", "kernel"), qkv_w, perm=(1, 0, 2, 3)),  # [3,E,H,D] -> [E,3,H,D]
             Row(attention + ("qkv_proj", "bias"), qkv_b),
             Row(attention + ("out", "kernel"), REPEAT + ("self_attention", "post", "w"), perm=(1, 2, 0)),
             Row(attention + ("out", "bias"), REPEAT + ("self_attention", "post", "b"))]
    for leaf in ("scale", "bias"):
        rows.append(Row(LAYERS + ("mlp", "mlp_layer_norm", leaf), REPEAT + ("ff_layer", "layer_norm", leaf)))
    for name, pax in (("wi", "ffn_layer1"), ("wo", "ffn_layer2")):
        rows += [Row(LAYERS + ("mlp", name, "kernel"), REPEAT + ("ff_layer", pax, "linear", "w")),
                 Row(LAYERS + ("mlp", name, "bias"), REPEAT + ("ff_layer", pax, "bias", "b"))]
    rows += [Row(("decoder", "decoder_norm", "scale"), ("final_ln", "scale")),
             Row(("decoder", "decoder_norm", "bias"), ("final_ln", "bias"))]
    return tuple(rows)


ROWS: tuple[Row, ...] = _rows()
_BY_TARGET = {row.target: row for row in ROWS}
#: PaxML variables the rows read; a checkpoint's other model variables have no place in MaxText's
#: GPT-3 (e.g. ``per_dim_scale``, a bias on the logits).
MAPPED_SOURCES = frozenset(row.source for row in ROWS)


def applies(source: Inventory, target: Inventory) -> bool:
    """A PaxML language model (``mdl_vars/params/lm/...``) into a MaxText-shaped tree."""
    return any(key[:3] == ("mdl_vars",) + PAX_PARAMS for key in source) and maxtext.applies(target)


def unmapped_variables(keys: Iterable[KeyPath]) -> list[KeyPath]:
    """PaxML model variables among ``keys`` that no row reads: what MaxText's GPT-3 cannot hold."""
    return [key for key in keys if key[:3] == ("mdl_vars",) + PAX_PARAMS and key[3:] not in MAPPED_SOURCES]


@dataclass(frozen=True)
class _Want:
    """One target key a row recognises."""

    entry: Entry
    row: Row
    root: KeyPath             # the target's params root (``params/params``, ``opt_state/mu/params``)
    kind: str                 # what PaxML calls that state: "mdl_vars", "m" or "v"
    layer: int | None = None  # for an unscanned ``layers_{i}`` key


class Gpt3Layout:
    """The :class:`ckptshim.rules.Layout` for PaxML GPT-3 into MaxText GPT-3.

    PaxML model variables MaxText's GPT-3 has no place for change what the model computes once
    trained (``per_dim_scale`` rescales queries, a logits bias shifts logits): the pairing warns
    of them, and under ``CKPTSHIM_STRICT`` refuses.
    """

    def pair(self, source: Inventory, target: Inventory, rules: Rules) -> Paired:
        sources = _source_index(source)
        wants = [want for want in map(_recognise, target.values()) if want is not None]
        groups: dict[tuple, list[_Want]] = {}  # one op per group: one source, one root, one layout
        missing: dict[KeyPath, str] = {}
        for want in wants:
            src = sources.get((want.kind, want.row.source))
            if src is None:
                missing[want.entry.key] = (f"MaxText's converter takes it from PaxML "
                                           f"{_pax_name(want.kind, want.row.source)}, which the checkpoint lacks")
                continue
            layout = "fused" if want.row.part is not None else want.row.target
            groups.setdefault((want.root, src.key, layout, want.layer is None), []).append(want)
        scanned = [(sources[w.kind, w.row.source], w) for w in wants
                   if w.layer is None and w.row.layered and w.entry.key not in missing]
        axis = _scan_axis(scanned, rules.strict)
        ops = [_op(sources[group[0].kind, group[0].row.source], group, axis) for group in groups.values()]
        ops += _count(source, target, wants)
        return Paired(tuple(ops), missing, warnings=_unmapped_warning(source, rules.strict))


GPT3_LAYOUT = Gpt3Layout()


def _unmapped_warning(source: Inventory, strict: bool) -> tuple[str, ...]:
    """The warning that PaxML model variables in ``source`` have no place in MaxText's GPT-3;
    under ``CKPTSHIM_STRICT``, the refusal."""
    lost = unmapped_variables(source)
    if not lost:
        return ()
    names = ", ".join(join_key(key, "/") for key in lost)
    message = (f"{source.source}: {len(lost)} PaxML model variable(s) have no place in MaxText's "
               f"GPT-3 model, so the restored model computes without them: {names} "
               f"(see {docs_page('paxml-gpt3')})")
    if strict:
        raise PlanError(message + "; CKPTSHIM_STRICT=1 refuses the restore. Restore into a model that "
                        "has them, or unset CKPTSHIM_STRICT to accept the difference.")
    return (message,)


#: PaxML GPT-3 into a MaxText-shaped tree: :data:`GPT3_LAYOUT`.
PROFILE = MarkedProfile("PaxML GPT-3 -> MaxText", "jax", applies, {"layouts": (GPT3_LAYOUT,)})


def _source_index(source: Inventory) -> dict[tuple[str, KeyPath], Entry]:
    """(kind, path under ``params/lm``) -> the PaxML entry; two Adam prefixes for one variable are refused."""
    found: dict[tuple[str, KeyPath], Entry] = {}
    for key, entry in source.items():
        if key[:3] == ("mdl_vars",) + PAX_PARAMS:
            where = ("mdl_vars", key[3:])
        elif (len(key) > 5 and key[0] == "opt_states_0" and key[2] in ("m", "v")
              and key[3:5] == PAX_PARAMS and _OPT_PREFIX.fullmatch(key[1])):
            where = (key[2], key[5:])
        else:
            continue
        other = found.setdefault(where, entry)
        if other is not entry:
            raise PlanError(f"checkpoint keys {join_key(other.key)!r} and {join_key(key)!r} are both the "
                            f"Adam state {where[0]!r} of {join_key(where[1])!r}; ckptshim will not pick one. "
                            "Restore from a checkpoint with one optimizer state per variable.")
    return found


def _recognise(entry: Entry) -> _Want | None:
    """The row, kind and layer of a MaxText target key, or None if no row names it."""
    key = entry.key
    for at, part in enumerate(key):
        if part in ("decoder", "token_embedder"):
            break
    else:
        return None
    root, rest, layer = key[:at], key[at:], None
    if len(rest) > 2 and rest[0] == "decoder" and (match := _LAYER_INDEX.fullmatch(rest[1])):
        rest, layer = LAYERS + rest[2:], int(match.group(1))
    row = _BY_TARGET.get(rest)
    if row is None or (layer is not None and not row.layered) or (root and root[-1] != "params"):
        return None
    kind = KINDS.get(root[-2], "mdl_vars") if len(root) > 1 else "mdl_vars"
    return _Want(entry, row, root, kind, layer)


def _pax_name(kind: str, path: KeyPath) -> str:
    if kind == "mdl_vars":
        return join_key(("mdl_vars",) + PAX_PARAMS + path, "/")
    prefix = "p_<L>_i-1_2" if path[:len(REPEAT)] == REPEAT else "no_prefix_2"
    return join_key(("opt_states_0", prefix, kind) + PAX_PARAMS + path, "/")


def _layer_shape(source: Entry, row: Row) -> tuple[int, ...]:
    """One layer's shape in MaxText's layout (for a fused row, of one part)."""
    shape = source.shape[1:] if row.layered else source.shape
    if row.part is not None:
        shape = shape[1:]
    return tuple(shape[a] for a in row.perm) if row.perm else shape


def _scanned_shape(source: Entry, row: Row, axis: int) -> tuple[int, ...]:
    shape = _layer_shape(source, row)
    return shape[:axis] + (source.shape[0],) + shape[axis:]


def _scan_axis(scanned: list[tuple[Entry, _Want]], strict: bool) -> int | None:
    """The one ``param_scan_axis`` every scanned target's shape fits; refuses when none does."""
    if not scanned:
        return None
    fits: dict[KeyPath, set[int]] = {}
    for source, want in scanned:
        rank = len(want.entry.shape)
        fits[want.entry.key] = {a for a in range(rank) if _scanned_shape(source, want.row, a) == want.entry.shape}
    for (source, want), axes in zip(scanned, fits.values()):
        if not axes:
            expected = ", ".join(f"{_scanned_shape(source, want.row, a)} (axis {a})"
                                 for a in range(len(_layer_shape(source, want.row)) + 1))
            raise PlanError(
                f"target {join_key(want.entry.key, '/')} has shape {want.entry.shape}, but PaxML "
                f"{join_key(source.key, '/')} {source.shape} gives {expected} with its {source.shape[0]} "
                "layers on MaxText's param_scan_axis; it fits none. Build the target with the "
                "checkpoint's model dimensions.")
    return maxtext.common_scan_axis(fits, strict)


def _op(source: Entry, group: list[_Want], axis: int | None):
    """The op that produces ``group`` (targets sharing one source and layout) from ``source``."""
    row = group[0].row
    layer_perm = row.perm or tuple(range(len(_layer_shape(source, row))))
    if group[0].layer is None:  # scanned, or not a layer variable
        if row.layered:
            perm = tuple(0 if t == axis else layer_perm[t if t < axis else t - 1] + 1
                         for t in range(len(layer_perm) + 1))
        else:
            perm = layer_perm
        if row.part is not None:  # (fused rows are all layer variables)
            return Split(source.key, _ordered(source, group, (1,), lambda w: (w.row.part,)), (1,), perm)
        _require_shape(group[0].entry, tuple(source.shape[a] for a in perm), source)
        if perm == tuple(range(len(perm))):
            return Rename(source.key, group[0].entry.key)
        return Transpose(source.key, group[0].entry.key, perm)
    for want in group:
        _require_shape(want.entry, _layer_shape(source, row), source)
    if row.part is not None:
        return Split(source.key, _ordered(source, group, (0, 1), lambda w: (w.layer, w.row.part)), (0, 1), layer_perm)
    targets = _ordered(source, group, (0,), lambda w: (w.layer,))
    if layer_perm == tuple(range(len(layer_perm))):
        return Unstack(source.key, targets, 0)
    return Split(source.key, targets, (0,), layer_perm)


def _ordered(source: Entry, group: list[_Want], axes: tuple[int, ...], index) -> tuple[KeyPath, ...]:
    """The group's target keys in row-major order over ``axes`` of the source; every index must be
    there (a target with a query kernel but no key kernel, or with layers missing, is refused)."""
    by_index = {index(want): want.entry.key for want in group}
    wanted = list(product(*(range(source.shape[a]) for a in axes)))
    absent = [i for i in wanted if i not in by_index]
    extra = [i for i in by_index if i not in set(wanted)]
    if absent or extra:
        meaning = {(0,): "layer", (1,): "query/key/value", (0, 1): "layer, query/key/value"}[axes]
        raise PlanError(
            f"{join_key(group[0].entry.key, '/')}: PaxML {join_key(source.key, '/')} {source.shape} holds "
            f"indices {wanted[0]}..{wanted[-1]} ({meaning}), but the target "
            + (f"lacks {absent[:6]}" if absent else f"also asks for {extra[:6]}")
            + ". MaxText's GPT-3 has every layer and all three of query, key and value; build the "
            "target with the checkpoint's layer count.")
    return tuple(by_index[i] for i in wanted)


def _require_shape(entry: Entry, expected: tuple[int, ...], source: Entry) -> None:
    if entry.shape != expected:
        raise PlanError(f"target {join_key(entry.key, '/')} has shape {entry.shape}, but PaxML "
                        f"{join_key(source.key, '/')} {source.shape} gives {expected} in MaxText's layout. "
                        "Build the target with the checkpoint's model dimensions.")


def _count(source: Inventory, target: Inventory, wants: list[_Want]) -> list[Rename]:
    """MaxText's Adam ``count`` (next to ``mu``) <- PaxML's ``no_prefix_0/count``, as the converter does."""
    roots = {w.entry.key[:w.entry.key.index("mu")] for w in wants if w.kind == "m"}
    return [Rename(COUNT_SOURCE, root + ("count",)) for root in sorted(roots)
            if root + ("count",) in target and COUNT_SOURCE in source]
