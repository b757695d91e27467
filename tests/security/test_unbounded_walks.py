"""Walks whose length the input chose: an OCDBT index that is not a tree, keys tens of thousands
of components deep through the planner, and ``inspect``'s table for one very long key.

Before: the OCDBT walk followed a node pointing back at its ancestor for ever (all checksums
valid); ``rules/roots.py`` searched the root prefix with a scan per candidate length, quadratic
in key depth (two keys 60,000 deep: minutes); ``inspect`` padded every line to the longest key
(a 1 MB key among 5,000 entries: 5 GB of spaces). Each runs in a confined child.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from hostile import confined
from support.ocdbt_nodes import children, deep_database, parse_location, point_child_at, root_location
from support.fixtures import FIXTURES

ts = pytest.importorskip("tensorstore")

OCDBT_ITEM = FIXTURES / "orbax_0.12.8_scanned/standard_checkpointer_scanned"


def _deep_ocdbt(tmp_path: Path) -> Path:
    return deep_database(OCDBT_ITEM, tmp_path / "item")


def test_deep_ocdbt_index_reads_as_the_fixture(tmp_path):
    """The control: four levels of uncompressed index nodes read to the fixture's values."""
    from ckptshim.formats import detect

    item = _deep_ocdbt(tmp_path)
    base = ts.KvStore.open(f"file://{item}/").result()
    assert ts.ocdbt.dump(base, root_location(item)).result()["height"] >= 2
    deep, fixture = detect.open_checkpoint(item), detect.open_checkpoint(OCDBT_ITEM)
    assert deep.complete, deep.all_problems()
    assert list(deep.inventory) == list(fixture.inventory)
    for entry in fixture.inventory.values():
        assert np.array_equal(deep.read(deep.inventory[entry.key]), fixture.read(entry))


@pytest.mark.parametrize("graph", ["child-points-at-root", "grandchild-points-at-parent", "two-parents-one-child"])
def test_ocdbt_index_that_is_no_tree_is_refused(tmp_path, graph):
    """An interior node's child reference rewritten (node length kept, checksum valid) to an
    ancestor -- a cycle -- or to its sibling's child (a node with two parents: shared ``k`` times
    over ``k`` levels, the walk doubles per level). Before: the walk never ended."""
    item = _deep_ocdbt(tmp_path)
    root = root_location(item)
    first, second = children(item, root)[:2]
    if graph == "child-points-at-root":
        point_child_at(item, second, 0, root)
    elif graph == "grandchild-points-at-parent":
        grandchild = children(item, second)[0]
        point_child_at(item, grandchild, 0, second)
    else:
        point_child_at(item, second, 0, children(item, first)[0])
    outcome = confined(f"""
        from pathlib import Path
        from ckptshim.cli import main
        print("EXIT", main(["inspect", {str(item)!r}]))
        """, memory_mb=2048, seconds=60)
    assert not outcome.timed_out, "the index walk did not end"
    assert "EXIT 1" in outcome.stdout and "reaches the node at d/" in outcome.stderr, \
        outcome.stdout[-1000:] + outcome.stderr[-2000:]
    assert parse_location(root)[0] in outcome.stderr


def test_orbax_restore_refuses_an_ocdbt_index_that_is_no_tree(tmp_path):
    """Through the Orbax hook: a clean refusal naming the checkpoint, not a hang."""
    ocp = pytest.importorskip("orbax.checkpoint")
    item = _deep_ocdbt(tmp_path)
    root = root_location(item)
    point_child_at(item, children(item, root)[1], 0, root)
    outcome = confined(f"""
        import ckptshim
        import orbax.checkpoint as ocp
        try:
            with ocp.StandardCheckpointer() as checkpointer:
                checkpointer.restore({str(item)!r})
            print("RESTORED")
        except ckptshim.ShimError as error:
            print("REFUSED", type(error).__name__, str(error)[:300])
        """, memory_mb=4096, seconds=120)
    assert not outcome.timed_out
    assert "REFUSED CorruptCheckpointError" in outcome.stdout and str(item) in outcome.stdout, \
        outcome.stdout[-1000:] + outcome.stderr[-2000:]


@pytest.mark.parametrize("side", ["checkpoint", "target"])
def test_keys_60000_components_deep_plan_in_linear_time(side):
    """Two keys 60,000 components deep, one side under one more root name. Before: the root
    prefix was searched one candidate length at a time over every key (minutes); the planner's
    promise is time linear in the keys."""
    outcome = confined(f"""
        from ckptshim.inventory import Entry, Inventory
        from ckptshim.planner import explain, plan
        from ckptshim.rules.context import LoadContext
        from ckptshim.rules.profiles import rules_for
        deep = tuple(f"c{{i}}" for i in range(60_000))
        inner = [deep + ("a",), deep + ("b",)]
        outer = [("model",) + key for key in inner]
        source, target = (outer, inner) if {side!r} == "checkpoint" else (inner, outer)
        source = Inventory([Entry(k, (2,), "float32", i) for i, k in enumerate(source)], "checkpoint")
        target = Inventory([Entry(k, (2,), "float32", i) for i, k in enumerate(target)], "target")
        found = plan(source, target, rules_for(LoadContext(source, target, "torch")))
        print("PLANNED", len(found.ops), len(found.missing), len(found.unexpected), found.notes)
        """, memory_mb=2048, seconds=30)
    assert not outcome.timed_out, "planning did not finish in 30 s"
    assert "PLANNED 2 0 0" in outcome.stdout and "root prefix 'model.'" in outcome.stdout, \
        outcome.stdout[-1000:] + outcome.stderr[-2000:]


def test_inspect_does_not_pad_every_line_to_the_longest_key(tmp_path):
    """One key of a million characters among 5,000 tensors: each line padded to it made 5 GB of
    output. Now the long key has a line of its own and the column stays 80 wide."""
    names = ["k" * 1_000_000] + [f"t{i}" for i in range(5000)]
    header = json.dumps({name: {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for name in names}).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    outcome = confined(f"""
        import contextlib, io
        from ckptshim.cli import main

        class Counted(io.TextIOBase):
            written = 0
            def write(self, text):
                Counted.written += len(text)
                if Counted.written > 200_000_000:
                    raise SystemExit("more than 200 MB of output")
                return len(text)

        with contextlib.redirect_stdout(Counted()):
            code = main(["inspect", {str(path)!r}])
        print("EXIT", code, "CHARACTERS", Counted.written)
        """, memory_mb=2048, seconds=120)
    assert not outcome.timed_out
    assert "EXIT 0" in outcome.stdout, outcome.stdout[-1000:] + outcome.stderr[-2000:]
    written = int(outcome.stdout.split("CHARACTERS")[1].split()[0])
    assert written < 1_000_000 + 5001 * 200, written
