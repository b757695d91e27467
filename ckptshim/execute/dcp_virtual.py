"""A checked key mapping of a DCP load (:class:`KeyMapping`), and the metadata a wrapped DCP
planner is shown for one that moves keys: each destination key as the stored chunks it comes
from, placed where their elements land (see :mod:`ckptshim.execute.dcp_planner`, which imports
this module only once the loading layer has a mapping).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from ckptshim.errors import InternalError
from ckptshim.geometry import BoxMap, StridedMap, box_maps
from ckptshim.inventory import Inventory, KeyPath
from ckptshim.ops import Cast, Drop, LayoutOp, Op, Rename, Synthesize, Tie, is_layout, pieces_by_target, require_kinds

if TYPE_CHECKING:
    from ckptshim.planner import Plan

Offsets = tuple[int, ...]


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


@dataclass(frozen=True)
class Link:
    """How one chunk of the virtual metadata maps onto the stored chunk ``fqn`` at ``offsets``.

    ``origin`` is where the virtual chunk starts inside the stored one, and virtual axis ``t``
    runs along stored axis ``axes[t]`` (one index where that is ``None``: a layer of a stack, an
    expert of a fused array); a stored axis no virtual axis runs along is one index (the stored
    chunk holds several layers, the read one) -- a :class:`~ckptshim.geometry.BoxMap`. Without
    ``axes`` the virtual chunk is the stored one as it is (a renamed key). ``reads`` is false
    for a key nothing is read for (synthesized, or tied to another).

    With ``factors`` the virtual chunk is read whole, as one strided copy (a
    :class:`~ckptshim.geometry.StridedMap`): its axes split row-major into ``factors`` and those
    permuted by ``order`` are the stored block of lengths ``lengths`` at ``origin``, its axes
    split row-major.
    """

    fqn: str = ""
    offsets: Offsets | None = None
    origin: Offsets = ()
    axes: tuple[int | None, ...] | None = None
    reads: bool = True
    factors: Offsets | None = None
    order: Offsets = ()
    lengths: Offsets = ()

    def stored_block(self, offsets: Offsets, lengths: Offsets) -> tuple[Offsets, Offsets]:
        """A block of the virtual chunk as the block of the stored chunk it reads."""
        if self.factors is not None:
            if any(offsets) or math.prod(lengths) != math.prod(self.factors):
                raise InternalError(f"a read of part of a reordered chunk of {self.fqn!r} ({list(offsets)}, "
                                    f"{list(lengths)}) was planned; this is a bug in ckptshim: please report it.")
            return self.origin, self.lengths
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
        chunk's axis order: what the storage reader copies the stored block into (split into
        the stored block's factors, for a strided copy)."""
        if self.factors is not None:
            return tensor.view(self.factors).permute(self.order)
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


_KEEP = Link(reads=False)

def _tensor_md(like: TensorStorageMetadata, size: tuple[int, ...],
               chunks: list[tuple[Offsets, Offsets]]) -> TensorStorageMetadata:
    return TensorStorageMetadata(like.properties, torch.Size(size),
                                 [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks])


def _chunks(md: TensorStorageMetadata) -> Iterator[tuple[Offsets, Offsets]]:
    for chunk in md.chunks:
        yield tuple(chunk.offsets), tuple(chunk.sizes)


def _link(part: BoxMap | StridedMap, src: str, offsets: Offsets) -> Link:
    """How the virtual chunk that is ``part``'s target box reads the stored chunk ``src`` at ``offsets``."""
    origin = tuple(r.start - at for r, at in zip(part.source_box, offsets))
    if isinstance(part, StridedMap):
        return Link(src, offsets, origin, factors=part.factors, order=part.order,
                    lengths=tuple(map(len, part.source_box)))
    return Link(src, offsets, origin, part.axes)


class _Virtual:
    """The metadata the wrapped planner sees, built op by op, and how each of its chunks maps to
    a stored one."""

    def __init__(self, metadata: Metadata, mapping: KeyMapping, whole: Callable[[str], bool]) -> None:
        self.stored = metadata.state_dict_metadata
        self.whole = whole
        self.virtual = dict(self.stored)
        self.links: dict[tuple[str, Any], Link] = {}
        self.source, self.target = mapping.source, mapping.target

    def _place(self, target: KeyPath, like: str, chunks: list[tuple[Offsets, Offsets, Link]]) -> None:
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
        that is its source as it is (one piece, the identity) as that source's own chunks. Where
        the target is read whole (``whole``), each part of a stored chunk that is one strided
        copy (:class:`~ckptshim.geometry.StridedMap`: a reorder's whole heads) is one chunk."""
        sources = [self.source.fqn(key) for key in op.sources]
        source_shapes = [self.source.inventory[key].shape for key in op.sources]
        target_shapes = [self.target.inventory[key].shape for key in op.targets]
        for index, (key, pieces) in enumerate(zip(op.targets, pieces_by_target(op, source_shapes, target_shapes))):
            if len(pieces) == 1 and pieces[0].is_identity(source_shapes[pieces[0].source.array], target_shapes[index]):
                self._as_stored(sources[pieces[0].source.array], key)
                continue
            chunks = []
            strided = self.whole(self.target.fqn(key))
            for piece in pieces:
                src, shape = sources[piece.source.array], source_shapes[piece.source.array]
                for o, n in _chunks(self.stored[src]):
                    for part in box_maps(piece, shape, target_shapes[index], tuple(map(range, o, map(sum, zip(o, n)))),
                                         strided):
                        chunks.append((tuple(r.start for r in part.target_box), tuple(map(len, part.target_box)),
                                       _link(part, src, o)))
            self._place(key, sources[pieces[0].source.array], chunks)

    def _as_stored(self, src: str, target: KeyPath) -> None:
        """``target`` is the stored ``src`` as it is: its chunks, under the target's name (free
        where the names agree)."""
        dst = self.target.fqn(target)
        md = self.virtual[dst] = self.stored[src]
        if src == dst:
            return
        if isinstance(md, BytesStorageMetadata):
            self.links[dst, None] = Link(src)
        for offsets, _ in _chunks(md) if isinstance(md, TensorStorageMetadata) else ():
            self.links[dst, offsets] = Link(src, offsets)

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


def virtual_metadata(metadata: Metadata, mapping: KeyMapping, whole: Callable[[str], bool] = lambda fqn: False
                     ) -> tuple[Metadata, dict[tuple[str, Any], Link]]:
    """The metadata the wrapped planner sees, and how each of its chunks maps to a stored one.
    ``whole(fqn)``: whether the planner reads each chunk of that destination key whole (DCP's
    own planner, a plain tensor), so a reordered chunk may be read as one strided copy."""
    require_kinds(mapping.plan.ops, VIRTUAL, "DCP load planner")
    built = _Virtual(metadata, mapping, whole)
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
