"""Orbax restores of a real PaxML run (``paxml_runs/TinySpmdRepeat``), as stored and unscanned.

PaxML 1.1 ``state/`` folders hold no Orbax tree metadata, so today's Orbax cannot restore them;
with ckptshim, ``StandardCheckpointer``/``PyTreeCheckpointer`` return the tree as stored (bits
equal to the manifest) or restore it into an unrepeated model (``x_layers_{i}``), where each
layer equals ``numpy.take`` of the natively read ``repeat/sub/x_layers_0`` stack along axis 0.
"""

from __future__ import annotations

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import ckptshim  # noqa: F401  (hooks on)
from ckptshim.api import inspect
from ckptshim.errors import ShimError
from ckptshim.inventory import flatten, unflatten
from support.fixtures import array_sha256, copy_fixture, expected_arrays
from support.native import diagnosis
from support.processes import run_device_worker

PAX = "paxml_runs/TinySpmdRepeat"
STEP = "checkpoint_00000001"


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory):
    return copy_fixture(f"{PAX}/checkpoints/{STEP}", tmp_path_factory.mktemp("pax")) / "state"


def native(state_dir) -> dict[tuple[str, ...], np.ndarray]:
    checkpoint = inspect(state_dir)
    try:
        return {key: checkpoint.read(entry).copy() for key, entry in checkpoint.inventory.items()}
    finally:
        checkpoint.close()


def unrepeated(key: tuple[str, ...], layer: int) -> tuple[str, ...]:
    at = key.index("repeat")
    return key[:at] + (f"x_layers_{layer}",) + key[at + 3:]


@pytest.mark.parametrize("checkpointer", [ocp.StandardCheckpointer, ocp.PyTreeCheckpointer])
def test_restore_as_stored_matches_the_manifest(state_dir, checkpointer):
    expected = {k.split("::", 1)[1]: v for k, v in expected_arrays(PAX).items() if k.startswith(STEP + "::")}
    restored = flatten(checkpointer().restore(state_dir))
    assert {".".join(k) for k in restored} == set(expected)
    for key, value in restored.items():
        assert array_sha256(np.asarray(value)) == expected[".".join(key)]["sha256"], key


def test_restore_into_an_unrepeated_model_equals_numpy_take(state_dir):
    stored = native(state_dir)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    target, expected = {}, {}
    for key, value in stored.items():
        if "repeat" in key:
            for layer in range(value.shape[0]):
                expected[unrepeated(key, layer)] = np.take(value, layer, axis=0)
        else:
            expected[key] = value
    for key, value in expected.items():
        target[key] = jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=replicated)
    assert len(target) > len(stored)
    restored = flatten(ocp.StandardCheckpointer().restore(state_dir, unflatten(target)))
    assert set(restored) == set(expected)
    for key, value in restored.items():
        assert isinstance(value, jax.Array) and value.sharding == replicated, key
        assert np.asarray(value).tobytes() == expected[key].tobytes(), key


def test_a_target_with_other_layer_count_is_orbaxs_error_noted_with_the_layers(state_dir):
    stored = native(state_dir)
    target = {}
    for key, value in stored.items():
        if "repeat" in key:
            for layer in range(value.shape[0] + 1):  # one layer more than the checkpoint has
                target[unrepeated(key, layer)] = jax.ShapeDtypeStruct(value.shape[1:], value.dtype)
        else:
            target[key] = jax.ShapeDtypeStruct(value.shape, value.dtype)
    with pytest.raises(FileNotFoundError, match="_METADATA") as raised:  # Orbax cannot read PaxML's layout
        ocp.StandardCheckpointer().restore(state_dir, unflatten(target))
    assert not isinstance(raised.value, ShimError)
    assert "x_layers" in diagnosis(raised.value)


def test_restores_sharded_over_four_devices(state_dir):
    """Each of 4 forced CPU devices holds exactly its slice, unrepeated and in a MaxText GPT-3
    state (layer axes moved, ``combined_qkv`` split). A sharding that does not divide an array
    leaves the restore to Orbax (which cannot read PaxML's layout), ckptshim's note naming the
    array (in one subprocess; see the worker)."""
    report = run_device_worker("paxml_sharded_worker.py", str(state_dir))
    assert report["devices"] == 4
    assert report["unrepeated"] == {"arrays": 22, "shards": 4 * 22}
    assert report["maxtext"] == {"arrays": 47, "shards": 4 * 47}
    assert report["indivisible"].startswith("FileNotFoundError: "), report["indivisible"]
    note, = report["indivisible_notes"]
    assert note.startswith("ckptshim: params/params/decoder/layers/self_attention/qkv_proj/kernel "
                           "given to orbax StandardCheckpointer.restore("), note
    assert "cannot split shape (32, 2, 3, 4, 8) evenly" in note
