"""The files executor: the arrays a plan produces from an open checkpoint, in order.

What ``ckptshim convert`` writes has no framework destination, so each target array is built
here in the checkpoint's storage dtype (bfloat16 as its uint16 bits). A target that is its
source as it is (a rename: one piece, the identity) is the source's own read (for
memory-mapped formats a view, no copy); every other target of a layout op is filled by the
block reads the JAX executor uses (:mod:`ckptshim.execute.blocks`), reading exactly the source
ranges the array needs into one new buffer, then multiplied where the plan ``Scale``\\ s it
(``ckptshim convert`` of MaxText params back to Hugging Face multiplies the query by
``float32(sqrt(head_dim))``, as MaxText's own way back does). ``Synthesize``\\ d targets are
not written (the checkpoint does not hold them) and ``Drop``\\ ped sources not read -- nor
``DropIfDerived`` ones: convert writes only the arrays the target layout names, so a source it
does not name is left unread whether or not its value is the derived one, as an unexpected one
is. Any other kind (a ``Cast``: convert copies bytes exactly) is refused before anything is read.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from ckptshim.execute import blocks
from ckptshim.formats.base import Checkpoint, numpy_dtype, storage_dtype
from ckptshim.inventory import Entry
from ckptshim.ops import Drop, DropIfDerived, Scale, Synthesize, require_kinds
from ckptshim.planner import Plan


@dataclass
class PlannedArrays:
    """What to write: the target entries in order, and how to get each one's bytes.

    Without a plan, every source entry as it is stored.
    """

    source: Checkpoint
    plan: Plan | None
    sep: str
    entries: list[Entry] = field(init=False)

    def __post_init__(self) -> None:
        if self.plan is None:
            self.entries = list(self.source.inventory.values())
            return
        require_kinds(self.plan.ops, KINDS, "array executor", sep=self.sep)
        self._scales = blocks.scales(self.plan)
        self.entries = [entry for entry in self.plan.target.values()
                        if self.plan.producer(entry.key).kind != Synthesize.kind]

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def values(self) -> Iterator[tuple[Entry, np.ndarray]]:
        """Every target entry with its value in its storage dtype (see :func:`storage_dtype`), in
        order. The values stored as they are come from the checkpoint's
        :meth:`~ckptshim.formats.base.Checkpoint.read_each`, which reads a checkpoint in a bucket
        ahead, in parallel; the others are assembled by block reads."""
        stored = [self._as_stored(entry) for entry in self.entries]
        ahead = self.source.read_each([source for source in stored if source is not None])
        for entry, source in zip(self.entries, stored):
            yield entry, next(ahead) if source is not None else self._assembled(entry)

    def _assembled(self, entry: Entry) -> np.ndarray:
        assert self.plan is not None, "without a plan every entry is stored as it is"
        fill = blocks.filler(self.source, self.plan, self.plan.producer(entry.key), entry.key, entry.shape,
                             numpy_dtype(entry.dtype), self.sep, self._scales.get(entry.key))
        return fill(blocks.whole(entry.shape)).view(storage_dtype(entry.dtype))

    def _as_stored(self, entry: Entry) -> Entry | None:
        """The source entry target ``entry`` is as it is stored (no plan; or its op's one piece of
        it is the identity, a rename, and it is not scaled), else ``None``."""
        if self.plan is None:
            return entry
        if entry.key in self._scales:
            return None
        op, key = self.plan.producer(entry.key), entry.key
        pieces = blocks.target_pieces(self.plan, op, key)
        if len(pieces) != 1:
            return None
        source = self.plan.source[op.sources[pieces[0].source.array]]
        return source if pieces[0].is_identity(source.shape, self.plan.target[key].shape) else None


#: The kinds this executor runs besides the layout kinds (each through :mod:`~ckptshim.execute.blocks`).
KINDS = frozenset({Synthesize.kind, Drop.kind, DropIfDerived.kind, Scale.kind})
