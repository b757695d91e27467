"""Legacy Flax msgpack checkpoints (flax 0.6.11 ``TrainState`` with adam) into scanned targets.

Through ``flax.training.checkpoints.restore_checkpoint`` and through Orbax calls. Expectations
come from Flax's own msgpack reader and numpy stacking on axis 1 (MaxText's scan axis).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import serialization
from flax.training import checkpoints, train_state

from ckptshim.loading import jax as jax_loading
from support.fixtures import array_sha256, copy_fixture, expected_arrays
from support.trees import assert_same, flat, scanned_expected

LAYERS = 3


@pytest.fixture(scope="module")
def legacy(tmp_path_factory):
    return copy_fixture("flax_0.6.11_legacy_msgpack", tmp_path_factory.mktemp("flax"))


def on_disk(path) -> dict[str, np.ndarray]:
    """What the file holds, read by Flax itself (and checked against the manifest for step 2)."""
    values = {k: np.asarray(v) for k, v in flat(serialization.msgpack_restore(path.read_bytes())).items()}
    if path.name == "checkpoint_2":
        manifest = expected_arrays("flax_0.6.11_legacy_msgpack")
        assert {k: array_sha256(v) for k, v in values.items()} == {k: m["sha256"] for k, m in manifest.items()}
    return values


def scanned_state(values: dict[str, np.ndarray]) -> train_state.TrainState:
    """A freshly initialised TrainState whose params are stacked the MaxText way."""
    params = {k.removeprefix("params/"): v for k, v in scanned_expected(values, LAYERS, lambda key: 1).items()
              if k.startswith("params/")}
    nested: dict = {}
    for key, value in params.items():
        node = nested
        *parents, leaf = key.split("/")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = jnp.zeros_like(value)
    return train_state.TrainState.create(apply_fn=None, params=nested, tx=optax.adam(1e-3))


def state_dict_values(state) -> dict[str, object]:
    return flat(serialization.to_state_dict(state))


@pytest.mark.parametrize("step", [None, 1])
def test_restore_checkpoint_into_scanned_train_state(legacy, step):
    folder = legacy / "legacy_msgpack"
    values = on_disk(folder / f"checkpoint_{step or 2}")
    target = scanned_state(values)
    restored = checkpoints.restore_checkpoint(folder, target=target, step=step)
    assert isinstance(restored, train_state.TrainState) and restored.step == (step or 2)
    expected = scanned_expected(values, LAYERS, lambda key: 1)
    got = state_dict_values(restored)
    assert_same({k: v for k, v in got.items() if k != "step"}, {k: v for k, v in expected.items() if k != "step"})
    kernel = restored.opt_state[0].mu["decoder"]["layers"]["mlp"]["wi_0"]["kernel"]
    assert isinstance(kernel, jax.Array) and kernel.shape == (32, LAYERS, 64)


def test_orbax_calls_read_the_legacy_msgpack_file(legacy):
    path = legacy / "legacy_msgpack" / "checkpoint_2"
    values = on_disk(path)
    expected = scanned_expected(values, LAYERS, lambda key: 1)
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype),
                                      serialization.to_state_dict(scanned_state(values)))
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(path, abstract)
    expected["step"] = expected["step"].astype(np.int32)  # jax.ShapeDtypeStruct canonicalises int64
    assert_same(flat(restored), expected)
    as_stored = ocp.PyTreeCheckpointer().restore(path)
    assert_same(flat(as_stored), values)


def test_flax_orbax_backend_checkpoint_into_scanned_train_state(legacy):
    """Flax 0.6.11's default (Orbax 0.2.3 aggregate) save, restored by today's Flax + Orbax."""
    values = on_disk(legacy / "legacy_msgpack" / "checkpoint_2")
    restored = checkpoints.restore_checkpoint(legacy / "flax_default_orbax_backend", target=scanned_state(values))
    expected = scanned_expected(values, LAYERS, lambda key: 1)
    assert_same({k: v for k, v in state_dict_values(restored).items() if k != "step"},
                {k: v for k, v in expected.items() if k != "step"})
    assert restored.step == 2


def test_matching_target_runs_flax_untouched(legacy, monkeypatch):
    def refuse(self):
        raise AssertionError("ckptshim restored a checkpoint Flax reads itself")

    monkeypatch.setattr(jax_loading.Prepared, "run", refuse)
    folder = legacy / "legacy_msgpack"
    raw = checkpoints.restore_checkpoint(folder, target=None)
    target = train_state.TrainState.create(apply_fn=None, params=raw["params"], tx=optax.adam(1e-3))
    restored = checkpoints.restore_checkpoint(folder, target=target)
    assert_same({k: v for k, v in state_dict_values(restored).items() if k != "step"},
                {k: v for k, v in on_disk(folder / "checkpoint_2").items() if k != "step"})
