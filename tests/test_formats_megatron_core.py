"""Megatron-Core ``dist_checkpointing`` folders: the zarr backend's reader (inventory, bit-exact
reads, completeness, bad input), and the torch_dist backend recognised as Megatron-Core's and read
by the DCP reader.

Fixtures: ``fixtures/megatron_core/{torch_dist,zarr}/<variant>`` written by Megatron-Core 0.16.1
(torch_dist: TP1/PP1, TP2/PP1, TP1/PP2, TP2/PP2, and TP1/PP1 in bfloat16) and 0.12.3 (zarr: TP1
and TP2) on CPU/gloo, all holding the same values; the manifest hashes the plain
``GPTModel.state_dict()`` that Megatron-Core's own ``dist_checkpointing.load`` gives a TP1/PP1
model from each, and lists each stored key's global shape.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

from ckptshim.cli import main
from ckptshim.errors import CorruptCheckpointError, UnknownFormatError, UnsafeCheckpointError
from ckptshim.formats import dcp, megatron_core
from ckptshim.formats.detect import detect, open_checkpoint
from ckptshim.inventory import join_key
from support.fixtures import FIXTURES, array_sha256, copy_fixture

MEGATRON = FIXTURES / "megatron_core"
MANIFEST = json.loads((MEGATRON / "manifest.json").read_text())
REFERENCE = {row["key"]: row for row in MANIFEST["keys"]}
ZARR = [v for v in MANIFEST["variants"] if v.startswith("zarr/")]
TORCH_DIST = [v for v in MANIFEST["variants"] if v.startswith("torch_dist/")]
QKV = "decoder.layers.self_attention.linear_qkv.weight"

#: Where the local spec's layer norms are stored: under the TE-fused names (see the module docstring
#: of ckptshim.formats.megatron_core); every other per-layer name is stored as it is.
_STORED_AS = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
              "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
              "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
              "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias"}


def _stored(name: str) -> tuple[str, int | None]:
    """The stored key of a ``GPTModel.state_dict()`` name, and its index on the stacked axis."""
    match = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name)
    if match is None:
        return name, None
    return "decoder.layers." + _STORED_AS.get(match[2], match[2]), int(match[1])


def _references(variant: str) -> dict[str, dict]:
    prefix = f"{variant}/"
    return {key[len(prefix):]: row for key, row in REFERENCE.items() if key.startswith(prefix)}


def _check_against_megatrons_own_load(checkpoint, variant: str) -> None:
    """Every tensor of the plain per-layer state dict Megatron-Core's load gave, bit for bit, at
    its stored key and global layer index; and the inventory's tensors as Megatron lists them."""
    stored = MANIFEST["stored"][variant]
    tensors = {join_key(k): e for k, e in checkpoint.inventory.items() if "/shard_" not in join_key(k)}
    assert {k: {"shape": list(e.shape), "dtype": e.dtype} for k, e in tensors.items()} == stored
    cache: dict[str, np.ndarray] = {}
    references = _references(variant)
    for name, row in references.items():
        key, layer = _stored(name)
        if key not in cache:
            cache[key] = checkpoint.read(tensors[key])
        value = cache[key] if layer is None else cache[key][layer]
        assert (list(value.shape), array_sha256(value)) == (row["shape"], row["sha256"]), name
    assert len(references) == 5 + 4 * 12  # 2 embeddings, final norm weight and bias, output layer; 12 per layer


@pytest.mark.parametrize("variant", ZARR)
def test_zarr_backend_reads_as_megatron_loads_it(variant: str) -> None:
    folder = MEGATRON / variant
    assert detect(folder) is megatron_core and detect(folder, backend="torch") is megatron_core
    checkpoint = open_checkpoint(folder)
    assert checkpoint.complete, checkpoint.all_problems()
    assert checkpoint.version == "Megatron-Core dist_checkpointing zarr v1"
    _check_against_megatrons_own_load(checkpoint, variant)
    objects = [join_key(k) for k in checkpoint.inventory if "/shard_" in join_key(k)]
    assert "decoder.layers.self_attention.linear_proj._extra_state/shard_3_4" in objects and len(objects) == 16


def test_zarr_and_torch_dist_list_the_same_tensors() -> None:
    """The same stacked keys, shapes and dtypes as Megatron-Core lists for torch_dist."""
    assert MANIFEST["stored"]["zarr/tp1_pp1"] == MANIFEST["stored"]["torch_dist/tp1_pp1"]
    assert MANIFEST["stored"]["torch_dist/tp1_pp1"][QKV] == {"shape": [4, 36, 12], "dtype": "float32"}


@pytest.mark.parametrize("variant", TORCH_DIST)
def test_torch_dist_reads_as_megatron_loads_it(variant: str) -> None:
    checkpoint = open_checkpoint(MEGATRON / variant)
    assert checkpoint.complete, checkpoint.all_problems()
    _check_against_megatrons_own_load(checkpoint, variant)


def test_inspect_torch_dist(capsys) -> None:
    """Listed under the model's names (the profile's; see test_megatron_core_profile)."""
    code = main(["inspect", str(MEGATRON / "torch_dist" / "tp2_pp2")])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "decoder.layers.{0..3}.self_attention.linear_qkv.weight" in captured.out and "(36, 12)" in captured.out


def test_torch_dist_is_recognised_as_megatron_cores() -> None:
    for variant in TORCH_DIST:
        folder = MEGATRON / variant
        assert megatron_core.config(folder) == megatron_core.Config("torch_dist", 1, "torch", 1)
        assert megatron_core.is_torch_dist(folder) and not megatron_core.is_zarr(folder)
        assert detect(folder, backend="torch") is dcp  # DCP's own reader's to read
    assert megatron_core.config(MEGATRON / "zarr" / "tp2_pp1").sharded_backend == "zarr"
    assert megatron_core.config(FIXTURES / "torch_dcp_single" / "dcp_plain") is None
    assert not megatron_core.is_torch_dist(FIXTURES / "torch_dcp_single" / "dcp_plain")


def test_metadata_json_that_is_not_a_file_is_not_read(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "metadata.json")  # reading it would block
    assert megatron_core.config(tmp_path) is None
    (tmp_path / "metadata.json").unlink()
    (tmp_path / "metadata.json").write_text("[1, 2]")
    assert megatron_core.config(tmp_path) is None


@pytest.mark.parametrize("variant", ZARR)
def test_convert_zarr_to_safetensors_bit_exact(variant: str, tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    """``--like`` the checkpoint itself keeps Megatron-Core's stored names (objects as their bytes)."""
    assert main(["convert", str(MEGATRON / variant), str(tmp_path / "out"), "--to", "safetensors",
                 "--like", str(MEGATRON / variant), "--no-progress"]) == 0
    written = {}
    for file in sorted((tmp_path / "out").glob("*.safetensors")):
        written.update(load_file(file))
    checkpoint = open_checkpoint(MEGATRON / variant)
    assert sorted(written) == sorted(join_key(k) for k in checkpoint.inventory)
    for key, entry in checkpoint.inventory.items():
        assert written[join_key(key)].tobytes() == checkpoint.read(entry).tobytes(), key


# -- completeness and bad input -----------------------------------------------------------------

def _copy(variant: str, tmp_path: Path) -> Path:
    return copy_fixture(f"megatron_core/{variant}", tmp_path, variant.replace("/", "_"))


def test_missing_chunk_is_named_with_its_block(tmp_path: Path, capsys) -> None:
    root = _copy("zarr/tp2_pp1", tmp_path)
    (root / QKV / "2.1.0").unlink()
    checkpoint = open_checkpoint(root)
    assert checkpoint.all_problems() == [f"{QKV}/2.1.0: missing"]
    assert main(["inspect", str(root)]) == 1
    assert f"{QKV}/2.1.0: missing; costs 1 array(s): {QKV} [2:3, 18:36, 0:12]" in capsys.readouterr().out
    assert main(["convert", str(root), str(tmp_path / "out"), "--to", "safetensors", "--no-progress"]) == 1
    assert not (tmp_path / "out").exists()


def test_short_chunk_is_named(tmp_path: Path) -> None:
    root = _copy("zarr/tp1_pp1", tmp_path)
    chunk = root / QKV / "1.0.0"
    chunk.write_bytes(chunk.read_bytes()[:100])
    checkpoint = open_checkpoint(root)
    assert checkpoint.all_problems() == [f"{QKV}/1.0.0: 100 bytes, but its metadata needs 1728"]
    with pytest.raises(CorruptCheckpointError, match="1.0.0"):
        checkpoint.read(checkpoint.inventory[tuple(QKV.split("."))])


def test_compressed_arrays_are_not_guessed_at(tmp_path: Path) -> None:
    root = _copy("zarr/tp1_pp1", tmp_path)
    meta = json.loads((root / QKV / ".zarray").read_text())
    for change in ({"compressor": {"id": "zstd", "level": 1}}, {"order": "F"}, {"dtype": ">f4"}):
        (root / QKV / ".zarray").write_text(json.dumps({**meta, **change}))
        with pytest.raises(UnknownFormatError, match="uncompressed little-endian C-order"):
            open_checkpoint(root)


def test_sharded_objects_are_bytes_never_unpickled(tmp_path: Path) -> None:
    """An ``_extra_state`` file is listed and converted as its bytes; nothing in it runs."""
    import pickle

    root = _copy("zarr/tp1_pp1", tmp_path)
    target = root / "decoder.layers.mlp.linear_fc2._extra_state" / "shard_0_4.pt"
    payload = pickle.dumps(_Boom())
    target.write_bytes(payload)
    checkpoint = open_checkpoint(root)
    entry = checkpoint.inventory[("decoder", "layers", "mlp", "linear_fc2", "_extra_state/shard_0_4")]
    assert entry.shape == (len(payload),) and checkpoint.read(entry).tobytes() == payload


class _Boom:
    def __reduce__(self):
        return os.system, ("echo should never run",)


def test_chunk_that_is_not_a_regular_file_is_refused_by_name_and_not_read(tmp_path: Path) -> None:
    """A FIFO among the chunks is refused when the folder is opened (reading it would block)."""
    root = _copy("zarr/tp1_pp1", tmp_path)
    chunk = root / QKV / "3.0.0"
    chunk.unlink()
    os.mkfifo(chunk)  # reading it would block
    with pytest.raises(UnsafeCheckpointError, match=f"{QKV}/3.0.0 is a named pipe"):
        open_checkpoint(root)


def test_chunk_longer_than_one_chunk_is_named(tmp_path: Path) -> None:
    root = _copy("zarr/tp1_pp1", tmp_path)
    chunk = root / QKV / "0.0.0"
    chunk.write_bytes(chunk.read_bytes() + b"\0" * 4)
    assert open_checkpoint(root).all_problems() == [f"{QKV}/0.0.0: 1732 bytes, more than the 1728 of one chunk"]
