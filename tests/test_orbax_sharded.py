"""Sharded restore across scan_layers on a 2x2 mesh of forced CPU devices.

The work happens in ``orbax_sharded_worker.py`` in a subprocess: the device count must be fixed
(``XLA_FLAGS``) before jax initialises, and forcing it for the whole session would change the
device every other test's arrays land on. The devices' slices of an array are read as the one
box they tile (a stored chunk several slices share is fetched once); that each process of a
multi-process restore reads only its own devices' part is ``test_jax_multiprocess.py``'s.
"""

from __future__ import annotations

from support.processes import run_device_worker


def test_the_devices_slices_are_read_exactly_once(tmp_path):
    report = run_device_worker("orbax_sharded_worker.py", str(tmp_path))
    assert report["devices"] == 4
    assert report["stacked_bytes_read"] == report["stacked_bytes_restored"]  # no byte read twice
