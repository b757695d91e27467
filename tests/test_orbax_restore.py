"""MaxText train states across ``scan_layers`` through real Orbax calls, bit-exact.

The two MaxText runs start from different random initialisations, so a restored value can only
equal the expectation if it came from the checkpoint. Expectations are the checkpoint restored
natively by Orbax, then stacked (``np.stack``) or taken apart (``np.take``) with numpy on the
MaxText axes: params and optimizer moments on axis 1, NNX rng state on axis 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import ckptshim
from ckptshim.errors import ShimError
from ckptshim.loading import jax as jax_loading
from support.fixtures import copy_fixture
from support.maxtext_states import LAYERS, abstract, axis_of, items, key_data, restored_natively, train_state
from support.native import diagnosis
from support.trees import assert_same, flat, scanned_expected, unscanned_expected


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return items(copy_fixture("maxtext_runs", tmp_path_factory.mktemp("maxtext")))


@pytest.fixture(scope="module")
def native(runs):
    return restored_natively(runs)


@pytest.mark.parametrize("kind", ["abstract", "concrete"])
def test_unscanned_into_scanned_with_standard_checkpointer(runs, native, kind):
    target = train_state(native["tiny_scanned"])
    target = abstract(target) if kind == "abstract" else target
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(runs["tiny_unscanned"], target)
    expected = scanned_expected(flat(train_state(native["tiny_unscanned"])), LAYERS, axis_of)
    assert_same(flat(restored), expected)
    leaf = restored["params"]["params"]["decoder"]["layers"]["mlp"]["wi_0"]["kernel"]
    assert isinstance(leaf, jax.Array) and leaf.shape == (32, LAYERS, 64)


def test_scanned_into_unscanned_with_standard_checkpointer(runs, native):
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(runs["tiny_scanned"], abstract(train_state(native["tiny_unscanned"])))
    expected = unscanned_expected(flat(train_state(native["tiny_scanned"])), LAYERS, axis_of)
    assert_same(flat(restored), expected)


@pytest.mark.parametrize("source,target", [("tiny_unscanned", "tiny_scanned"), ("tiny_scanned", "tiny_unscanned")])
def test_pytree_checkpointer_partial_restore_across_scan_layers(runs, native, source, target):
    args = ocp.args.PyTreeRestore(abstract(train_state(native[target])), partial_restore=True)
    restored = ocp.PyTreeCheckpointer().restore(runs[source], args=args)
    values = flat(train_state(native[source]))
    convert = scanned_expected if target == "tiny_scanned" else unscanned_expected
    assert_same(flat(restored), convert(values, LAYERS, axis_of))


def test_rng_state_the_checkpoint_lacks_is_orbaxs_error_noted_with_the_layers(runs, native):
    """No plan fills rng state for layers the checkpoint lacks: Orbax's own refusal stands, and
    ckptshim's note names the layers and the opt-in rule."""
    with ocp.StandardCheckpointer() as checkpointer, pytest.raises(ValueError) as error:
        checkpointer.restore(runs["tiny_unscanned"], abstract(native["tiny_scanned"]))
    assert not isinstance(error.value, ShimError)
    assert "tree structures do not match" in str(error.value)
    noted = diagnosis(error.value)
    assert ("target key nnx_aux/model/decoder/layers/self_attention/rngs/dropout/key stacks 3 layers, "
            "but the checkpoint has only layer(s) {0}") in noted
    assert "layers {1..2} are missing" in noted and "CKPTSHIM_RNG_FROM_TARGET=1" in noted


def test_opt_in_rule_keeps_the_targets_own_rng_state(runs, native, monkeypatch):
    monkeypatch.setenv("CKPTSHIM_RNG_FROM_TARGET", "1")
    target = native["tiny_scanned"]  # concrete: an initialised state
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(runs["tiny_unscanned"], target)
        with pytest.raises(ValueError, match="tree structures do not match") as error:
            checkpointer.restore(runs["tiny_unscanned"], abstract(target))
        assert "gives only a shape" in diagnosis(error.value)
    got = flat(restored)
    expected = scanned_expected(flat(train_state(native["tiny_unscanned"])), LAYERS, axis_of)
    assert_same({k: v for k, v in got.items() if not k.startswith("nnx_aux/")}, expected)
    for key, value in flat(target["nnx_aux"]).items():  # the target's own arrays, as given
        assert got["nnx_aux/" + key] is value


def test_matching_layout_runs_orbax_untouched(runs, native, monkeypatch):
    def refuse(self):
        raise AssertionError("ckptshim restored a checkpoint Orbax reads itself")

    monkeypatch.setattr(jax_loading.Prepared, "run", refuse)
    target = abstract(native["tiny_scanned"])
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(runs["tiny_scanned"], target)
    assert_same(flat(key_data(restored)), flat(key_data(native["tiny_scanned"])))


def test_dtype_cast_matches_orbax_cast(runs, native):
    """f32 per-layer arrays into a bf16 scanned target: cast as Orbax casts (tensorstore)."""
    params = native["tiny_scanned"]["params"]
    as_bf16 = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16), params)
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(runs["tiny_unscanned"], {"params": as_bf16})
        unscanned_bf16 = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16),
                                                native["tiny_unscanned"]["params"])
        natively_cast = checkpointer.restore(runs["tiny_unscanned"], {"params": unscanned_bf16})
    expected = scanned_expected(flat(natively_cast), LAYERS, axis_of)
    assert_same(flat(restored), expected)


def test_nnx_param_only_checkpoint_into_linen_train_state(tmp_path, native):
    """MaxText's param-only tool writes ``decoder/layers_{i}/.../kernel/value`` in bf16."""
    params = native["tiny_unscanned"]["params"]["params"]
    nnx = jax.tree_util.tree_map(lambda x: {"value": x.astype(jnp.bfloat16)}, params)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "nnx", nnx)
        checkpointer.wait_until_finished()
        linen = {"params": {"params": jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16), native["tiny_scanned"]["params"]["params"])}}
        restored = checkpointer.restore(tmp_path / "nnx", linen)
    expected = scanned_expected({"params/params/" + k: np.asarray(v).astype(jnp.bfloat16)
                                 for k, v in flat(params).items()}, LAYERS, axis_of)
    assert_same(flat(restored), expected)


def test_uninstall_restores_orbax_and_install_puts_the_hook_back():
    patched = ocp.Checkpointer.restore
    ckptshim.uninstall(["orbax"])
    try:
        assert ocp.Checkpointer.restore is not patched
        assert not hasattr(ocp.Checkpointer.restore, "__wrapped__")
        assert ocp.CheckpointManager.restore.__module__.startswith("orbax.")
    finally:
        ckptshim.install(["orbax"])
    assert hasattr(ocp.Checkpointer.restore, "__wrapped__")


def test_typed_prng_keys_come_back_as_keys_of_the_targets_impl(runs, native):
    """NNX names for the params force ckptshim's path; the rng keys then go through it too."""
    state = native["tiny_scanned"]
    nnx_params = jax.tree_util.tree_map(lambda x: {"value": x}, state["params"]["params"])
    target = abstract({"model": nnx_params, "nnx_aux": state["nnx_aux"]})
    target = {"nnx_aux": target["nnx_aux"], **target["model"]}
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(runs["tiny_scanned"], target)
    key = restored["nnx_aux"]["model"]["decoder"]["layers"]["self_attention"]["rngs"]["dropout"]["key"]
    assert key.dtype == state["nnx_aux"]["model"]["decoder"]["layers"]["self_attention"]["rngs"]["dropout"]["key"].dtype
    assert_same(flat(key_data(restored["nnx_aux"])), flat(key_data(state["nnx_aux"])))
    assert_same({k.removesuffix("/value"): v for k, v in flat(restored).items() if not k.startswith("nnx_aux")},
                flat(state["params"]["params"]))
