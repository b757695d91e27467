"""The DCP planner runs every layout op over any chunking of the stored arrays.

A checkpoint written by another number of ranks stores each tensor as several chunks. Here the
stored arrays are cut into a random grid of chunks, served by an in-memory storage reader, and
loaded through :class:`~ckptshim.execute.dcp_planner.RemappingLoadPlanner` with a random layout
plan (transpose, split, join, chunk, concat, reorder): DCP's own planner reads the virtual
metadata, every read item is translated back to a stored chunk, and the destination must be
exactly what numpy makes of the plan (``test_plan_properties.execute``).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

import ckptshim
from ckptshim.execute.dcp_planner import RemappingLoadPlanner
from ckptshim.execute.dcp_virtual import FlatKeys, KeyMapping
from ckptshim.inventory import Entry, Inventory, join_key
from ckptshim.ops import Concat, Join, Reorder
from ckptshim.planner import Plan
from support.markers import QUIET
from test_plan_properties import execute, layout_plans, same_bits

pytestmark = QUIET


class ChunkedArrays(StorageReader):
    """A checkpoint held in memory, each array stored as the chunks of a grid. ``strided``: it
    takes a block's destination split into factors, as ckptshim's own readers do (the planner's
    ``destination_shape``); else it asserts, as torch's reader does, that the shapes match."""

    def __init__(self, arrays: dict[str, np.ndarray], cuts: dict[str, list[list[int]]], strided: bool = False) -> None:
        super().__init__()
        self.strided = strided
        self.read_items = 0
        self.chunks: dict[tuple[str, tuple[int, ...]], np.ndarray] = {}
        self.metadata: dict[str, TensorStorageMetadata] = {}
        for fqn, array in arrays.items():
            bounds = [list(zip([0, *axis_cuts], [*axis_cuts, size])) for axis_cuts, size in zip(cuts[fqn], array.shape)]
            chunks = []
            for block in (np.ndindex(*map(len, bounds)) if array.ndim else [()]):
                spans = [bounds[axis][at] for axis, at in enumerate(block)]
                offsets = tuple(start for start, _ in spans)
                self.chunks[fqn, offsets] = array[tuple(slice(a, b) for a, b in spans)]
                chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(tuple(b - a for a, b in spans))))
            self.metadata[fqn] = TensorStorageMetadata(TensorProperties(dtype=getattr(torch, array.dtype.name)),
                                                       torch.Size(array.shape), chunks)

    def reset(self, checkpoint_id=None) -> None:
        pass

    def read_metadata(self, *args, **kwargs) -> Metadata:
        return Metadata(state_dict_metadata=dict(self.metadata))

    def set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        self.read_items += len(plan.items)
        for item in plan.items:
            chunk = self.chunks[item.storage_index.fqn, tuple(item.storage_index.offset)]
            block = chunk[tuple(slice(o, o + n) for o, n in zip(item.storage_offsets, item.lengths))]
            destination = planner.resolve_tensor(item)
            shape = planner.destination_shape(item) if self.strided else tuple(item.lengths)
            assert tuple(destination.shape) == shape, item
            destination.copy_(torch.from_numpy(np.ascontiguousarray(block)).reshape(shape))
            planner.commit_tensor(item, destination)
        done: Future = Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True


def flat(inventory: Inventory) -> FlatKeys:
    return FlatKeys(Inventory([Entry(e.key, e.shape, e.dtype, join_key(e.key)) for e in inventory.values()],
                              inventory.source), frozenset())


@pytest.fixture(scope="module", autouse=True)
def no_hooks():
    """The planner under test is passed in directly; the hook would wrap it once more."""
    ckptshim.uninstall()
    yield
    ckptshim.install()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout_plans(), st.data())
def test_every_layout_op_reads_through_any_stored_chunking(drawn, data):
    p, arrays = drawn
    rng = random.Random(data.draw(st.integers(0, 2**32 - 1)))
    cuts = {join_key(key): [sorted(rng.sample(range(1, size), rng.randint(0, min(2, size - 1)))) if size > 1 else []
                            for size in value.shape] for key, value in arrays.items()}
    load_and_compare(p, arrays, cuts, strided=data.draw(st.booleans()))


def load_and_compare(p: Plan, arrays: dict, cuts: dict[str, list[list[int]]], strided: bool = False) -> ChunkedArrays:
    """Load ``arrays``, stored cut at ``cuts``, through ``p`` into destinations that start out
    holding a value no source has (NaN, or the dtype's largest integer), so an element left
    unwritten cannot pass for a written one; compare with what numpy makes of the plan.
    ``strided``: by a reader that takes a reorder's block as one strided copy. Returns the reader."""
    stored = {join_key(key): value for key, value in arrays.items()}
    mapping = KeyMapping(p, flat(p.source), flat(p.target))
    state_dict = {join_key(key): unwritten(entry.shape, getattr(torch, entry.dtype)) for key, entry in p.target.items()}
    reader = ChunkedArrays(stored, cuts, strided)
    dcp.load(state_dict, storage_reader=reader,
             planner=RemappingLoadPlanner(None, lambda metadata, sd, partial: mapping, strided_reads=strided),
             no_dist=True)
    expected = execute(p, arrays)
    for key, value in expected.items():
        assert same_bits(state_dict[join_key(key)].numpy(), value), (key, p.ops, cuts)
    return reader


@pytest.mark.parametrize(("row_cuts", "strided_items"), [([], 2), ([4], 4), ([6], 12)])
def test_a_per_head_reorder_is_one_strided_copy_per_stored_chunk(row_cuts, strided_items):
    """Meta's rotary pairs -> Hugging Face's halves per head (rows as ``(heads, d/2, 2)`` ->
    ``(heads, 2, d/2)``): a reader that takes strided copies gets one read item per stored
    chunk whose rows are whole heads (a chunk cut inside a head, at row 6: one per run of rows
    of its two parts), any other reader one per row; the values are the same."""
    heads, dim, hidden = 3, 4, 5
    wq = np.arange(heads * dim * hidden, dtype=np.float32).reshape(heads * dim, hidden)
    p = Plan(Inventory([Entry(("wq",), wq.shape, "float32", None)], "source"),
             Inventory([Entry(("w",), wq.shape, "float32", None)], "target"),
             (Reorder(("wq",), ("w",), 0, (heads, dim // 2, 2), (0, 2, 1)),))
    cuts = {"wq": [row_cuts, [2]]}
    assert load_and_compare(p, {("wq",): wq}, cuts, strided=True).read_items == strided_items
    assert load_and_compare(p, {("wq",): wq}, cuts).read_items == 2 * heads * dim


def unwritten(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype)
    return torch.full(shape, True if dtype == torch.bool else torch.iinfo(dtype).max, dtype=dtype)


def test_a_join_whose_permutation_is_not_its_own_inverse_reads_every_chunk():
    """Found by the property above: a part joined with perm (2, 0, 1), stored in two chunks cut
    along its axis 1, had its second chunk placed outside the target, so DCP never read it."""
    part = np.arange(6, dtype=np.float32).reshape(1, 3, 2)
    p = Plan(Inventory([Entry(("part_0",), (1, 3, 2), "float32", None)], "source"),
             Inventory([Entry(("w",), (1, 2, 1, 3), "float32", None)], "target"),
             (Join((("part_0",),), ("w",), (0,), (2, 0, 1)),))
    load_and_compare(p, {("part_0",): part}, {"part_0": [[], [1], [1]]})


def test_a_part_one_index_wide_is_read():
    """Found by the property above: a part of a fused axis one index wide (a source axis of
    length 1 under a longer target axis) runs along no source axis; it was taken for the source
    axis's innermost factor, which a factor of 1 is not, and planning failed."""
    parts = {("a",): np.arange(2, dtype=np.float32).reshape(1, 2), ("b",): np.arange(4, dtype=np.float32).reshape(2, 2)}
    p = Plan(Inventory([Entry(k, v.shape, "float32", None) for k, v in parts.items()], "source"),
             Inventory([Entry(("w",), (3, 2), "float32", None)], "target"), (Concat((("a",), ("b",)), ("w",), 0, (1, 2)),))
    load_and_compare(p, parts, {"a": [[], [1]], "b": [[1], []]})


def test_a_fused_target_lists_each_source_chunk_at_its_offset():
    """The virtual metadata of Mixtral-style fused experts: each expert's w1 and w3 one slab at
    ``[e, part * I, 0]``, so DCP's resharding picks the experts a rank's rows hold."""
    from ckptshim.execute.dcp_virtual import virtual_metadata

    experts, inner, hidden = 3, 2, 4
    sources = [("w1", e) for e in range(experts)] + [("w3", e) for e in range(experts)]
    keys = tuple((f"e{e}", w) for w, e in sources)
    op = Concat(keys, ("gate_up",), 1, (inner, inner), 0)
    source = Inventory([Entry(k, (inner, hidden), "float32", join_key(k)) for k in keys], "ckpt")
    target = Inventory([Entry(("gate_up",), (experts, 2 * inner, hidden), "float32", "gate_up")], "model")
    reader = ChunkedArrays({join_key(k): np.zeros((inner, hidden), np.float32) for k in keys},
                           {join_key(k): [[], []] for k in keys})
    metadata, links = virtual_metadata(reader.read_metadata(), KeyMapping(Plan(source, target, (op,)), flat(source), flat(target)))
    chunks = {tuple(c.offsets): tuple(c.sizes) for c in metadata.state_dict_metadata["gate_up"].chunks}
    assert chunks == {(e, part * inner, 0): (1, inner, hidden) for part in range(2) for e in range(experts)}
    assert links["gate_up", (2, inner, 0)].fqn == "e2.w3"
