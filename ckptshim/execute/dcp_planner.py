"""A DCP load planner that loads checkpoints saved under other names or another layer layout.

DCP plans a load by looking up each flat key of the caller's state dict in the checkpoint's
metadata, then reading the overlap of every stored chunk with every local shard.
:class:`RemappingLoadPlanner` puts ckptshim's plan in between. The planner that would have run
-- the caller's own, or DCP's default -- is shown a *virtual* metadata in which every
destination key lists the stored chunks it comes from: a renamed key the source's chunks as
they are (free); a stacked key each per-layer chunk as a one-layer slab; a per-layer key its
layer's slice of each stacked chunk. Every read item it asks for is then translated back to the
real stored chunk, offsets and lengths, and its destination is the matching view of the caller's
tensor. So DCP's own resharding (DTensor, FSDP2, another number of ranks) runs unchanged on top
of the remapping, and planning still reads no tensor bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem

from ckptshim import config
from ckptshim.errors import PlanError
from ckptshim.execute.dcp_storage import Refusal
from ckptshim.inventory import Entry, Inventory, KeyPath, dtype_name, join_key, split_key
from ckptshim.log import logger, report_load
from ckptshim.planner import Plan, Rename, Stack, Synthesize, Unstack
from ckptshim.planner import plan as make_plan
from ckptshim.rules.layers import TORCH_SCAN_AXES
from ckptshim.rules import DEFAULT_RULES, Rules
from ckptshim.rules.buffers import derivable_rule
from ckptshim.rules.prefixes import strip_wrappers

HOOK = "torch.distributed.checkpoint.load"


@dataclass(frozen=True)
class _Link:
    """How one chunk of the virtual metadata maps onto a stored chunk.

    ``kind`` is ``"rename"`` (same block), ``"stack"`` (the virtual chunk is the stored one
    with a one-long ``axis`` inserted), ``"unstack"`` (the virtual chunk is the stored one's
    slice ``layer`` along ``axis``) or ``"keep"`` (a synthesized key: nothing is read).
    """

    kind: str
    fqn: str = ""
    offsets: tuple[int, ...] | None = None
    axis: int = 0
    layer: int = 0


@dataclass
class _Side:
    """One side of the load as the planner sees it: an inventory whose locations are DCP's flat
    keys, and which of those keys are Python objects rather than tensors."""

    inventory: Inventory
    objects: frozenset[KeyPath]

    def fqn(self, key: KeyPath) -> str:
        return self.inventory[key].location


def _app_levels(paths: Mapping[str, tuple]) -> set[str]:
    """The top-level state-dict names (``"model"``, ``"optim"``) that nest the flat keys."""
    return {str(path[0]) for path in paths.values() if len(path) > 1}


def _side(items: Mapping[str, tuple[tuple[int, ...], str] | None], paths: Mapping[str, tuple],
          strip_app: bool, source: str) -> _Side:
    """Build one side; ``items`` maps each flat key to ``(shape, dtype)`` or ``None`` (an object).

    With ``strip_app`` the top-level state-dict name is left out of the key path, so that a
    checkpoint saved as ``{"model": sd}`` and a state dict passed as ``sd`` (or the other way
    round) line up.
    """
    entries, objects, seen = [], set(), {}
    for fqn, spec in items.items():
        path = paths.get(fqn, (fqn,))
        key = split_key(fqn)
        if strip_app and len(path) > 1:
            key = key[len(split_key(str(path[0]))):]
        if key in seen:
            raise PlanError(
                f"{source} keys {seen[key]!r} and {fqn!r} both mean {join_key(key)!r} once the "
                "top-level state-dict name is set aside, so ckptshim cannot tell which one to use. "
                "Pass the state dict nested the way the checkpoint was saved.")
        seen[key] = fqn
        if spec is None:
            objects.add(key)
            spec = ((), "uint8")  # a placeholder: objects only ever match objects by name
        entries.append(Entry(key, spec[0], spec[1], fqn))
    return _Side(Inventory(entries, source), frozenset(objects))


def _sides(metadata: Metadata, state_dict: dict[str, Any], where: str) -> tuple[_Side, _Side, str | None]:
    """Both sides, and a note when a top-level state-dict name was set aside to match them."""
    flat, target_paths = flatten_state_dict(state_dict)
    source_paths = metadata.planner_data if isinstance(metadata.planner_data, Mapping) else {}
    source_apps, target_apps = _app_levels(source_paths), _app_levels(target_paths)
    renamed_app = len(source_apps) == len(target_apps) == 1 and source_apps != target_apps
    strip_source = bool(source_apps) and (not target_apps or renamed_app)
    strip_target = bool(target_apps) and (not source_apps or renamed_app)
    source_items = {fqn: ((tuple(md.size), dtype_name(md.properties.dtype))
                          if isinstance(md, TensorStorageMetadata) else None)
                    for fqn, md in metadata.state_dict_metadata.items()}
    target_items = {fqn: ((tuple(value.size()), dtype_name(value.dtype))
                          if isinstance(value, torch.Tensor) else None)
                    for fqn, value in flat.items()}
    names = [f"the {side}'s {', '.join(map(repr, sorted(apps)))}" for side, apps, strip in
             (("checkpoint", source_apps, strip_source), ("state dict", target_apps, strip_target)) if strip]
    return (_side(source_items, source_paths, strip_source, where),
            _side(target_items, target_paths, strip_target, "the state dict passed to dcp.load"),
            f"keys matched without the top-level name(s) {' and '.join(names)}" if names else None)


def _rules(target: _Side) -> Rules:
    return DEFAULT_RULES.extend(
        synthesize=[key for key in target.inventory if key not in target.objects
                    and derivable_rule(strip_wrappers(key)) is not None],
        scan_axes=TORCH_SCAN_AXES,
        strict=config.strict(),
    )


def _check_objects(plan: Plan, source: _Side, target: _Side) -> None:
    """A Python object loads only into a non-tensor value of the same name, and vice versa."""
    for op in plan.ops:
        if isinstance(op, (Rename, Stack, Unstack)):
            if any(k in source.objects for k in op.sources) != any(k in target.objects for k in op.targets):
                stored = "a Python object" if op.sources[0] in source.objects else "a tensor"
                raise PlanError(
                    f"checkpoint key {source.fqn(op.sources[0])!r} holds {stored}, but the state "
                    f"dict wants the other kind at {target.fqn(op.targets[0])!r}; DCP cannot load "
                    "one into the other. Pass a value of the stored kind.")


def _insert(values: tuple[int, ...], axis: int, value: int) -> tuple[int, ...]:
    return values[:axis] + (value,) + values[axis:]


def _remove(values: tuple[int, ...], axis: int) -> tuple[int, ...]:
    return values[:axis] + values[axis + 1:]


def _tensor_md(like: TensorStorageMetadata, size: tuple[int, ...],
               chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> TensorStorageMetadata:
    return TensorStorageMetadata(like.properties, torch.Size(size),
                                 [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks])


def _virtual(metadata: Metadata, plan: Plan, source: _Side, target: _Side) -> tuple[Metadata, dict[tuple[str, Any], _Link]]:
    """The metadata the wrapped planner sees, and how each of its chunks maps to a stored one."""
    stored = metadata.state_dict_metadata
    virtual = dict(stored)
    links: dict[tuple[str, Any], _Link] = {}
    for op in plan.ops:
        if isinstance(op, Rename):
            src, dst = source.fqn(op.source), target.fqn(op.target)
            md = virtual[dst] = stored[src]
            if src == dst:
                continue
            if isinstance(md, BytesStorageMetadata):
                links[dst, None] = _Link("rename", src)
            for chunk in getattr(md, "chunks", ()):
                offsets = tuple(chunk.offsets)
                links[dst, offsets] = _Link("rename", src, offsets)
        elif isinstance(op, Stack):
            dst, chunks = target.fqn(op.target), []
            for layer, key in enumerate(op.sources):
                for chunk in stored[source.fqn(key)].chunks:
                    offsets = _insert(tuple(chunk.offsets), op.axis, layer)
                    chunks.append((offsets, _insert(tuple(chunk.sizes), op.axis, 1)))
                    links[dst, offsets] = _Link("stack", source.fqn(key), tuple(chunk.offsets), op.axis)
            virtual[dst] = _tensor_md(stored[source.fqn(op.sources[0])], target.inventory[op.target].shape, chunks)
        elif isinstance(op, Unstack):
            md = stored[source.fqn(op.source)]
            for layer, key in enumerate(op.targets):
                dst, chunks = target.fqn(key), []
                for chunk in md.chunks:
                    start, count = chunk.offsets[op.axis], chunk.sizes[op.axis]
                    if start <= layer < start + count:
                        offsets = _remove(tuple(chunk.offsets), op.axis)
                        chunks.append((offsets, _remove(tuple(chunk.sizes), op.axis)))
                        links[dst, offsets] = _Link("unstack", source.fqn(op.source), tuple(chunk.offsets),
                                                    op.axis, layer - start)
                virtual[dst] = _tensor_md(md, target.inventory[key].shape, chunks)
        elif isinstance(op, Synthesize):
            dst, entry = target.fqn(op.target), target.inventory[op.target]
            like = TensorStorageMetadata(TensorProperties(dtype=getattr(torch, entry.dtype)), torch.Size(entry.shape), [])
            virtual[dst] = _tensor_md(like, entry.shape, [((0,) * len(entry.shape), entry.shape)])
            links[dst, (0,) * len(entry.shape)] = _Link("keep")
    return dataclasses.replace(metadata, state_dict_metadata=virtual), links


def _translate(item: ReadItem, link: _Link) -> ReadItem | None:
    """The read of the stored chunk that fills what ``item`` asks of the virtual one."""
    if link.kind == "keep":
        return None
    index = MetadataIndex(link.fqn, link.offsets)
    if link.kind == "rename":
        return dataclasses.replace(item, storage_index=index)
    if link.kind == "stack":
        return dataclasses.replace(item, storage_index=index,
                                   storage_offsets=torch.Size(_remove(tuple(item.storage_offsets), link.axis)),
                                   lengths=torch.Size(_remove(tuple(item.lengths), link.axis)))
    return dataclasses.replace(item, storage_index=index,
                               storage_offsets=torch.Size(_insert(tuple(item.storage_offsets), link.axis, link.layer)),
                               lengths=torch.Size(_insert(tuple(item.lengths), link.axis, 1)))


class RemappingLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner with ckptshim's key and layout mapping in front of it.

    ``inner`` is the caller's own planner, if they passed one: it then does all the planning
    (on the virtual metadata) and receives every ``resolve_tensor``/``commit_tensor``/
    ``load_bytes`` call for its own read items. Without one, this planner is DCP's default.
    A read item whose destination is a stacked or per-layer tensor resolves to a view of the
    caller's tensor shaped like the stored block, so the storage reader copies straight into it.
    """

    def __init__(self, inner: LoadPlanner | None = None) -> None:
        super().__init__()
        self._base: LoadPlanner = inner if inner is not None else super()
        self._allow_missing = bool(getattr(inner, "allow_partial_load", False))
        self._links: dict[tuple[str, Any], _Link] = {}
        self._virtual_items: dict[ReadItem, ReadItem] = {}
        self._resolved: dict[ReadItem, torch.Tensor] = {}

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        storage_data = getattr(metadata, "storage_data", None)
        if isinstance(storage_data, Refusal):  # the storage reader refused the checkpoint
            raise storage_data.error
        if metadata is not None and state_dict:
            where = str(getattr(metadata.storage_meta, "checkpoint_id", None) or "DCP checkpoint")
            source, target, note = _sides(metadata, state_dict, where)
            plan = make_plan(source.inventory, target.inventory, _rules(target))
            plan.require_complete(allow_missing=self._allow_missing, allow_unexpected=True)
            _check_objects(plan, source, target)
            report_load(HOOK, plan)  # on every rank: each loads its own part
            if note:
                logger.info("%s: %s", HOOK, note)
            metadata, self._links = _virtual(metadata, plan, source, target)
        self._base.set_up_planner(state_dict, metadata, is_coordinator)

    def create_local_plan(self) -> LoadPlan:
        plan = self._base.create_local_plan()
        items = []
        for item in plan.items:
            offsets = None if item.storage_index.offset is None else tuple(item.storage_index.offset)
            link = self._links.get((item.storage_index.fqn, offsets))
            real = item if link is None else _translate(item, link)
            if real is not None:
                if real is not item:
                    self._virtual_items[real] = item
                items.append(real)
        return dataclasses.replace(plan, items=items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return self._base.create_global_plan(global_plan)

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return self._base.finish_plan(central_plan)

    def load_bytes(self, read_item: ReadItem, value) -> None:
        self._base.load_bytes(self._virtual_items.get(read_item, read_item), value)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        virtual = self._virtual_items.get(read_item)
        if virtual is None:
            return self._base.resolve_tensor(read_item)
        tensor = self._resolved[read_item] = self._base.resolve_tensor(virtual)
        return tensor.view(read_item.lengths)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        virtual = self._virtual_items.get(read_item)
        if virtual is None:
            self._base.commit_tensor(read_item, tensor)
        else:
            self._base.commit_tensor(virtual, self._resolved.pop(read_item))
