"""A DCP load planner that loads checkpoints saved under other names or another layer layout.

DCP plans a load by looking up each flat key of the caller's state dict in the checkpoint's
metadata, then reading the overlap of every stored chunk with every local shard.
:class:`RemappingLoadPlanner` puts ckptshim's plan in between. The planner that would have run
-- the caller's own, or DCP's default -- is shown a *virtual* metadata in which every
destination key lists the stored chunks it comes from, each placed where its elements land in
the destination. Every layout op shows so through its geometry (:mod:`ckptshim.geometry`),
whatever its kind: a key that is its source as it is (a rename) as the source's chunks (free);
any other as the maps between boxes of each stored chunk and of the destination that its
pieces give (:func:`~ckptshim.geometry.box_maps`) -- a stacked key each per-layer chunk as a
one-layer slab, a fused key each source's chunks at their offset along the fused axis, a
per-layer or per-part key the overlap of each stored chunk with its layer or part, a transposed
key each chunk with its axes permuted, a key reordered or reshaped along split axes each run
of elements that stays consecutive on both sides. Every read item DCP asks for is then
translated back to the real stored chunk, offsets and lengths (:class:`_Link`), and its
destination is the matching view of the caller's tensor. So DCP's own resharding (DTensor,
FSDP2, another number of ranks) runs unchanged on top of the remapping -- each rank reads only
the stored chunks, and the parts of them, that overlap its shard, each once -- and planning
still reads no tensor bytes.

Which plan to run is the loading layer's decision (:mod:`ckptshim.loading.dcp`), passed in as a
function; this module only executes it. It runs every layout kind and the kinds in
:data:`VIRTUAL`, and refuses any other before DCP plans a read. Where the loading layer has no plan
(:class:`~ckptshim.errors.NoPlan`) or its plan changes nothing, the wrapped planner plans on the
stored metadata itself, exactly as without ckptshim -- its errors are DCP's own, with ckptshim's
diagnosis added as a note.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping
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

from ckptshim.errors import InternalError, NoPlan, add_diagnosis
from ckptshim.execute.dcp_storage import Refusal
from ckptshim.inventory import Inventory, KeyPath
from ckptshim.geometry import box_maps
from ckptshim.keytext import shown_lines
from ckptshim.ops import Cast, Drop, LayoutOp, Op, Rename, Synthesize, Tie, is_layout, pieces_by_target, require_kinds
from ckptshim.planner import Plan

Offsets = tuple[int, ...]


@dataclass(frozen=True)
class _Link:
    """How one chunk of the virtual metadata maps onto the stored chunk ``fqn`` at ``offsets``.

    ``origin`` is where the virtual chunk starts inside the stored one, and virtual axis ``t``
    runs along stored axis ``axes[t]`` (one index where that is ``None``: a layer of a stack, an
    expert of a fused array); a stored axis no virtual axis runs along is one index (the stored
    chunk holds several layers, the read one) -- a :class:`~ckptshim.geometry.BoxMap`. Without
    ``axes`` the virtual chunk is the stored one as it is (a renamed key). ``reads`` is false
    for a key nothing is read for (synthesized, or tied to another).
    """

    fqn: str = ""
    offsets: Offsets | None = None
    origin: Offsets = ()
    axes: tuple[int | None, ...] | None = None
    reads: bool = True

    def stored_block(self, offsets: Offsets, lengths: Offsets) -> tuple[Offsets, Offsets]:
        """A block of the virtual chunk as the block of the stored chunk it reads."""
        if self.axes is None:
            return offsets, lengths
        stored_offsets, stored_lengths = list(self.origin), [1] * len(self.origin)
        for axis, stored in enumerate(self.axes):
            if stored is not None:
                stored_offsets[stored] += offsets[axis]
                stored_lengths[stored] = lengths[axis]
        return tuple(stored_offsets), tuple(stored_lengths)

    def stored_view(self, tensor: torch.Tensor) -> torch.Tensor:
        """The destination of a virtual read (a view of the caller's tensor) in the stored
        chunk's axis order: what the storage reader copies the stored block into."""
        if self.axes is None:
            return tensor
        for axis in reversed(range(len(self.axes))):
            if self.axes[axis] is None:
                tensor = tensor.squeeze(axis)
        along = [stored for stored in self.axes if stored is not None]
        order = sorted(range(len(along)), key=along.__getitem__)
        if order != list(range(len(along))):
            tensor = tensor.permute(order)
        for stored in range(len(self.origin)):
            if stored not in along:
                tensor = tensor.unsqueeze(stored)
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

    def moved(self, op: LayoutOp) -> None:
        """Each target of a layout op as the stored chunks of its sources, placed where their
        elements land (:func:`~ckptshim.geometry.box_maps` of each of the op's pieces); a target
        that is its source as it is (one piece, the identity) as that source's own chunks."""
        sources = [self.source.fqn(key) for key in op.sources]
        source_shapes = [self.source.inventory[key].shape for key in op.sources]
        target_shapes = [self.target.inventory[key].shape for key in op.targets]
        for index, (key, pieces) in enumerate(zip(op.targets, pieces_by_target(op, source_shapes, target_shapes))):
            if len(pieces) == 1 and pieces[0].is_identity(source_shapes[pieces[0].source.array], target_shapes[index]):
                self._as_stored(sources[pieces[0].source.array], key)
                continue
            chunks = []
            for piece in pieces:
                src, shape = sources[piece.source.array], source_shapes[piece.source.array]
                for o, n in _chunks(self.stored[src]):
                    for part in box_maps(piece, shape, target_shapes[index], tuple(map(range, o, map(sum, zip(o, n))))):
                        chunks.append((tuple(r.start for r in part.target_box), tuple(map(len, part.target_box)),
                                       _Link(src, o, tuple(r.start - at for r, at in zip(part.source_box, o)),
                                             part.axes)))
            self._place(key, sources[pieces[0].source.array], chunks)

    def _as_stored(self, src: str, target: KeyPath) -> None:
        """``target`` is the stored ``src`` as it is: its chunks, under the target's name (free
        where the names agree)."""
        dst = self.target.fqn(target)
        md = self.virtual[dst] = self.stored[src]
        if src == dst:
            return
        if isinstance(md, BytesStorageMetadata):
            self.links[dst, None] = _Link(src)
        for offsets, _ in _chunks(md) if isinstance(md, TensorStorageMetadata) else ():
            self.links[dst, offsets] = _Link(src, offsets)

    def keep(self, op: Synthesize | Tie) -> None:
        """Nothing is read: a synthesized key keeps its value (a Python object too); a tied one is
        filled through its twin."""
        dst, entry = self.target.fqn(op.target), self.target.inventory[op.target]
        if op.target in self.target.objects:
            self.virtual[dst] = BytesStorageMetadata()
            self.links[dst, None] = _KEEP
            return
        like = TensorStorageMetadata(TensorProperties(dtype=getattr(torch, entry.dtype)), torch.Size(entry.shape), [])
        self.virtual[dst] = _tensor_md(like, entry.shape, [((0,) * len(entry.shape), entry.shape)])
        self.links[dst, (0,) * len(entry.shape)] = _KEEP

    def nothing(self, op: Op) -> None:
        """``Drop`` reads nothing; a ``Cast`` is DCP's own ``copy_`` into the destination."""


#: How each kind that is not a layout op shows in the virtual metadata (every layout op shows
#: through :meth:`_Virtual.moved`); any other kind is refused.
VIRTUAL: Mapping[str, Callable[[_Virtual, Any], None]] = {
    Synthesize.kind: _Virtual.keep, Tie.kind: _Virtual.keep, Drop.kind: _Virtual.nothing, Cast.kind: _Virtual.nothing,
}


def virtual_metadata(metadata: Metadata, mapping: KeyMapping) -> tuple[Metadata, dict[tuple[str, Any], _Link]]:
    """The metadata the wrapped planner sees, and how each of its chunks maps to a stored one."""
    require_kinds(mapping.plan.ops, VIRTUAL, "DCP load planner")
    built = _Virtual(metadata, mapping)
    for op in mapping.plan.ops:
        if is_layout(op):
            built.moved(op)
        else:
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

    @property
    def remaps(self) -> bool:
        """Whether some key is read from stored chunks of another name or layout (known once
        planned): else every read item is the wrapped planner's own, on the stored metadata."""
        return bool(self._links)

    def create_local_plan(self) -> LoadPlan:
        try:
            plan = self._base.create_local_plan()
        except Exception as error:  # the wrapped planner's own refusal, as without ckptshim
            if self.no_plan is not None:
                add_diagnosis(error, shown_lines(str(self.no_plan)))
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
