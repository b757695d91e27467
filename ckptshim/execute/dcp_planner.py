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

Which plan to run is the loading layer's decision (:mod:`ckptshim.loading.dcp`), passed in as a
function; this module only executes it. It runs the op kinds in :data:`VIRTUAL` and refuses any
other before DCP plans a read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
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

from ckptshim.execute.dcp_storage import Refusal
from ckptshim.inventory import Inventory, KeyPath
from ckptshim.ops import Cast, Drop, Op, Rename, Stack, Synthesize, Unstack, require_kinds
from ckptshim.planner import Plan


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


@dataclass(frozen=True)
class FlatKeys:
    """One side of a DCP load as the planner sees it: an inventory whose locations are DCP's
    flat keys, and which of those keys are Python objects rather than tensors."""

    inventory: Inventory
    objects: frozenset[KeyPath]

    def fqn(self, key: KeyPath) -> str:
        return self.inventory[key].location


@dataclass(frozen=True)
class KeyMapping:
    """A checked plan from the checkpoint's flat keys to the state dict's."""

    plan: Plan
    source: FlatKeys
    target: FlatKeys


#: ``(metadata, state_dict, allow_missing) -> KeyMapping``: the loading layer's decision.
Prepare = Callable[[Metadata, dict[str, Any], bool], KeyMapping]


def _insert(values: tuple[int, ...], axis: int, value: int) -> tuple[int, ...]:
    return values[:axis] + (value,) + values[axis:]


def _remove(values: tuple[int, ...], axis: int) -> tuple[int, ...]:
    return values[:axis] + values[axis + 1:]


def _tensor_md(like: TensorStorageMetadata, size: tuple[int, ...],
               chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> TensorStorageMetadata:
    return TensorStorageMetadata(like.properties, torch.Size(size),
                                 [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks])


class _Virtual:
    """The metadata the wrapped planner sees, built op by op, and how each of its chunks maps to
    a stored one."""

    def __init__(self, metadata: Metadata, mapping: KeyMapping) -> None:
        self.stored = metadata.state_dict_metadata
        self.virtual = dict(self.stored)
        self.links: dict[tuple[str, Any], _Link] = {}
        self.source, self.target = mapping.source, mapping.target

    def rename(self, op: Rename) -> None:
        src, dst = self.source.fqn(op.source), self.target.fqn(op.target)
        md = self.virtual[dst] = self.stored[src]
        if src == dst:
            return
        if isinstance(md, BytesStorageMetadata):
            self.links[dst, None] = _Link("rename", src)
        for chunk in getattr(md, "chunks", ()):
            offsets = tuple(chunk.offsets)
            self.links[dst, offsets] = _Link("rename", src, offsets)

    def stack(self, op: Stack) -> None:
        dst, chunks = self.target.fqn(op.target), []
        for layer, key in enumerate(op.sources):
            for chunk in self.stored[self.source.fqn(key)].chunks:
                offsets = _insert(tuple(chunk.offsets), op.axis, layer)
                chunks.append((offsets, _insert(tuple(chunk.sizes), op.axis, 1)))
                self.links[dst, offsets] = _Link("stack", self.source.fqn(key), tuple(chunk.offsets), op.axis)
        self.virtual[dst] = _tensor_md(self.stored[self.source.fqn(op.sources[0])],
                                       self.target.inventory[op.target].shape, chunks)

    def unstack(self, op: Unstack) -> None:
        md = self.stored[self.source.fqn(op.source)]
        for layer, key in enumerate(op.targets):
            dst, chunks = self.target.fqn(key), []
            for chunk in md.chunks:
                start, count = chunk.offsets[op.axis], chunk.sizes[op.axis]
                if start <= layer < start + count:
                    offsets = _remove(tuple(chunk.offsets), op.axis)
                    chunks.append((offsets, _remove(tuple(chunk.sizes), op.axis)))
                    self.links[dst, offsets] = _Link("unstack", self.source.fqn(op.source), tuple(chunk.offsets),
                                                      op.axis, layer - start)
            self.virtual[dst] = _tensor_md(md, self.target.inventory[key].shape, chunks)

    def keep(self, op: Synthesize) -> None:
        dst, entry = self.target.fqn(op.target), self.target.inventory[op.target]
        like = TensorStorageMetadata(TensorProperties(dtype=getattr(torch, entry.dtype)), torch.Size(entry.shape), [])
        self.virtual[dst] = _tensor_md(like, entry.shape, [((0,) * len(entry.shape), entry.shape)])
        self.links[dst, (0,) * len(entry.shape)] = _Link("keep")

    def nothing(self, op: Op) -> None:
        """``Drop`` reads nothing; a ``Cast`` is DCP's own ``copy_`` into the destination."""


#: Op kind -> how it shows in the virtual metadata; any other kind is refused.
VIRTUAL: Mapping[str, Callable[[_Virtual, Any], None]] = {
    Rename.kind: _Virtual.rename, Stack.kind: _Virtual.stack, Unstack.kind: _Virtual.unstack,
    Synthesize.kind: _Virtual.keep, Drop.kind: _Virtual.nothing, Cast.kind: _Virtual.nothing,
}


def _virtual(metadata: Metadata, mapping: KeyMapping) -> tuple[Metadata, dict[tuple[str, Any], _Link]]:
    """The metadata the wrapped planner sees, and how each of its chunks maps to a stored one."""
    require_kinds(mapping.plan.ops, VIRTUAL, "DCP load planner",
                  hint="Layout ops run only in the JAX executor and in `ckptshim convert`.")
    built = _Virtual(metadata, mapping)
    for op in mapping.plan.ops:
        VIRTUAL[op.kind](built, op)
    return dataclasses.replace(metadata, state_dict_metadata=built.virtual), built.links


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
    ``prepare`` maps the checkpoint's keys onto the state dict's (the loading layer's decision).
    A read item whose destination is a stacked or per-layer tensor resolves to a view of the
    caller's tensor shaped like the stored block, so the storage reader copies straight into it.
    """

    def __init__(self, inner: LoadPlanner | None, prepare: Prepare) -> None:
        super().__init__()
        self._prepare = prepare
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
            metadata, self._links = _virtual(metadata, self._prepare(metadata, state_dict, self._allow_missing))
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
