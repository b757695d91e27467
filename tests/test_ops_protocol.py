"""The op protocol: adding a kind that only moves elements is one class -- its geometry
(``pieces``) is all every executor needs, with no executor edited -- and adding one that changes
values is one class plus a handler in each executor that runs it; every executor that has no
handler for a kind refuses it by itself, before anything is read or written
(``ckptshim.ops.require_kinds``), naming the op."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pytest
import torch

import ckptshim.ops as ops
from ckptshim.errors import PlanError
from ckptshim.inventory import Entry, Inventory, KeyPath, join_key
from ckptshim.planner import Plan, explain, summary
from support.fixtures import FIXTURES

#: Every op class the protocol defines.
OP_CLASSES = [ops.Rename, ops.Stack, ops.Unstack, ops.Synthesize, ops.Drop, ops.Cast,
              ops.Transpose, ops.Split, ops.Join, ops.Concat, ops.Chunk, ops.Reorder, ops.Tie, ops.Reshape, ops.Scale,
              ops.Replicate, ops.Replicated, ops.Sum, ops.Share]
#: The kinds that only move elements, each run by every executor through its geometry alone.
LAYOUT_CLASSES = {ops.Rename, ops.Stack, ops.Unstack, ops.Transpose, ops.Split, ops.Join, ops.Concat, ops.Chunk,
                  ops.Reorder, ops.Reshape, ops.Replicate}


class _OneToOne:
    """What a test's own kind shares with most ops: one source key, one target key."""

    produces: ClassVar[bool] = True
    summary_by_example: ClassVar[bool] = False

    @property
    def sources(self) -> tuple[KeyPath, ...]:
        return (self.source,)

    @property
    def targets(self) -> tuple[KeyPath, ...]:
        return (self.target,)


@dataclass(frozen=True)
class Clamp(_OneToOne):
    """A kind no executor has a handler for: the target is the source clipped to ``[low, high]``."""

    kind: ClassVar[str] = "clamp"

    source: KeyPath
    target: KeyPath
    low: float
    high: float

    def inverse(self) -> Clamp:
        raise ValueError("clipping loses values; it has no inverse")

    def describe(self, sep: str = ".") -> str:
        return f"{join_key(self.source, sep)} -> clamp({self.low}, {self.high}) -> {join_key(self.target, sep)}"

    def tally(self) -> tuple[str, int]:
        return "clamped", 1

    def note(self, sep: str = ".") -> str:
        return f"{self.low}..{self.high}"


SOURCE = Inventory([Entry(("a",), (2, 3), "float32"), Entry(("w",), (2, 3), "float32")], "ckpt")
TARGET = Inventory([Entry(("a",), (2, 3), "float32"), Entry(("t",), (2, 3), "float32")], "model")
PLAN = Plan(SOURCE, TARGET, (ops.Rename(("a",), ("a",)), Clamp(("w",), ("t",), -1.0, 1.0)))
REFUSAL = r"'t'.*`w -> clamp\(-1.0, 1.0\) -> t`.*'clamp' op, which the {} does not run"


def test_every_op_class_declares_the_protocol():
    for cls in OP_CLASSES:
        assert isinstance(cls.kind, str) and isinstance(cls.produces, bool), cls
        assert isinstance(cls.summary_by_example, bool), cls
        for method in ("inverse", "describe", "tally", "note"):
            assert callable(getattr(cls, method)), (cls, method)
        assert cls.layout is (cls in LAYOUT_CLASSES) and callable(getattr(cls, "pieces", None)) is cls.layout, cls
    assert len({cls.kind for cls in OP_CLASSES}) == len(OP_CLASSES)


def test_a_new_kind_plans_and_explains_through_the_protocol():
    assert PLAN.producer(("t",)).kind == "clamp"
    assert summary(PLAN) == "1 clamped (-1.0..1.0)"
    assert explain(PLAN) == ["w -> clamp(-1.0, 1.0) -> t"]


def test_the_torch_executor_refuses_it():
    from ckptshim.execute.torch import prepare

    destinations = {("a",): torch.zeros(2, 3), ("t",): torch.zeros(2, 3)}
    fetched = []
    with pytest.raises(PlanError, match=REFUSAL.format("torch executor")):
        prepare(PLAN, lambda key: fetched.append(key) or torch.ones(2, 3), destinations)
    assert fetched == []  # refused before a source was fetched
    assert all(not t.any() for t in destinations.values())


class _Arrays:
    """A checkpoint of numpy arrays that counts its reads."""

    path = "arrays"

    def __init__(self) -> None:
        self.reads = 0

    def read_into(self, entry, index, out):
        self.reads += 1
        out[...] = 1


def test_the_jax_executor_refuses_it():
    import jax

    from ckptshim.execute.jax import build
    from ckptshim.targets.jax_tree import TargetTree

    tree = {"a": jax.ShapeDtypeStruct((2, 3), np.float32), "t": jax.ShapeDtypeStruct((2, 3), np.float32)}
    source = _Arrays()
    with pytest.raises(PlanError, match=REFUSAL.format("JAX executor").replace("'t'", "t")):
        build(source, PLAN, TargetTree(tree).targets, "/")
    assert source.reads == 0


def test_the_files_executor_refuses_it(tmp_path):
    """``ckptshim convert``'s executor, on a real checkpoint: nothing is read."""
    from safetensors.numpy import save_file

    from ckptshim.execute.arrays import PlannedArrays
    from ckptshim.formats.detect import open_checkpoint

    save_file({"a": np.ones((2, 3), np.float32), "w": np.ones((2, 3), np.float32)}, tmp_path / "m.safetensors")
    checkpoint = open_checkpoint(tmp_path / "m.safetensors")
    plan = dataclasses.replace(PLAN, source=checkpoint.inventory)
    with pytest.raises(PlanError, match=REFUSAL.format("array executor")):
        PlannedArrays(checkpoint, plan, ".")


def test_the_dcp_planner_refuses_it():
    """DCP's load planner: refused while DCP plans, before a read item exists."""
    from torch.distributed.checkpoint import FileSystemReader

    from ckptshim.execute.dcp_planner import RemappingLoadPlanner
    from ckptshim.execute.dcp_virtual import FlatKeys, KeyMapping

    metadata = FileSystemReader(FIXTURES / "torch_dcp_single" / "dcp_plain").read_metadata()
    stored = sorted(k for k, md in metadata.state_dict_metadata.items() if hasattr(md, "size"))[:2]

    def keys(names: list[str], source: str) -> FlatKeys:
        shapes = [tuple(metadata.state_dict_metadata[n].size) for n in stored]
        return FlatKeys(Inventory([Entry((name,), shape, "float32", fqn) for name, shape, fqn
                                   in zip(names, shapes, stored)], source), frozenset())

    source, target = keys(["a", "w"], "ckpt"), keys(["a", "t"], "state dict")
    plan = Plan(source.inventory, target.inventory,
                (ops.Rename(("a",), ("a",)), Clamp(("w",), ("t",), -1.0, 1.0)))
    planner = RemappingLoadPlanner(None, lambda *_: KeyMapping(plan, source, target))
    state_dict = {fqn: torch.zeros(metadata.state_dict_metadata[fqn].size) for fqn in stored}
    with pytest.raises(PlanError, match=REFUSAL.format("DCP load planner")):
        planner.set_up_planner(state_dict, metadata)


# -- a new kind that only moves elements: its geometry is all any executor needs ----------------


@dataclass(frozen=True)
class Roll(_OneToOne):
    """A layout kind no executor knows by name: the target is the source with its axes permuted
    by ``perm`` (target axis ``i`` is source axis ``perm[i]``), then rolled by ``shift`` along
    target axis ``axis`` -- ``numpy.roll(source.transpose(perm), shift, axis)``. It says so only
    through its geometry: two pieces, each a range of the rolled axis on both sides, permuted."""

    kind: ClassVar[str] = "roll"
    layout: ClassVar[bool] = True

    source: KeyPath
    target: KeyPath
    perm: tuple[int, ...]
    axis: int
    shift: int

    def pieces(self, source_shapes, target_shapes):
        from ckptshim.geometry import Piece, View

        (source,), (target,) = source_shapes, target_shapes
        length, shift, rolled = target[self.axis], self.shift % target[self.axis], self.perm[self.axis]

        def view(array: int, shape: tuple[int, ...], axis: int, part: range) -> View:
            return View(array, shape, tuple(part if a == axis else range(n) for a, n in enumerate(shape)))

        return tuple(Piece(view(0, source, rolled, range(start, start + size)),
                           view(0, target, self.axis, range(at, at + size)), self.perm)
                     for start, at, size in ((0, shift, length - shift), (length - shift, 0, shift)) if size)

    def inverse(self) -> Roll:
        back = ops.inverse_perm(self.perm)
        return Roll(self.target, self.source, back, self.perm[self.axis], -self.shift)

    def describe(self, sep: str = ".") -> str:
        return f"{join_key(self.source, sep)} -> roll({self.note()}) -> {join_key(self.target, sep)}"

    def tally(self) -> tuple[str, int]:
        return "rolled", 1

    def note(self, sep: str = ".") -> str:
        return f"perm {self.perm}, {self.shift} along axis {self.axis}"


ROLLED = np.arange(4 * 6 * 5, dtype=np.float32).reshape(4, 6, 5)
ROLL = Roll(("w",), ("t",), (1, 2, 0), 0, 2)  # [4, 6, 5] -> [6, 5, 4], rolled by 2 along its axis 0
WANT = {("a",): np.ones((2, 3), np.float32), ("t",): np.roll(ROLLED.transpose(ROLL.perm), ROLL.shift, ROLL.axis)}
ROLL_PLAN = Plan(Inventory([Entry(("a",), (2, 3), "float32"), Entry(("w",), ROLLED.shape, "float32")], "ckpt"),
                 Inventory([Entry(key, value.shape, "float32") for key, value in WANT.items()], "model"),
                 (ops.Rename(("a",), ("a",)), ROLL))


def _saved(tmp_path):
    """The source arrays in a real safetensors file, opened by ckptshim."""
    from safetensors.numpy import save_file

    from ckptshim.formats.detect import open_checkpoint

    save_file({"a": WANT[("a",)], "w": ROLLED}, tmp_path / "m.safetensors")
    return open_checkpoint(tmp_path / "m.safetensors")


def test_a_new_layout_kind_runs_in_the_torch_executor_and_inverts():
    from ckptshim.execute.torch import prepare

    arrays = {("a",): WANT[("a",)], ("w",): ROLLED}
    destinations = {key: torch.zeros(value.shape) for key, value in WANT.items()}
    prepare(ROLL_PLAN, lambda key: torch.from_numpy(arrays[key]), destinations).write()
    assert all(np.array_equal(destinations[key].numpy(), value) for key, value in WANT.items())
    back = Plan(ROLL_PLAN.target, ROLL_PLAN.source, tuple(op.inverse() for op in ROLL_PLAN.ops))
    sources = {("a",): torch.zeros(2, 3), ("w",): torch.zeros(ROLLED.shape)}
    prepare(back, destinations.__getitem__, sources).write()
    assert np.array_equal(sources[("w",)].numpy(), ROLLED)
    assert summary(ROLL_PLAN) == "1 rolled (perm (1, 2, 0), 2 along axis 0)"


def test_a_new_layout_kind_runs_in_the_block_reads_of_the_jax_executor(tmp_path):
    """Every block a device could hold (here: each range of every axis), read from a real
    safetensors file, is that block of the rolled array; and ``build`` restores it whole."""
    import jax

    from ckptshim.execute import blocks
    from ckptshim.execute.jax import build
    from ckptshim.targets.jax_tree import TargetTree

    checkpoint = _saved(tmp_path)
    plan = dataclasses.replace(ROLL_PLAN, source=checkpoint.inventory)
    want = WANT[("t",)]
    fill = blocks.filler(checkpoint, plan, ROLL, ("t",), want.shape, np.dtype(np.float32))
    for axis, length in enumerate(want.shape):
        for low in range(length):
            for high in range(low + 1, length + 1):
                block = tuple(slice(low, high) if a == axis else slice(0, n) for a, n in enumerate(want.shape))
                assert np.array_equal(fill(block), want[block]), block
    tree = {"a": jax.ShapeDtypeStruct((2, 3), np.float32), "t": jax.ShapeDtypeStruct(want.shape, np.float32)}
    built = build(checkpoint, plan, TargetTree(tree).targets, "/")
    assert all(np.array_equal(np.asarray(built[key]), value) for key, value in WANT.items())


def test_a_new_layout_kind_runs_in_the_files_executor(tmp_path):
    """``ckptshim convert``'s executor, on a real checkpoint."""
    from ckptshim.execute.arrays import PlannedArrays

    checkpoint = _saved(tmp_path)
    arrays = PlannedArrays(checkpoint, dataclasses.replace(ROLL_PLAN, source=checkpoint.inventory), ".")
    assert [e.key for e in arrays.entries] == list(WANT)
    values = list(arrays.values())
    assert [entry.key for entry, _ in values] == list(WANT)
    assert all(np.array_equal(value, WANT[entry.key]) for entry, value in values)


@pytest.mark.parametrize("cuts", [None, {"w": [[1, 3], [2], [4]]}])
def test_a_new_layout_kind_runs_in_the_dcp_load_planner(tmp_path, cuts):
    """DCP's own load, planned through the virtual metadata: from a real ``dcp.save`` (one chunk
    per tensor), and from tensors stored as a grid of chunks (another number of ranks)."""
    import torch.distributed.checkpoint as dcp

    import ckptshim
    from ckptshim.execute.dcp_planner import RemappingLoadPlanner
    from ckptshim.execute.dcp_virtual import FlatKeys, KeyMapping

    def flat(inventory: Inventory) -> FlatKeys:
        return FlatKeys(Inventory([Entry(e.key, e.shape, e.dtype, join_key(e.key)) for e in inventory.values()],
                                  inventory.source), frozenset())

    mapping = KeyMapping(ROLL_PLAN, flat(ROLL_PLAN.source), flat(ROLL_PLAN.target))
    planner = RemappingLoadPlanner(None, lambda metadata, state_dict, partial: mapping)
    state_dict = {join_key(key): torch.full(value.shape, float("nan")) for key, value in WANT.items()}
    ckptshim.uninstall()  # the planner under test is passed in directly; the hook would wrap it once more
    try:
        if cuts is None:
            dcp.save({"a": torch.from_numpy(WANT[("a",)]), "w": torch.from_numpy(ROLLED)}, checkpoint_id=tmp_path,
                     no_dist=True)
            dcp.load(state_dict, checkpoint_id=tmp_path, planner=planner, no_dist=True)
        else:
            from test_dcp_layouts import ChunkedArrays

            reader = ChunkedArrays({"a": WANT[("a",)], "w": ROLLED}, {"a": [[], []], **cuts})
            dcp.load(state_dict, storage_reader=reader, planner=planner, no_dist=True)
    finally:
        ckptshim.install()
    assert all(np.array_equal(state_dict[join_key(key)].numpy(), value) for key, value in WANT.items())
