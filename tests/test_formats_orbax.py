"""Orbax and Flax formats: inventories from metadata only, bit-exact reads, completeness.

Every layout is read from a real fixture (or written by today's Orbax) and checked against the
fixture manifest's hashes; bad-input cases delete or corrupt files in a copy.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from ckptshim.api import describe, inspect, plan
from ckptshim.cli import main
from ckptshim.errors import CorruptCheckpointError
from support.fixtures import FIXTURES, array_sha256, copy_fixture, expected_arrays

LAYOUTS = [  # path under tests/fixtures, format, version, manifest folder, manifest key prefix
    ("maxtext_runs/tiny_scanned/checkpoints/1/items", "orbax", "ocdbt zarr3",
     "maxtext_runs/tiny_scanned", "step1::"),
    ("maxtext_runs/tiny_unscanned/checkpoints/1/items", "orbax", "ocdbt zarr3",
     "maxtext_runs/tiny_unscanned", "step1::"),
    ("orbax_0.12.8_scanned/standard_checkpointer_scanned", "orbax", "ocdbt zarr2",
     "orbax_0.12.8_scanned", "[scanned] "),
    ("orbax_0.2.3_unscanned/pytree_checkpointer", "orbax", "legacy aggregate",
     "orbax_0.2.3_unscanned", ""),
    ("orbax_0.2.3_unscanned/checkpoint_manager/1/default", "orbax", "legacy aggregate",
     "orbax_0.2.3_unscanned", ""),
    ("flax_0.6.11_legacy_msgpack/flax_default_orbax_backend/checkpoint_2", "orbax", "legacy aggregate",
     "flax_0.6.11_legacy_msgpack", ""),
    ("flax_0.6.11_legacy_msgpack/legacy_msgpack/checkpoint_2", "flax-msgpack", "legacy msgpack",
     "flax_0.6.11_legacy_msgpack", ""),
]


@pytest.mark.parametrize("path,fmt,version,folder,prefix", LAYOUTS, ids=[row[0] for row in LAYOUTS])
def test_inventory_and_reads_match_the_manifest(path, fmt, version, folder, prefix):
    manifest = {k: v for k, v in expected_arrays(folder).items() if k.startswith(prefix)}
    checkpoint = inspect(FIXTURES / path)
    try:
        assert (checkpoint.format, checkpoint.version) == (fmt, version)
        assert checkpoint.complete, checkpoint.all_problems()
        keys = {prefix + "/".join(e.key): e for e in checkpoint.inventory.values()}
        assert set(keys) == set(manifest)
        for key, entry in keys.items():
            assert [list(entry.shape), entry.dtype] == [manifest[key]["shape"], manifest[key]["dtype"]], key
            assert array_sha256(checkpoint.read(entry)) == manifest[key]["sha256"], key
    finally:
        checkpoint.close()


def test_manager_root_reads_its_latest_step_and_names_the_item():
    checkpoint = inspect(FIXTURES / "orbax_0.12.8_scanned/checkpoint_manager_scanned")
    assert checkpoint.format == "orbax-manager"
    assert checkpoint.version == "step 2 (steps: 1, 2); items: state"
    manifest = expected_arrays("orbax_0.12.8_scanned")
    for entry in checkpoint.inventory.values():  # one item: its keys are the item's own
        assert array_sha256(checkpoint.read(entry)) == manifest["[scanned] " + "/".join(entry.key)]["sha256"]
    step = inspect(FIXTURES / "maxtext_runs/tiny_unscanned/checkpoints/0")
    assert (step.format, step.version) == ("orbax-manager", "step folder; items: items")


def test_legacy_flax_folder_reads_its_latest_step():
    checkpoint = inspect(FIXTURES / "flax_0.6.11_legacy_msgpack/legacy_msgpack")
    assert checkpoint.path.name == "checkpoint_2"
    assert checkpoint.version == "legacy msgpack, latest of 2 step file(s)"


def test_per_leaf_zarr_written_by_todays_orbax(tmp_path):
    import orbax.checkpoint as ocp

    tree = {"params": {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "n": np.int32(7)}}
    path = tmp_path / "per_leaf"
    ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False)).save(path, tree)
    checkpoint = inspect(path)
    assert checkpoint.version == "per-leaf zarr2" and checkpoint.complete
    read = {"/".join(e.key): checkpoint.read(e) for e in checkpoint.inventory.values()}
    assert np.array_equal(read["params/w"], tree["params"]["w"]) and read["params/n"] == 7


def test_flax_chunked_arrays_read_back_bit_exact(tmp_path, monkeypatch):
    from flax import serialization

    monkeypatch.setattr(serialization, "MAX_CHUNK_SIZE", 64)  # force Flax's >1 GiB code path
    rng = np.random.default_rng(0)
    tree = {"big": rng.standard_normal((10, 7)).astype(np.float32), "small": np.arange(3, dtype=np.int8)}
    path = tmp_path / "checkpoint_3"
    path.write_bytes(serialization.msgpack_serialize(tree))
    checkpoint = inspect(path)
    read = {"/".join(e.key): checkpoint.read(e) for e in checkpoint.inventory.values()}
    assert read["big"].shape == (10, 7) and np.array_equal(read["big"], tree["big"])
    assert np.array_equal(read["small"], tree["small"])


def test_cli_inspect_json_and_plan_across_scan_layers(capsys):
    assert main(["inspect", str(FIXTURES / "orbax_0.2.3_unscanned/pytree_checkpointer"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["format"] == "orbax" and info["complete"] and len(info["entries"]) == 30
    result = plan(FIXTURES / "orbax_0.2.3_unscanned/checkpoint_manager",
                  FIXTURES / "orbax_0.12.8_scanned/checkpoint_manager_scanned")
    assert result.complete and result.counts()["stacked"] == 27


def test_inventory_needs_no_chunk_data(tmp_path):
    """Planning never reads tensor bytes: with every chunk file gone the inventory is whole."""
    root = copy_fixture("orbax_0.2.3_unscanned", tmp_path) / "pytree_checkpointer"
    for chunk in root.glob("*/0*"):
        chunk.unlink()
    checkpoint = inspect(root)
    assert len(checkpoint.inventory) == 30 and not checkpoint.complete
    assert len(checkpoint.all_problems()) == 30


def test_deleted_zarr_chunk_is_reported(tmp_path, capsys):
    root = copy_fixture("orbax_0.2.3_unscanned", tmp_path) / "pytree_checkpointer"
    (root / "params.decoder.layers_1.mlp.wo.kernel" / "0.0").unlink()
    assert main(["inspect", str(root), "--json"]) == 1
    info = json.loads(capsys.readouterr().out)
    assert info["complete"] is False
    assert info["problems"] == ["params.decoder.layers_1.mlp.wo.kernel/0.0: missing"]
    (writer,) = [w for w in info["writers"] if w["gaps"]]
    assert writer["writer"] == "params.decoder.layers_1.mlp.wo.kernel/" and writer["files_missing"] == 1
    assert writer["gaps"][0]["costs"] == ["params/decoder/layers_1/mlp/wo/kernel [0:64, 0:32]"]


def test_deleted_ocdbt_data_file_is_reported(tmp_path):
    root = copy_fixture("maxtext_runs", tmp_path) / "tiny_scanned/checkpoints/1/items"
    data = max((root / "ocdbt.process_0" / "d").iterdir(), key=lambda p: p.stat().st_size)
    data.unlink()
    info = describe(inspect(root))
    assert info["complete"] is False
    assert info["problems"] == [f"ocdbt.process_0/d/{data.name}: missing"]


def test_corrupt_metadata_is_refused(tmp_path, capsys):
    root = copy_fixture("orbax_0.12.8_scanned", tmp_path) / "standard_checkpointer_scanned"
    (root / "_METADATA").write_text('{"tree_metadata": ')
    with pytest.raises(CorruptCheckpointError, match="_METADATA: not a valid Orbax metadata file"):
        inspect(root)
    assert main(["inspect", str(root)]) == 1
    assert "not a valid Orbax metadata file" in capsys.readouterr().err
