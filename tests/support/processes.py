"""Tests that need a process of their own: workers under ``tests/workers``, started with ``tests/``
importable (their ``support`` imports) and any extra environment they need."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
WORKERS = TESTS / "workers"


def worker(name: str) -> str:
    """The path of ``tests/workers/<name>``."""
    return str(WORKERS / name)


def environment(extra: Mapping[str, str] = {}) -> dict[str, str]:
    """This process's environment with ``tests/`` first on ``PYTHONPATH``, plus ``extra``."""
    path = [str(TESTS), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), **extra}


def run_device_worker(name: str, *argv: str, devices: int = 4) -> dict:
    """Run ``tests/workers/<name>`` in a fresh process with ``devices`` forced CPU devices; its last
    stdout line, as JSON. (The device count must be fixed before jax initialises, and forcing it
    for the whole session would change the device every other test's arrays land on.)"""
    env = environment({"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu"})
    result = subprocess.run([sys.executable, worker(name), *argv], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])
