"""Hugging Face Llama-3 and Qwen3 folders straight into torchtitan-shaped models, and back.

The fixtures (tests/fixtures/hf_to_torchtitan, see its ``produce.py``) are tiny folders written by
transformers 5.23's ``save_pretrained`` (bfloat16), and what torchtitan 0.3.0's own
``convert_from_hf.py`` made of each (DCP, float32, torchtitan's names, Llama's wq/wk permuted per
head). The torchtitan models are built from their recorded state-dict layouts
(tests/support/titan.py). Every load is compared bit for bit with the converter's output.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

from ckptshim.inventory import Entry, Inventory, split_key
from ckptshim.rules.profiles import torchtitan as profile
from support.fixtures import FIXTURES, array_sha256, expected_arrays, writable_copy
from support.markers import QUIET
from support.native import diagnosis, natively, raised, same_error
from support.processes import environment, worker
from support.titan import FIXTURE, MODELS, converted, model

pytestmark = QUIET


def hf(name: str) -> dict[str, torch.Tensor]:
    return load_file(FIXTURE / name / "hf" / "model.safetensors")


def fingerprint(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {key: value.clone() for key, value in module.state_dict().items()}


def assert_converted(module: torch.nn.Module, name: str) -> None:
    """The module holds exactly what torchtitan's converter wrote."""
    expected, actual = converted(name), module.state_dict()
    assert actual.keys() == expected.keys()
    different = [key for key, value in expected.items() if not torch.equal(actual[key], value)]
    assert not different, different


def assert_untouched(module: torch.nn.Module, before: dict[str, torch.Tensor]) -> None:
    assert all(torch.equal(before[key], value) for key, value in module.state_dict().items())


def with_config(tmp_path, name: str, **changes) -> object:
    """A copy of the model's Hugging Face folder with its config.json changed (``None``: removed)."""
    folder = writable_copy(FIXTURE / name / "hf", tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_fixture_files_hold_what_the_manifest_lists():
    expected = expected_arrays("hf_to_torchtitan")
    for name in MODELS:
        for kind, tensors in (("hf", hf(name)), ("dcp", converted(name))):
            for key, tensor in tensors.items():
                bits = tensor.view(torch.uint16) if tensor.dtype == torch.bfloat16 else tensor
                assert array_sha256(bits.numpy()) == expected[f"{name}/{kind}/{key}"]["sha256"], (name, kind, key)
            assert len(tensors) == sum(key.startswith(f"{name}/{kind}/") for key in expected)
    assert all(t.dtype == torch.bfloat16 for t in hf("llama3").values())
    assert "lm_head.weight" not in hf("qwen3") and "lm_head.weight" in converted("qwen3")


# -- into torchtitan -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_dcp_load_of_the_folder_equals_convert_from_hf(name, caplog):
    """``dcp.load(torchtitan_model.state_dict(), checkpoint_id=hf_dir)``: torchtitan's names, bf16
    into fp32, Llama's wq/wk permuted per head with the heads of the folder's config.json."""
    caplog.set_level(logging.INFO, logger="ckptshim")
    titan = model(name)
    dcp.load(titan.state_dict(), checkpoint_id=FIXTURE / name / "hf")
    assert_converted(titan, name)
    summary = caplog.text
    assert "cast (bfloat16 -> float32)" in summary
    if name == "llama3":
        assert "4 reordered (axis 0 as 2x2x8, perm 0,2,1; axis 0 as 4x2x8, perm 0,2,1)" in summary
    else:
        assert "reordered" not in summary and "1 tied (lm_head.weight = tok_embeddings.weight)" in summary
        assert titan.lm_head.weight is titan.tok_embeddings.weight


def test_set_model_state_dict_of_qwen3_equals_convert_from_hf():
    """Qwen3's rows are renames only, so the state dict alone suffices (no config.json)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    titan = model("qwen3")
    set_model_state_dict(titan, hf("qwen3"))
    assert_converted(titan, "qwen3")


def test_set_model_state_dict_of_llama_without_a_config_is_torchs_own_error():
    """A state dict carries no head count: ckptshim has no plan for Llama's wq/wk, so torch's own
    call refuses the load, and ckptshim's note names them and the config.json that would tell."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    titan, native_titan = model("llama3"), model("llama3")
    assert_untouched(native_titan, fingerprint(titan))
    error = same_error(raised(lambda: set_model_state_dict(titan, hf("llama3"))),
                       raised(lambda: natively(lambda: set_model_state_dict(native_titan, hf("llama3")))))
    assert ("  layers.{0..1}.attention.qkv_linear.wq.weight (torchtitan's Llama takes "
            "model.layers.{0..1}.self_attn.q_proj.weight permuted per head") in diagnosis(error)
    assert "config.json" in diagnosis(error)
    assert_untouched(titan, fingerprint(native_titan))  # what torch's own call leaves


def inv_freq(name: str) -> torch.Tensor:
    """``rotary_emb.inv_freq`` as transformers before 4.35 saved it (default rotary embedding)."""
    config = json.loads((FIXTURE / name / "hf" / "config.json").read_text())
    dim = config["head_dim"]
    return 1.0 / (config["rope_parameters"]["rope_theta"] ** (torch.arange(0, dim, 2).float() / dim))


def test_an_old_checkpoints_inv_freq_is_left_unread_by_dcp_load(tmp_path):
    """torchtitan's map skips ``rotary_emb.inv_freq``; DCP reads only what the state dict asks for,
    so a checkpoint of transformers before 4.35 that holds it loads, the buffer unread."""
    folder = writable_copy(FIXTURE / "qwen3" / "hf", tmp_path / "hf")
    tensors = hf("qwen3")
    tensors.update({f"model.layers.{i}.self_attn.rotary_emb.inv_freq": inv_freq("qwen3") for i in range(2)})
    save_file(tensors, folder / "model.safetensors")
    titan = model("qwen3")
    dcp.load(titan.state_dict(), checkpoint_id=folder)
    assert_converted(titan, "qwen3")


def test_inv_freq_is_not_dropped_on_its_name_by_a_strict_set_model_state_dict():
    """A torchtitan model has no ``inv_freq`` buffer to check the checkpoint's copy against, so a
    strict ``set_model_state_dict`` names it as unexpected rather than drop an unchecked value."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    titan = model("qwen3")
    before = fingerprint(titan)
    tensors = {**hf("qwen3"), "model.layers.0.self_attn.rotary_emb.inv_freq": inv_freq("qwen3")}
    with pytest.raises(BaseException, match=r"rotary_emb\.inv_freq"):
        set_model_state_dict(titan, tensors)
    assert_untouched(titan, before)


def test_fsdp2_two_ranks_each_read_their_own_rows(tmp_path):
    """Two gloo ranks shard the torchtitan model with ``fully_shard``; ``dcp.load`` of the Hugging
    Face folder gives each rank exactly its rows of the converter's output and reads about half of
    the file (``rchar``); ``set_model_state_dict`` of the full Qwen3 state dict, and ``dcp.load`` into
    tensor-parallel shards (rows or columns) too."""
    for name in MODELS:
        folder = writable_copy(FIXTURE / name / "hf", tmp_path / name)
        out = tmp_path / f"{name}-out"
        out.mkdir()
        env = {k: v for k, v in environment().items() if not k.startswith("CKPTSHIM_")}
        run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                              worker("titan_worker.py"), name, str(folder), str(out)],
                             capture_output=True, text=True, timeout=300, env=env, check=False)
        assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
        size = (folder / "model.safetensors").stat().st_size
        for rank in (0, 1):
            result = json.loads((out / f"rank{rank}.json").read_text())
            assert result["dcp_load"] == result["tp_dcp_load"] == result.get("set_model_state_dict", "ok") == "ok", result
            # its shards are float32, the file bfloat16: half their bytes is what it must read
            assert result["shard_bytes"] // 2 <= result["read_bytes"] <= 0.6 * size, (name, result, size)


# -- refusals --------------------------------------------------------------------------------------


def test_a_llama_folder_without_config_is_refused(tmp_path):
    folder = writable_copy(FIXTURE / "llama3" / "hf", tmp_path / "hf")
    (folder / "config.json").unlink()
    titan = model("llama3")
    before = fingerprint(titan)
    with pytest.raises(BaseException, match=r"qkv_linear\.wq\.weight") as error:
        dcp.load(titan.state_dict(), checkpoint_id=folder)
    assert "config.json" in str(error.value) and "permuted per head" in str(error.value)
    assert_untouched(titan, before)


def test_a_config_without_head_dim_takes_transformers_default(tmp_path):
    """No ``head_dim`` (older configs): hidden_size / num_attention_heads, as transformers takes it."""
    titan = model("llama3")
    dcp.load(titan.state_dict(), checkpoint_id=with_config(tmp_path, "llama3", head_dim=None))
    assert_converted(titan, "llama3")


@pytest.mark.parametrize("changes", [{"num_attention_heads": 3}, {"num_key_value_heads": 3},
                                     {"head_dim": 12}, {"num_attention_heads": "four"}])
def test_heads_that_do_not_divide_the_rows_are_refused(tmp_path, changes):
    titan = model("llama3")
    before = fingerprint(titan)
    with pytest.raises(BaseException, match=r"config\.json") as error:
        dcp.load(titan.state_dict(), checkpoint_id=with_config(tmp_path, "llama3", **changes))
    assert next(iter(changes)) in str(error.value)
    assert_untouched(titan, before)


@pytest.mark.parametrize(("name", "model_type", "says"), [("llama3", "mistral", "llama and qwen3 only"),
                                                          ("llama3", "qwen3", "Llama's"),
                                                          ("qwen3", "llama", "Qwen3's")])
def test_a_config_of_another_model_is_refused(tmp_path, name, model_type, says):
    titan = model(name)
    with pytest.raises(BaseException, match=says):
        dcp.load(titan.state_dict(), checkpoint_id=with_config(tmp_path, name, model_type=model_type))


def test_a_key_set_that_is_neither_is_refused_by_name():
    """A GPT-NeoX folder is no Llama: nothing fits torchtitan's keys, each missing one is named."""
    titan = model("llama3")
    before = fingerprint(titan)
    with pytest.raises(BaseException, match=r"layers\.\{0\.\.1\}\.attention\.qkv_linear\.wq\.weight \(nearest"):
        dcp.load(titan.state_dict(), checkpoint_id=FIXTURES / "hf_gptneox_tf5_resaved" / "save_pretrained_default")
    assert_untouched(titan, before)


def test_the_profile_fires_only_when_the_key_sets_prove_it():
    """One side all Hugging Face, the other all torchtitan; a side with both spellings, or a pair
    that shares one (``lm_head.weight`` only), is left to the name matcher."""
    def inventory(*keys):
        return Inventory([Entry(split_key(key), (4, 4), "float32") for key in keys])

    hf_side = inventory("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "lm_head.weight")
    tt_side = inventory("tok_embeddings.weight", "layers.0.attention.qkv_linear.wq.weight", "lm_head.weight")
    both = inventory("model.embed_tokens.weight", "tok_embeddings.weight")
    assert profile.applies(hf_side, tt_side) and profile.applies(tt_side, hf_side)
    assert not profile.applies(both, tt_side) and not profile.applies(hf_side, both)
    assert not profile.applies(hf_side, hf_side) and not profile.applies(inventory("lm_head.weight"), tt_side)


# -- back to Hugging Face --------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_convert_back_gives_the_original_logits(tmp_path, name):
    """``ckptshim convert --to safetensors --like <hf_dir>`` of torchtitan's DCP checkpoint: the
    original arrays (in the float32 torchtitan stored), and ``from_pretrained`` computes the
    original's logits exactly."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "back"
    folder.mkdir()
    (folder / "config.json").write_bytes((FIXTURE / name / "hf" / "config.json").read_bytes())
    run = subprocess.run([sys.executable, "-m", "ckptshim", "convert", str(FIXTURE / name / "dcp"),
                          str(folder / "model.safetensors"), "--to", "safetensors", "--like", str(FIXTURE / name / "hf")],
                         capture_output=True, text=True, env=environment(), timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-4000:]
    back, original = load_file(folder / "model.safetensors"), hf(name)
    assert back.keys() == original.keys()
    assert all(back[key].dtype == torch.float32 and torch.equal(back[key], original[key].float()) for key in original)
    ids = torch.arange(12).reshape(1, 12) * 5 % 128
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(FIXTURE / name / "hf").eval()(ids).logits
        actual = AutoModelForCausalLM.from_pretrained(folder).eval()(ids).logits
    assert actual.dtype == torch.bfloat16 and torch.equal(actual, expected)


@pytest.mark.parametrize("name", MODELS)
def test_dcp_load_of_torchtitan_checkpoint_into_hugging_face_names(tmp_path, name):
    """The other way through ``dcp.load``: torchtitan's DCP checkpoint (with the Hugging Face
    config.json beside it) into a transformers model's state dict."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = writable_copy(FIXTURE / name / "dcp", tmp_path / "dcp")
    (folder / "config.json").write_bytes((FIXTURE / name / "hf" / "config.json").read_bytes())
    torch.manual_seed(1234)
    transformers_model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(FIXTURE / name / "hf"))
    state = transformers_model.state_dict()
    dcp.load(state, checkpoint_id=folder)
    original = hf(name)
    assert all(torch.equal(state[key], value) for key, value in original.items())


def test_chunks_written_through_a_stream_extension_are_reordered_too(tmp_path):
    """torchtitan's checkpoint saved again through DCP's ``ZStandard`` extension: torch's own
    reader reads those chunks, into a buffer of the stored block's shape (it requires one), and
    ckptshim's per-head reorder copies it in."""
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint._extension import ZStandard
    from transformers import AutoConfig, AutoModelForCausalLM

    stored = natively(lambda: FileSystemReader(FIXTURE / "llama3" / "dcp").read_metadata()).state_dict_metadata
    titan = {key: torch.zeros(md.size, dtype=md.properties.dtype) for key, md in stored.items() if hasattr(md, "size")}
    natively(lambda: dcp.load(titan, checkpoint_id=FIXTURE / "llama3" / "dcp"))
    folder = tmp_path / "zstd"
    natively(lambda: dcp.save(titan, storage_writer=FileSystemWriter(folder, _extensions=[ZStandard()])))
    (folder / "config.json").write_bytes((FIXTURE / "llama3" / "hf" / "config.json").read_bytes())
    state = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(FIXTURE / "llama3" / "hf")).state_dict()
    dcp.load(state, checkpoint_id=folder)
    assert all(torch.equal(state[key], value) for key, value in hf("llama3").items())


def test_plan_cli_names_the_per_head_permutation(capsys):
    from ckptshim import cli

    code = cli.main(["plan", str(FIXTURE / "llama3" / "hf"), "--like", str(FIXTURE / "llama3" / "dcp")])
    shown = capsys.readouterr()
    assert code == 0, shown.err
    assert ("model.layers.{0..1}.self_attn.q_proj.weight -> reorder(axis 0 as 4x2x8, perm 0,2,1) -> "
            "layers.{0..1}.attention.qkv_linear.wq.weight") in shown.out


def test_a_converted_copy_saved_by_safetensors_loads_too(tmp_path):
    """A single safetensors file beside its config.json (not a model folder): the same load."""
    folder = tmp_path / "single"
    folder.mkdir()
    save_file(hf("llama3"), folder / "model.safetensors")
    (folder / "config.json").write_bytes((FIXTURE / "llama3" / "hf" / "config.json").read_bytes())
    titan = model("llama3")
    dcp.load(titan.state_dict(), checkpoint_id=folder / "model.safetensors")
    assert_converted(titan, "llama3")
