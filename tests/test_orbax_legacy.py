"""Old Orbax layouts, CheckpointManager steps and item names, through real Orbax calls.

``orbax_0.2.3_unscanned`` (no ``_METADATA``: aggregate msgpack with ``PLACEHOLDER://`` leaves and
one zarr folder per leaf) and ``orbax_0.12.8_scanned`` (OCDBT, items ``state`` and ``default``)
hold the same values, which ``_shared/tiny_decoder_values.npz`` holds too: expectations come
from that file with numpy, independent of any checkpoint reader.
"""

from __future__ import annotations

import re

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from ckptshim.errors import ShimError
from support.fixtures import copy_fixture, tiny_decoder_values
from support.native import diagnosis
from support.trees import assert_same, flat, nest

LAYERS = 3


@pytest.fixture(scope="module")
def values():
    return tiny_decoder_values(LAYERS)


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    root = tmp_path_factory.mktemp("orbax")
    return {name: copy_fixture(name, root) for name in ("orbax_0.2.3_unscanned", "orbax_0.12.8_scanned",
                                                        "maxtext_runs")}


def target(flat_values: dict[str, np.ndarray]) -> dict:
    return nest({k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in flat_values.items()})


def test_old_pytree_folder_into_scanned_target_with_standard_checkpointer(fixtures, values):
    path = fixtures["orbax_0.2.3_unscanned"] / "pytree_checkpointer"
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(path, target(values["scanned"]))
    assert_same(flat(restored), values["scanned"])


def test_old_manager_steps_into_scanned_target(fixtures, values):
    manager = ocp.CheckpointManager(fixtures["orbax_0.2.3_unscanned"] / "checkpoint_manager")
    assert manager.all_steps() == [1, 2]
    restored = manager.restore(2, args=ocp.args.StandardRestore(target(values["scanned"])))
    assert_same(flat(restored), values["scanned"])
    as_stored = manager.restore(1)  # no args: the old item restored as it was saved
    assert_same(flat(as_stored), values["unscanned"])


@pytest.mark.parametrize("layout", ["standard_checkpointer_scanned", "checkpoint_manager_default_item_scanned/1/default"])
def test_new_scanned_into_unscanned_target(fixtures, values, layout):
    path = fixtures["orbax_0.12.8_scanned"] / layout
    restored = ocp.PyTreeCheckpointer().restore(path, args=ocp.args.PyTreeRestore(target(values["unscanned"])))
    assert_same(flat(restored), values["unscanned"])


def test_item_state_restored_by_a_default_item_request(fixtures, values):
    root = fixtures["orbax_0.12.8_scanned"] / "checkpoint_manager_scanned"
    restored = ocp.CheckpointManager(root).restore(2, args=ocp.args.StandardRestore(target(values["unscanned"])))
    assert_same(flat(restored), values["unscanned"])


def test_item_default_restored_by_a_state_request(fixtures, values):
    root = fixtures["orbax_0.12.8_scanned"] / "checkpoint_manager_default_item_scanned"
    manager = ocp.CheckpointManager(root, item_names=("state",))
    restored = manager.restore(1, args=ocp.args.Composite(state=ocp.args.StandardRestore(target(values["scanned"]))))
    assert list(restored.keys()) == ["state"]
    assert_same(flat(restored["state"]), values["scanned"])


def test_old_default_item_through_a_composite_checkpointer(fixtures, values):
    step = fixtures["orbax_0.2.3_unscanned"] / "checkpoint_manager" / "1"
    checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
    restored = checkpointer.restore(step, args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(target(values["scanned"]))))
    assert_same(flat(restored["state"]), values["scanned"])


def test_maxtext_items_restored_without_args(fixtures):
    """MaxText names its item ``items``; a fresh manager finds no handler for it on its own.

    Restored as stored: rng keys come back as their uint32 key data (no target names a key type).
    """
    root = fixtures["maxtext_runs"] / "tiny_unscanned" / "checkpoints"
    restored = ocp.CheckpointManager(root).restore(None)
    with ocp.StandardCheckpointer() as checkpointer:
        expected = checkpointer.restore(root / "1" / "items")
    assert list(restored.keys()) == ["items"]
    as_data = jax.tree_util.tree_map(
        lambda x: jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x, expected)
    assert_same(flat(restored["items"]), {k: np.asarray(v) for k, v in flat(as_data).items()})


def test_an_item_name_no_item_stands_for_is_orbaxs_error_with_what_is_there(tmp_path):
    """Two train-state items could be the ``state`` asked for, and no name but those stands for
    another: ckptshim has no plan, Orbax's own KeyError stands, and ckptshim's note lists the
    items."""
    step = copy_fixture("maxtext_runs", tmp_path) / "tiny_unscanned" / "checkpoints" / "1"
    checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
    for other in ("default", "params"):
        (step / other).mkdir()
        (step / other / "_METADATA").write_text((step / "items" / "_METADATA").read_text())
    for asked, holds in (("state", "'default', 'items', 'params' and 2 of them could be it"),
                         ("model", "'default', 'items', 'params'. Name the item")):
        with pytest.raises(KeyError, match=f'Item "{asked}" was not found in the checkpoint') as raised:
            checkpointer.restore(step, args=ocp.args.Composite(**{asked: ocp.args.StandardRestore()}))
        assert not isinstance(raised.value, ShimError)
        assert re.search(f"the restore asks for item '{asked}', but checkpoint step .* holds {holds}",
                         diagnosis(raised.value)), diagnosis(raised.value)


def test_async_checkpointer_and_legacy_item_keyword(fixtures, values):
    path = fixtures["orbax_0.2.3_unscanned"] / "pytree_checkpointer"
    with ocp.AsyncCheckpointer(ocp.StandardCheckpointHandler()) as checkpointer:
        restored = checkpointer.restore(path, args=ocp.args.StandardRestore(target(values["scanned"])))
    assert_same(flat(restored), values["scanned"])
    restored = ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).restore(path, item=target(values["scanned"]))
    assert_same(flat(restored), values["scanned"])


def test_manager_with_pytree_restore_args(fixtures, values):
    manager = ocp.CheckpointManager(fixtures["orbax_0.2.3_unscanned"] / "checkpoint_manager")
    restored = manager.restore(1, args=ocp.args.PyTreeRestore(target(values["scanned"])))
    assert_same(flat(restored), values["scanned"])
