"""Bad input through real Orbax calls: clear ShimErrors, and nothing returned half-built.

Deleted or corrupt files are made in copies of the fixtures. A checkpoint with missing data is
refused even where Orbax would have read it (a missing zarr chunk reads as zeros there).
"""

from __future__ import annotations

import logging
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts

from ckptshim.errors import CorruptCheckpointError, PlanError, ShimError
from support.fixtures import FIXTURES, copy_fixture
from support.native import same_failure, without_and_with


def abstract(tree):
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), tree)


@pytest.fixture(scope="module")
def scanned_target():
    with ocp.StandardCheckpointer() as checkpointer:
        return abstract(checkpointer.restore(FIXTURES / "orbax_0.12.8_scanned" / "standard_checkpointer_scanned"))


def restore(path, target):
    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(path, target)


def test_deleted_zarr_chunk(tmp_path, scanned_target):
    root = copy_fixture("orbax_0.2.3_unscanned", tmp_path) / "pytree_checkpointer"
    (root / "params.decoder.layers_2.mlp.wi_1.kernel" / "0.0").unlink()
    with pytest.raises(CorruptCheckpointError,
                       match=r"incomplete:\n  params.decoder.layers_2.mlp.wi_1.kernel/0.0: missing"):
        restore(root, scanned_target)


@pytest.mark.parametrize("target", ["scanned", "same layout"])
def test_deleted_ocdbt_data_file(tmp_path, target):
    root = copy_fixture("maxtext_runs", tmp_path) / "tiny_unscanned/checkpoints/1/items"
    with ocp.StandardCheckpointer() as checkpointer:
        own = abstract({"params": checkpointer.restore(root)["params"]})
    data = max((root / "ocdbt.process_0" / "d").iterdir(), key=lambda p: p.stat().st_size)
    data.unlink()
    wanted = own
    if target == "scanned":
        with ocp.StandardCheckpointer() as checkpointer:
            other = FIXTURES / "maxtext_runs/tiny_scanned/checkpoints/1/items"
            wanted = abstract({"params": checkpointer.restore(other)["params"]})
    with pytest.raises(CorruptCheckpointError, match=f"ocdbt.process_0/d/{data.name}: missing"):
        restore(root, wanted)


def test_corrupt_metadata(tmp_path, scanned_target):
    root = copy_fixture("orbax_0.12.8_scanned", tmp_path) / "standard_checkpointer_unscanned"
    (root / "_METADATA").write_bytes(b"\x00garbage")
    with pytest.raises(CorruptCheckpointError, match="_METADATA: not a valid Orbax metadata file"):
        restore(root, scanned_target)


def test_corrupt_chunk_fails_the_whole_restore(tmp_path):
    """Reading fails half-way: the caller gets the error, no partly filled tree, its target intact.

    The chunk swapped in is a whole zstd frame (written by tensorstore, so its headers pass the
    completeness check) holding one float where the array needs 128 x 32: only reading finds it.
    """
    root = copy_fixture("orbax_0.2.3_unscanned", tmp_path) / "pytree_checkpointer"
    small = {"driver": "zarr", "kvstore": {"driver": "file", "path": str(tmp_path / "small")},
             "metadata": {"shape": [1], "chunks": [1], "dtype": "<f4",
                          "compressor": {"id": "zstd", "level": 1}}}
    ts.open(small, create=True).result().write(np.ones(1, np.float32)).result()
    shutil.copy(tmp_path / "small" / "0", root / "params.token_embedder.embedding" / "0.0")
    with ocp.StandardCheckpointer() as checkpointer:
        target = checkpointer.restore(FIXTURES / "orbax_0.12.8_scanned" / "standard_checkpointer_scanned")
    before = jax.tree_util.tree_map(np.array, target)
    with pytest.raises(CorruptCheckpointError, match="reading 'params/token_embedder/embedding' failed"):
        restore(root, target)
    for a, b in zip(jax.tree_util.tree_leaves(target), jax.tree_util.tree_leaves(before)):
        assert np.array_equal(np.asarray(a), b)


def test_shape_mismatch_is_orbaxs_own_outcome(tmp_path):
    """Names fit and a shape does not: no rule mends that, so the restore is Orbax's. Into jax
    arrays Orbax refuses, type and text (it tells the user about ``strict=False``), and
    ckptshim's reading is a note; into shapes without a sharding Orbax returns the stored numpy
    arrays, and so it does with ckptshim."""
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ckpt", {"w": np.arange(12, dtype=np.float32).reshape(4, 3),
                                              "b": np.zeros(3, np.float32)})
        checkpointer.wait_until_finished()
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = {"w": jax.ShapeDtypeStruct((4, 5), np.float32, sharding=device),
              "b": jax.ShapeDtypeStruct((3,), np.float32, sharding=device)}
    native, shimmed = without_and_with(lambda: restore(tmp_path / "ckpt", target))
    noted = same_failure(native, shimmed)
    assert type(shimmed.error) is ValueError
    assert "Requested shape" in str(shimmed.error) and "strict=False" in str(shimmed.error)
    assert "w: target shape (4, 5) but checkpoint w has (4, 3)" in noted

    unsharded = {"w": jax.ShapeDtypeStruct((4, 5), np.float32), "b": jax.ShapeDtypeStruct((3,), np.float32)}
    restored = restore(tmp_path / "ckpt", unsharded)
    assert type(restored["w"]) is np.ndarray
    assert np.array_equal(restored["w"], np.arange(12, dtype=np.float32).reshape(4, 3))


def test_a_layout_orbax_cannot_read_that_does_not_fit_is_orbaxs_error_with_the_keys_noted(scanned_target):
    """The pre-``_METADATA`` folder Orbax cannot read, into a target no plan fits: Orbax's own
    error, with what ckptshim found (both shapes, keys in the user's terms) as its note."""
    old = FIXTURES / "orbax_0.2.3_unscanned" / "pytree_checkpointer"
    bad = jax.tree_util.tree_map(lambda x: x, scanned_target)
    bad["params"]["decoder"]["decoder_norm"]["scale"] = jax.ShapeDtypeStruct((33,), np.float32)
    extra = dict(scanned_target, extra={"w": jax.ShapeDtypeStruct((2,), np.float32)})
    for target, noted in ((bad, "1 key(s) match by name but not by shape:\n  params/decoder/decoder_norm/scale: "
                                "target shape (33,) but checkpoint params/decoder/decoder_norm/scale has (32,)"),
                          (extra, "1 key(s) the target needs are not in the checkpoint:\n  extra/w")):
        native, shimmed = without_and_with(lambda: restore(old, target))  # noqa: B023 - called at once
        assert noted in same_failure(native, shimmed)
        assert type(shimmed.error) is FileNotFoundError


def test_ambiguous_stacking_axis_is_refused(tmp_path):
    blocks = {f"blocks_{i}": {"w": np.full((2, 2), i, np.float32)} for i in range(2)}
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "blocks", blocks)
        checkpointer.wait_until_finished()
    target = {"blocks": {"w": jax.ShapeDtypeStruct((2, 2, 2), np.float32)}}
    with pytest.raises(PlanError, match=r"could be stacked along axis 0 or 1 or 2.*Add a scan-axis rule"):
        restore(tmp_path / "blocks", target)


@pytest.mark.parametrize("manager", [False, True], ids=["Checkpointer", "CheckpointManager"])
def test_a_restore_orbax_itself_fails_raises_orbaxs_error_once(tmp_path, scanned_target, caplog, manager):
    """A folder no reader of ckptshim's recognises is left to Orbax; Orbax's own error is the
    caller's, as without ckptshim -- not reported as a bug in the hook, and Orbax's restore is
    not run a second time as a fallback."""
    caplog.set_level(logging.INFO, logger="ckptshim")
    step = tmp_path / "0" / "items"
    step.mkdir(parents=True)
    (step / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(FileNotFoundError) as raised:
        if manager:
            with ocp.CheckpointManager(tmp_path, item_names=("items",)) as checkpoints:
                checkpoints.restore(0, args=ocp.args.Composite(items=ocp.args.StandardRestore(scanned_target)))
        else:
            restore(step, scanned_target)
    assert not isinstance(raised.value, ShimError)
    assert "internal error" not in caplog.text and "falling back" not in caplog.text
    assert raised.value.__context__ is None or "FrameworkRaised" not in type(raised.value.__context__).__name__
