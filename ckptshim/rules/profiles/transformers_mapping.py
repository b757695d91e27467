"""transformers' conversion mapping, translated into ckptshim ops at load time.

transformers 5 converts checkpoints while ``from_pretrained`` loads them, from a table it
publishes per model class (``transformers.conversion_mapping``): ``WeightRenaming``\\ s (regexes,
capture groups included) rename keys, and ``WeightConverter``\\ s chain tensor operations --
Mixtral's per-expert ``block_sparse_moe.experts.{e}.w1/w3.weight`` become one fused
``mlp.experts.gate_up_proj`` (``MergeModulelist(0)`` then ``Concatenate(1)``). A plain
``load_state_dict``, ``dcp.load`` or ``set_model_state_dict`` never sees that table.

:class:`ConversionLayout` reads it for the model at hand and pairs keys as transformers would,
by running transformers' own renaming (``rename_source_key``) over the actual keys of one side;
each rename becomes an exact ``Rename`` of one key onto another, and each converter, with the
keys it collected, one ckptshim op (see :data:`TRANSLATORS`). Which side is renamed decides the
direction, key by key: the checkpoint's keys onto the target's is ``from_pretrained``'s way; the
target's keys onto the checkpoint's, with every op inverted, is ``save_pretrained``'s way back
(a transformers-5 checkpoint into code of the transformers-4 era). A converter whose chain of
operations ckptshim cannot express is refused by name (:func:`untranslatable`), never skipped.

The mapping comes from the live module (:func:`from_module`) or, where the caller passed none,
from the checkpoint's own ``config.json`` (:func:`from_config`: ``architectures``, then
``model_type``, looked up in the same table). transformers is never imported here unless a
module is a ``PreTrainedModel`` (it is then already imported) or a config names a model type.
"""

from __future__ import annotations

import copy
import math
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckptshim.errors import PlanError
from ckptshim.inventory import Entry, Inventory, KeyPath, join_key, split_key
from ckptshim.ops import Chunk, Concat, Op, Rename, Reorder, Stack, Transpose, fits
from ckptshim.rules import Paired, Rules
from ckptshim.rules.context import LoadContext
from ckptshim.rules.profiles import decoders
from ckptshim.rules.prefixes import WRAPPER_SEGMENTS, strip_wrappers

#: A key component holding one index: ``3``, ``shard_3``.
_NUMBERED = re.compile(r"(\D*)(\d+)(\D*)")


@dataclass(frozen=True)
class Conversions:
    """transformers' conversion mapping for one model.

    ``transforms`` are transformers' own ``WeightTransform`` objects in the table's order;
    ``config`` is the model's config object (``PermuteForRope`` reads its head count; ``None``
    when unknown); ``origin`` says where the mapping came from, for messages;
    ``base_model_prefix`` is the model class's (``model`` for a ``...ForCausalLM``), which
    transformers adds to or strips from a renamed key that lands on the target only so;
    ``prefix`` is where the model's keys sit among the target's (a model nested in a container).
    """

    transforms: tuple[Any, ...]
    config: Any
    origin: str
    base_model_prefix: str | None = None
    prefix: KeyPath = ()


def from_module(module: Any) -> tuple[Conversions, ...]:
    """The mapping of every outermost transformers model in ``module`` (wrapper components in
    its path ignored, as the planner ignores them in keys); none for other modules."""
    modeling = sys.modules.get("transformers.modeling_utils")
    table = sys.modules.get("transformers.conversion_mapping")
    if modeling is None or table is None or not hasattr(table, "get_model_conversion_mapping"):
        return ()
    found: list[Conversions] = []
    claimed: list[str] = []
    for path, sub in module.named_modules():
        if not isinstance(sub, modeling.PreTrainedModel):
            continue
        if any(owner == "" or path.startswith(owner + ".") for owner in claimed):
            continue
        claimed.append(path)
        transforms = tuple(table.get_model_conversion_mapping(sub))
        if transforms:
            prefix = tuple(part for part in split_key(path) if part not in WRAPPER_SEGMENTS) if path else ()
            found.append(Conversions(transforms, sub.config, type(sub).__name__, sub.base_model_prefix or None, prefix))
    return tuple(found)


def from_config(config: Mapping[str, Any], origin: str) -> Conversions | None:
    """The mapping a ``config.json`` names: its ``architectures`` (class names take priority in
    transformers' table), else its ``model_type``; with transformers' legacy renames, as
    ``from_pretrained`` adds them. ``None`` when the config names no model transformers maps,
    or transformers is not installed."""
    model_type = config.get("model_type")
    architectures = config.get("architectures")
    names = [name for name in architectures if isinstance(name, str)] if isinstance(architectures, list) else []
    if not isinstance(model_type, str) and not names:
        return None
    try:
        import transformers
        from transformers import conversion_mapping as table
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    except Exception:  # not installed, or failing to import: its tables are not there to read
        return None
    transforms = next((found for name in names if (found := table.get_checkpoint_conversion_mapping(name))), None)
    if transforms is None and isinstance(model_type, str):
        transforms = table.get_checkpoint_conversion_mapping(model_type)
    if not transforms:
        return None
    try:
        model_config = CONFIG_MAPPING[model_type].from_dict(dict(config))
    except Exception:  # an unknown or malformed model type: ops that need the config refuse
        model_config = None
    return Conversions(tuple(transforms) + tuple(table.get_checkpoint_conversion_mapping("legacy")),
                       model_config, origin, _base_model_prefix(transformers, names))


def _base_model_prefix(transformers: Any, names: list[str]) -> str | None:
    """The ``base_model_prefix`` of the first class ``names`` (a config's ``architectures``)
    gives that transformers has; ``None`` when none does.

    Looking a name up imports transformers' own module for it, which can fail: a name may be a
    placeholder transformers puts in place of a class whose backend is missing (an image
    processor without torchvision or PIL), whose every attribute raises ``ImportError``. Such
    a name gives no prefix; a config's lookup never fails a load or a plan.
    """
    for name in names:
        try:
            prefix = getattr(getattr(transformers, name, None), "base_model_prefix", None)
        except Exception:  # ImportError from a placeholder; any error importing a model's code
            continue
        if isinstance(prefix, str) and prefix:
            return prefix
    return None


# -- translating one converter -------------------------------------------------------------------


@dataclass(frozen=True)
class Collected:
    """What one converter collected, as transformers collects it for one target.

    ``parts`` holds, per source pattern (in the converter's order), the keys it matched in
    index order; ``targets`` the keys its target patterns name; ``entries`` every key's entry.
    """

    converter: Any
    parts: tuple[tuple[KeyPath, ...], ...]
    targets: tuple[KeyPath, ...]
    entries: Mapping[KeyPath, Entry]
    config: Any

    @property
    def sources(self) -> tuple[KeyPath, ...]:
        return tuple(key for part in self.parts for key in part)

    def shape(self, key: KeyPath) -> tuple[int, ...]:
        return self.entries[key].shape

    @property
    def operations(self) -> list[Any]:
        return self.converter.operations


def _merge(group: Collected) -> Op:
    """``MergeModulelist(d)``: one pattern's keys stacked along ``d``."""
    (keys,), (target,) = _one_part(group), _one_target(group)
    return Stack(keys, target, group.operations[0].dim)


def _merge_concat(group: Collected) -> Op:
    """``MergeModulelist(d)`` then ``Concatenate(a)``: each pattern's keys stacked along ``d``,
    the stacks side by side along ``a`` (Mixtral's ``w1``/``w3`` into ``gate_up_proj``)."""
    (target,) = _one_target(group)
    merge, concat = group.operations
    counts = {len(part) for part in group.parts}
    if len(counts) != 1:
        raise PlanError(f"{join_key(target)}: transformers stacks {' and '.join(str(len(p)) for p in group.parts)} "
                        "experts side by side, but each part must have as many; the checkpoint lacks some. "
                        "Load a complete checkpoint.")
    if concat.dim == merge.dim:  # side by side along the stacking axis: one stack of them all
        return Stack(group.sources, target, merge.dim)
    sizes = tuple(_stacked(group.shape(part[0]), merge.dim, len(part))[concat.dim] for part in group.parts)
    return Concat(group.sources, target, concat.dim, sizes, merge.dim)


def _concat(group: Collected) -> Op:
    """``Concatenate(a)``: every key, pattern by pattern, side by side along ``a``."""
    (target,) = _one_target(group)
    axis = group.operations[0].dim
    return Concat(group.sources, target, axis, tuple(group.shape(key)[axis] for key in group.sources))


def _chunk(group: Collected) -> Op:
    """``Chunk(a)``: one key cut into equal parts along ``a``, as ``torch.chunk`` cuts it."""
    source = _one_source(group)
    axis, length, count = group.operations[0].dim, group.shape(source)[group.operations[0].dim], len(group.targets)
    step = math.ceil(length / count)
    sizes = tuple(min(step, length - start) for start in range(0, length, step))
    return Chunk(source, group.targets, axis, _require_count(group, sizes))


def _split(group: Collected) -> Op:
    """``Split(a)``: one key cut along ``a`` into parts sized like each target."""
    source = _one_source(group)
    axis = group.operations[0].dim
    return Chunk(source, group.targets, axis, tuple(group.shape(key)[axis] for key in group.targets))


def _transpose(group: Collected) -> Op:
    """``Transpose(d0, d1)``: two axes swapped (with ``check_dims``, only where the shapes say so)."""
    source, (target,) = _one_source(group), _one_target(group)
    op = group.operations[0]
    if op.check_dims and group.shape(source) == group.shape(target):
        return Rename(source, target)
    perm = list(range(len(group.shape(source))))
    perm[op.dim0], perm[op.dim1] = perm[op.dim1], perm[op.dim0]
    return Transpose(source, target, tuple(perm))


def _interleave(group: Collected) -> Op:
    """``Interleave(a)``: the two halves of axis ``a`` interleaved (or, inverted, taken apart)."""
    source, (target,) = _one_source(group), _one_target(group)
    op = group.operations[0]
    half = group.shape(source)[op.dim] // 2
    return Reorder(source, target, op.dim, (2, half) if op.inverse else (half, 2), (1, 0))


def _permute_for_rope(group: Collected) -> Op:
    """``PermuteForRope``: per head, rotary pairs interleaved (``[d/2, 2]``) become its two
    halves (``[2, d/2]``) along axis 0, the head count read from the model's config."""
    source, (target,) = _one_source(group), _one_target(group)
    op = group.operations[0]
    (pattern,) = group.converter.source_patterns
    if op.permute_layer_names is not None and not any(name in pattern for name in op.permute_layer_names):
        return Rename(source, target)
    if group.config is None:
        raise PlanError(f"{join_key(target)}: transformers permutes it for RoPE with the model's head count, "
                        "but no config says it. Pass the model itself, or keep config.json beside the checkpoint.")
    config = getattr(group.config, op.subconfig_key, group.config) if op.subconfig_key else group.config
    heads = getattr(config, "num_attention_heads", 1)
    half = group.shape(source)[0] // heads // 2
    return Reorder(source, target, 0, (heads, 2, half) if op.inverse else (heads, half, 2), (0, 2, 1))


#: transformers' chains of operations (class names) ckptshim translates, each into one op.
TRANSLATORS: Mapping[tuple[str, ...], Callable[[Collected], Op]] = {
    ("MergeModulelist",): _merge,
    ("MergeModulelist", "Concatenate"): _merge_concat,
    ("Concatenate",): _concat,
    ("Chunk",): _chunk,
    ("Split",): _split,
    ("Transpose",): _transpose,
    ("Interleave",): _interleave,
    ("PermuteForRope",): _permute_for_rope,
}


def chain(converter: Any) -> tuple[str, ...]:
    """A converter's operations, by class name."""
    return tuple(type(op).__name__ for op in converter.operations)


def untranslatable(transform: Any) -> str | None:
    """Why ckptshim cannot run ``transform`` (its chain of operations), or ``None`` if it can.

    Every ``WeightRenaming`` can (transformers' own code renames the keys); a converter can
    when its chain is one of :data:`TRANSLATORS` -- except a ``Chunk`` whose number of parts a
    config field gives (``num_shards_attribute``): its targets are named from that number, which
    no checkpoint key says. (A ``Concatenate`` of such shards needs no number: it takes what
    the checkpoint holds, and its way back cuts at those parts' sizes.)
    """
    operations = getattr(transform, "operations", None)
    if operations is None:
        return None
    names = chain(transform)
    if names not in TRANSLATORS:
        return " + ".join(names)
    if names == ("Chunk",) and operations[0].num_shards_attribute is not None:
        return f"Chunk(num_shards_attribute={operations[0].num_shards_attribute!r})"
    return None


def _one_source(group: Collected) -> KeyPath:
    sources = group.sources
    if len(sources) != 1:
        raise PlanError(f"{join_key(group.targets[0])}: transformers' {' + '.join(chain(group.converter))} takes one "
                        f"checkpoint key, but {len(sources)} match ({join_key(sources[0])}, ...). "
                        "Load a checkpoint with one.")
    return sources[0]


def _one_part(group: Collected) -> tuple[tuple[KeyPath, ...]]:
    if len(group.parts) != 1:
        raise PlanError(f"{join_key(group.targets[0])}: transformers' {' + '.join(chain(group.converter))} "
                        f"expects one source pattern, but {len(group.parts)} matched.")
    return group.parts  # type: ignore[return-value]


def _one_target(group: Collected) -> tuple[KeyPath]:
    if len(group.targets) != 1:
        raise PlanError(f"{join_key(group.targets[0])}: transformers' {' + '.join(chain(group.converter))} "
                        f"makes one array, but the converter names {len(group.targets)}.")
    return group.targets  # type: ignore[return-value]


def _require_count(group: Collected, sizes: tuple[int, ...]) -> tuple[int, ...]:
    if len(sizes) != len(group.targets):
        raise PlanError(f"{join_key(_one_source(group))} {group.shape(_one_source(group))}: torch.chunk cuts it "
                        f"into {len(sizes)} parts, not the {len(group.targets)} transformers names.")
    return sizes


def _stacked(shape: tuple[int, ...], axis: int, count: int) -> tuple[int, ...]:
    return shape[:axis] + (count,) + shape[axis:]


# -- the layout ----------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)  # one per mapping read; transformers' objects compare by identity
class ConversionLayout:
    """The :class:`~ckptshim.rules.Layout` that pairs keys as transformers' mapping does."""

    conversions: Conversions

    def pair(self, source: Inventory, target: Inventory, rules: Rules) -> Paired:
        ckpt, model = _relative(source, self.conversions.prefix), _relative(target, self.conversions.prefix)
        loading = self._translate(ckpt, model)
        found = set(loading)  # the same op found both ways (a base-model prefix) counts once
        ops = loading + [op for op in (back.inverse() for back in self._translate(model, ckpt)) if op not in found]
        for side in ("sources", "targets"):  # each key has one place, or which is meant is a guess
            claimed: dict[KeyPath, Op] = {}
            for op in ops:
                for key in getattr(op, side):
                    other = claimed.setdefault(key, op)
                    if other is not op:
                        raise PlanError(f"{join_key(key)}: transformers' mapping of {self.conversions.origin} gives "
                                        f"it two places (`{other.describe()}` and `{op.describe()}`); ckptshim "
                                        "will not pick one. Load a checkpoint whose keys are all in one layout.")
        return Paired(tuple(ops))

    def _translate(self, keys: Mapping[str, Entry], onto: Mapping[str, Entry]) -> list[Op]:
        """The ops that take ``keys`` (one side, relative to the model) onto ``onto``, found by
        transformers' own renaming of each key (with its ``base_model_prefix`` added or stripped
        where only that lands on ``onto``). A key whose new name ``onto`` lacks, or whose own name
        ``onto`` has, is left to the planner (transformers keeps the old name then)."""
        if not keys:
            return []
        from transformers import core_model_loading as core

        transforms = copy.deepcopy(list(self.conversions.transforms))  # renamings keep state
        renamings = [t for t in transforms if isinstance(t, core.WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, core.WeightConverter)]
        by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
        ops: list[Op] = []
        collected: dict[str, dict[str, list[str]]] = {}
        for name in sorted(keys, key=core.dot_natural_key):
            renamed, pattern = core.rename_source_key(name, renamings, converters, self.conversions.base_model_prefix,
                                                      onto)
            if name in onto:
                continue
            if pattern is not None:
                collected.setdefault(renamed, {}).setdefault(pattern, []).append(name)
            elif renamed != name and renamed in onto:
                ops.append(Rename(keys[name].key, onto[renamed].key))
        for renamed, parts in collected.items():
            op = self._convert(renamed, parts, by_pattern, keys, onto)
            if op is not None:
                ops.append(op)
        return ops

    def _convert(self, renamed: str, parts: dict[str, list[str]], by_pattern: Mapping[str, Any],
                 keys: Mapping[str, Entry], onto: Mapping[str, Entry]) -> Op | None:
        """One converter's op for the keys it collected under ``renamed`` (its first target)."""
        converter = by_pattern[next(iter(parts))]
        targets = [renamed.replace(converter.target_patterns[0], pattern, 1) for pattern in converter.target_patterns]
        if not all(name in onto for name in targets):
            return None  # not this target's layout: the planner reports the keys
        why = untranslatable(converter)
        if why is not None:
            raise PlanError(
                f"{', '.join(targets)}: transformers' mapping of {self.conversions.origin} makes "
                f"{'them' if len(targets) > 1 else 'it'} from {', '.join(_indexed(parts))} with {why}, "
                "which ckptshim cannot express as a load of the stored bytes; it will not load without "
                "that step. Load this checkpoint with from_pretrained, or convert it there and save it.")
        ordered = tuple(tuple(keys[name].key for name in _in_index_order(parts[pattern]))
                        for pattern in converter.source_patterns if pattern in parts)
        entries = {entry.key: entry for entry in (*(keys[n] for p in parts.values() for n in p),
                                                  *(onto[n] for n in targets))}
        group = Collected(converter, ordered, tuple(onto[name].key for name in targets), entries,
                          self.conversions.config)
        op = TRANSLATORS[chain(converter)](group)
        _require_shapes(op, group)
        return op


def _relative(inventory: Inventory, prefix: KeyPath) -> dict[str, Entry]:
    """Each entry by its dotted name relative to ``prefix``, wrapper components left out; keys
    outside ``prefix``, and keys that would share one name, are left to the planner."""
    found: dict[str, Entry] = {}
    clashes: set[str] = set()
    for key, entry in inventory.items():
        bare = strip_wrappers(key) if not WRAPPER_SEGMENTS.isdisjoint(key[:-1]) else key
        if bare[:len(prefix)] != prefix:
            continue
        name = join_key(bare[len(prefix):])
        if found.setdefault(name, entry) is not entry:
            clashes.add(name)
    for name in clashes:
        del found[name]
    return found


def _in_index_order(names: list[str]) -> list[str]:
    """One pattern's keys by the number its ``*`` matched (``experts.{i}``, ``shard_{i}``): they
    must differ in that one component only, and hold every index from 0 once, or stacking them
    would be a guess."""
    if len(names) == 1:
        return names
    paths = [split_key(name) for name in names]
    varying = {at for at in range(len(paths[0])) if len({path[at] if at < len(path) else None for path in paths}) > 1}
    if len({len(path) for path in paths}) == 1 and len(varying) == 1:
        (at,) = varying
        found = [_NUMBERED.fullmatch(path[at]) for path in paths]
        if all(found) and len({(m.group(1), m.group(3)) for m in found}) == 1:
            by_index = {int(m.group(2)): name for m, name in zip(found, names)}
            if sorted(by_index) == list(range(len(names))):
                return [by_index[i] for i in range(len(names))]
    raise PlanError(f"transformers' mapping stacks {', '.join(names[:4])}{', ...' if len(names) > 4 else ''} "
                    "as one list, but they are not indices 0..N-1 of one list (some are missing, or the keys "
                    "differ in more than the index); ckptshim will not guess their order. Load a complete checkpoint.")


def _indexed(parts: Mapping[str, Sequence[str]]) -> list[str]:
    return [names[0] + (f" (and {len(names) - 1} more)" if len(names) > 1 else "") for names in parts.values()]


def _require_shapes(op: Op, group: Collected) -> None:
    """The op's targets must have the shapes it makes from its sources, as transformers'
    ``convert`` would make them; else the checkpoint is not this model's."""
    if not fits(op, group.shape):
        shown = ", ".join(f"{join_key(key)} {group.shape(key)}" for key in (*op.sources[:2], *op.targets[:2]))
        raise PlanError(f"{join_key(op.targets[0])}: transformers' {' + '.join(chain(group.converter))} does not "
                        f"fit these shapes ({shown}, ...). Build the model with the checkpoint's config.")


@dataclass(frozen=True)
class TransformersProfile:
    """The layouts the target's own model publishes (transformers' conversion mapping of each
    transformers model in it: :func:`from_module`); where it publishes none, the mapping of the
    model the checkpoint's model config names (:func:`from_config`). Not beside the decoder hub
    (:mod:`.decoders`), which maps another producer's names, no transformers model's."""

    name: str = "transformers conversion mapping"

    def applies(self, context: LoadContext) -> bool:
        return context.backend == "torch" and decoders.sides(context) is None

    def rules(self, context: LoadContext) -> Mapping[str, Any]:
        if context.facts.layouts:
            return {"layouts": context.facts.layouts}
        if context.model_config is None:
            return {}
        found = from_config(context.model_config, f"config.json of {context.source.source}")
        return {"layouts": (ConversionLayout(found),)} if found is not None else {}


PROFILE = TransformersProfile()
