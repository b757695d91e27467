"""Helpers shared by the Orbax/Flax tests: fixture copies, key paths of JAX trees, layer stacking.

Fixtures are copied into a temporary folder before use (Orbax managers may write next to a
checkpoint; bad-input tests delete files), so ``tests/fixtures`` is never touched.
"""

from __future__ import annotations

import shutil
import stat
from pathlib import Path

import numpy as np

from ckptshim.inventory import split_key, unflatten
from manifest import FIXTURES


def copy_fixture(name: str, into: Path) -> Path:
    """A writable copy of ``tests/fixtures/<name>`` under ``into``."""
    destination = into / name
    if not destination.exists():
        shutil.copytree(FIXTURES / name, destination)
        for path in [destination, *destination.rglob("*")]:
            path.chmod(path.stat().st_mode | stat.S_IWUSR)
    return destination


def nest(flat: dict[str, object]) -> dict:
    """``{"a/b": x}`` -> ``{"a": {"b": x}}``: the nested tree Orbax saves and restores."""
    return unflatten({split_key(key, "/"): value for key, value in flat.items()})


def flat(tree) -> dict[str, object]:
    """``{"a/b/0/c": leaf}`` with Orbax's spelling of JAX key paths."""
    import jax

    from ckptshim.execute.jax_tree import key_name

    return {"/".join(key_name(p) for p in path): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def scanned_expected(unscanned: dict[str, object], layers: int, axis_of) -> dict[str, np.ndarray]:
    """Stack ``.../layers_{i}/...`` of a flat tree with numpy: ``axis_of(key)`` names the axis."""
    out: dict[str, np.ndarray] = {}
    for key, value in unscanned.items():
        if "/layers_0/" in key:
            whole = key.replace("/layers_0/", "/layers/")
            out[whole] = np.stack([np.asarray(unscanned[key.replace("/layers_0/", f"/layers_{i}/")])
                                   for i in range(layers)], axis=axis_of(whole))
        elif "/layers_" not in key:
            out[key] = np.asarray(value)
    return out


def unscanned_expected(scanned: dict[str, object], layers: int, axis_of) -> dict[str, np.ndarray]:
    """Take ``.../layers/...`` of a flat tree apart with numpy into ``.../layers_{i}/...``."""
    out: dict[str, np.ndarray] = {}
    for key, value in scanned.items():
        if "/layers/" in key:
            for i in range(layers):
                out[key.replace("/layers/", f"/layers_{i}/")] = np.take(np.asarray(value), i, axis=axis_of(key))
        else:
            out[key] = np.asarray(value)
    return out


def assert_same(actual: dict[str, object], expected: dict[str, np.ndarray]) -> None:
    """Same keys, dtypes, shapes and bits."""
    assert sorted(actual) == sorted(expected)
    for key, value in expected.items():
        got = np.asarray(actual[key])
        assert got.dtype == value.dtype and got.shape == value.shape, (key, got.dtype, got.shape, value.dtype, value.shape)
        assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(value).tobytes(), key


def run_device_worker(worker: str, *argv: str, devices: int = 4) -> dict:
    """Run ``tests/<worker>`` in a fresh process with ``devices`` forced CPU devices; its last
    stdout line, as JSON. (The device count must be fixed before jax initialises, and forcing it
    for the whole session would change the device every other test's arrays land on.)"""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, str(Path(__file__).with_name(worker)), *argv], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])
