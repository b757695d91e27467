"""A DCP load planner that loads checkpoints saved under other names or another layer layout.

DCP plans a load by looking up each flat key of the caller's state dict in the checkpoint's
metadata, then reading the overlap of every stored chunk with every local shard.
:class:`RemappingLoadPlanner` puts ckptshim's plan in between. The planner that would have run
-- the caller's own, or DCP's default -- is shown a *virtual* metadata in which every
destination key lists the stored chunks it comes from, each placed where its elements land in
the destination. Every layout op shows so through its geometry (:mod:`ckptshim.geometry`),
whatever its kind: a key that is its source as it is (a rename) as the source's chunks (free);
any other as the maps between boxes of each stored chunk and of the destination that its pieces
give (:func:`~ckptshim.geometry.box_maps`) -- a stacked key each per-layer chunk as a one-layer
slab, a fused key each source's chunks at their offset along the fused axis, a per-layer or
per-part key the overlap of each stored chunk with its layer or part, a transposed key each
chunk with its axes permuted, a key reordered or reshaped along split axes each run of elements
that stays consecutive on both sides. Every read item DCP asks for is then translated back to
the real stored chunk, offsets and lengths (:class:`~ckptshim.execute.dcp_virtual.Link`), and
its destination is the matching view of the caller's tensor. So DCP's own resharding (DTensor,
FSDP2, another number of ranks) runs unchanged on top of the remapping -- each rank reads only
the stored chunks, and the parts of them, that overlap its shard, each once -- and planning
still reads no tensor bytes.

Which plan to run is the loading layer's decision (:mod:`ckptshim.loading.dcp`), passed in as a
function; this module only executes it. It runs every layout kind and the kinds in
:data:`~ckptshim.execute.dcp_virtual.VIRTUAL`, and refuses any other before DCP plans a read.
Where the loading layer has no plan (:class:`~ckptshim.errors.NoPlan`) or its plan changes
nothing, the wrapped planner plans on the stored metadata itself, exactly as without ckptshim --
its errors are DCP's own, with ckptshim's diagnosis added as a note.

The virtual metadata and the ops it is built from (:mod:`ckptshim.execute.dcp_virtual`) are
imported only once there is a plan that moves something: a load whose names and shapes fit costs
no more than DCP's own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem

from ckptshim.errors import NoPlan, add_diagnosis
from ckptshim.execute.dcp_storage import Refusal
from ckptshim.keytext import shown_lines

if TYPE_CHECKING:
    from ckptshim.execute.dcp_virtual import KeyMapping, Link


#: ``(metadata, state_dict, allow_missing) -> KeyMapping``: the loading layer's decision
#: (``None``: nothing to map).
Prepare = Callable[[Metadata, dict[str, Any], bool], "KeyMapping | None"]


def _translate(item: ReadItem, link: Link) -> ReadItem | None:
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
    ``strided_reads``: the storage reader is ckptshim's, which takes a reordered block as one
    strided copy (a destination of the block's lengths split into factors,
    :meth:`destination_shape`); any other reader gets one read item per run of rows.
    A read item whose destination is remapped resolves to a view of the caller's tensor shaped
    like the stored block (:meth:`~ckptshim.execute.dcp_virtual.Link.stored_view`), so the
    storage reader copies straight into it.
    """

    def __init__(self, inner: LoadPlanner | None, prepare: Prepare, strided_reads: bool = False) -> None:
        super().__init__()
        self._prepare = prepare
        self._base: LoadPlanner = inner if inner is not None else super()
        self._strided_reads = strided_reads and inner is None
        self._allow_missing = bool(getattr(inner, "allow_partial_load", False))
        self._links: dict[tuple[str, Any], Link] = {}
        self._virtual_items: dict[ReadItem, tuple[ReadItem, Link]] = {}
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
                if mapping is not None:
                    from ckptshim.execute.dcp_virtual import keeps_stored_names, virtual_metadata

                    if not keeps_stored_names(mapping):
                        metadata, self._links = virtual_metadata(metadata, mapping, self._reads_whole(state_dict))
        self._base.set_up_planner(state_dict, metadata, is_coordinator)

    def _reads_whole(self, state_dict: dict[str, Any]) -> Callable[[str], bool]:
        """Whether each destination key (a flat key) has every chunk read whole, by a reader that
        takes strided copies: DCP's own planner reads a plain tensor as one piece per chunk (a
        caller's planner, a DTensor's shard, may read part of one)."""
        if not self._strided_reads:
            return lambda fqn: False
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict

        flat, _ = flatten_state_dict(state_dict)
        return lambda fqn: type(flat.get(fqn)) is torch.Tensor

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

    def destination_shape(self, read_item: ReadItem) -> tuple[int, ...]:
        """The shape :meth:`resolve_tensor` gives ``read_item``: its lengths, or, for a strided
        copy (:attr:`~ckptshim.execute.dcp_virtual.Link.factors`), them split row-major into the
        stored block's factors -- which the storage reader copies the block into, so split."""
        found = self._virtual_items.get(read_item)
        if found is None or found[1].factors is None:
            return tuple(read_item.lengths)
        link = found[1]
        return tuple(link.factors[axis] for axis in link.order)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        found = self._virtual_items.get(read_item)
        if found is None:
            self._base.commit_tensor(read_item, tensor)
        else:
            self._base.commit_tensor(found[0], self._resolved.pop(read_item))
