"""Multi-process JAX restores through the Orbax hook: one launch of real ``jax.distributed``.

``tests/workers/jax_multiprocess_worker.py`` runs as 4 processes on localhost, 2 CPU devices
each (8 global devices), coordinated by ``jax.distributed.initialize`` with gloo CPU
collectives; every case runs on every process (see the worker's docstring). The tests below read
what each process wrote.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.fixtures import copy_fixture
from support.processes import environment, worker

PROCESSES = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("jax_multiprocess")
    fixtures = out / "fixtures"
    for name in ("maxtext_runs", "paxml_runs/TinySpmdRepeat", "orbax_0.2.3_unscanned",
                 "t5x_tiny_decoder/legacy_checkpointer"):
        copy_fixture(name, fixtures)
    env = environment({"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu",
                       "CKPTSHIM_AGREEMENT_TIMEOUT": "60"})
    env = {k: v for k, v in env.items() if not k.startswith("CKPTSHIM_") or k == "CKPTSHIM_AGREEMENT_TIMEOUT"}
    port = _free_port()
    start = time.monotonic()
    processes = [subprocess.Popen([sys.executable, worker("jax_multiprocess_worker.py"), str(i),
                                   str(PROCESSES), str(port), str(out)],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for i in range(PROCESSES)]
    logs = []
    for process in processes:
        try:
            logs.append(process.communicate(timeout=max(600 - (time.monotonic() - start), 1))[0])
        except subprocess.TimeoutExpired:
            for other in processes:
                other.kill()
            pytest.fail("the processes hung:\n" + "\n".join(p.communicate()[0][-3000:] for p in processes))
    assert all(p.returncode == 0 for p in processes), "\n----\n".join(log[-4000:] for log in logs)
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


def test_refusal_from_metadata_is_the_same_on_every_process(launch):
    runs = [result["case_refused_from_metadata"] for result in launch]
    assert len({run["message"] for run in runs}) == 1 and "layers" in runs[0]["message"]


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
