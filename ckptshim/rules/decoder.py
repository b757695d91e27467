"""The canonical decoder-only transformer (the hub), and a load from one producer's names into
another's as the composition A -> canonical -> B.

The canonical model is described once, as Hugging Face lays it out: per layer the query, key,
value and output projections, the optional per-head query/key norms, the gated MLP's gate, up and
down projections and the two layer norms; outside the layers the embeddings, the final norm and
the head. Every Linear is ``[out, in]``; the query and key rows are ``heads x head_dim``, each
head's rotary dimensions as two halves. The dimensions that decide layouts are :class:`Dims`,
read from metadata only (:func:`read_dims`).

A producer is one :class:`Naming` onto it: where each slot lives under its names, which slots it
keeps fused in one array (Megatron-Core's ``linear_qkv`` by query group, its ``linear_fc1`` as
``[gate; up]``), whether its rotary embedding takes each head's pairs interleaved (Meta's
original layout, torchtitan, MaxText's Llama), how it lays out a slot's factors (MaxText's
kernels ``[in, out]``, its query ``[in, heads, head_dim]``), on which axis it stacks the layers,
and whether its attention expects the query pre-scaled. :func:`pair` plans one load between two
namings slot by slot: for a slot both keep apart, one op that reads the source's factors and
lays them out as the target's (a :class:`~ckptshim.ops.Reshape`, said as the plainest kind that
says it: a rename, a transpose, an (un)stack, a per-head :class:`~ckptshim.ops.Reorder`), and
the query's :class:`~ckptshim.ops.Scale` where one side expects it; a split or join where one
fuses what the other keeps apart (the query-group kinds, :class:`~ckptshim.ops.SplitGroups`). So
adding a family is one :class:`Naming`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from ckptshim.errors import MetadataConflict, PlanError
from ckptshim.inventory import Entry, Inventory, KeyPath, join_key
from ckptshim.ops import Chunk, Op, Rename, Reshape, Scale, SplitGroups, Stack, Unstack, fits, float32, rsqrt_float32
from ckptshim.rules import Paired
from ckptshim.rules.prefixes import strip_wrappers

#: One layer's slots, and those outside the layers. Beyond a Llama's, the optional slots of other
#: architectures: the linear layers' biases, LayerNorm's biases (a norm without one is RMSNorm's
#: scale), an ungated MLP (``up`` and ``down`` without ``gate``: GPT-NeoX's ``dense_h_to_4h`` /
#: ``dense_4h_to_h``), and the rotary inverse frequencies a producer may save (``inv_freq``).
LAYER_SLOTS = ("q", "k", "v", "o", "q_bias", "k_bias", "v_bias", "o_bias", "q_norm", "k_norm", "gate", "up", "down",
               "up_bias", "down_bias", "attn_norm", "attn_norm_bias", "mlp_norm", "mlp_norm_bias", "inv_freq")
TOP_SLOTS = ("embed", "norm", "norm_bias", "head")
#: The slots that tell architectures apart: what each one's presence says, and the slot it goes
#: with (where the other side lacks it, the key that says so). A load between two producers is
#: composed only where both sides hold the same of these, for a slot one side has and the other
#: lacks would be dropped from the checkpoint, or left at the target's initial values.
ARCHITECTURE: Mapping[str, tuple[str, str]] = {
    "gate": ("a gated MLP (gate, up, down)", "up"), "o_bias": ("an output projection bias", "o"),
    "up_bias": ("an MLP up-projection bias", "up"), "down_bias": ("an MLP down-projection bias", "down"),
    "attn_norm_bias": ("LayerNorm (with a bias) before the attention", "attn_norm"),
    "mlp_norm_bias": ("LayerNorm (with a bias) before the MLP", "mlp_norm"),
    "norm_bias": ("a final LayerNorm (with a bias)", "norm")}
#: How a rotary embedding takes each head's dimensions: two halves (Hugging Face, Megatron-Core)
#: or interleaved pairs (Meta's original layout, torchtitan's Llama, torchtune).
HALVES, PAIRS = "halves", "pairs"
#: The slots the rotary embedding turns (the query and key rows, and their biases where a model
#: has them: Qwen2), and the slots laid out by query head (the others by key/value head).
ROTARY = ("q", "k", "q_bias", "k_bias")
QUERY = ("q", "q_bias", "o")
#: A layer index that stands for every layer: a producer's stacked array (Megatron-Core stores
#: its layers so, one array per slot with the layer on axis 0; MaxText's scanned params on its
#: ``param_scan_axis``).
STACKED = -1
#: One layer's array of a slot as runs of named factors, one run per axis, row-major.
Axes = tuple[tuple[str, ...], ...]
#: The canonical array of each slot whose factors a producer may lay out otherwise: the query,
#: key and value rows are heads x head_dim, so are the output projection's columns; every
#: Linear is ``[out, in]``. The other slots' axes are their own (norms, the embedding).
CANONICAL_AXES: Mapping[str, Axes] = {
    **dict.fromkeys(("q", "k", "v"), (("heads", "head_dim"), ("in",))), "o": (("out",), ("heads", "head_dim")),
    **dict.fromkeys(("gate", "up", "down", "head"), (("out",), ("in",)))}
#: Each head's rotary dimensions as factors: which half, then the place in it (halves), or the
#: place, then which of the pair (interleaved pairs).
_ROTARY_FACTORS = {HALVES: ("which", "within"), PAIRS: ("within", "which")}
#: How a producer that stacks its layers on an axis of its own choosing (MaxText's
#: ``param_scan_axis``) picks it: from the axes each stacked array's shape fits, and strictness.
ScanChoice = Callable[[Mapping[KeyPath, set[int]], bool], int]


@dataclass(frozen=True)
class Dims:
    """The dimensions that decide layouts, and where they were read (``fields``: the names the
    metadata gives query heads, key/value heads and head_dim, for messages)."""

    heads: int
    kv_heads: int
    head_dim: int
    origin: str
    fields: tuple[str, str, str] = ("heads", "kv heads", "head_dim")

    def of(self, slot: str) -> tuple[int, str]:
        """A slot's head count and the metadata field that gave it."""
        return (self.heads, self.fields[0]) if slot in QUERY else (self.kv_heads, self.fields[1])

    def text(self) -> str:
        return (f"{self.heads} heads ({self.fields[0]}) in {self.kv_heads} key/value groups ({self.fields[1]}), "
                f"head_dim {self.head_dim}")

    @property
    def file(self) -> str:
        """The file the dimensions were read from (``config.json``)."""
        return self.origin.rsplit(" ", 1)[-1]


@dataclass(frozen=True)
class Fused:
    """Canonical slots a producer keeps as one array: by query group (each group's query heads,
    then its key and value head: :class:`~ckptshim.ops.SplitGroups`) or side by side on axis 0."""

    slots: tuple[str, ...]
    by_group: bool


@dataclass(frozen=True, eq=False)
class Naming:
    """One producer's names for the canonical model.

    - ``layers``: the key prefix of the layer list (``model.layers``), a layer index after it;
    - ``rows``: per slot (or fused part, a key of ``fused``) its spellings under one layer, its
      own first (Megatron-Core's local spec stores its layer norms under the fused modules' names);
    - ``top``: per slot outside the layers, its key;
    - ``rotary``: :data:`HALVES` or :data:`PAIRS`; ``None`` for a producer whose convention is its
      model family's (torchtune's), until the model's config names the family (:meth:`with_rotary`);
    - ``stacked``: whether its checkpoints store each slot once for all layers (on axis 0);
    - ``scan``: for a producer whose own names stack the layers on an axis of its choosing
      (MaxText's ``param_scan_axis``), how it picks that axis; its stacked names are then always
      its own (no metadata needed);
    - ``axes``: per slot, how one layer's array lays out the canonical factors where it differs
      from :data:`CANONICAL_AXES` (MaxText's kernels ``[in, out]``, its query ``[in, heads,
      head_dim]``);
    - ``roots``: the prefixes its names may sit under, longest first (MaxText's train state keeps
      its params under ``params/params``);
    - ``joined``: whether a layer's index joins the layer list's last name (MaxText's unscanned
      ``decoder/layers_0``) rather than following it;
    - ``query_scale``: why its attention expects the query pre-multiplied by ``1/sqrt(head_dim)``
      (MaxText's Llama), empty where it does not;
    - ``no_rotary``: where ``rotary`` is ``None``, why, and what to do: the hint on each query and
      key row left unmapped (``{source}``: the checkpoint's key);
    - ``first``: the index in the layer list of layer 0 (GPT-NeoX's pipeline: 2, after the
      embedding and a function);
    - ``after``: per slot outside the layers that the layer list itself holds after the last
      layer (GPT-NeoX's pipeline: the final norm, then the output layer), how far past the last
      layer, and its names under that index. Such a key says which slot it is by those names; its
      index is checked against the layer count where the inventory holds layer 0 (a pipeline
      stage may not), and a key written for it needs the count (:meth:`key`).
    """

    name: str
    layers: KeyPath
    rows: Mapping[str, tuple[KeyPath, ...]]
    top: Mapping[str, KeyPath]
    rotary: str | None
    fused: Mapping[str, Fused] = field(default_factory=dict)
    stacked: bool = False
    scan: ScanChoice | None = None
    axes: Mapping[str, Axes] = field(default_factory=dict)
    roots: tuple[KeyPath, ...] = ((),)
    joined: bool = False
    query_scale: str = ""
    no_rotary: str = ""
    first: int = 0
    after: Mapping[str, tuple[int, KeyPath]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.rotary is None and not self.no_rotary:
            raise ValueError(f"{self.name}: names without a rotary convention say why (no_rotary)")
        if self.rotary != HALVES and any(how.by_group for how in self.fused.values()):
            raise ValueError(f"{self.name}: a query-group fusion is read as rotary halves (SplitGroups' pairs "
                             "flag marks the parts that hold interleaved pairs)")
        spellings = {spelling: part for part, spelled in self.rows.items() for spelling in spelled}
        object.__setattr__(self, "_parts", spellings)
        object.__setattr__(self, "_top", {key: slot for slot, key in self.top.items()})
        object.__setattr__(self, "_after", {names: slot for slot, (_, names) in self.after.items()})

    def with_rotary(self, rotary: str) -> Naming:
        """These names with the rotary convention of the model family a config named."""
        return replace(self, rotary=rotary)

    def slots(self, part: str) -> tuple[str, ...]:
        return self.fused[part].slots if part in self.fused else (part,)

    def layout(self, slot: str, rank: int) -> Axes:
        """How one layer's array of ``slot`` (of ``rank`` axes) lays out the canonical factors."""
        return self.axes.get(slot) or CANONICAL_AXES.get(slot) or tuple((f"axis {i}",) for i in range(rank))

    def stacks(self, stacked: bool) -> bool:
        """Whether its stacked names are read: its own (``scan``), or where metadata says so."""
        return self.scan is not None or (stacked and self.stacked)

    def locate(self, key: KeyPath, stacked: bool = False) -> tuple[int | None, str] | None:
        """``(layer, part)`` of a key under these names (wrappers left out): ``layer`` ``None``
        outside the layers, :data:`STACKED` for a stacked array (only where ``stacked``)."""
        key = strip_wrappers(key)
        for root in self.roots:
            if key[:len(root)] == root:
                found = self._locate(key[len(root):], stacked)
                if found is not None:
                    return found
        return None

    def _locate(self, key: KeyPath, stacked: bool) -> tuple[int | None, str] | None:
        prefix = len(self.layers)
        if self.joined and key[:prefix - 1] == self.layers[:-1] and len(key) > prefix:
            index = key[prefix - 1].removeprefix(f"{self.layers[-1]}_")
            if index != key[prefix - 1] and index.isdigit() and key[prefix:] in self._parts:
                return int(index), self._parts[key[prefix:]]
        if key[:prefix] == self.layers and len(key) > prefix + 1:
            if not self.joined and key[prefix].isdigit() and key[prefix + 1:] in self._parts \
                    and int(key[prefix]) >= self.first:
                return int(key[prefix]) - self.first, self._parts[key[prefix + 1:]]
            if stacked and key[prefix:] in self._parts:
                return STACKED, self._parts[key[prefix:]]
            if key[prefix].isdigit() and key[prefix + 1:] in self._after:
                return None, self._after[key[prefix + 1:]]
        slot = self._top.get(key)
        return None if slot is None else (None, slot)

    def layer_key(self, layer: int) -> KeyPath:
        """The key prefix of layer ``layer`` (from 0) under these names."""
        index = layer + self.first
        return (*self.layers[:-1], f"{self.layers[-1]}_{index}") if self.joined else (*self.layers, str(index))

    def within(self, key: KeyPath) -> tuple[int, KeyPath] | None:
        """The layer (from 0) a key of a layer list without joined indices sits in, slot or not
        (a buffer), and its names under the layer; ``None`` outside the layers."""
        prefix = len(self.layers)
        if self.joined or key[:prefix] != self.layers or len(key) <= prefix + 1 or not key[prefix].isdigit():
            return None
        layer = int(key[prefix]) - self.first
        return None if layer < 0 or key[prefix + 1:] in self._after else (layer, key[prefix + 1:])

    def key(self, unit: tuple[int | None, str], layers: int | None = None) -> KeyPath:
        """A unit's key under these names (its own spelling); ``layers``, the layer count, places
        a slot the layer list holds after the last layer (:attr:`after`)."""
        layer, part = unit
        if layer is None and part in self.after:
            if layers is None:
                raise ValueError(f"{self.name}: the key of {part} depends on the layer count")
            offset, names = self.after[part]
            return (*self.layer_key(layers - 1 + offset), *names)
        return self.top[part] if layer is None else (*self.layer_key(layer), *self.rows[part][0])

    def units(self, inventory: Inventory, stacked: bool = False) -> dict[tuple[int | None, str], Entry]:
        """Each entry of ``inventory`` these names know, by ``(layer, part)``; two entries of one
        unit are left to the planner, which reports them."""
        found: dict[tuple[int | None, str], Entry] = {}
        clashes = set()
        for key, entry in inventory.items():
            unit = self.locate(key, self.stacks(stacked))
            if unit is not None and found.setdefault(unit, entry) is not entry:
                clashes.add(unit)
        for unit in clashes:
            del found[unit]
        if self.after and (0, next(iter(self.rows))) in found:
            self._placed_after(found)
        return found

    def _placed_after(self, found: dict[tuple[int | None, str], Entry]) -> None:
        """Leave out the slots held after the last layer whose index is not where the layer
        count puts them (a key named like the final norm in another place is not it)."""
        layers = 1 + max(layer for layer, _ in found if layer is not None and layer != STACKED)
        for slot in self.after:
            entry, placed = found.get((None, slot)), self.key((None, slot), layers)
            if entry is not None and strip_wrappers(entry.key)[-len(placed):] != placed:
                del found[None, slot]

    def marks(self, inventory: Inventory, root: KeyPath = ()) -> bool:
        """Whether ``inventory`` holds layer 0's first row (the query projection, or the fused
        array holding it; GPT-NeoX's MLP, whose names tell its namings apart) under these names (below ``root``: the attribute a Lightning module
        holds the model in): looked up, not searched for, so that loads of other models pay one
        lookup per producer."""
        first = next(iter(self.rows.values()))[0]
        return any((*root, *at, *layer, *first) in inventory for at in self.roots
                   for layer in (self.layer_key(0), *((self.layers,) if self.scan is not None else ())))


#: ``LlamaForCausalLM`` (and the Llama-like models transformers names alike: Mistral, Qwen2/3).
HUGGING_FACE = Naming(
    "Hugging Face", ("model", "layers"),
    rows={"q": (("self_attn", "q_proj", "weight"),), "k": (("self_attn", "k_proj", "weight"),),
          "v": (("self_attn", "v_proj", "weight"),), "o": (("self_attn", "o_proj", "weight"),),
          "q_bias": (("self_attn", "q_proj", "bias"),), "k_bias": (("self_attn", "k_proj", "bias"),),
          "v_bias": (("self_attn", "v_proj", "bias"),), "q_norm": (("self_attn", "q_norm", "weight"),), "k_norm": (("self_attn", "k_norm", "weight"),),
          "gate": (("mlp", "gate_proj", "weight"),), "up": (("mlp", "up_proj", "weight"),),
          "down": (("mlp", "down_proj", "weight"),), "attn_norm": (("input_layernorm", "weight"),),
          "mlp_norm": (("post_attention_layernorm", "weight"),)},
    top={"embed": ("model", "embed_tokens", "weight"), "norm": ("model", "norm", "weight"),
         "head": ("lm_head", "weight")},
    rotary=HALVES)

#: Where a load's dimensions come from: :class:`Dims`, or why there are none (a hint).
DimsSource = Callable[[], "Dims | str"]


def pair(source_names: Naming, target_names: Naming, source: Inventory, target: Inventory, dims: DimsSource,
         stacked: bool = False, strict: bool = False) -> Paired:
    """The ops that carry what ``source`` holds under ``source_names`` into ``target``'s keys
    under ``target_names``: the composition source -> canonical -> target, slot by slot.

    ``dims`` gives the dimensions (read lazily: a load that needs no head count reads none); a
    target it cannot fill without them is missing, with the hint. ``stacked``: the checkpoint's
    own metadata says its producer stored its layers stacked. ``strict``: a stacking axis the
    shapes leave open is refused rather than taken as the producer's default.
    """
    have = source_names.units(source, stacked)
    want = target_names.units(target)
    other = _other_architecture(source_names, target_names, have, want)
    if other:
        return Paired((), other, (f"{source_names.name} and {target_names.name}: different architectures",))
    composer = _Composer(source_names, target_names, have, dims, strict)
    for unit in want:
        if unit not in composer.done:
            composer.fill(unit, want)
    composer.settle()
    return Paired(tuple(composer.ops), composer.missing, (f"{source_names.name} -> {target_names.name} names",))


#: One composed op (a target's shapes fitting it or not), a hint why there is none, or ``None``:
#: left to the name matcher.
Composed = tuple[Op, bool] | str | None


@dataclass(eq=False)
class _Composer:
    """One :func:`pair`: the ops found so far, the targets missing (with hints), the target units
    done, the dimensions once read, and the stacked arrays whose axis the shapes choose (``open``:
    each with the op each axis it fits gives)."""

    source: Naming
    target: Naming
    have: Mapping[tuple[int | None, str], Entry]
    dims_source: DimsSource
    strict: bool = False
    ops: list[Op] = field(default_factory=list)
    missing: dict[KeyPath, str] = field(default_factory=dict)
    done: set = field(default_factory=set)
    open: list[tuple[Entry, dict[int, list[Op]], list[Entry]]] = field(default_factory=list)
    _dims: Dims | str | None = None

    def dims(self) -> Dims | str:
        if self._dims is None:
            self._dims = self.dims_source()
        return self._dims

    def fill(self, unit: tuple[int | None, str], want: Mapping[tuple[int | None, str], Entry]) -> None:
        layer, part = unit
        slots = self.target.slots(part)
        if layer == STACKED:  # the target stacks every layer: from each of the source's
            sources = _every_layer(self.have, part)
            if sources and slots == self.source.slots(part):
                self._same(slots[0], sources, [want[unit]], into_stack=True)
            return
        holder = self._holder(layer, slots[0])
        if holder is None:
            return  # left to the name matcher, which reports it
        (held_layer, held_part), entry = holder
        held_slots = self.source.slots(held_part)
        if held_layer == STACKED:
            layers = (_layers(entry) if self.source.scan is None else
                      sorted(at for at, p in want if p == part and at is not None and at != STACKED))
        else:
            layers = (layer,)
        if held_slots == slots:
            how = self.target.fused.get(part)
            if self.source.fused.get(held_part) != how:
                return  # one array fused two ways (litgpt's two layouts): left to the name matcher
            if how is not None and how.by_group:
                self.dims()  # laid out per head alike, but two sides' head counts that disagree are refused
            targets = [want.get((at, part)) for at in layers]
            if None in targets:
                return
            self._same(slots[0], [entry], targets, held_layer == STACKED)
        elif len(held_slots) > 1:  # the source fuses what the target keeps apart
            targets = [want.get((at, slot)) for at in layers for slot in held_slots]
            if None in targets:
                return
            self._add(self._split(entry, targets, held_part, held_layer == STACKED), targets)
        else:  # the target fuses what the source keeps apart, layer by layer
            sources = [self.have.get((layer, slot)) for slot in slots]
            if None in sources:
                return
            target = want[unit]
            self._add(self._split(target, sources, part, False, self.target, self.source), [target],
                      invert=True)

    def _holder(self, layer: int | None, slot: str) -> tuple[tuple[int | None, str], Entry] | None:
        for at in (layer, STACKED) if layer is not None else (None,):
            for part in (slot, *(p for p, f in self.source.fused.items() if slot in f.slots)):
                entry = self.have.get((at, part))
                if entry is not None:
                    return (at, part), entry
        return None

    def _add(self, op: Op | list[Op] | str | None, targets: list[Entry], invert: bool = False) -> None:
        for entry in targets:
            self.done.add(self.target.locate(entry.key, True))
        if op is None:
            return
        if isinstance(op, str):
            for entry in targets:
                self.missing[entry.key] = op
            return
        for each in op if isinstance(op, list) else [op]:
            if not (isinstance(each, Rename) and each.source == each.target):  # a key both name alike
                self.ops.append(each.inverse() if invert else each)

    def _same(self, slot: str, sources: list[Entry], targets: list[Entry], stacked: bool = False,
              into_stack: bool = False) -> None:
        """One slot (or one fused part) the two producers keep alike, up to its layout: a rename,
        a transpose, an (un)stack, each head's rotary dimensions reordered -- or all of these as
        one :class:`~ckptshim.ops.Reshape` -- and the query's scale where one side expects it.
        ``stacked``: the one source stacks every layer, listed in ``targets``; ``into_stack``: the
        one target stacks every layer, listed in ``sources``. A stacking axis the producer chooses
        (``scan``) is each axis the shapes fit, settled once every slot is known."""
        listed = "targets" if stacked else "sources" if into_stack else None
        stacker = self.source if stacked else self.target if into_stack else None
        stack = sources[0] if stacked else targets[0]
        open_axis = stacker is not None and stacker.scan is not None
        axes = range(len(stack.shape)) if open_axis else [0 if stacker is not None else None]
        fits: dict[int | None, list[Op]] = {}
        errors = []
        for axis in axes:
            try:
                composed = self._compose(slot, sources, targets, listed, axis)
            except PlanError as error:  # on a wrong axis, other sizes read as the heads
                if not open_axis:
                    raise
                errors.append(error)
                continue
            if isinstance(composed, str) or (composed is None and not open_axis):
                self._add(composed, targets)
                return
            if composed is None:
                continue
            op, fitting = composed
            if not fitting and (open_axis or not isinstance(op, _PLAIN)):
                if not open_axis:
                    raise PlanError(self._unfit(sources, targets, op))
                continue
            fits[axis] = [op, *self._scale(slot, sources, targets)]  # a plain op's shapes: the planner's
        if not open_axis:
            self._add(fits[axes[0]], targets)
            return
        if not fits and errors and len(errors) == len(axes):
            raise errors[0]
        self.open.append((stack, fits, targets))
        for entry in targets:
            self.done.add(self.target.locate(entry.key, True))

    def settle(self) -> None:
        """The stacked arrays whose axis the shapes choose: the one axis all of them fit, as
        their producer picks it (MaxText's ``param_scan_axis``)."""
        if not self.open:
            return
        for stack, fitting, targets in self.open:
            if not fitting:
                raise PlanError(f"{join_key(stack.key)} has shape {list(stack.shape)}, which stacks the layers of "
                                f"{join_key(targets[0].key)} {list(targets[0].shape)} on none of its axes in "
                                f"{self.target.name}'s layout. Build the target with the checkpoint's model "
                                "dimensions.")
        stacker = self.source if self.source.scan is not None else self.target
        axis = stacker.scan({stack.key: set(fitting) for stack, fitting, _ in self.open}, self.strict)
        for _, fitting, _ in self.open:
            self.ops.extend(fitting[axis])

    def _compose(self, slot: str, sources: list[Entry], targets: list[Entry], listed: str | None,
                 axis: int | None) -> Composed:
        """The one op that lays ``sources`` out as ``targets``, and whether the targets' shapes are
        what it makes. ``listed``: the side (``"sources"``, ``"targets"``) whose arrays are each
        one layer of the other side's one array, which stacks them on ``axis``."""
        shape = (len(sources), *sources[0].shape) if listed == "sources" and len(sources) > 1 else sources[0].shape
        source_at = axis if listed == "targets" else _listed_at(listed == "sources", len(sources))
        target_at = axis if listed == "sources" else _listed_at(listed == "targets", len(targets))
        layer_shape = shape[:source_at] + shape[source_at + 1:] if isinstance(source_at, int) else shape
        src, tgt = self.source.layout(slot, len(layer_shape)), self.target.layout(slot, len(layer_shape))
        if len(src) != len(layer_shape):
            return None
        reorder = slot in ROTARY and self.source.rotary != self.target.rotary
        if reorder and None in (self.source.rotary, self.target.rotary):
            unknown = self.source if self.source.rotary is None else self.target
            return unknown.no_rotary.format(source=join_key(sources[0].key))
        apart = reorder or not (_heads_together(src) and _heads_together(tgt))
        sizes = {"layer": shape[source_at] if isinstance(source_at, int) else len(sources)}
        if apart:
            dims = self.dims()
            if isinstance(dims, str):
                return dims.format(target=join_key(targets[0].key), source=join_key(sources[0].key))
            heads, heads_field = dims.of(slot)
            if reorder and dims.head_dim % 2:
                raise PlanError(f"{dims.origin}: head_dim {dims.head_dim} is odd, so {join_key(sources[0].key)} has no "
                                "rotary halves to lay out as pairs. Keep the checkpoint's own config beside it.")
            sizes.update(heads=heads, head_dim=dims.head_dim, which=2, within=dims.head_dim // 2)
        src = _refined(src, apart, self.source.rotary if reorder else None)
        tgt = _refined(tgt, apart, self.target.rotary if reorder else None)
        for index, (axis, size) in enumerate(zip(src, layer_shape)):
            unknown = [name for name in axis if name not in sizes]
            known = math.prod(sizes[name] for name in axis if name in sizes)
            if len(unknown) == 1 and size % known == 0:
                sizes[unknown[0]] = size // known
            elif unknown or known != size:
                raise PlanError(f"{join_key(sources[0].key)} has shape {tuple(sources[0].shape)}: its axis {index} is "
                                f"not {dims.file}'s {heads_field} {heads} x {dims.fields[2]} {dims.head_dim} = "
                                f"{heads * dims.head_dim}, the [heads, head_dim] {self.target.name} lays it out by. "
                                f"Check that {dims.file} belongs to these weights.")
        src, tgt = _with_layer(src, source_at), _with_layer(tgt, target_at)
        order, wanted = [n for axis in src for n in axis], [n for axis in tgt for n in axis]
        if sorted(order) != sorted(wanted) or (listed == "targets" and sizes["layer"] != len(targets)):
            return None
        target_shape = tuple(math.prod(sizes[name] for name in axis) for axis in tgt)
        op = Reshape(tuple(s.key for s in sources), tuple(t.key for t in targets), shape,
                     tuple(sizes[name] for name in order), tuple(order.index(name) for name in wanted), target_shape)
        expected = target_shape[1:] if len(targets) > 1 else target_shape
        return op.simplified(), all(t.shape == expected for t in targets)

    def _scale(self, slot: str, sources: list[Entry], targets: list[Entry]) -> list[Op]:
        """The query multiplied by ``1/sqrt(head_dim)`` where only the target expects it so
        (MaxText's Llama, as its converter does), or back where only the source holds it so."""
        if slot != "q" or bool(self.source.query_scale) == bool(self.target.query_scale):
            return []
        head_dim = self.dims().head_dim
        into = bool(self.target.query_scale)
        down, up = rsqrt_float32(head_dim), float32(math.sqrt(head_dim))
        return [Scale(tuple(s.key for s in sources), tuple(t.key for t in targets), down if into else up,
                      up if into else down, (sources if into else targets)[0].dtype,
                      self.target.query_scale or self.source.query_scale)]

    def _unfit(self, sources: list[Entry], targets: list[Entry], op: Op) -> str:
        return (f"{join_key(targets[0].key)} has shape {list(targets[0].shape)}, but {self.source.name}'s "
                f"{join_key(sources[0].key)} {list(sources[0].shape)} is laid out in {self.target.name}'s layout as "
                f"{op.describe()}. Build the target with the checkpoint's model dimensions.")

    def _split(self, fused: Entry, parts: list[Entry], part: str, stacked: bool, fusing: Naming | None = None,
               apart: Naming | None = None) -> Op | str | None:
        """The fused array ``fused`` (``part`` of ``fusing``'s names) cut into ``parts`` (layer by
        layer when ``stacked``), kept apart by ``apart`` (in the canonical layout: a producer
        that lays the parts out otherwise is left to the name matcher)."""
        fusing, apart = fusing or self.source, apart or self.target
        how = fusing.fused[part]
        if apart.axes.keys() & set(how.slots):
            return None
        keys = tuple(p.key for p in parts)
        if not how.by_group:
            if any(slot in ROTARY for slot in how.slots):
                self.dims()  # cut by sizes, but two sides' head counts that disagree are refused
            sizes = tuple(p.shape[0] for p in parts[:len(how.slots)])
            op = (Chunk(fused.key, _by_slot(keys, len(how.slots)), 1, sizes, 0) if stacked
                  else Chunk(fused.key, keys, 0, sizes))
            return op if fits(op, _shapes(fused, parts)) else None
        dims = self.dims()
        if isinstance(dims, str):
            return dims.format(target=join_key(parts[0].key), source=join_key(fused.key))
        if dims.heads % dims.kv_heads:
            raise PlanError(f"{dims.origin}: {dims.text()}; query heads must fill the key/value groups evenly")
        pairs = tuple(slot in ROTARY and fusing.rotary != apart.rotary for slot in how.slots)
        heads = tuple(dims.heads // dims.kv_heads if slot == "q" else 1 for slot in how.slots)
        op = SplitGroups(fused.key, keys, dims.kv_heads, heads, how.slots, dims.head_dim, pairs)
        if not fits(op, _shapes(fused, parts)):
            raise PlanError(f"{join_key(fused.key)} {list(fused.shape)} does not split into "
                            f"{', '.join(f'{join_key(p.key)} {list(p.shape)}' for p in parts[:len(how.slots)])} as "
                            f"{dims.origin} says ({dims.text()}); the metadata is not this checkpoint's.")
        return op


#: The kinds whose shapes the planner checks itself (a target of another shape is its mismatch).
_PLAIN = (Rename, Stack, Unstack)


def _other_architecture(source: Naming, target: Naming, have: Mapping[tuple[int | None, str], Entry],
                        want: Mapping[tuple[int | None, str], Entry]) -> dict[KeyPath, str]:
    """Where the two sides are different architectures (:data:`ARCHITECTURE`), the target keys
    that say so, each with why: a slot the target has and the checkpoint lacks, and the slot
    that goes with one the checkpoint has and the target lacks. Compared where both sides hold
    layers (a pipeline stage may hold none), and the final norm where both hold one. Nothing is
    composed then: the other keys are left to the name matcher, which names them."""
    layers = all(any(layer is not None for layer, _ in units) for units in (have, want))
    norms = (None, "norm") in have and (None, "norm") in want

    def held(names: Naming, units: Mapping[tuple[int | None, str], Entry]) -> dict[str, list[Entry]]:
        found: dict[str, list[Entry]] = {}
        for (layer, part), entry in units.items():
            for slot in names.slots(part):
                if slot in ARCHITECTURE and (layers if layer is not None else norms):
                    found.setdefault(slot, []).append(entry)
        return found

    def keys(names: Naming, slot: str) -> list[KeyPath]:
        return [entry.key for (_, part), entry in want.items() if slot in names.slots(part)]

    ours, theirs = held(source, have), held(target, want)
    hints: dict[KeyPath, str] = {}
    for slot in theirs.keys() - ours.keys():
        for key in keys(target, slot):
            hints[key] = (f"the target ({target.name}) has {ARCHITECTURE[slot][0]}, which the checkpoint "
                          f"({source.name}) lacks: another architecture")
    for slot in ours.keys() - theirs.keys():
        said = (f"the checkpoint ({source.name}) has {ARCHITECTURE[slot][0]} ({join_key(ours[slot][0].key)}), which "
                f"the target ({target.name}) has no place for: another architecture")
        for key in keys(target, ARCHITECTURE[slot][1]) or [entry.key for entry in want.values()]:
            hints.setdefault(key, said)
    return hints


def _every_layer(have: Mapping[tuple[int | None, str], Entry], part: str) -> list[Entry]:
    """Each layer's ``part``, layer 0 on, where the layers run without a gap (else none)."""
    layers = []
    while (len(layers), part) in have:
        layers.append(have[len(layers), part])
    return layers if layers and not any(at not in (None, STACKED) and at >= len(layers) and p == part
                                        for at, p in have) else []


def _listed_at(listed: bool, count: int) -> int | str | None:
    """Where the layer factor of a side whose arrays are each one layer lies: on a leading axis
    of their own (several), or, one array, joined to its last axis (a factor of 1)."""
    return None if not listed else 0 if count > 1 else "join"


def _with_layer(axes: Axes, at: int | str | None) -> Axes:
    if at is None:
        return axes
    if at == "join":
        return (*axes[:-1], (*axes[-1], "layer"))
    return (*axes[:at], ("layer",), *axes[at:])


def _heads_together(axes: Axes) -> bool:
    """Whether ``axes`` keep each head's rows in one axis (heads x head_dim), or have no heads."""
    return all(("heads" in axis) == ("head_dim" in axis) for axis in axes)


def _refined(axes: Axes, apart: bool, rotary: str | None) -> Axes:
    """``axes`` with heads x head_dim as one factor (``apart`` false: no head count needed), or
    with each head's rotary dimensions as ``rotary`` lays them out."""
    if not apart:
        return tuple(tuple("rows" if name == "heads" else name for name in axis if name != "head_dim") for axis in axes)
    if rotary is None:
        return axes
    return tuple(tuple(part for name in axis for part in (_ROTARY_FACTORS[rotary] if name == "head_dim" else (name,)))
                 for axis in axes)


def _layers(entry: Entry) -> tuple[int, ...]:
    return tuple(range(entry.shape[0])) if entry.shape else ()


def _by_slot(keys: tuple[KeyPath, ...], slots: int) -> tuple[KeyPath, ...]:
    """Layer-major keys (each layer's slots in turn) as slot-major runs (each slot's layers)."""
    return tuple(key for start in range(slots) for key in keys[start::slots])


def _shapes(fused: Entry, parts: list[Entry]) -> Callable[[KeyPath], tuple[int, ...]]:
    shapes = {fused.key: fused.shape, **{p.key: p.shape for p in parts}}
    return shapes.__getitem__


# -- dimensions from metadata ---------------------------------------------------------------------


#: Each kind of model description: where it is read (for messages), and its fields for the query
#: heads, the key/value heads, head_dim (``None``: never given) and the hidden size head_dim
#: defaults from (``hidden // heads``, as each producer defaults it).
DESCRIPTIONS = {"meta": ("params.json", "n_heads", "n_kv_heads", None, "dim"),
                "megatron": ("run_config.yaml", "num_attention_heads", "num_query_groups", "kv_channels", "hidden_size"),
                "litgpt": ("model_config.yaml", "n_head", "n_query_groups", "head_size", "n_embd"),
                "deepspeed": ("the pipeline checkpoint's args (mp_rank_00_model_states.pt)", "num_attention_heads",
                              "num_kv_heads", None, "hidden_size"),
                "hf": ("the Hugging Face folder's config.json", "num_attention_heads", "num_key_value_heads",
                       "head_dim", "hidden_size")}


def read_dims(config: Mapping | None) -> Dims | None:
    """The :class:`Dims` a model description gives -- Meta's ``params.json`` (``n_heads``),
    litgpt's ``model_config.yaml`` (``n_head``, ``n_query_groups``, ``head_size``), Megatron's run
    config (``num_query_groups``, ``kv_channels``), the args a DeepSpeed pipeline checkpoint
    saves (GPT-NeoX's: ``num_layers``, ``padded_vocab_size`` beside the head count), a Hugging
    Face ``config.json`` -- or ``None`` without one; a value that is no positive whole number is
    refused, naming it."""
    if config is None:
        return None
    kind = ("meta" if "n_heads" in config else "litgpt" if "n_head" in config else
            "megatron" if "num_query_groups" in config or "kv_channels" in config else
            "deepspeed" if "padded_vocab_size" in config and "num_layers" in config else "hf")
    origin, heads_field, kv_field, head_dim_field, hidden_field = DESCRIPTIONS[kind]
    heads = _positive(config, heads_field, origin)
    kv = _positive(config, kv_field, origin, heads)
    if head_dim_field is None or config.get(head_dim_field) is None:
        head_dim = _positive(config, hidden_field, origin) // heads
    else:
        head_dim = _positive(config, head_dim_field, origin)
    return Dims(heads, kv, head_dim, origin, (heads_field, kv_field, head_dim_field or hidden_field))


def agreeing(source: Dims | None, target: Dims | None) -> Dims | None:
    """The one set of dimensions two sides' metadata give; a near miss -- other head counts for
    the same shapes, the silent error of hand-written converters -- is refused, naming both."""
    if source is None or target is None:
        return source or target
    if (source.heads, source.kv_heads, source.head_dim) != (target.heads, target.kv_heads, target.head_dim):
        raise MetadataConflict(f"{source.origin} (the checkpoint's) says {source.text()}, but {target.origin} (the "
                        f"target's) says {target.text()}: the same shapes under another head grouping would load "
                        "without an error and compute garbage. Build the target from the checkpoint's own config.")
    return source


def _positive(config: Mapping, key: str, origin: str, default: int | None = None) -> int:
    """``config[key]`` (``default`` where it is absent or null), which must be a positive whole number."""
    value = config.get(key)
    if value is None:
        value = default
    if type(value) is not int or value < 1:
        raise PlanError(f"{origin}: {key} is {value!r:.40}, not a positive whole number; the head layout of "
                        "the query and key projections depends on it. Keep the checkpoint's own config beside it.")
    return value
