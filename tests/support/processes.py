"""Tests that need a process of their own: workers under ``tests/workers``, started with ``tests/``
importable (their ``support`` imports) and any extra environment they need."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import NoReturn

TESTS = Path(__file__).resolve().parent.parent
WORKERS = TESTS / "workers"


def worker(name: str) -> str:
    """The path of ``tests/workers/<name>``."""
    return str(WORKERS / name)


def environment(extra: Mapping[str, str] = {}) -> dict[str, str]:
    """This process's environment with ``tests/`` first on ``PYTHONPATH``, plus ``extra``."""
    path = [str(TESTS), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), **extra}


def run_pipeline_loads(workdir: Path, sources: Sequence[Path]) -> list[dict]:
    """DeepSpeed's real ``PipelineModule.load_state_dir`` of each of ``sources`` into GPT-NeoX's
    layers (``tests/workers/deepspeed_worker.py``, one process, gloo): per source, ``{"error"}``
    for a ckptshim refusal or ``{"shimmed"}``, and the logits in ``workdir/<name>.npy``."""
    import socket

    tokens = TESTS / "fixtures" / "hf_gptneox_tf4.30.2" / "ref_input_ids.npy"
    jobs = [{"source": str(source), "tokens": str(tokens), "out": str(workdir / f"{source.name}.npy"),
             "options": {}} for source in sources]
    (workdir / "jobs.json").write_text(json.dumps(jobs))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    run = subprocess.run([sys.executable, worker("deepspeed_worker.py"), str(workdir / "jobs.json"), "0", "1", port],
                         capture_output=True, text=True, timeout=300, cwd=workdir, env=environment())
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])["jobs"]


def run_ranks(name: str, jobs: list[dict], world: int, workdir: Path, extra: Mapping[str, str] = {},
              timeout: int = 300) -> list:
    """Run ``tests/workers/<name> JOBS.json RANK WORLD PORT`` as ``world`` processes of one
    ``torch.distributed`` group (the worker sets it up on a free local port) on ``jobs``; each
    rank's last ``RESULT`` line, as JSON, in rank order. Ranks still running after ``timeout``
    seconds are killed."""
    import socket

    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "jobs.json").write_text(json.dumps(jobs))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    env = environment({"OMP_NUM_THREADS": "1", **extra})
    procs = [subprocess.Popen([sys.executable, worker(name), str(workdir / "jobs.json"), str(rank), str(world), port],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=workdir, env=env)
             for rank in range(world)]
    results, deadline = [], time.monotonic() + timeout
    try:
        for proc in procs:  # all ranks within ``timeout`` together
            out, err = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
            lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
            assert proc.returncode == 0 and lines, out[-3000:] + err[-3000:]
            results.append(json.loads(lines[-1][len("RESULT "):]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def run_device_worker(name: str, *argv: str, devices: int = 4) -> dict:
    """Run ``tests/workers/<name>`` in a fresh process with ``devices`` forced CPU devices; its last
    stdout line, as JSON. (The device count must be fixed before jax initialises, and forcing it
    for the whole session would change the device every other test's arrays land on.)"""
    env = environment({"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu"})
    result = subprocess.run([sys.executable, worker(name), *argv], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def on_a_terminal(argv: list[str], env: Mapping[str, str], columns: int = 100, timeout: int = 180) -> str:
    """What ``python argv...`` writes to stderr when stderr is a terminal (a pseudo-terminal of
    ``columns``, as a real one or ``script`` has), with ``\\r\\n`` read as ``\\n``; the
    process must exit 0 within ``timeout`` seconds (it is killed, and the test fails, if not)."""
    import pty
    import select
    import termios

    controller, terminal = pty.openpty()
    termios.tcsetwinsize(terminal, (24, columns))
    child = subprocess.Popen([sys.executable, *argv], stdout=subprocess.DEVNULL, stderr=terminal, env=dict(env))
    os.close(terminal)
    deadline = time.monotonic() + timeout
    shown = b""
    try:
        while (left := deadline - time.monotonic()) > 0:
            if not select.select([controller], [], [], left)[0]:
                break  # the deadline passed with nothing to read
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            shown += chunk
    finally:
        os.close(controller)
    text = shown.decode(errors="replace").replace("\r\n", "\n")
    try:
        returncode = child.wait(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
        raise AssertionError(f"still running after {timeout} s; it showed:\n{text}") from None
    assert returncode == 0, text
    return text


def run_rank_cases(cases: Sequence[Callable[..., object]], *args: object, report: Path) -> NoReturn:
    """Run every case on this ``torchrun`` rank, all ranks in step (a barrier after each), and
    write ``report``: each case's name -> ``"ok"`` or its traceback (every case reported, not
    just the first failure; DCP's ``CheckpointException`` is a ``BaseException``); then leave."""
    import torch.distributed as dist
    from torch.distributed.checkpoint import CheckpointException

    results = {}
    for case in cases:
        try:
            case(*args)
            results[case.__name__] = "ok"
        except (Exception, CheckpointException):
            results[case.__name__] = traceback.format_exc()
        dist.barrier()
    report.write_text(json.dumps(results, indent=1))
    leave_process_group()


def leave_process_group() -> NoReturn:
    """End a ``torchrun`` worker whose results are written: every rank done (a barrier), the
    process group destroyed, then the process exits at once, without C++ static destructors. On
    a loaded machine a gloo or store thread still winding down at interpreter exit otherwise
    aborts a rank ("terminate called without an active exception"), failing a run that passed."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
