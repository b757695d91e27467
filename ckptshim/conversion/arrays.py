"""The arrays a conversion writes, produced one at a time from the source by a plan.

Without a target layout every source entry is passed through as is (a plan of renames onto
itself). With ``like``, the plan is the one ``ckptshim plan SRC --like LIKE`` shows; its ops
become numpy reads: a rename is the source array (a memory-mapped view), an unstack is one
slice of the stacked source, a stack is the per-layer sources copied into one new array.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ckptshim.errors import PlanError
from ckptshim.formats.base import Checkpoint, storage_dtype
from ckptshim.formats.detect import open_checkpoint
from ckptshim.inventory import Entry, KeyPath, join_key
from ckptshim.planner import Plan, Rename, Stack, Synthesize, Unstack


@dataclass
class PlannedArrays:
    """What to write: the target entries in order, and how to get each one's bytes."""

    source: Checkpoint
    plan: Plan | None
    entries: list[Entry]
    sep: str

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def read(self, entry: Entry) -> np.ndarray:
        """``entry``'s value in its storage dtype (see :func:`storage_dtype`)."""
        if self.plan is None:
            return self.source.read(entry)
        producer = self.plan.producer(entry.key)
        src = self.plan.source
        if isinstance(producer, Rename):
            return self.source.read(src[producer.source])
        if isinstance(producer, Unstack):
            layer = producer.targets.index(entry.key)
            return np.take(self.source.read(src[producer.source]), layer, axis=producer.axis)
        if isinstance(producer, Stack):
            out = np.empty(entry.shape, storage_dtype(entry.dtype))
            for i, key in enumerate(producer.sources):
                out[(slice(None),) * producer.axis + (i,)] = self.source.read(src[key])
            return out
        raise PlanError(f"{join_key(entry.key, self.sep)}: convert cannot produce it "
                        f"({type(producer).__name__ if producer else 'nothing in the plan'})")


def _target_plan(source: Checkpoint, like: Path) -> Plan:
    from ckptshim.api import plan as make_plan

    result = make_plan(source.path, like)
    casts = result.casts()
    if casts:
        first = next(iter(casts.values()))
        raise PlanError(f"{len(casts)} arrays would change dtype (e.g. {join_key(first.target, source.key_sep)}: "
                        f"{first.source_dtype} -> {first.target_dtype}); convert copies bytes "
                        "exactly and never casts. Convert without --like, or cast when loading.")
    result.require_complete(source.key_sep, allow_missing=False, allow_unexpected=True)
    return result


@contextlib.contextmanager
def planned_arrays(path: Path, like: str | Path | None) -> Iterator[PlannedArrays]:
    source = open_checkpoint(path)
    try:
        source.require_complete()
        if like is None:
            entries = list(source.inventory.values())
            yield PlannedArrays(source, None, entries, source.key_sep)
            return
        result = _target_plan(source, Path(like))
        synthesized: set[KeyPath] = {op.target for op in result.of_type(Synthesize)}
        entries = [e for e in result.target.values() if e.key not in synthesized]
        yield PlannedArrays(source, result, entries, source.key_sep)
    finally:
        source.close()
