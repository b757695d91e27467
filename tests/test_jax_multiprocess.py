"""Multi-process JAX restores through the Orbax hook: one launch of real ``jax.distributed``.

``tests/workers/jax_multiprocess_worker.py`` runs as 4 processes on localhost, 2 CPU devices
each (8 global devices), coordinated by ``jax.distributed.initialize`` with gloo CPU
collectives; every case runs on every process (see the worker's docstring). The tests below read
what each process wrote.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from ckptshim.cli import main as cli
from ckptshim.errors import ShimError
from support import jax_processes
from support.fixtures import copy_fixture
from support.processes import worker

PROCESSES = 4
#: The first test waits for ``launch``, whose processes are killed after 600 s.
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("jax_multiprocess")
    fixtures = out / "fixtures"
    for name in ("maxtext_runs", "paxml_runs/TinySpmdRepeat", "orbax_0.2.3_unscanned",
                 "t5x_tiny_decoder/legacy_checkpointer"):
        copy_fixture(name, fixtures)
    ran = jax_processes.launch(worker("jax_multiprocess_worker.py"), PROCESSES, [str(out)], timeout=600,
                               extra_env={"CKPTSHIM_AGREEMENT_TIMEOUT": "60"})
    if ran.hung:
        pytest.fail("the processes hung:\n" + "\n".join(log[-3000:] for log in ran.logs))
    assert all(code == 0 for code in ran.returncodes), "\n----\n".join(log[-4000:] for log in ran.logs)
    return [json.loads((out / f"process{i}.json").read_text()) | {"out": str(out)} for i in range(PROCESSES)]


CASES = ["case_save_then_scan", "case_maxtext", "case_paxml_gpt3", "case_legacy_orbax", "case_t5x",
         "case_refused_from_metadata", "case_damaged_chunk_one_process", "case_process_that_never_reports"]


@pytest.mark.parametrize("case", CASES)
def test_case_passes_on_every_process(launch, case):
    failed = {i: result[case]["status"] for i, result in enumerate(launch) if result[case]["status"] != "ok"}
    assert not failed, "\n".join(f"process {i}:\n{text}" for i, text in failed.items())
    assert all(result["devices"] == 2 * PROCESSES and result["local_devices"] == 2 for result in launch)


@pytest.mark.parametrize("case", ["case_save_then_scan", "case_maxtext", "case_paxml_gpt3", "case_legacy_orbax", "case_t5x"])
def test_each_process_builds_only_its_own_shards(launch, case):
    """Every process checked its addressable shards, and those are a quarter of the devices'."""
    counts = [result[case]["shards_checked"] for result in launch]
    assert len(set(counts)) == 1 and counts[0] > 0, counts


def test_each_process_reads_about_its_share_of_the_bytes(launch):
    """The saved checkpoint holds one chunk per device's rows; a process restoring its rows
    reads its chunks and the index: close to 1/N of what is stored, never the whole."""
    runs = [result["case_save_then_scan"] for result in launch]
    stored = runs[0]["stored_bytes"]
    shares = [run["rchar"] / stored for run in runs]
    assert all(0.95 / PROCESSES < share < 1.1 / PROCESSES for share in shares), shares


def test_only_process_0_shows_a_progress_bar(launch):
    assert [result["shows_progress"] for result in launch] == [True] + [False] * (PROCESSES - 1)


def test_a_restore_no_plan_fits_is_orbaxs_alike_on_every_process(launch):
    """Every process decides "no plan" from the same metadata and they agree on it; each then
    runs Orbax's own restore, which refuses it (not ckptshim), with the same note everywhere."""
    runs = [result["case_refused_from_metadata"] for result in launch]
    assert not any(run["shim_error"] for run in runs), runs[0]
    assert len({(run["message"], tuple(run["notes"])) for run in runs}) == 1
    assert "tree structures do not match" in runs[0]["message"]
    assert any(note.startswith("ckptshim: ") and "layers" in note for note in runs[0]["notes"]), runs[0]["notes"]


def test_a_read_failing_on_one_process_fails_every_process_quickly(launch):
    """Only the last process reads the damaged chunk: it raises the read's own error, and every
    other process a PeerError naming it and its reason -- none returns, none hangs."""
    runs = [result["case_damaged_chunk_one_process"] for result in launch]
    last = runs[-1]
    assert not last["peer"] and "'params/layers_2/w'" in last["message"], last
    for run in runs[:-1]:
        assert run["peer"] and f"process {PROCESSES - 1} failed" in run["message"], run
    assert all(run["seconds"] < 30 for run in runs), [run["seconds"] for run in runs]


def test_a_process_that_never_reports_is_named_within_the_timeout(launch):
    runs = [result["case_process_that_never_reports"] for result in launch[:-1]]
    for run in runs:
        assert f"process {PROCESSES - 1} did not report within 3 s" in run["message"], run
        assert 3 <= run["seconds"] < 15, run


# -- completeness of the checkpoint the four processes saved --------------------------------------


def _damaged_copy(launch, tmp_path: Path, damage: str) -> tuple[Path, str]:
    """A copy of the 4-process save with one data file of ``ocdbt.process_2`` damaged."""
    root = tmp_path / "ckpt"
    shutil.copytree(Path(launch[0]["out"]) / "mp_unscanned", root)
    data = sorted((root / "ocdbt.process_2" / "d").iterdir(), key=lambda p: p.stat().st_size)[-1]
    if damage == "deleted":
        data.unlink()
    elif damage == "truncated":
        os.truncate(data, data.stat().st_size // 2)
    elif damage == "directory":
        data.unlink()
        data.mkdir()
    elif damage == "symlinked away":
        moved = tmp_path / "elsewhere"
        data.rename(moved)
        data.symlink_to(moved)
    return root, str(data.relative_to(root))


@pytest.mark.parametrize("damage", ["deleted", "truncated", "directory"])
def test_inspect_names_the_writer_the_file_and_what_it_costs(launch, tmp_path, capsys, damage):
    root, damaged = _damaged_copy(launch, tmp_path, damage)
    assert cli(["inspect", str(root), "--json"]) == 1
    info = json.loads(capsys.readouterr().out)
    writers = {w["writer"]: w for w in info["writers"]}
    assert set(writers) == {"root"} | {f"ocdbt.process_{i}" for i in range(PROCESSES)}
    assert [w for w, report in writers.items() if report["gaps"]] == ["ocdbt.process_2"]
    gap = writers["ocdbt.process_2"]["gaps"][0]
    assert gap["file"] == damaged and info["problems"] == [gap["problem"]]
    assert writers["ocdbt.process_2"]["bytes_present"] < writers["ocdbt.process_2"]["bytes_needed"]
    # process 2 wrote the rows of devices 4 and 5: 32 rows each of every layer's w
    assert gap["costs"] and all(re.search(r"params/layers_\d/(w \[(128|160):(160|192), 0:1024\]|b \[(128|160):(160|192)\])", c)
                                for c in gap["costs"]), gap["costs"]
    assert cli(["inspect", str(root)]) == 1
    text = capsys.readouterr().out
    assert re.search(rf"\n    {re.escape(damaged)}: .*; costs \d array\(s\): params/layers_", text), text
    assert re.search(r"\n    ocdbt.process_2: \d file\(s\)", text), text


@pytest.mark.parametrize("damage", ["deleted", "truncated", "directory", "symlinked away"])
def test_a_load_is_refused_before_any_read(launch, tmp_path, monkeypatch, damage):
    root, damaged = _damaged_copy(launch, tmp_path, damage)
    import jax
    import orbax.checkpoint as ocp

    from ckptshim.formats.orbax import OrbaxCheckpoint  # (the hooks are on: ckptshim is imported)

    reads = []
    monkeypatch.setattr(OrbaxCheckpoint, "read_into", lambda *args: reads.append(args))
    target = {"params": {"layers": {"w": jax.ShapeDtypeStruct((256, 4, 1024), "float32"),
                                    "b": jax.ShapeDtypeStruct((256, 4), "float32")}}}
    with pytest.raises(ShimError, match=re.escape(Path(damaged).name)):
        ocp.StandardCheckpointer().restore(root, target)
    assert reads == []


def test_a_missing_index_node_costs_every_array_it_indexes(launch, tmp_path, capsys):
    root, _ = _damaged_copy(launch, tmp_path, "none")
    (node,) = (root / "d").iterdir()  # the merged index's one node
    node.unlink()
    assert cli(["inspect", str(root), "--json"]) == 1
    info = json.loads(capsys.readouterr().out)
    (gap,) = [gap for w in info["writers"] for gap in w["gaps"]]
    assert gap["file"] == f"d/{node.name}" and gap["lost"].startswith("8 array(s)")
    assert all(cost.split(" ")[1:3] == ["(its", "index"] for cost in gap["costs"])


def test_files_the_latest_version_does_not_use_are_not_needed(launch, tmp_path, capsys):
    """A per-process database keeps the index nodes of its earlier generations; the merged index
    never points at them, so deleting them loses nothing (Orbax and ckptshim restore alike)."""
    root, _ = _damaged_copy(launch, tmp_path, "none")
    from ckptshim.formats import kvstore

    needed = set(kvstore.ocdbt_index(root).files)
    unused = [p for p in root.glob("ocdbt.process_*/d/*") if str(p.relative_to(root)) not in needed]
    for path in unused:
        path.unlink()
    assert cli(["inspect", str(root)]) == 0
    assert capsys.readouterr().out.rstrip().endswith("complete")
