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
``[gate; up]``), and whether its rotary embedding takes each head's pairs interleaved (Meta's
original layout, torchtitan). :func:`pair` plans one load between two namings slot by slot: a
rename where both keep a slot alike, a :class:`~ckptshim.ops.Reorder` per head where their rotary
conventions differ, a split or join where one fuses what the other keeps apart -- each an op
ckptshim already has, or the query-group kinds (:class:`~ckptshim.ops.SplitGroups`), so adding a
family is one :class:`Naming`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from ckptshim.errors import MetadataConflict, PlanError
from ckptshim.inventory import Entry, Inventory, KeyPath, join_key
from ckptshim.ops import Chunk, Op, Rename, Reorder, SplitGroups, Unstack, fits
from ckptshim.rules import Paired
from ckptshim.rules.prefixes import strip_wrappers

#: One layer's slots, and those outside the layers.
LAYER_SLOTS = ("q", "k", "v", "o", "q_bias", "k_bias", "v_bias", "q_norm", "k_norm", "gate", "up", "down",
               "attn_norm", "mlp_norm")
TOP_SLOTS = ("embed", "norm", "head")
#: How a rotary embedding takes each head's dimensions: two halves (Hugging Face, Megatron-Core)
#: or interleaved pairs (Meta's original layout, torchtitan's Llama, torchtune).
HALVES, PAIRS = "halves", "pairs"
#: The slots the rotary embedding turns (the query and key rows, and their biases where a model
#: has them: Qwen2), and those of them laid out by query head (the others by key/value head).
ROTARY = ("q", "k", "q_bias", "k_bias")
QUERY = ("q", "q_bias")
#: A layer index that stands for every layer: a producer's stacked array (Megatron-Core stores
#: its layers so, one array per slot with the layer on axis 0).
STACKED = -1


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
        """A rotary slot's head count and the metadata field that gave it."""
        return (self.heads, self.fields[0]) if slot in QUERY else (self.kv_heads, self.fields[1])

    def text(self) -> str:
        return (f"{self.heads} heads ({self.fields[0]}) in {self.kv_heads} key/value groups ({self.fields[1]}), "
                f"head_dim {self.head_dim}")


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
    - ``no_rotary``: where ``rotary`` is ``None``, why, and what to do: the hint on each query and
      key row left unmapped (``{source}``: the checkpoint's key).
    """

    name: str
    layers: KeyPath
    rows: Mapping[str, tuple[KeyPath, ...]]
    top: Mapping[str, KeyPath]
    rotary: str | None
    fused: Mapping[str, Fused] = field(default_factory=dict)
    stacked: bool = False
    no_rotary: str = ""

    def __post_init__(self) -> None:
        if self.rotary is None and not self.no_rotary:
            raise ValueError(f"{self.name}: names without a rotary convention say why (no_rotary)")
        if self.rotary != HALVES and any(how.by_group for how in self.fused.values()):
            raise ValueError(f"{self.name}: a query-group fusion is read as rotary halves (SplitGroups' pairs "
                             "flag marks the parts that hold interleaved pairs)")
        spellings = {spelling: part for part, spelled in self.rows.items() for spelling in spelled}
        object.__setattr__(self, "_parts", spellings)
        object.__setattr__(self, "_top", {key: slot for slot, key in self.top.items()})

    def with_rotary(self, rotary: str) -> Naming:
        """These names with the rotary convention of the model family a config named."""
        return replace(self, rotary=rotary)

    def slots(self, part: str) -> tuple[str, ...]:
        return self.fused[part].slots if part in self.fused else (part,)

    def locate(self, key: KeyPath, stacked: bool = False) -> tuple[int | None, str] | None:
        """``(layer, part)`` of a key under these names (wrappers left out): ``layer`` ``None``
        outside the layers, :data:`STACKED` for a stacked array (only where ``stacked``)."""
        key = strip_wrappers(key)
        prefix = len(self.layers)
        if key[:prefix] == self.layers and len(key) > prefix + 1:
            if key[prefix].isdigit() and key[prefix + 1:] in self._parts:
                return int(key[prefix]), self._parts[key[prefix + 1:]]
            if stacked and key[prefix:] in self._parts:
                return STACKED, self._parts[key[prefix:]]
        slot = self._top.get(key)
        return None if slot is None else (None, slot)

    def key(self, unit: tuple[int | None, str]) -> KeyPath:
        """A unit's key under these names (its own spelling)."""
        layer, part = unit
        return self.top[part] if layer is None else (*self.layers, str(layer), *self.rows[part][0])

    def units(self, inventory: Inventory, stacked: bool = False) -> dict[tuple[int | None, str], Entry]:
        """Each entry of ``inventory`` these names know, by ``(layer, part)``; two entries of one
        unit are left to the planner, which reports them."""
        found: dict[tuple[int | None, str], Entry] = {}
        clashes = set()
        for key, entry in inventory.items():
            unit = self.locate(key, stacked and self.stacked)
            if unit is not None and found.setdefault(unit, entry) is not entry:
                clashes.add(unit)
        for unit in clashes:
            del found[unit]
        return found

    def marks(self, inventory: Inventory, root: KeyPath = ()) -> bool:
        """Whether ``inventory`` holds layer 0's first row (the query projection, or the fused
        array holding it) under these names (below ``root``: the attribute a Lightning module
        holds the model in): looked up, not searched for, so that loads of other models pay one
        lookup per producer."""
        first = next(iter(self.rows.values()))[0]
        return (*root, *self.layers, "0", *first) in inventory


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
         stacked: bool = False) -> Paired:
    """The ops that carry what ``source`` holds under ``source_names`` into ``target``'s keys
    under ``target_names``: the composition source -> canonical -> target, slot by slot.

    ``dims`` gives the dimensions (read lazily: a load that needs no head count reads none); a
    target it cannot fill without them is missing, with the hint. ``stacked``: the checkpoint's
    own metadata says its producer stored its layers stacked.
    """
    have = source_names.units(source, stacked)
    want = target_names.units(target)
    composer = _Composer(source_names, target_names, have, dims)
    for unit in want:
        if unit not in composer.done:
            composer.fill(unit, want)
    return Paired(tuple(composer.ops), composer.missing, (f"{source_names.name} -> {target_names.name} names",))


@dataclass(eq=False)
class _Composer:
    """One :func:`pair`: the ops found so far, the targets missing (with hints), the target units
    done, and the dimensions once read."""

    source: Naming
    target: Naming
    have: Mapping[tuple[int | None, str], Entry]
    dims_source: DimsSource
    ops: list[Op] = field(default_factory=list)
    missing: dict[KeyPath, str] = field(default_factory=dict)
    done: set = field(default_factory=set)
    _dims: Dims | str | None = None

    def dims(self) -> Dims | str:
        if self._dims is None:
            self._dims = self.dims_source()
        return self._dims

    def fill(self, unit: tuple[int | None, str], want: Mapping[tuple[int | None, str], Entry]) -> None:
        layer, part = unit
        slots = self.target.slots(part)
        holder = self._holder(layer, slots[0])
        if holder is None:
            return  # left to the name matcher, which reports it
        (held_layer, held_part), entry = holder
        held_slots = self.source.slots(held_part)
        layers = _layers(entry) if held_layer == STACKED else (layer,)
        if held_slots == slots:
            if self.source.fused.get(held_part) != self.target.fused.get(part):
                return  # one array fused two ways (litgpt's two layouts): left to the name matcher
            targets = [want.get((at, part)) for at in layers]
            if None in targets:
                return
            self._add(self._same(entry, targets, slots[0], held_layer == STACKED), targets)
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

    def _add(self, op: Op | str | None, targets: list[Entry], invert: bool = False) -> None:
        for entry in targets:
            self.done.add(self.target.locate(entry.key))
        if op is None:
            return
        if isinstance(op, str):
            for entry in targets:
                self.missing[entry.key] = op
            return
        self.ops.append(op.inverse() if invert else op)

    def _same(self, entry: Entry, targets: list[Entry], slot: str, stacked: bool) -> Op | str | None:
        """One slot (or one fused part) kept alike: a rename or an unstack, or, where the rotary
        conventions differ, each head's rotary dimensions reordered."""
        if stacked:
            if slot in ROTARY and self.source.rotary != self.target.rotary:
                return None  # no producer stacks an unfused query; left to the name matcher
            return Unstack(entry.key, tuple(t.key for t in targets), 0)
        (target,) = targets
        if slot not in ROTARY or self.source.rotary == self.target.rotary:
            return Rename(entry.key, target.key)
        unknown = next((names for names in (self.source, self.target) if names.rotary is None), None)
        if unknown is not None:
            return unknown.no_rotary.format(source=join_key(entry.key))
        dims = self.dims()
        if isinstance(dims, str):
            return dims.format(target=join_key(target.key), source=join_key(entry.key))
        heads, heads_field = dims.of(slot)
        half = dims.head_dim // 2
        rows = entry.shape[0] if entry.shape else 0
        if rows != heads * dims.head_dim or dims.head_dim % 2 or entry.shape != target.shape:
            raise PlanError(f"{join_key(entry.key)} {list(entry.shape)}: {dims.origin} says {heads} heads "
                            f"({heads_field}) of head_dim {dims.head_dim}, which do not divide its {rows} rows into "
                            f"rotary halves (or {self.target.name}'s {join_key(target.key)} is "
                            f"{list(target.shape)}); the metadata is not this checkpoint's. Keep the checkpoint's "
                            "own config beside it.")
        factors = (heads, 2, half) if self.source.rotary == HALVES else (heads, half, 2)
        return Reorder(entry.key, target.key, 0, factors, (0, 2, 1))

    def _split(self, fused: Entry, parts: list[Entry], part: str, stacked: bool, fusing: Naming | None = None,
               apart: Naming | None = None) -> Op | str:
        """The fused array ``fused`` (``part`` of ``fusing``'s names) cut into ``parts`` (layer by
        layer when ``stacked``), kept apart by ``apart``."""
        fusing, apart = fusing or self.source, apart or self.target
        how = fusing.fused[part]
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
                "hf": ("the Hugging Face folder's config.json", "num_attention_heads", "num_key_value_heads",
                       "head_dim", "hidden_size")}


def read_dims(config: Mapping | None) -> Dims | None:
    """The :class:`Dims` a model description gives -- Meta's ``params.json`` (``n_heads``),
    litgpt's ``model_config.yaml`` (``n_head``, ``n_query_groups``, ``head_size``), Megatron's run
    config (``num_query_groups``, ``kv_channels``), a Hugging Face ``config.json`` -- or ``None`` without one; a value that is no positive whole number is
    refused, naming it."""
    if config is None:
        return None
    kind = ("meta" if "n_heads" in config else "litgpt" if "n_head" in config else
            "megatron" if "num_query_groups" in config or "kv_channels" in config else "hf")
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
