"""A DCP load planner that loads checkpoints saved under other names or another layer layout.

DCP plans a load by looking up each flat key of the caller's state dict in the checkpoint's
metadata, then reading the overlap of every stored chunk with every local shard.
:class:`RemappingLoadPlanner` puts ckptshim's plan in between. The planner that would have run
-- the caller's own, or DCP's default -- is shown a *virtual* metadata in which every
destination key lists the stored chunks it comes from, each placed where its elements land in
the destination: a renamed key the source's chunks as they are (free); a stacked key each
per-layer chunk as a one-layer slab; a fused key (experts' ``w1`` and ``w3`` side by side) each
source's chunks at their offset along the fused axis; a per-layer or per-part key the overlap of
each stored chunk with its layer or part; a transposed key each chunk with its axes permuted; a
key reordered along an axis each run of rows that stays consecutive. Every read item DCP asks
for is then translated back to the real stored chunk, offsets and lengths (:class:`_Link`), and
its destination is the matching view of the caller's tensor. So DCP's own resharding (DTensor,
FSDP2, another number of ranks) runs unchanged on top of the remapping -- each rank reads only
the stored chunks, and the parts of them, that overlap its shard -- and planning still reads no
tensor bytes.

Which plan to run is the loading layer's decision (:mod:`ckptshim.loading.dcp`), passed in as a
function; this module only executes it. It runs the op kinds in :data:`VIRTUAL` and refuses any
other before DCP plans a read. Where the loading layer has no plan (:class:`~ckptshim.errors.NoPlan`)
or its plan changes nothing, the wrapped planner plans on the stored metadata itself, exactly as
without ckptshim -- its errors are DCP's own, with ckptshim's diagnosis added as a note.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
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

from ckptshim.errors import InternalError, NoPlan, add_diagnosis
from ckptshim.execute.dcp_storage import Refusal
from ckptshim.inventory import Inventory, KeyPath
from ckptshim.ops import (
    Cast,
    Chunk,
    Concat,
    Drop,
    Join,
    Op,
    Rename,
    Reorder,
    Split,
    Stack,
    Synthesize,
    Tie,
    Transpose,
    Unstack,
    inverse_perm,
    require_kinds,
)
from ckptshim.planner import Plan

Offsets = tuple[int, ...]


@dataclass(frozen=True)
class _Link:
    """How one chunk of the virtual metadata maps onto the stored chunk ``fqn`` at ``offsets``.

    A read of a block of the virtual chunk (offsets relative to it, lengths) becomes a read of
    the stored chunk after four steps, in this order: the virtual axes in ``squeeze`` (length one,
    absent from the stored chunk: a layer of a stack, an expert of a fused array) are dropped;
    the remaining axes are permuted (stored axis ``i`` is axis ``perm[i]``); each ``(axis,
    index)`` of ``insert`` is put in (the stored chunk holds several layers, the read one); and
    ``shift`` is added (the virtual chunk starts inside the stored one). ``reads`` is false for a
    key nothing is read for (synthesized, or tied to another).
    """

    fqn: str = ""
    offsets: Offsets | None = None
    squeeze: tuple[int, ...] = ()
    perm: tuple[int, ...] | None = None
    insert: tuple[tuple[int, int], ...] = ()
    shift: Offsets | None = None
    reads: bool = True

    def stored_block(self, offsets: Offsets, lengths: Offsets) -> tuple[Offsets, Offsets]:
        """A block of the virtual chunk as the block of the stored chunk it reads."""
        offsets, lengths = list(offsets), list(lengths)
        for axis in sorted(self.squeeze, reverse=True):
            del offsets[axis], lengths[axis]
        if self.perm is not None:
            offsets, lengths = [offsets[a] for a in self.perm], [lengths[a] for a in self.perm]
        for axis, index in self.insert:
            offsets.insert(axis, index)
            lengths.insert(axis, 1)
        if self.shift is not None:
            offsets = [o + s for o, s in zip(offsets, self.shift)]
        return tuple(offsets), tuple(lengths)

    def stored_view(self, tensor: torch.Tensor) -> torch.Tensor:
        """The destination of a virtual read (a view of the caller's tensor) in the stored
        chunk's axis order: what the storage reader copies the stored block into."""
        for axis in sorted(self.squeeze, reverse=True):
            tensor = tensor.squeeze(axis)
        if self.perm is not None:
            tensor = tensor.permute(self.perm)
        for axis, _ in self.insert:
            tensor = tensor.unsqueeze(axis)
        return tensor


_KEEP = _Link(reads=False)


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


#: ``(metadata, state_dict, allow_missing) -> KeyMapping``: the loading layer's decision
#: (``None``: nothing to map).
Prepare = Callable[[Metadata, dict[str, Any], bool], "KeyMapping | None"]


def _insert(values: Offsets, axis: int, value: int) -> Offsets:
    return values[:axis] + (value,) + values[axis:]


def _remove(values: Offsets, axis: int) -> Offsets:
    return values[:axis] + values[axis + 1:]


def _replace(values: Offsets, axis: int, value: int) -> Offsets:
    return values[:axis] + (value,) + values[axis + 1:]


def _tensor_md(like: TensorStorageMetadata, size: tuple[int, ...],
               chunks: list[tuple[Offsets, Offsets]]) -> TensorStorageMetadata:
    return TensorStorageMetadata(like.properties, torch.Size(size),
                                 [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks])


def _chunks(md: TensorStorageMetadata) -> Iterator[tuple[Offsets, Offsets]]:
    for chunk in md.chunks:
        yield tuple(chunk.offsets), tuple(chunk.sizes)


class _Virtual:
    """The metadata the wrapped planner sees, built op by op, and how each of its chunks maps to
    a stored one."""

    def __init__(self, metadata: Metadata, mapping: KeyMapping) -> None:
        self.stored = metadata.state_dict_metadata
        self.virtual = dict(self.stored)
        self.links: dict[tuple[str, Any], _Link] = {}
        self.source, self.target = mapping.source, mapping.target

    def _place(self, target: KeyPath, like: str, chunks: list[tuple[Offsets, Offsets, _Link]]) -> None:
        """Show ``target`` as ``chunks`` (virtual offsets, sizes, and the stored chunk each reads).

        The stored chunks tile each stored tensor (:mod:`ckptshim.formats.dcp` checks it), so the
        chunks shown must tile ``target``: DCP's planner reads only where a chunk overlaps the
        destination, and a chunk placed wrong would leave part of it unwritten without a word.
        """
        dst = self.target.fqn(target)
        shape = self.target.inventory[target].shape
        inside = all(len(o) == len(shape) and all(0 <= a and a + b <= c for a, b, c in zip(o, n, shape))
                     for o, n, _ in chunks)
        if not inside or sum(math.prod(n) for _, n, _ in chunks) != math.prod(shape):
            raise InternalError(f"ckptshim placed the stored chunks of {dst!r} so that they do not tile its "
                                f"shape {list(shape)} ({[(o, n) for o, n, _ in chunks][:4]}...); this is a bug in "
                                "ckptshim: please report it.")
        for offsets, _, link in chunks:
            self.links[dst, offsets] = link
        self.virtual[dst] = _tensor_md(self.stored[like], shape,
                                       [(offsets, sizes) for offsets, sizes, _ in chunks])

    def rename(self, op: Rename) -> None:
        src, dst = self.source.fqn(op.source), self.target.fqn(op.target)
        md = self.virtual[dst] = self.stored[src]
        if src == dst:
            return
        if isinstance(md, BytesStorageMetadata):
            self.links[dst, None] = _Link(src)
        for offsets, _ in _chunks(md) if isinstance(md, TensorStorageMetadata) else ():
            self.links[dst, offsets] = _Link(src, offsets)

    def transpose(self, op: Transpose) -> None:
        src = self.source.fqn(op.source)
        back = inverse_perm(op.perm)
        self._place(op.target, src, [(tuple(o[a] for a in op.perm), tuple(n[a] for a in op.perm), _Link(src, o, perm=back))
                                     for o, n in _chunks(self.stored[src])])

    def joined(self, op: Stack | Join | Concat) -> None:
        """Each source's chunks placed where that source lies in the target: at its index of the
        stacked axes (``Stack``, ``Join``, a ``Concat`` with a stack axis), at its offset along a
        fused axis (``Concat``), with its axes permuted (``Join``)."""
        shape = self.target.inventory[op.target].shape
        chunks = []
        for index, key in enumerate(op.sources):
            src = self.source.fqn(key)
            squeeze, perm, place = PLACES[op.kind](op, index, shape)
            back = None if perm is None else inverse_perm(perm)  # remaining axis r is the source's axis back[r]
            for o, n in _chunks(self.stored[src]):
                offsets, sizes = (o, n) if back is None else (tuple(o[a] for a in back), tuple(n[a] for a in back))
                for axis, at in sorted(place.items()):
                    if axis in squeeze:
                        offsets, sizes = _insert(offsets, axis, at), _insert(sizes, axis, 1)
                    else:
                        offsets = _replace(offsets, axis, offsets[axis] + at)
                chunks.append((offsets, sizes, _Link(src, o, squeeze=squeeze, perm=perm)))
        self._place(op.target, self.source.fqn(op.sources[0]), chunks)

    def taken_apart(self, op: Unstack | Split | Chunk) -> None:
        """Each target shows the overlap of every stored chunk with its layer or part of the source."""
        src = self.source.fqn(op.source)
        shape = self.source.inventory[op.source].shape
        for index, key in enumerate(op.targets):
            squeeze, perm, place = PLACES[op.kind](op, index, shape)
            extent = {axis: 1 if axis in squeeze else op.slot(index, len(op.targets))[2] for axis in place}
            chunks = []
            for o, n in _chunks(self.stored[src]):
                low = {a: max(o[a], at) for a, at in place.items()}
                high = {a: min(o[a] + n[a], at + extent[a]) for a, at in place.items()}
                if any(low[a] >= high[a] for a in place):
                    continue
                offsets, sizes = list(o), list(n)
                for axis in place:
                    offsets[axis], sizes[axis] = low[axis] - place[axis], high[axis] - low[axis]
                shift = tuple(low[a] - o[a] if a in place and a not in squeeze else 0 for a in range(len(o)))
                insert = tuple((a, low[a] - o[a]) for a in sorted(squeeze))
                for axis in sorted(squeeze, reverse=True):
                    del offsets[axis], sizes[axis]
                if perm is not None:
                    offsets, sizes = [offsets[a] for a in perm], [sizes[a] for a in perm]
                chunks.append((tuple(offsets), tuple(sizes),
                               _Link(src, o, perm=None if perm is None else inverse_perm(perm),
                                     insert=insert, shift=shift if any(shift) else None)))
            self._place(key, src, chunks)

    def reorder(self, op: Reorder) -> None:
        """Each run of target rows whose source rows are consecutive, cut at stored chunks."""
        src = self.source.fqn(op.source)
        chunks = []
        for t0, s0, length in _runs(op):
            for o, n in _chunks(self.stored[src]):
                low, high = max(s0, o[op.axis]), min(s0 + length, o[op.axis] + n[op.axis])
                if low < high:
                    chunks.append((_replace(o, op.axis, t0 + low - s0), _replace(n, op.axis, high - low),
                                   _Link(src, o, shift=_replace((0,) * len(o), op.axis, low - o[op.axis]))))
        self._place(op.target, src, chunks)

    def keep(self, op: Synthesize | Tie) -> None:
        """Nothing is read: a synthesized key keeps its value; a tied one is filled through its twin."""
        dst, entry = self.target.fqn(op.target), self.target.inventory[op.target]
        like = TensorStorageMetadata(TensorProperties(dtype=getattr(torch, entry.dtype)), torch.Size(entry.shape), [])
        self.virtual[dst] = _tensor_md(like, entry.shape, [((0,) * len(entry.shape), entry.shape)])
        self.links[dst, (0,) * len(entry.shape)] = _KEEP

    def nothing(self, op: Op) -> None:
        """``Drop`` reads nothing; a ``Cast`` is DCP's own ``copy_`` into the destination."""


#: Op kind -> how it shows in the virtual metadata; any other kind is refused.
VIRTUAL: Mapping[str, Callable[[_Virtual, Any], None]] = {
    Rename.kind: _Virtual.rename, Transpose.kind: _Virtual.transpose,
    Stack.kind: _Virtual.joined, Join.kind: _Virtual.joined, Concat.kind: _Virtual.joined,
    Unstack.kind: _Virtual.taken_apart, Split.kind: _Virtual.taken_apart, Chunk.kind: _Virtual.taken_apart,
    Reorder.kind: _Virtual.reorder,
    Synthesize.kind: _Virtual.keep, Tie.kind: _Virtual.keep, Drop.kind: _Virtual.nothing, Cast.kind: _Virtual.nothing,
}


Place = tuple[tuple[int, ...], tuple[int, ...] | None, dict[int, int]]


def _indexed_place(op: Stack | Join | Unstack | Split, index: int, shape: tuple[int, ...]) -> Place:
    """The ``index``-th array is one index of each of the op's axes (row-major), its axes permuted."""
    at = np.unravel_index(index, [shape[axis] for axis in op.axes])
    perm = None if op.perm is None else (op.perm if isinstance(op, Split) else inverse_perm(op.perm))
    return op.axes, perm, dict(zip(op.axes, map(int, at)))


def _slot_place(op: Concat | Chunk, index: int, shape: tuple[int, ...]) -> Place:
    """The ``index``-th array is its part along the fused axis, and one index of the stack axis."""
    member, start, _ = op.slot(index, len(op.sources if isinstance(op, Concat) else op.targets))
    if member is None:
        return (), None, {op.axis: start}
    return (op.stack_axis,), None, {op.axis: start, op.stack_axis: member}


#: Op kind -> where the ``index``-th of the op's many arrays lies in its one array of ``shape``:
#: the axes it is one index of (``squeeze``), the permutation from the one array's remaining axes
#: to its own (its axis ``i`` is remaining axis ``perm[i]``; ``None`` for none), and its start
#: along each axis it does not span whole (``place``).
PLACES: Mapping[str, Callable[[Any, int, tuple[int, ...]], Place]] = {
    Stack.kind: _indexed_place, Join.kind: _indexed_place, Unstack.kind: _indexed_place, Split.kind: _indexed_place,
    Concat.kind: _slot_place, Chunk.kind: _slot_place,
}


def _runs(op: Reorder) -> Iterator[tuple[int, int, int]]:
    """``(first target row, first source row, length)`` of each run of target rows along the
    op's axis whose source rows are consecutive."""
    source_rows = np.arange(int(np.prod(op.factors))).reshape(op.factors).transpose(op.order).reshape(-1)
    breaks = np.flatnonzero(np.diff(source_rows) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(source_rows)]))
    for start, end in zip(starts.tolist(), ends.tolist()):
        yield start, int(source_rows[start]), end - start


def virtual_metadata(metadata: Metadata, mapping: KeyMapping) -> tuple[Metadata, dict[tuple[str, Any], _Link]]:
    """The metadata the wrapped planner sees, and how each of its chunks maps to a stored one."""
    require_kinds(mapping.plan.ops, VIRTUAL, "DCP load planner")
    built = _Virtual(metadata, mapping)
    for op in mapping.plan.ops:
        VIRTUAL[op.kind](built, op)
    return dataclasses.replace(metadata, state_dict_metadata=built.virtual), built.links


def keeps_stored_names(mapping: KeyMapping) -> bool:
    """Whether every key the state dict asks for is read under its stored name and layout (a cast
    is DCP's own ``copy_``): the wrapped planner then plans on the stored metadata itself."""
    return all(op.kind == Cast.kind or op.kind == Drop.kind
               or (op.kind == Rename.kind and mapping.source.fqn(op.source) == mapping.target.fqn(op.target))
               for op in mapping.plan.ops)


def _translate(item: ReadItem, link: _Link) -> ReadItem | None:
    """The read of the stored chunk that fills what ``item`` asks of the virtual one."""
    if not link.reads:
        return None
    offsets, lengths = link.stored_block(tuple(item.storage_offsets), tuple(item.lengths))
    return dataclasses.replace(item, storage_index=MetadataIndex(link.fqn, link.offsets),
                               storage_offsets=torch.Size(offsets), lengths=torch.Size(lengths))


class RemappingLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner with ckptshim's key and layout mapping in front of it.

    ``inner`` is the caller's own planner, if they passed one: it then does all the planning
    (on the virtual metadata) and receives every ``resolve_tensor``/``commit_tensor``/
    ``load_bytes`` call for its own read items. Without one, this planner is DCP's default.
    ``prepare`` maps the checkpoint's keys onto the state dict's (the loading layer's decision).
    A read item whose destination is remapped resolves to a view of the caller's tensor shaped
    like the stored block (:meth:`_Link.stored_view`), so the storage reader copies straight
    into it.
    """

    def __init__(self, inner: LoadPlanner | None, prepare: Prepare) -> None:
        super().__init__()
        self._prepare = prepare
        self._base: LoadPlanner = inner if inner is not None else super()
        self._allow_missing = bool(getattr(inner, "allow_partial_load", False))
        self._links: dict[tuple[str, Any], _Link] = {}
        self._virtual_items: dict[ReadItem, tuple[ReadItem, _Link]] = {}
        self._resolved: dict[ReadItem, torch.Tensor] = {}
        #: why the checkpoint does not fit, where ckptshim has no plan: the wrapped planner then
        #: plans on the stored metadata, as without ckptshim, and this rides on its error as a note
        self.no_plan: NoPlan | None = None

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        storage_data = getattr(metadata, "storage_data", None)
        if isinstance(storage_data, Refusal):  # the storage reader refused the checkpoint
            raise storage_data.error
        if metadata is not None and state_dict:
            try:
                mapping = self._prepare(metadata, state_dict, self._allow_missing)
            except NoPlan as no_plan:
                self.no_plan = no_plan
            else:
                if mapping is not None and not keeps_stored_names(mapping):
                    metadata, self._links = virtual_metadata(metadata, mapping)
        self._base.set_up_planner(state_dict, metadata, is_coordinator)

    def create_local_plan(self) -> LoadPlan:
        try:
            plan = self._base.create_local_plan()
        except Exception as error:  # the wrapped planner's own refusal, as without ckptshim
            if self.no_plan is not None:
                add_diagnosis(error, self.no_plan)
            raise
        items = []
        for item in plan.items:
            offsets = None if item.storage_index.offset is None else tuple(item.storage_index.offset)
            link = self._links.get((item.storage_index.fqn, offsets))
            real = item if link is None else _translate(item, link)
            if real is not None:
                if real is not item:
                    self._virtual_items[real] = item, link
                items.append(real)
        return dataclasses.replace(plan, items=items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return self._base.create_global_plan(global_plan)

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return self._base.finish_plan(central_plan)

    def load_bytes(self, read_item: ReadItem, value) -> None:
        virtual = self._virtual_items.get(read_item)
        self._base.load_bytes(read_item if virtual is None else virtual[0], value)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        found = self._virtual_items.get(read_item)
        if found is None:
            return self._base.resolve_tensor(read_item)
        virtual, link = found
        tensor = self._resolved[read_item] = self._base.resolve_tensor(virtual)
        return link.stored_view(tensor)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        found = self._virtual_items.get(read_item)
        if found is None:
            self._base.commit_tensor(read_item, tensor)
        else:
            self._base.commit_tensor(found[0], self._resolved.pop(read_item))
