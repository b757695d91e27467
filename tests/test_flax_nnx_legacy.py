"""NNX states flax 0.8.5 split and Orbax 0.5 saved (``tests/fixtures/flax_0.8.5_nnx``), restored
into today's ``nnx.split`` states through Orbax's own ``StandardCheckpointer.restore``.

Every leaf of such a checkpoint is recorded at ``.../raw_value``; today's state asks for
``.../value``. Expectations are the fixture's ``values.npz``, written by the producer from the
states it saved; each case shows what Orbax alone does first.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from ckptshim.errors import ShimError
from ckptshim.loading import jax as jax_loading
from support.fixtures import copy_fixture
from support.native import same_failure, without_and_with


class Model(nnx.Module):
    """The producer's model (``produce.py``), in today's flax."""

    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(3, 5, rngs=rngs)
        self.norm = nnx.BatchNorm(5, use_running_average=False, rngs=rngs)
        self.out = nnx.Linear(5, 2, rngs=rngs)


@pytest.fixture(scope="module")
def fixture(tmp_path_factory):
    return copy_fixture("flax_0.8.5_nnx", tmp_path_factory.mktemp("nnx"))


@pytest.fixture(scope="module")
def values(fixture):
    with np.load(fixture / "values.npz") as npz:
        return {key: npz[key] for key in npz.files}


def abstract_states():
    """Today's states of the model as shapes: the whole state, and its params and the rest."""
    abstract = nnx.eval_shape(lambda: Model(nnx.Rngs(0)))
    graphdef, full = nnx.split(abstract)
    _, params, rest = nnx.split(abstract, nnx.Param, ...)
    return graphdef, full, params, rest


def flat_values(state) -> dict[str, np.ndarray]:
    """``path -> array`` of a state, its variables' own ``value`` field left out of the path."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        out["/".join(n for n in names if n != "value")] = np.asarray(leaf)
    return out


def restore(path, target):
    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(path, target)


def assert_bits(restored: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert sorted(restored) == sorted(expected)
    for key, value in expected.items():
        assert restored[key].dtype == value.dtype and restored[key].shape == value.shape, key
        assert restored[key].tobytes() == value.tobytes(), key


@pytest.mark.parametrize("saved", ["full", "params"])
def test_a_flax_08_state_restores_into_todays_state(fixture, values, saved):
    graphdef, full, params, _ = abstract_states()
    target = full if saved == "full" else params
    alone, shimmed = without_and_with(lambda: restore(fixture / saved, target))
    assert "not found" in str(alone.error) and "'value'" in str(alone.error)
    assert shimmed.error is None, shimmed.error
    assert isinstance(shimmed.result, nnx.State)
    assert_bits(flat_values(shimmed.result), {k.split("/", 1)[1]: v for k, v in values.items()
                                               if k.startswith(saved + "/")})


def test_the_restored_state_merges_into_a_working_model(fixture, values):
    graphdef, full, _, _ = abstract_states()
    model = nnx.merge(graphdef, restore(fixture / "full", full))
    assert np.asarray(model.norm.mean[...]).tobytes() == values["full/norm/mean"].tobytes()
    model.norm.use_running_average = True
    x = jnp.ones((1, 3), jnp.float32)
    assert model.out(model.norm(model.linear(x))).shape == (1, 2)


def test_a_params_only_state_into_a_full_state_stays_refused(fixture):
    """The BatchNorm statistics are not in the checkpoint: no rename makes them so."""
    _, full, _, _ = abstract_states()
    alone, shimmed = without_and_with(lambda: restore(fixture / "params", full))
    same_failure(alone, shimmed)
    assert not isinstance(shimmed.error, ShimError)


def test_a_raw_value_key_among_others_is_not_renamed(tmp_path):
    """Only a state whose every leaf is a ``raw_value`` is one of flax < 0.9."""
    tree = {"a": {"raw_value": np.arange(3, dtype=np.float32)}, "b": np.ones(2, np.float32)}
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "mixed", tree)
    target = {"a": {"value": jax.ShapeDtypeStruct((3,), jnp.float32)}, "b": jax.ShapeDtypeStruct((2,), jnp.float32)}
    alone, shimmed = without_and_with(lambda: restore(tmp_path / "mixed", target))
    same_failure(alone, shimmed)


def test_a_state_of_todays_flax_is_orbaxs_own_restore(tmp_path, monkeypatch):
    model = Model(nnx.Rngs(3))
    _, state = nnx.split(model)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "today", state)
    monkeypatch.setattr(jax_loading.Prepared, "run", lambda self: pytest.fail("ckptshim restored what Orbax reads"))
    _, full, _, _ = abstract_states()
    assert_bits(flat_values(restore(tmp_path / "today", full)), flat_values(state))
