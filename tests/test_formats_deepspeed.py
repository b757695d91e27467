"""DeepSpeed/GPT-NeoX pipeline checkpoints: inventory, bit-exact reads, merges, bad input.

Fixtures: ``fixtures/neox_deepspeed/{pp1_mp1,pp2_mp2,old_pp1_mp1}`` written by GPT-NeoX with
DeepSpeed 0.19.8; their manifests hash every tensor of every file, and ``hf/`` holds NeoX's own
``convert_neox_to_hf.py`` output, which ``hf_mapping.json`` ties to each NeoX tensor.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from ckptshim.cli import main
from ckptshim.errors import CorruptCheckpointError, UnsafeCheckpointError
from ckptshim.formats import deepspeed_pipeline
from ckptshim.formats.detect import detect, open_checkpoint
from ckptshim.inventory import split_key
from support.fixtures import FIXTURES, array_sha256, copy_fixture

NEOX = FIXTURES / "neox_deepspeed"
VARIANTS = ("pp1_mp1", "pp2_mp2", "old_pp1_mp1")


def _manifest(variant: str) -> dict:
    return json.loads((NEOX / variant / "manifest.json").read_text())


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_shard_reads_bit_exact(variant: str) -> None:
    files = _manifest(variant)["files"]
    checkpoint = open_checkpoint(NEOX / variant / "checkpoint")
    assert detect(NEOX / variant / "checkpoint") is deepspeed_pipeline
    assert checkpoint.complete, checkpoint.all_problems()
    seen = 0
    for name, info in files.items():
        match = deepspeed_pipeline._LAYER_FILE.fullmatch(Path(name).name)
        if match is None:
            continue
        for tensor, expected in info["tensors"].items():
            key = ("sequential", str(int(match[1]))) + split_key(tensor)
            array = checkpoint.read_shard(key, int(match[2]))
            assert list(array.shape) == expected["shape"]
            assert array_sha256(array) == expected["sha256"], (name, tensor)
            seen += 1
    assert seen == sum(len(i["tensors"]) for n, i in files.items() if "/layer_" in n)


@pytest.mark.parametrize("variant", VARIANTS)
def test_merged_entries_equal_neox_converter_output(variant: str) -> None:
    """Each merged tensor is what NeoX's convert_neox_to_hf.py wrote (cat, or sum of biases)."""
    from safetensors.numpy import load_file

    hf = load_file(NEOX / variant / "hf" / "model.safetensors")
    mapping = json.loads((NEOX / variant / "hf_mapping.json").read_text())["hf_dirs"]["hf"]["mapping"]
    checkpoint = open_checkpoint(NEOX / variant / "checkpoint")
    for row in mapping:
        key = ("sequential", str(row["neox_layer_file"])) + split_key(row["neox_key"])
        merged = checkpoint.read(checkpoint.inventory[key])
        np.testing.assert_array_equal(merged, hf[row["hf_key"]], err_msg=str(row))
    assert len(mapping) == len(checkpoint.inventory) - sum("inv_freq" in k for k in checkpoint.inventory)


def test_inspect_cli_and_engine_state(capsys) -> None:
    assert main(["inspect", str(NEOX / "pp2_mp2" / "checkpoint")]) == 0
    out = capsys.readouterr().out
    assert "deepspeed-pipeline" in out and "tp=2 pp=2" in out
    assert "sequential.0.word_embeddings.weight" in out and "(256, 64)" in out
    assert "word_embeddings.weight float32[128, 64]" in out  # each rank's shard, per file
    checkpoint = open_checkpoint(NEOX / "pp2_mp2" / "checkpoint" / "global_step0")
    assert checkpoint.tp_degree == 2 and checkpoint.engine["args"]["padded_vocab_size"] == 256


def test_numpy_rng_state_is_inert_data() -> None:
    with open(NEOX / "pp1_mp1/checkpoint/global_step0/mp_rank_00_model_states.pt", "rb") as raw:
        from ckptshim.formats.torch_pickle import read_archive

        tree = read_archive(raw, "mp_rank_00", deepspeed_pipeline.MP_RANK_GLOBALS).tree
    state = tree["np_rng_state"][1]
    assert isinstance(state, deepspeed_pipeline.NumpyArray)
    expected = _manifest("pp1_mp1")["files"]["checkpoint/global_step0/mp_rank_00_model_states.pt"]
    assert array_sha256(state.value()) == expected["non_tensor_values"]["np_rng_state[1]"]["sha256"]


def _copy(variant: str, tmp_path: Path) -> Path:
    return copy_fixture(f"neox_deepspeed/{variant}/checkpoint", tmp_path, variant)


def test_missing_layer_file_is_reported(tmp_path: Path) -> None:
    root = _copy("pp1_mp1", tmp_path)
    (root / "global_step0" / "layer_03-model_00-model_states.pt").unlink()
    checkpoint = open_checkpoint(root)
    assert not checkpoint.complete
    assert any("layer_03-model_00-model_states.pt: missing" in p for p in checkpoint.all_problems())
    with pytest.raises(CorruptCheckpointError, match="layer_03"):
        checkpoint.require_complete()
    assert main(["inspect", str(root)]) == 1


def test_missing_tensor_parallel_rank_is_reported(tmp_path: Path) -> None:
    root = _copy("pp2_mp2", tmp_path)
    (root / "global_step0" / "layer_02-model_01-model_states.pt").unlink()
    problems = open_checkpoint(root).all_problems()
    assert any("layer 02 has tensor-parallel ranks [0]" in p for p in problems), problems


def test_mismatched_tensor_parallel_shards_are_refused(tmp_path: Path) -> None:
    root = _copy("pp2_mp2", tmp_path)
    step = root / "global_step0"
    # a rank-1 norm file from another run: replicated values that disagree with rank 0
    state = torch.load(step / "layer_05-model_01-model_states.pt", weights_only=True)
    state["norm.weight"] = state["norm.weight"] + 1
    torch.save(state, step / "layer_05-model_01-model_states.pt")
    checkpoint = open_checkpoint(root)
    with pytest.raises(CorruptCheckpointError, match="rank 1 holds a different value"):
        checkpoint.read(checkpoint.inventory[("sequential", "5", "norm", "weight")])
    # and a shard of another shape is caught from metadata alone
    state = torch.load(step / "layer_02-model_01-model_states.pt", weights_only=True)
    state["mlp.linear1.weight"] = state["mlp.linear1.weight"][:64]
    torch.save(state, step / "layer_02-model_01-model_states.pt")
    problems = open_checkpoint(root).all_problems()
    assert any("sequential.2.mlp.linear1.weight: tensor-parallel shards disagree" in p for p in problems)


class Evil:
    """Stands for any class a pickle could name to run code."""


def test_forbidden_global_is_refused_by_name(tmp_path: Path) -> None:
    root = _copy("pp1_mp1", tmp_path)
    layer = root / "global_step0" / "layer_02-model_00-model_states.pt"
    state = torch.load(layer, weights_only=True)
    torch.save({**state, "extra": Evil()}, layer)
    with pytest.raises(UnsafeCheckpointError, match="Evil"):
        open_checkpoint(root)


def test_forbidden_global_in_engine_state(tmp_path: Path) -> None:
    """An mp_rank file is refused when it holds the model; beside layer files it is left unread."""
    root = _copy("pp1_mp1", tmp_path)
    torch.save({"module": None, "args": Evil()}, root / "global_step0" / "mp_rank_00_model_states.pt")
    checkpoint = open_checkpoint(root)
    assert checkpoint.complete and len(checkpoint.inventory) == 28
    notes = [line for f in checkpoint.files if f.path.startswith("mp_rank") for line in f.contents]
    assert any("engine state not read" in n and "Evil" in n for n in notes), notes
    for layer in (root / "global_step0").glob("layer_*"):
        layer.unlink()
    with pytest.raises(UnsafeCheckpointError, match="Evil"):
        open_checkpoint(root)


def test_latest_naming_a_missing_step_is_clear(tmp_path: Path) -> None:
    root = _copy("pp1_mp1", tmp_path)
    (root / "latest").write_text("global_step9")
    (root / "global_step9").mkdir()
    (root / "global_step9" / "layer_00-model_00-model_states.pt").write_bytes(b"")
    shutil.rmtree(root / "global_step9")
    assert not deepspeed_pipeline.sniff(root)
    with pytest.raises(CorruptCheckpointError, match="global_step9"):
        deepspeed_pipeline.open_checkpoint(root)


def test_sequential_run_keeps_its_model_in_mp_rank_files(tmp_path: Path) -> None:
    """Without pipeline parallelism NeoX saves ``sequential.*`` under ``module`` of each mp_rank file."""
    source = open_checkpoint(NEOX / "pp2_mp2" / "checkpoint")
    step = tmp_path / "global_step3"
    step.mkdir()
    for rank in range(2):
        module = {".".join(key): torch.from_numpy(np.array(source.read_shard(key, rank)))
                  for key in source.inventory}
        torch.save({"module": module, "np_rng_state": np.random.get_state(), "iteration": 3},
                   step / f"mp_rank_{rank:02d}_model_states.pt")
    (tmp_path / "latest").write_text("global_step3")
    checkpoint = open_checkpoint(tmp_path)
    assert checkpoint.complete and checkpoint.tp_degree == 2
    assert list(checkpoint.inventory) == list(source.inventory)
    for key, entry in checkpoint.inventory.items():
        assert checkpoint.read(entry).tobytes() == source.read(source.inventory[key]).tobytes()
