"""The op protocol: adding an op kind is one class plus a handler in each executor that runs it,
and every executor that has no handler for it refuses it by itself, before anything is read or
written (``ckptshim.ops.require_kinds``), naming the op."""

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
              ops.Transpose, ops.Split, ops.Join, ops.Concat, ops.Chunk, ops.Reorder, ops.Tie, ops.Reshape, ops.Scale]


@dataclass(frozen=True)
class Clamp:
    """A kind no executor has a handler for: the target is the source clipped to ``[low, high]``."""

    kind: ClassVar[str] = "clamp"
    produces: ClassVar[bool] = True
    summary_by_example: ClassVar[bool] = False

    source: KeyPath
    target: KeyPath
    low: float
    high: float

    @property
    def sources(self) -> tuple[KeyPath, ...]:
        return (self.source,)

    @property
    def targets(self) -> tuple[KeyPath, ...]:
        return (self.target,)

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
    from ckptshim.execute.jax_tree import TargetTree

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

    from ckptshim.execute.dcp_planner import FlatKeys, KeyMapping, RemappingLoadPlanner

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
