"""The first hooked ``dcp.load`` that steps aside imports no planning machinery, and decides exactly
as the full planner would.

``ckptshim.loading.dcp.prepare_mapping`` answers "nothing to map" from the names, shapes and
dtypes alone, before the planner, the rules and the profiles are imported; a load that plans
imports them. Here, in fresh processes: a load whose names match leaves them unimported, a load
that plans imports them and loads the same values as the matching one. And over the real DCP
fixtures with edits drawn by hypothesis (a wrapper prefix, a nesting level, a changed shape or
dtype, a missing or extra key): wherever the quick answer says "nothing to map", the full
planner, run anyway, keeps every stored name and layout too -- DCP's own planner would have run
on the stored metadata either way. (The time itself is measured by
``bench/bench_first_call.py``, not here.)
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from ckptshim.errors import NoPlan, PlanError
from ckptshim.execute.dcp_virtual import keeps_stored_names
from ckptshim.formats import detect
from ckptshim.loading import dcp as dcp_loading
from ckptshim.loading import dcp_mapping
from support.fixtures import FIXTURES, fixture_module
from support.markers import QUIET
from support.processes import environment

pytestmark = QUIET
build = fixture_module("torch_dcp_single/dcp_tiny_model.py").build
CHECKPOINTS = {name: FIXTURES / "torch_dcp_single" / name for name in ("dcp_plain", "dcp_compiled", "dcp_plain_toplevel")}
#: What a load that only steps aside must not import (``fsspec``: DCP's own local load does not; the
#: readers of other formats: a DCP folder is told from them by file names alone).
PLANNING = ("ckptshim.planner", "ckptshim.ops", "ckptshim.rules", "ckptshim.geometry", "ckptshim.formats.detect",
            "ckptshim.loading.dcp_mapping", "ckptshim.execute.dcp_virtual", "fsspec",
            "ckptshim.formats.safetensors", "ckptshim.formats.megatron_core", "ckptshim.formats.kvstore",
            "ckptshim.formats.zarr")

LOAD = """
import json, sys
import ckptshim
import torch, torch.distributed.checkpoint as dcp
sys.path.insert(0, sys.argv[2])
from dcp_tiny_model import build
model = build(seed=1)
state = {"model": model.state_dict()} if sys.argv[3] == "nested" else model.state_dict()
dcp.load(state, checkpoint_id=sys.argv[1])
planning = sorted(m for m in sys.modules if m.startswith(PLANNING))
print(json.dumps({"planning": planning, "sum": float(sum(v.double().sum() for v in model.state_dict().values()))}))
""".replace("PLANNING", repr(PLANNING))


def _load(checkpoint: str, nested: bool) -> dict:
    """A fresh process's first ``dcp.load`` of ``checkpoint`` into the tiny model's state dict
    (``nested``: under ``"model"``): the planning modules it imported, and a sum of the values."""
    run = subprocess.run([sys.executable, "-c", LOAD, str(CHECKPOINTS[checkpoint]), str(FIXTURES / "torch_dcp_single"),
                          "nested" if nested else "flat"],
                         capture_output=True, text=True, env=environment(), timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_a_first_load_that_steps_aside_imports_no_planning_machinery():
    stepped_aside = _load("dcp_plain", nested=True)
    assert stepped_aside["planning"] == []
    planned = _load("dcp_compiled", nested=False)  # saved as model._orig_mod.*: ckptshim renames
    assert {"ckptshim.planner", "ckptshim.rules", "ckptshim.loading.dcp_mapping",
            "ckptshim.execute.dcp_virtual"} <= set(planned["planning"])
    assert planned["sum"] == stepped_aside["sum"]


def test_the_formats_tried_before_detect_are_detects_first_for_torch():
    assert tuple(fmt for fmt in detect.FORMATS if "torch" in fmt.READERS)[:len(dcp_loading.FIRST_TRIED)] == \
        dcp_loading.FIRST_TRIED
    for folder in CHECKPOINTS.values():
        assert dcp_loading._torch_format(folder) is detect.detect(folder, backend="torch")


# -- the quick answer against the full planner ----------------------------------------------------

EDITS = ("none", "wrapper", "nest", "unnest", "shape", "dtype", "drop", "extra")


def _edited(state: dict, edit: str, which: int) -> dict:
    """``state`` with one edit; a key-level edit lands in the tensors' own level (under
    ``"model"`` where the state dict nests them)."""
    if edit == "nest":
        return {"model": state}
    if set(state) == {"model"}:
        return dict(state["model"]) if edit == "unnest" else {"model": _edited(state["model"], edit, which)}
    keys = sorted(state)
    key = keys[which % len(keys)]
    if edit == "wrapper":
        return {f"_orig_mod.{k}": v for k, v in state.items()}
    if edit == "shape":
        return {**state, key: torch.zeros(*state[key].shape, 2)}
    if edit == "dtype":
        return {**state, key: state[key].to(torch.float64 if state[key].dtype != torch.float64 else torch.float32)}
    if edit == "drop":
        return {k: v for k, v in state.items() if k != key}
    if edit == "extra":
        return {**state, "extra.weight": torch.zeros(3)}
    return state  # "none", or "unnest" of a flat state dict


def _as_saved(name: str) -> dict:
    """The state dict of the tiny model, laid out as ``name`` was saved."""
    state = build(seed=2).state_dict()
    if name == "dcp_compiled":
        return {"model": {f"_orig_mod.{k}": v for k, v in state.items()}}
    return {"model": state} if name == "dcp_plain" else state


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(CHECKPOINTS)), edits=st.lists(st.tuples(st.sampled_from(EDITS), st.integers(0, 50)),
                                                                max_size=2))
def test_nothing_to_map_only_where_the_full_planner_keeps_every_stored_name(name, edits):
    metadata = FileSystemReader(CHECKPOINTS[name]).read_metadata()
    state = _as_saved(name)
    for edit, which in edits:
        state = _edited(state, edit, which)
    flat, paths = flatten_state_dict(state)
    quick = dcp_loading._stored_as_asked(metadata, flat)
    try:
        full = dcp_mapping.checked_mapping(metadata, flat, paths, False, CHECKPOINTS[name], None, "test")
    except (NoPlan, PlanError):
        full = None
    if quick:
        assert full is not None and keeps_stored_names(full), (name, edits)
    if not edits or all(edit == "none" for edit, _ in edits):
        assert quick, name  # the checkpoint as saved: nothing to map


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_a_load_as_saved_steps_aside_without_planning(name, monkeypatch):
    """The hook's own path: ``prepare_mapping`` on a state dict laid out as saved answers ``None``
    and never reaches the planner."""
    def planned(*args, **kwargs):
        raise AssertionError("the planner ran for a load with nothing to map")

    monkeypatch.setattr(dcp_mapping, "checked_mapping", planned)
    metadata = FileSystemReader(CHECKPOINTS[name]).read_metadata()
    assert dcp_loading.prepare_mapping(metadata, _as_saved(name), False, CHECKPOINTS[name]) is None
