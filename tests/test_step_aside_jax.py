"""Where ckptshim has no plan, Orbax and Flax run as they do without it.

Each call is made twice, with every hook off and with the hooks on (``support.native``), on
checkpoints Orbax and Flax write themselves. Calls ckptshim does not understand (placeholders,
restore args it cannot honour), steps Orbax refuses (incomplete, missing), args Orbax rejects,
item layouts it restores itself, and URLs return what the framework returns, or raise the
framework's own exception, type and text -- with ckptshim's reading added as a note where it
has one. (The loads ckptshim does carry out are tested in ``test_orbax_*``, ``test_flax_legacy``
and the differential suite.)
"""

from __future__ import annotations

import os
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import config as flax_config, serialization
from flax.training import checkpoints as flax_checkpoints

from ckptshim.loading import t5x as t5x_loading
from ckptshim.loading.paths import local_path
from support.native import Outcome, same_failure, without_and_with
from support.trees import flat

TREE = {"a": np.arange(8, dtype=np.float32), "b": np.arange(6, dtype=np.int32).reshape(2, 3),
        "c": {"d": np.full(4, 2.5, np.float32), "e": np.ones((3, 2), np.float32)}}


def abstract(tree):
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), tree)


def same_result(native: Outcome, shimmed: Outcome) -> None:
    """Both calls returned, the same tree: structure, leaf types, dtypes, shapes and bits."""
    assert native.error is None, f"the framework alone raised {native.error!r}"
    assert shimmed.error is None, f"with ckptshim: {shimmed.error!r}"
    assert str(jax.tree_util.tree_structure(shimmed.result)) == str(jax.tree_util.tree_structure(native.result))
    for key, value in flat(native.result).items():
        got = flat(shimmed.result)[key]
        assert type(got) is type(value), key
        if value is not ocp.PLACEHOLDER:
            assert np.asarray(got).dtype == np.asarray(value).dtype and np.shape(got) == np.shape(value), key
            assert np.asarray(got).tobytes() == np.asarray(value).tobytes(), key


@pytest.fixture
def saved(tmp_path):
    """``TREE`` saved by Orbax's PyTreeCheckpointer."""
    with ocp.PyTreeCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "pytree", TREE)
    return tmp_path / "pytree"


def pytree_restore(path, item, **kwargs):
    with ocp.PyTreeCheckpointer() as checkpointer:
        return checkpointer.restore(path, args=ocp.args.PyTreeRestore(item, **kwargs))


# -- calls ckptshim does not understand ---------------------------------------------------------------


def test_partial_restore_with_placeholders(saved):
    """``ocp.PLACEHOLDER`` leaves skip arrays: Orbax's restore, as Orbax returns it or refuses it
    (an item missing a leaf, a placeholder standing for a subtree)."""
    item = abstract(TREE)
    item["b"], item["c"]["e"] = ocp.PLACEHOLDER, ocp.PLACEHOLDER
    same_result(*without_and_with(lambda: pytree_restore(saved, item)))

    missing_leaf = abstract(TREE)
    missing_leaf["b"], missing_leaf["c"]["e"] = ocp.PLACEHOLDER, ocp.PLACEHOLDER
    del missing_leaf["c"]["d"]
    whole_subtree = dict(abstract(TREE), c=ocp.PLACEHOLDER)
    for bad in (missing_leaf, whole_subtree):
        native, shimmed = without_and_with(lambda: pytree_restore(saved, bad))  # noqa: B023 - called at once
        noted = same_failure(native, shimmed)
        assert "User-provided restore item and on-disk value" in str(shimmed.error)
        assert "ocp.PLACEHOLDER" in noted


def test_restore_args_ckptshim_cannot_honour_leave_the_restore_to_orbax(tmp_path):
    """Padding (``global_shape`` with ``strict=False``) is Orbax's to do: where ckptshim would
    otherwise stack layers, it does not plan the restore, and Orbax's own outcome stands."""
    layers = {"layers_0": {"w": np.arange(4, dtype=np.float32)}, "layers_1": {"w": np.ones(4, np.float32)}}
    with ocp.PyTreeCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "layers", layers)
    padded = {"layers": {"w": jax.ShapeDtypeStruct((2, 6), np.float32)}}
    args = {"layers": {"w": ocp.ArrayRestoreArgs(global_shape=(2, 6), strict=False, restore_type=np.ndarray)}}
    native, shimmed = without_and_with(lambda: pytree_restore(tmp_path / "layers", padded, restore_args=args))
    assert "layers/w: restore args strict=False" in same_failure(native, shimmed)

    args = {key: {"w": ocp.ArrayRestoreArgs(global_shape=(6,), strict=False, restore_type=np.ndarray)}
            for key in layers}
    same_result(*without_and_with(lambda: pytree_restore(tmp_path / "layers", abstract(layers), restore_args=args)))


# -- steps and paths Orbax refuses ------------------------------------------------------------------


def test_an_incomplete_step_is_refused_as_orbax_refuses_it(tmp_path):
    """A step whose save was cut short is not restored, by the manager nor by a checkpointer
    pointed at its folder: "Found incomplete checkpoint". Here the save marks completion with
    ``commit_success.txt`` (as on GCS), and the file is gone. Not even single-item args, for
    which ckptshim would restore the step's one ``state`` item, get past Orbax's refusal."""
    options = ocp.CheckpointManagerOptions(temporary_path_class=ocp.path.atomicity.CommitFileTemporaryPath)
    with ocp.CheckpointManager(tmp_path, item_names=("state",), options=options) as manager:
        manager.save(0, args=ocp.args.Composite(state=ocp.args.StandardSave(TREE)))
    (tmp_path / "0" / "commit_success.txt").unlink()
    standard = ocp.args.StandardRestore(abstract(TREE))

    def manager_restore(args=None):
        with ocp.CheckpointManager(tmp_path, options=options) as manager:
            return manager.restore(0, args=args)

    def checkpointer_restore():
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler(),
                              temporary_path_class=ocp.path.atomicity.CommitFileTemporaryPath) as checkpointer:
            return checkpointer.restore(tmp_path / "0", args=ocp.args.Composite(state=standard))

    for call in (manager_restore, checkpointer_restore, lambda: manager_restore(ocp.args.Composite(state=standard))):
        native, shimmed = without_and_with(call)
        same_failure(native, shimmed)
        assert "Found incomplete checkpoint" in str(shimmed.error)
    native, shimmed = without_and_with(lambda: manager_restore(standard))
    assert "which failed: ValueError: Found incomplete checkpoint" in same_failure(native, shimmed)


def test_missing_paths_steps_and_items_are_orbaxs_errors(tmp_path, saved):
    with ocp.CheckpointManager(tmp_path / "root", item_names=("params",)) as manager:
        manager.save(0, args=ocp.args.Composite(params=ocp.args.StandardSave(TREE)))

    def restore(step, directory=None, **items):
        with ocp.CheckpointManager(tmp_path / "root", item_names=("params",)) as manager:
            return manager.restore(step, directory=directory, args=ocp.args.Composite(**items))

    pytree = ocp.args.PyTreeRestore(abstract(TREE))
    calls = {"a checkpointer's missing folder": lambda: ocp.PyTreeCheckpointer().restore(tmp_path / "missing"),
             "a missing step": lambda: restore(7, params=pytree),
             "an item the step lacks": lambda: restore(0, invalid=pytree),
             "a root without the step": lambda: restore(0, directory=tmp_path / "elsewhere", params=pytree)}
    for name, call in calls.items():
        native, shimmed = without_and_with(call)
        same_failure(native, shimmed)
        assert isinstance(shimmed.error, (FileNotFoundError, KeyError)), name


# -- CheckpointManager items ---------------------------------------------------------------------------


def test_wrong_args_for_a_manager_are_refused_as_orbax_refuses_them(tmp_path):
    """A manager that knows its kind (``item_names``, or a save in this process) refuses args of
    the other kind before reading: a usage error, not a layout ckptshim mends."""
    with ocp.CheckpointManager(tmp_path / "named", item_names=("params",)) as manager:
        manager.save(0, args=ocp.args.Composite(params=ocp.args.PyTreeSave(TREE)))
        native, shimmed = without_and_with(lambda: manager.restore(0, args=ocp.args.PyTreeRestore()))
        assert same_failure(native, shimmed) == ""
    with ocp.CheckpointManager(tmp_path / "single") as manager:
        manager.save(0, args=ocp.args.PyTreeSave(TREE))
        composite = ocp.args.Composite(params=ocp.args.PyTreeRestore())
        native, shimmed = without_and_with(lambda: manager.restore(0, args=composite))
        assert same_failure(native, shimmed) == ""

    def fresh():  # a manager that learns its kind from the step: 'params' is no train-state name
        with ocp.CheckpointManager(tmp_path / "single") as manager:
            return manager.restore(0, args=composite)
    native, shimmed = without_and_with(fresh)
    assert "the restore names 'params', which ckptshim does not take for it" in same_failure(native, shimmed)


def test_a_step_with_two_items_takes_no_single_item_args(tmp_path):
    """A fresh manager learns from the step that it holds named items; with two array items, no
    one of them stands for single-item args: Orbax's refusal, ckptshim's reason as a note."""
    with ocp.CheckpointManager(tmp_path, item_names=("params", "ema")) as manager:
        manager.save(0, args=ocp.args.Composite(params=ocp.args.StandardSave(TREE), ema=ocp.args.StandardSave(TREE)))

    def restore():
        with ocp.CheckpointManager(tmp_path) as manager:
            return manager.restore(0, args=ocp.args.StandardRestore(abstract(TREE)))
    native, shimmed = without_and_with(restore)
    noted = same_failure(native, shimmed)
    assert "Must provide `args` of type `Composite`" in str(shimmed.error)
    assert "holds 'ema', 'params'. Name the item the checkpoint uses" in noted


def test_a_renamed_item_that_does_not_fit_either_is_orbaxs_refusal_with_a_note(tmp_path):
    """Single-item args for a step holding one item ``state``: ckptshim restores that item for
    them; where that fails too (a shape no rule mends), Orbax's answer to the call stands."""
    with ocp.CheckpointManager(tmp_path, item_names=("state",)) as manager:
        manager.save(0, args=ocp.args.Composite(state=ocp.args.StandardSave(TREE)))
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    wrong = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), abstract(TREE))
    wrong["a"] = jax.ShapeDtypeStruct((9,), np.float32, sharding=device)

    def restore(target):
        with ocp.CheckpointManager(tmp_path) as manager:
            return manager.restore(0, args=ocp.args.StandardRestore(target))
    native, shimmed = without_and_with(lambda: restore(wrong))
    noted = same_failure(native, shimmed)
    assert "Must provide `args` of type `Composite`" in str(shimmed.error)
    assert "the step holds item 'state', restored for the single-item args, which failed: ValueError: " \
           "Requested shape: (9,)" in noted

    native, shimmed = without_and_with(lambda: restore(abstract(TREE)))  # fits: ckptshim's load
    assert native.error is not None and shimmed.error is None
    assert all(np.array_equal(np.asarray(flat(shimmed.result)[k]), v) for k, v in flat(TREE).items())


def test_multi_item_managers_restore_as_orbax_does(tmp_path):
    """Two items, arrays and JSON, restored by a manager that did not save them. Without args,
    Orbax knows no handler for them and refuses; ckptshim could read ``params`` as stored, but
    not ``meta``, so Orbax's refusal stands (not a result that lacks ``meta``)."""
    with ocp.CheckpointManager(tmp_path, item_names=("params", "meta")) as manager:
        manager.save(0, args=ocp.args.Composite(params=ocp.args.StandardSave(TREE),
                                                meta=ocp.args.JsonSave({"step": 0, "note": "two items"})))

    def restore(args=None):
        with ocp.CheckpointManager(tmp_path, item_names=("params", "meta")) as manager:
            restored = manager.restore(0, args=args)
            return {name: restored[name] for name in restored.keys()}
    for args in (ocp.args.Composite(params=ocp.args.StandardRestore(abstract(TREE)), meta=ocp.args.JsonRestore()),
                 ocp.args.Composite(meta=ocp.args.JsonRestore())):
        same_result(*without_and_with(lambda: restore(args)))  # noqa: B023 - called at once
    native, shimmed = without_and_with(restore)
    assert "ckptshim reads item(s) params as stored, but Orbax cannot restore the other items" \
        in same_failure(native, shimmed)


def test_a_default_item_manager_restores_as_orbax_does(tmp_path):
    with ocp.CheckpointManager(tmp_path) as manager:
        manager.save(0, args=ocp.args.StandardSave({"a": 1, "b": 2}))

        def again(args):
            return lambda: manager.restore(0, args=args)
        for args in (None, ocp.args.StandardRestore()):
            same_result(*without_and_with(again(args)))

    def fresh(args):
        with ocp.CheckpointManager(tmp_path) as manager:
            return manager.restore(0, args=args)
    for args in (None, ocp.args.StandardRestore()):
        same_result(*without_and_with(lambda: fresh(args)))  # noqa: B023 - called at once


# -- Flax ----------------------------------------------------------------------------------------------------


@pytest.fixture
def legacy_flax(tmp_path, monkeypatch):
    """Flax's own legacy msgpack writer (``flax_use_orbax_checkpointing`` off)."""
    previous = flax_config.flax_use_orbax_checkpointing
    flax_config.update("flax_use_orbax_checkpointing", False)
    yield tmp_path
    flax_config.update("flax_use_orbax_checkpointing", previous)


def test_flax_restores_its_arrays_into_a_smaller_target(legacy_flax):
    """Flax restores what the file holds whatever the target's shapes; so it does with ckptshim."""
    flax_checkpoints.save_checkpoint(legacy_flax, {"a": np.ones((16, 32), np.float32)}, 0, keep=1)
    native, shimmed = without_and_with(
        lambda: flax_checkpoints.restore_checkpoint(legacy_flax, {"a": np.zeros((2, 3), np.float32)}))
    same_result(native, shimmed)
    assert shimmed.result["a"].shape == (16, 32)


# -- URLs ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("url", ["gs://bucket/ckpt", "s3://bucket/ckpt"])
def test_a_url_is_never_read_as_a_local_path(tmp_path, monkeypatch, request, url):
    """``pathlib.Path`` collapses ``gs://bucket/ckpt`` into ``gs:/bucket/ckpt``. A checkpoint
    waiting at that local path (relative to the working directory) must not be read in the
    URL's place: every JAX hook leaves the URL to the framework's own file systems, and what the
    framework does with it stands. The clients are pointed at the tests' local server of the
    scheme, where the URL's bucket does not exist: what they do with it is decided here, never
    by the real cloud (reaching it can hang)."""
    request.getfixturevalue({"gs": "gcs_server", "s3": "s3_server"}[url.split(":")[0]])
    monkeypatch.chdir(tmp_path)
    decoy = tmp_path / os.fspath(url).replace("://", ":/", 1)
    layers = {"layers_0": {"w": np.zeros(4, np.float32)}, "layers_1": {"w": np.ones(4, np.float32)}}
    with ocp.PyTreeCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "saved", layers)
    shutil.copytree(tmp_path / "saved", decoy / "0" / "default")  # a manager's step, an item folder
    stacked = {"layers": {"w": jax.ShapeDtypeStruct((2, 4), np.float32)}}  # ckptshim would stack them
    calls = {
        "StandardCheckpointer": lambda: ocp.StandardCheckpointer().restore(f"{url}/0/default", stacked),
        "PyTreeCheckpointer": lambda: pytree_restore(f"{url}/0/default", stacked),
        "CheckpointManager": lambda: ocp.CheckpointManager(
            url, options=ocp.CheckpointManagerOptions(read_only=True)).restore(0, args=ocp.args.StandardRestore(stacked)),
    }
    for name, call in calls.items():
        native, shimmed = without_and_with(call)
        assert shimmed.error is not None, name
        same_failure(native, shimmed)

    (decoy / "checkpoint_3").write_bytes(serialization.msgpack_serialize({"w": np.ones(3, np.float32)}))
    same_result(*without_and_with(lambda: flax_checkpoints.restore_checkpoint(url, {"w": np.zeros(2)})))

    for location in (url, f"{url}/checkpoint_3"):
        assert local_path(location) is None
        assert t5x_loading.orbax_era_step(location) is None
    assert local_path("relative/ckpt") is not None and local_path(decoy) == decoy
