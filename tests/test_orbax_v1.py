"""Orbax's v1 API (``ocp.v1.load``/``load_pytree``/``load_checkpointables``) through ckptshim's
v1 seams, on the real MaxText runs, the Orbax 0.2.3 fixture and checkpoints v1 itself writes.

Expectations are the checkpoints restored natively by Orbax (or the fixture's numpy values),
stacked or taken apart with numpy on MaxText's axes; every case first shows that v1 alone fails.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import ckptshim
from ckptshim.errors import ShimError
from ckptshim.hooks import orbax_v1
from ckptshim.loading import jax as jax_loading
from support.fixtures import copy_fixture, tiny_decoder_values
from support.maxtext_states import LAYERS, abstract, axis_of, items, key_data, restored_natively, train_state
from support.native import same_failure, without_and_with
from support.trees import assert_same, flat, nest, scanned_expected, unscanned_expected

v1 = ocp.v1


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return items(copy_fixture("maxtext_runs", tmp_path_factory.mktemp("maxtext")))


@pytest.fixture(scope="module")
def native(runs):
    return restored_natively(runs)


def step_of(item):
    return item.parent  # MaxText's step folder: ``items`` beside Orbax's step metadata


def loads_only_with_ckptshim(call):
    """``call()`` fails with v1 alone and succeeds with ckptshim; what ckptshim returned."""
    alone, shimmed = without_and_with(call)
    assert alone.error is not None, "v1 alone loaded it: nothing for ckptshim to show here"
    assert shimmed.error is None, f"with ckptshim: {shimmed.error!r}"
    return shimmed.result


def test_load_pytree_of_an_unscanned_maxtext_step_into_a_scanned_state(runs, native):
    target = abstract(train_state(native["tiny_scanned"]))
    restored = loads_only_with_ckptshim(
        lambda: v1.load_pytree(step_of(runs["tiny_unscanned"]), target, checkpointable_name="items"))
    assert_same(flat(restored), scanned_expected(flat(train_state(native["tiny_unscanned"])), LAYERS, axis_of))
    leaf = restored["params"]["params"]["decoder"]["layers"]["mlp"]["wi_0"]["kernel"]
    assert isinstance(leaf, jax.Array) and leaf.shape == (32, LAYERS, 64)


def test_load_of_a_scanned_maxtext_step_into_an_unscanned_state(runs, native):
    target = abstract(train_state(native["tiny_unscanned"]))
    restored = loads_only_with_ckptshim(
        lambda: v1.load(step_of(runs["tiny_scanned"]), target, checkpointable_name="items"))
    assert_same(flat(restored), unscanned_expected(flat(train_state(native["tiny_scanned"])), LAYERS, axis_of))


def test_load_checkpointables_names_the_item(runs, native):
    target = abstract(train_state(native["tiny_scanned"]))
    restored = loads_only_with_ckptshim(
        lambda: v1.load_checkpointables(step_of(runs["tiny_unscanned"]), {"items": target}))
    assert list(restored) == ["items"]
    assert_same(flat(restored["items"]), scanned_expected(flat(train_state(native["tiny_unscanned"])), LAYERS, axis_of))


def test_a_checkpoint_v1_writes_loads_across_scan_layers(tmp_path, native):
    """v1's own layout (``ocp.v1.save``): the same seam, the same plan."""
    params = native["tiny_unscanned"]["params"]
    v1.save(tmp_path / "step", params)
    target = abstract(native["tiny_scanned"]["params"])
    restored = loads_only_with_ckptshim(lambda: v1.load(tmp_path / "step", target))
    assert_same(flat(restored), scanned_expected(flat(params), LAYERS, lambda key: 1))


def test_matching_names_are_v1s_own_load(runs, native, monkeypatch):
    def refuse(self):
        raise AssertionError("ckptshim restored a checkpoint Orbax reads itself")

    monkeypatch.setattr(jax_loading.Prepared, "run", refuse)
    target = abstract(native["tiny_scanned"])
    restored = v1.load(step_of(runs["tiny_scanned"]), target, checkpointable_name="items")
    assert_same(flat(key_data(restored)), flat(key_data(native["tiny_scanned"])))


def test_a_load_as_stored_is_v1s_own(runs, monkeypatch):
    monkeypatch.setattr(jax_loading, "prepare", lambda *a, **k: pytest.fail("ckptshim planned a load as stored"))
    as_stored = v1.load(step_of(runs["tiny_unscanned"]), checkpointable_name="items")
    assert "layers_0" in as_stored["params"]["params"]["decoder"]


def test_no_plan_leaves_v1s_error_with_ckptshims_note(runs, native):
    """rng state for layers the checkpoint lacks: v1's own refusal, type and text, noted."""
    target = abstract(native["tiny_scanned"])  # with nnx_aux rng state of every layer
    alone, shimmed = without_and_with(
        lambda: v1.load(step_of(runs["tiny_unscanned"]), target, checkpointable_name="items"))
    noted = same_failure(alone, shimmed)
    assert "tree structures do not match" in str(shimmed.error)
    assert "layers {1..2} are missing" in noted and "CKPTSHIM_RNG_FROM_TARGET=1" in noted


@pytest.fixture(scope="module")
def old_values():
    return tiny_decoder_values(LAYERS)


@pytest.fixture(scope="module")
def old(tmp_path_factory):
    return copy_fixture("orbax_0.2.3_unscanned", tmp_path_factory.mktemp("orbax"))


def as_target(values: dict[str, np.ndarray]) -> dict:
    return nest({k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in values.items()})


@pytest.mark.parametrize("name", [None, "AUTO"])
def test_an_old_layout_v1_refuses_loads_into_a_scanned_target(old, old_values, name):
    path = old / "pytree_checkpointer"
    restored = loads_only_with_ckptshim(
        lambda: v1.load(path, as_target(old_values["scanned"]), checkpointable_name=name))
    assert_same(flat(restored), old_values["scanned"])


def test_an_old_manager_step_by_its_item_name(old, old_values):
    step = old / "checkpoint_manager" / "2"
    restored = loads_only_with_ckptshim(lambda: v1.load_checkpointables(
        step, {"default": as_target(old_values["scanned"])}))
    assert_same(flat(restored["default"]), old_values["scanned"])
    as_stored = loads_only_with_ckptshim(lambda: v1.load(step, checkpointable_name="default"))
    assert_same(flat(as_stored), old_values["unscanned"])


def test_a_layout_nobody_reads_is_v1s_refusal_with_a_note(tmp_path):
    (tmp_path / "empty").mkdir()
    alone, shimmed = without_and_with(lambda: v1.load(tmp_path / "empty", {"a": jax.ShapeDtypeStruct((2,), jnp.float32)},
                                                      checkpointable_name=None))
    same_failure(alone, shimmed)
    assert isinstance(shimmed.error, v1.errors.InvalidLayoutError) and not isinstance(shimmed.error, ShimError)


def test_uninstall_puts_v1_back_and_install_hooks_it_again():
    from orbax.checkpoint.experimental.v1._src.handlers import pytree_handler
    from orbax.checkpoint.experimental.v1._src.loading import loading

    hooked = [pytree_handler.PyTreeHandler.__dict__["_background_load"], loading.load, v1.load,
              loading.load_checkpointables, v1.load_checkpointables]
    assert all(hasattr(f, "__wrapped__") for f in hooked)
    ckptshim.uninstall(["orbax-v1"])
    try:
        assert not orbax_v1._patches.active
        assert not hasattr(pytree_handler.PyTreeHandler.__dict__["_background_load"], "__wrapped__")
        assert not any(hasattr(f, "__wrapped__") for f in (loading.load, v1.load, v1.load_checkpointables))
    finally:
        ckptshim.install(["orbax-v1"])
    assert hasattr(v1.load, "__wrapped__") and orbax_v1._patches.active
