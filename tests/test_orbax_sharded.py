"""Sharded restore across scan_layers on a 2x2 mesh of forced CPU devices.

The work happens in ``orbax_sharded_worker.py`` in a subprocess: the device count must be fixed
(``XLA_FLAGS``) before jax initialises, and forcing it for the whole session would change the
device every other test's arrays land on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def test_each_device_reads_exactly_its_slice(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    worker = Path(__file__).with_name("orbax_sharded_worker.py")
    result = subprocess.run([sys.executable, str(worker), str(tmp_path)], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["devices"] == 4
    assert report["stacked_bytes_read"] == report["stacked_bytes_restored"]  # no byte read twice
