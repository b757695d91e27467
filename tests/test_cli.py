"""The ``ckptshim`` command on real fixtures and on damaged copies of them."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ckptshim.cli import main
from ckptshim.formats.detect import open_checkpoint
from support.fixtures import FIXTURES, array_sha256, copy_fixture, expected_arrays

TORCH_FILES = [
    ("torch_dcp_single", "torch_save/model.pt", ""),
    ("hf_gptneox_tf4.30.2", "pytorch_model_bin", ""),
    ("hf_gptneox_tf4.30.2", "safetensors", ""),
    ("hf_gptneox_tf4.30.2", "safetensors/model.safetensors", ""),
    ("hf_gptneox_tf5_resaved", "save_pretrained_default", ""),
]


def run_json(capsys, *argv: str) -> tuple[int, dict]:
    """The command's exit code and its JSON, read from what it alone printed (not what the test
    printed before it: DeepSpeed, which transformers imports once accelerate is installed, prints
    its accelerator on standard output the first time)."""
    capsys.readouterr()
    code = main(list(argv))
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(("folder", "item", "_"), TORCH_FILES)
def test_inspect_json_matches_manifest(capsys, folder, item, _):
    code, info = run_json(capsys, "inspect", str(FIXTURES / folder / item), "--json")
    expected = expected_arrays(folder)
    found = {e["key"]: e for e in info["entries"]}
    assert code == 0 and info["complete"] is True and info["problems"] == []
    assert set(found) <= set(expected) and len(found) >= len(expected) - 6
    for key, entry in found.items():
        assert entry["shape"] == expected[key]["shape"], key
        assert entry["dtype"] == expected[key]["dtype"], key
    assert info["total_bytes"] == sum(e["bytes"] for e in info["entries"]) > 0


@pytest.mark.parametrize(("folder", "item", "_"), TORCH_FILES)
def test_reads_are_bit_exact_against_manifest(folder, item, _):
    expected = expected_arrays(folder)
    checkpoint = open_checkpoint(FIXTURES / folder / item)
    for key, entry in checkpoint.inventory.items():
        assert array_sha256(checkpoint.read(entry)) == expected[".".join(key)]["sha256"], key


def test_truncated_file_is_incomplete(tmp_path, capsys):
    copy = tmp_path / "model.safetensors"
    data = (FIXTURES / "hf_gptneox_tf4.30.2/safetensors/model.safetensors").read_bytes()
    copy.write_bytes(data[: len(data) - 1000])
    code, info = run_json(capsys, "inspect", str(copy), "--json")
    assert code == 1 and info["complete"] is False
    assert "model.safetensors" in info["problems"][0] and "needs" in info["problems"][0]


def test_deleted_shard_is_named(tmp_path, capsys):
    """A sharded HF directory whose index names a shard that is gone."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPTNeoXConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                        num_attention_heads=4, intermediate_size=64)
    transformers.GPTNeoXForCausalLM(config).save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    shards = sorted((tmp_path / "hf").glob("model-*.safetensors"))
    assert len(shards) > 1
    code, info = run_json(capsys, "inspect", str(tmp_path / "hf"), "--json")
    assert code == 0 and info["complete"]
    shards[0].unlink()
    code, info = run_json(capsys, "inspect", str(tmp_path / "hf"), "--json")
    assert code == 1 and info["complete"] is False
    assert any(shards[0].name in p and "missing" in p for p in info["problems"])


def test_hub_cache_snapshot_reads_through_its_blob_symlinks(tmp_path, capsys):
    """A sharded model in the Hugging Face hub cache: snapshot files are symlinks into the
    repository's shared ``blobs/``; that is where the shards live, not an escape."""
    import hashlib

    from huggingface_hub import scan_cache_dir
    from safetensors.numpy import load_file

    transformers = pytest.importorskip("transformers")
    config = transformers.GPTNeoXConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                        num_attention_heads=4, intermediate_size=64)
    saved = tmp_path / "saved"
    transformers.GPTNeoXForCausalLM(config).save_pretrained(saved, max_shard_size="20KB")
    repo = tmp_path / "hub" / "models--tiny--neox"
    snapshot = repo / "snapshots" / ("0" * 40)
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    for file in saved.iterdir():
        blob = hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.move(file, repo / "blobs" / blob)
        (snapshot / file.name).symlink_to(Path("../../blobs") / blob)
    assert [r.repo_id for r in scan_cache_dir(tmp_path / "hub").repos] == ["tiny/neox"]

    code, info = run_json(capsys, "inspect", str(snapshot), "--json")
    assert code == 0 and info["complete"], info["problems"]
    checkpoint = open_checkpoint(snapshot)
    expected = {key: value for shard in snapshot.glob("model-*.safetensors")
                for key, value in load_file(shard).items()}
    assert {".".join(e.key) for e in checkpoint.inventory.values()} == set(expected)
    for entry in checkpoint.inventory.values():
        assert checkpoint.read(entry).tobytes() == expected[".".join(entry.key)].tobytes()

    # A snapshot file that leads anywhere but the repository's blobs is still refused.
    elsewhere = tmp_path / "elsewhere.safetensors"
    shard = sorted(snapshot.glob("model-*.safetensors"))[0]
    shutil.copy(shard, elsewhere)
    shard.unlink()
    shard.symlink_to(elsewhere)
    code = main(["inspect", str(snapshot), "--json"])
    assert code == 1 and "lies outside the directory" in capsys.readouterr().err


def test_unknown_format_and_empty_dir(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["inspect", str(tmp_path / "empty")]) == 1
    assert "empty directory" in capsys.readouterr().err
    (tmp_path / "notes.txt").write_text("hello")
    assert main(["inspect", str(tmp_path / "notes.txt")]) == 1
    assert "not in a format ckptshim knows" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "absent")]) == 1
    assert "no such file" in capsys.readouterr().err


def test_garbage_safetensors_header(tmp_path, capsys):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes((10**12).to_bytes(8, "little") + b"{}")
    assert main(["inspect", str(bad)]) == 1
    assert "header claims" in capsys.readouterr().err


def test_usage_error_exits_2(capsys):
    assert main(["frobnicate"]) == 2
    assert main(["plan", "x"]) == 2  # --like is required


def test_plan_dry_run_lists_dropped_legacy_buffers(capsys):
    old = FIXTURES / "hf_gptneox_tf4.30.2/safetensors"
    new = FIXTURES / "hf_gptneox_tf5_resaved/save_pretrained_default"
    code, info = run_json(capsys, "plan", str(old), "--like", str(new), "--json")
    assert code == 0 and info["complete"] and info["summary"] == "6 dropped (attention.bias, attention.masked_bias, inv_freq)"
    assert "gpt_neox.layers.{0..1}.attention.rotary_emb.inv_freq -> drop(inv_freq) once its value is checked" \
        in info["lines"]
    code, info = run_json(capsys, "plan", str(new), "--like", str(old), "--json")
    assert code == 1 and not info["complete"]
    assert len(info["missing"]) == 6


def test_python_dash_m_entry_point():
    result = subprocess.run([sys.executable, "-m", "ckptshim", "inspect", "--json",
                             str(FIXTURES / "torch_dcp_single/torch_save/model.pt")],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["format"] == "torch-pickle"


def test_truncated_torch_save_is_reported_as_truncated(tmp_path, capsys):
    data = (FIXTURES / "torch_dcp_single/torch_save/model.pt").read_bytes()
    (tmp_path / "model.pt").write_bytes(data[: len(data) // 2])
    assert main(["inspect", str(tmp_path / "model.pt")]) == 1
    assert "truncated" in capsys.readouterr().err


def test_plan_on_maxtext_runs_uses_the_jax_tree_rules(capsys):
    """`ckptshim plan` stacks a MaxText unscanned run onto the scanned one on axis 1."""
    runs = FIXTURES / "maxtext_runs"
    unscanned = runs / "tiny_unscanned/checkpoints/1/items"
    scanned = runs / "tiny_scanned/checkpoints/1/items"
    code, info = run_json(capsys, "plan", str(unscanned), "--like", str(scanned), "--json", "--sep", "/")
    assert "params/params/decoder/layers_{0..2}/mlp/wo/kernel -> stack(axis=1) -> " \
           "params/params/decoder/layers/mlp/wo/kernel" in info["lines"]
    # the unscanned run keeps NNX rng state for layers_0 only: the rest cannot be planned
    assert code == 1 and info["missing"] and all("rngs" in key for key in info["missing"])


def _every_fixture_checkpoint() -> list[tuple[str, str, str]]:
    """(path under fixtures, manifest folder, manifest key prefix) for every checkpoint there."""
    from test_formats_orbax import LAYOUTS

    dcp = [(f"torch_dcp_single/{name}", "torch_dcp_single", prefix)
           for name, prefix in (("dcp_plain", "model."), ("dcp_compiled", "model._orig_mod."),
                                ("dcp_plain_toplevel", ""))]
    torch_files = [(f"{folder}/{item}", folder, "") for folder, item, _ in TORCH_FILES]
    jax = [(path, folder, prefix) for path, _, _, folder, prefix in LAYOUTS]
    return torch_files + dcp + jax


@pytest.mark.parametrize(("path", "folder", "prefix"), _every_fixture_checkpoint(), ids=lambda v: str(v))
def test_inspect_json_on_every_fixture(capsys, path, folder, prefix):
    """Entry count, shapes and dtypes as the manifest lists them (its key format per folder)."""
    code, info = run_json(capsys, "inspect", str(FIXTURES / path), "--json")
    assert code == 0 and info["complete"] is True, info["problems"]
    manifest_prefix = prefix if prefix.startswith(("[", "step")) else ""
    stored_prefix = "" if manifest_prefix else prefix
    expected = {k[len(manifest_prefix):]: v for k, v in expected_arrays(folder).items() if k.startswith(manifest_prefix)}
    found = {e["key"].removeprefix(stored_prefix): e for e in info["entries"]}
    assert len(found) == len(info["entries"]) and set(found) <= set(expected)
    if folder not in {"hf_gptneox_tf4.30.2", "hf_gptneox_tf5_resaved"}:  # HF files omit derived buffers
        assert len(found) == len(expected)
    for key, entry in found.items():
        assert [entry["shape"], entry["dtype"]] == [expected[key]["shape"], expected[key]["dtype"]], key
    assert info["total_bytes"] == sum(e["bytes"] for e in info["entries"])


@pytest.mark.parametrize(("path", "damage"), [
    ("orbax_0.12.8_scanned/standard_checkpointer_scanned", "delete"),
    ("orbax_0.12.8_scanned/standard_checkpointer_scanned", "truncate"),
    ("orbax_0.2.3_unscanned/pytree_checkpointer", "delete"),
    ("orbax_0.2.3_unscanned/pytree_checkpointer", "truncate"),
    ("paxml_runs/TinySpmdRepeat/checkpoints/checkpoint_00000000", "truncate")])
def test_damaged_jax_checkpoint_names_the_file(tmp_path, capsys, path, damage):
    root = copy_fixture(path, tmp_path, "copy")
    victim = max((p for p in root.rglob("*") if p.is_file() and not p.name.startswith(("_", "."))
                  and p.name not in {"manifest.ocdbt", "commit_success.txt", "checkpoint"}),
                 key=lambda p: p.stat().st_size)
    if damage == "delete":
        victim.unlink()
    else:
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    code, info = run_json(capsys, "inspect", str(root), "--json")
    assert code == 1 and info["complete"] is False
    named = victim.name if "ocdbt" in str(victim) else victim.parent.name
    assert any(named in problem for problem in info["problems"]), info["problems"]


LIKE_MODULE = '''
def compiled():
    import torch
    from dcp_tiny_model import TinyLM
    return torch.compile(TinyLM())


def scanned():
    import jax
    import numpy as np
    layers = {"mlp": {"wi_0": {"kernel": jax.ShapeDtypeStruct((32, 3, 64), np.float32)}}}
    return {"params": {"decoder": {"layers": layers}}}


def empty():
    return {}
'''


def test_plan_like_module_function(tmp_path, capsys, monkeypatch):
    (tmp_path / "my_models.py").write_text(LIKE_MODULE)  # beside the model's code, as a user's would be
    copy_fixture("torch_dcp_single/dcp_tiny_model.py", tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    code, info = run_json(capsys, "plan", str(FIXTURES / "torch_dcp_single/torch_save/model.pt"),
                          "--like", "my_models:compiled", "--json")
    assert code == 0 and info["complete"] and info["summary"].startswith("26 renamed")
    code, info = run_json(capsys, "plan", str(FIXTURES / "orbax_0.2.3_unscanned/pytree_checkpointer"),
                          "--like", "my_models:scanned", "--json", "--sep", "/")
    assert code == 1 and info["missing"] == [] and "params/decoder/decoder_norm/scale" in info["unexpected"]
    assert any("stack(axis=1)" in line and "layers/mlp/wi_0/kernel" in line for line in info["lines"])
    assert main(["plan", str(FIXTURES / "torch_dcp_single/torch_save/model.pt"), "--like", "my_models:empty"]) == 1
    assert main(["plan", str(FIXTURES / "torch_dcp_single/torch_save/model.pt"), "--like", "my_models:absent"]) == 1
    assert "module my_models has no function 'absent'" in capsys.readouterr().err


@pytest.mark.parametrize("step", ["checkpoint_00000000", "checkpoint_00000002"])
def test_inspect_json_on_paxml_fixture(capsys, step):
    """PaxML's manifest keys are ``<step>::<zarr folder name>``, the path joined with dots."""
    code, info = run_json(capsys, "inspect", str(FIXTURES / "paxml_runs/TinySpmdRepeat/checkpoints" / step), "--json")
    expected = {k.split("::", 1)[1]: v for k, v in expected_arrays("paxml_runs/TinySpmdRepeat").items()
                if k.startswith(step + "::")}
    found = {e["key"].replace("/", "."): e for e in info["entries"]}
    assert code == 0 and info["complete"] and set(found) == set(expected)
    for key, entry in found.items():
        assert [entry["shape"], entry["dtype"]] == [expected[key]["shape"], expected[key]["dtype"]], key


def test_plan_neox_pipeline_like_its_hf_conversion(capsys):
    """The GPT-NeoX <-> Hugging Face profile applies to `ckptshim plan` as it does to loads."""
    run = FIXTURES / "neox_deepspeed/pp1_mp1"
    code, info = run_json(capsys, "plan", str(run / "checkpoint"), "--like", str(run / "hf"), "--json")
    assert code == 0 and info["complete"]
    assert "sequential.6.final_linear.weight -> rename -> embed_out.weight" in info["lines"]
    assert info["summary"].startswith("28 renamed")


@pytest.mark.parametrize("model_dir", [
    "t5x_tiny_decoder/legacy_checkpointer", "paxml_runs/TinySpmdRepeat/checkpoints",
    "orbax_0.2.3_unscanned/checkpoint_manager"])
def test_two_folders_holding_one_step_are_refused(tmp_path, capsys, model_dir):
    """``checkpoint_1`` beside ``checkpoint_01``: which one is meant would be a guess."""
    root = copy_fixture(model_dir, tmp_path, "run")
    step = max((p for p in root.iterdir() if p.is_dir() and p.name[-1].isdigit()),
               key=lambda p: p.name)
    prefix, number = step.name.rstrip("0123456789"), step.name[len(step.name.rstrip("0123456789")):]
    shutil.copytree(step, root / f"{prefix}0{number}")
    assert main(["inspect", str(root)]) == 1
    assert f"both hold step {int(number)}" in capsys.readouterr().err
