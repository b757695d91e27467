"""T5X (legacy msgpack + tensorstore, Orbax-era) and PaxML formats on the real fixtures.

Inventories come from metadata only; every read is compared with the manifest's sha256. The
two T5X generations of one training state must list the same keys and hold the same bits.
Bad-input cases damage copies (``tests/fixtures`` is never written).
"""

from __future__ import annotations

import json

import msgpack
import numpy as np
import pytest

from ckptshim.api import inspect
from ckptshim.cli import main
from ckptshim.errors import CorruptCheckpointError, UnknownFormatError, UnsafeCheckpointError
from support.fixtures import FIXTURES, array_sha256, copy_fixture, expected_arrays

T5X = "t5x_tiny_decoder"
LEGACY = FIXTURES / T5X / "legacy_checkpointer/checkpoint_0"
ORBAX_ERA = FIXTURES / T5X / "orbax_checkpoint_manager/checkpoint_0"


def t5x_expected() -> dict[str, dict]:
    """Manifest entries of legacy step 0 keyed as T5X's state dict (``optimizer/`` stripped)."""
    prefix = "legacy/checkpoint_0::optimizer/"
    return {k[len(prefix):]: v for k, v in expected_arrays(T5X).items() if k.startswith(prefix)}


def read_all(checkpoint) -> dict[str, np.ndarray]:
    return {"/".join(e.key): checkpoint.read(e) for e in checkpoint.inventory.values()}


@pytest.mark.parametrize("path,version", [
    (LEGACY, "legacy msgpack v3"),
    (LEGACY / "checkpoint", "legacy msgpack v3"),
    (FIXTURES / T5X / "legacy_checkpointer", "legacy msgpack v3"),
    (ORBAX_ERA, "orbax-era, state/ item (ocdbt zarr2)"),
    (FIXTURES / T5X / "orbax_checkpoint_manager", "orbax-era, state/ item (ocdbt zarr2)"),
], ids=["legacy-step", "legacy-file", "legacy-model-dir", "orbax-step", "orbax-model-dir"])
def test_t5x_both_generations_match_the_manifest(path, version):
    expected = t5x_expected()
    checkpoint = inspect(path)
    try:
        assert (checkpoint.format, checkpoint.version) == ("t5x", version)
        assert checkpoint.complete, checkpoint.all_problems()
        arrays = read_all(checkpoint)
        assert set(arrays) == set(expected)
        assert any(k.startswith("target/") for k in arrays) and any(k.startswith("state/") for k in arrays)
        for key, array in arrays.items():
            entry = checkpoint.inventory[tuple(key.split("/"))]
            assert [list(entry.shape), entry.dtype] == [expected[key]["shape"], expected[key]["dtype"]], key
            assert array_sha256(array) == expected[key]["sha256"], key
    finally:
        checkpoint.close()


def test_t5x_cli_inspect_json_on_both_generations(capsys):
    found = {}
    for path in (LEGACY, ORBAX_ERA):
        assert main(["inspect", str(path), "--json"]) == 0
        info = json.loads(capsys.readouterr().out)
        assert info["format"] == "t5x" and info["complete"] is True
        found[path] = {e["key"]: (e["shape"], e["dtype"]) for e in info["entries"]}
    assert found[LEGACY] == found[ORBAX_ERA]
    expected = t5x_expected()
    assert {k: (v["shape"], v["dtype"]) for k, v in expected.items()} == found[LEGACY]


def _rewrite_msgpack(step, edit) -> None:
    """Decode the T5X msgpack of a copied step with msgpack (no pickle), edit, write back."""
    path = step / "checkpoint"
    tree = msgpack.unpackb(path.read_bytes(), raw=False, strict_map_key=False)
    edit(tree)
    path.write_bytes(msgpack.packb(tree, use_bin_type=True))


def _spec(tree, *keys):
    node = tree["optimizer"]
    for key in keys:
        node = node[key]
    return node


def test_t5x_spec_pointing_outside_the_folder_is_refused(tmp_path):
    step = copy_fixture(f"{T5X}/legacy_checkpointer/checkpoint_0", tmp_path)
    (tmp_path / "secret.v").mkdir()
    _rewrite_msgpack(step, lambda t: _spec(t, "target", "decoder", "decoder_norm", "scale")["kvstore"]
                     .update(path="../secret.v/"))
    with pytest.raises(UnsafeCheckpointError, match=r"outside the checkpoint folder"):
        inspect(step)


def test_t5x_gcs_spec_reads_from_the_local_folder(tmp_path):
    step = copy_fixture(f"{T5X}/legacy_checkpointer/checkpoint_0", tmp_path)

    def to_gcs(tree):
        spec = _spec(tree, "target", "decoder", "token_embedder", "embedding")
        spec["kvstore"] = {"driver": "gcs", "bucket": "some-bucket", "path": spec["kvstore"]["path"]}

    _rewrite_msgpack(step, to_gcs)
    checkpoint = inspect(step)
    key = "target/decoder/token_embedder/embedding"
    assert array_sha256(read_all(checkpoint)[key]) == t5x_expected()[key]["sha256"]


def test_t5x_missing_target_folder_is_named(tmp_path, capsys):
    step = copy_fixture(f"{T5X}/legacy_checkpointer/checkpoint_0", tmp_path)
    import shutil

    shutil.rmtree(step / "target.decoder.layers_1.mlp.wo.kernel")
    assert main(["inspect", str(step), "--json"]) == 1
    info = json.loads(capsys.readouterr().out)
    assert info["complete"] is False
    assert any("target.decoder.layers_1.mlp.wo.kernel/" in p and "missing" in p for p in info["problems"])
    with pytest.raises(CorruptCheckpointError, match="target.decoder.layers_1.mlp.wo.kernel"):
        inspect(step).require_complete()


def test_t5x_unknown_version_is_refused(tmp_path):
    step = copy_fixture(f"{T5X}/legacy_checkpointer/checkpoint_0", tmp_path)
    _rewrite_msgpack(step, lambda t: t.update(version=7))
    with pytest.raises(UnknownFormatError, match=r"version 7.*reads versions 2, 3"):
        inspect(step)
    _rewrite_msgpack(step, lambda t: t.update(version=1))
    with pytest.raises(UnknownFormatError, match=r"version 1"):
        inspect(step)


def test_t5x_corrupt_msgpack_is_refused(tmp_path):
    step = copy_fixture(f"{T5X}/legacy_checkpointer/checkpoint_0", tmp_path)
    data = (step / "checkpoint").read_bytes()
    (step / "checkpoint").write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        inspect(step)


def test_t5x_version_2_uint16_arrays_read_as_bfloat16_bits(tmp_path):
    """Version 2 wrote bfloat16 arrays as uint16 bit patterns; they come back as those bfloat16s."""
    import ml_dtypes
    import tensorstore as ts

    step = copy_fixture(f"{T5X}/legacy_checkpointer/checkpoint_0", tmp_path)
    values = np.linspace(-3, 3, 32, dtype=np.float32).astype(ml_dtypes.bfloat16)
    folder = step / "target.decoder.decoder_norm.scale"
    import shutil

    shutil.rmtree(folder)
    spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": str(folder) + "/"},
            "metadata": {"shape": [32], "chunks": [32], "dtype": "<u2", "compressor": {"id": "gzip"}}}
    ts.open(spec, create=True).result().write(values.view(np.uint16)).result()

    def as_v2(tree):
        tree["version"] = 2
        leaf = _spec(tree, "target", "decoder", "decoder_norm", "scale")
        leaf.update(dtype="uint16")

    _rewrite_msgpack(step, as_v2)
    checkpoint = inspect(step)
    assert checkpoint.version == "legacy msgpack v2"
    entry = checkpoint.inventory["target", "decoder", "decoder_norm", "scale"]
    assert entry.dtype == "bfloat16"
    assert checkpoint.read(entry).tobytes() == values.tobytes()
    as_float = np.empty(32, np.float32)
    checkpoint.read_into(entry, (), as_float)
    assert np.array_equal(as_float, values.astype(np.float32))


# -- PaxML ------------------------------------------------------------------------------------

PAX = "paxml_runs/TinySpmdRepeat"
PAX_STEPS = FIXTURES / PAX / "checkpoints"


@pytest.mark.parametrize("step", ["checkpoint_00000000", "checkpoint_00000001", "checkpoint_00000002"])
@pytest.mark.parametrize("item", ["", "state"])
def test_paxml_tensorstore_layout_matches_the_manifest(step, item):
    expected = {k.split("::", 1)[1]: v for k, v in expected_arrays(PAX).items() if k.startswith(step + "::")}
    checkpoint = inspect(PAX_STEPS / step / item)
    try:
        assert (checkpoint.format, checkpoint.version) == ("paxml", "1.1, tensorstore")
        assert checkpoint.complete, checkpoint.all_problems()
        found = {".".join(e.key): e for e in checkpoint.inventory.values()}
        assert set(found) == set(expected)
        for key, entry in found.items():
            assert [list(entry.shape), entry.dtype] == [expected[key]["shape"], expected[key]["dtype"]], key
            assert array_sha256(checkpoint.read(entry)) == expected[key]["sha256"], key
        layers = checkpoint.inventory["mdl_vars", "params", "lm", "transformer", "repeat", "sub",
                                      "x_layers_0", "self_attention", "combined_qkv", "w"]
        assert layers.shape == (2, 3, 32, 4, 8)  # the layer axis first
    finally:
        checkpoint.close()


def test_paxml_cli_inspect_reads_the_latest_step(capsys):
    assert main(["inspect", str(PAX_STEPS), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["format"] == "paxml" and info["complete"] is True
    assert info["path"].endswith("checkpoint_00000002/state")
    expected = {k.split("::", 1)[1]: v for k, v in expected_arrays(PAX).items()
                if k.startswith("checkpoint_00000002::")}
    assert {e["key"].replace("/", "."): e["shape"] for e in info["entries"]} == \
        {k: v["shape"] for k, v in expected.items()}


def _edit_metadata(step, key: tuple[str, ...], unpadded: list[int]) -> None:
    path = step / "metadata" / "metadata"
    meta = json.loads(path.read_text())
    node = meta["train_state_metadata"]
    for part in key:
        node = node[part]
    node["unpadded_shape"] = unpadded
    path.write_text(json.dumps(meta))


def test_paxml_padded_arrays_are_listed_and_read_unpadded(tmp_path):
    step = copy_fixture(f"{PAX}/checkpoints/checkpoint_00000001", tmp_path)
    key = ("mdl_vars", "params", "lm", "softmax", "logits_ffn", "linear", "w")
    full = inspect(step)
    stored = full.read(full.inventory[key]).copy()
    _edit_metadata(step, key, [30, 250])
    padded = inspect(step)
    entry = padded.inventory[key]
    assert entry.shape == (30, 250)
    assert np.array_equal(padded.read(entry), stored[:30, :250])
    part = np.empty((10, 250), np.float32)
    padded.read_into(entry, (slice(20, None), slice(None)), part).result()
    assert np.array_equal(part, stored[20:30, :250])
    _edit_metadata(step, key, [40, 256])
    with pytest.raises(CorruptCheckpointError, match=r"unpadded shape \[40, 256\], but its zarr array is \[32, 256\]"):
        inspect(step)


def test_paxml_missing_chunk_is_reported(tmp_path, capsys):
    step = copy_fixture(f"{PAX}/checkpoints/checkpoint_00000001", tmp_path)
    (step / "state" / "mdl_vars.params.lm.final_ln.scale" / "0").unlink()
    assert main(["inspect", str(step), "--json"]) == 1
    info = json.loads(capsys.readouterr().out)
    assert any("mdl_vars.params.lm.final_ln.scale" in p and "missing" in p for p in info["problems"])


def test_paxml_report_is_per_array_folder(tmp_path, capsys):
    """PaxML writes one zarr folder per array: that folder is the writer a gap is reported under,
    with the block of the array the missing chunk held."""
    step = copy_fixture(f"{PAX}/checkpoints/checkpoint_00000001", tmp_path)
    (step / "state" / "mdl_vars.params.lm.softmax.logits_ffn.linear.w" / "0.0").unlink()
    assert main(["inspect", str(step), "--json"]) == 1
    info = json.loads(capsys.readouterr().out)
    (writer,) = [w for w in info["writers"] if w["gaps"]]
    assert writer["writer"] == "mdl_vars.params.lm.softmax.logits_ffn.linear.w/" and writer["files_missing"] == 1
    assert writer["gaps"][0]["costs"] == ["mdl_vars/params/lm/softmax/logits_ffn/linear/w [0:32, 0:256]"]
    assert len(info["writers"]) == len(info["entries"])  # every other array's folder: whole


def test_t5x_orbax_era_step_is_recognised_by_its_tree_without_manager_metadata(tmp_path):
    step = copy_fixture(f"{T5X}/orbax_checkpoint_manager/checkpoint_0", tmp_path)
    (step / "_CHECKPOINT_METADATA").unlink()
    checkpoint = inspect(step)
    assert checkpoint.format == "t5x" and {k[0] for k in checkpoint.inventory} == {"target", "state"}
    maxtext_state = FIXTURES / "orbax_0.12.8_scanned"
    assert inspect(next(p for p in sorted(maxtext_state.rglob("state")) if p.is_dir()).parent).format != "t5x"
