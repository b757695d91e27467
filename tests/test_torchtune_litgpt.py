"""torchtune 0.6.1 and litgpt 0.5.13 checkpoints into Hugging Face's names, through the decoder
hub: each family one more naming onto the canonical model.

Against what each producer's own converter made of the same weights (tests/fixtures/torchtune_0.6.1
and tests/fixtures/litgpt_0.5.13 and litgpt_0.5.4, see their ``produce.py``): torchtune's ``tune_to_hf`` /
``qwen2_tune_to_hf``, each litgpt release's ``convert_lit_checkpoint``. Bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from ckptshim.cli import main
from support.fixtures import writable_copy
from support.markers import QUIET
from test_decoder_hub import assert_same, empty_like

pytestmark = QUIET

TORCHTUNE = Path(__file__).parent / "fixtures" / "torchtune_0.6.1"
LITGPT = Path(__file__).parent / "fixtures" / "litgpt_0.5.13"


def hf_model(folder: Path) -> torch.nn.Module:
    """The transformers model a folder's ``config.json`` describes, with its own random values."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)).to(torch.bfloat16)


def tune(family: str) -> dict[str, torch.Tensor]:
    return torch.load(TORCHTUNE / family / "torchtune" / "epoch_0" / "model-00001-of-00001.bin", weights_only=True)


def tune_to_hf(family: str) -> dict[str, torch.Tensor]:
    """What torchtune's own converter made of the weights."""
    return load_file(TORCHTUNE / family / "expected_hf.safetensors")


# -- torchtune -------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama3", "qwen2"])
def test_load_state_dict_of_a_torchtune_checkpoint(family):
    """``LlamaForCausalLM``/``Qwen2ForCausalLM``'s ``load_state_dict(torch.load(bin))``: Llama's
    q/k permuted per head as ``tune_to_hf`` does, Qwen2's (and its biases) renamed only."""
    model = hf_model(TORCHTUNE / family / "torchtune" / "epoch_0")
    model.load_state_dict(tune(family))
    assert_same(model.state_dict(), tune_to_hf(family))


def test_qwen2_is_not_permuted_as_llama():
    """The Qwen2 load renames q/k; Llama's permutation, which the Llama load applies, would have
    moved them (the check can fail: the rows differ from their permuted selves)."""
    model = hf_model(TORCHTUNE / "qwen2" / "torchtune" / "epoch_0")
    model.load_state_dict(tune("qwen2"))
    q = tune("qwen2")["layers.0.attn.q_proj.weight"]
    loaded = model.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(loaded, q)
    permuted = q.view(8, 4, 2, -1).transpose(1, 2).reshape(q.shape)
    assert not torch.equal(loaded, permuted)


def test_without_a_family_the_query_rows_are_not_guessed():
    """A torchtune state dict into a model with no config (no family): the load is torch's, which
    refuses the names; the hint says why ckptshim did not map them."""
    from ckptshim.inventory import Entry, Inventory, split_key
    from ckptshim.planner import plan as make_plan
    from ckptshim.rules.context import LoadContext
    from ckptshim.rules.profiles import rules_for

    def inventory(state_dict):
        return Inventory([Entry(split_key(k), tuple(v.shape), "bfloat16") for k, v in state_dict.items()])

    source, target = inventory(tune("llama3")), inventory(tune_to_hf("llama3"))
    config = {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8}
    plan = make_plan(source, target, rules_for(LoadContext(source, target, "torch", target_config=config)))
    assert not plan.complete
    assert "model_type" in plan.hints[split_key("model.layers.0.self_attn.q_proj.weight")]
    assert split_key("model.layers.0.self_attn.v_proj.weight") not in plan.missing


@pytest.mark.parametrize("family", ["llama3", "qwen2"])
def test_dcp_load_of_a_torchtune_folder(family):
    """``dcp.load`` of the ``epoch_0`` folder: its ``.bin`` read as a torch.save file, its
    ``config.json`` naming the family (and the head counts)."""
    folder = TORCHTUNE / family / "torchtune" / "epoch_0"
    state_dict = hf_model(folder).state_dict()
    dcp.load(state_dict, checkpoint_id=folder)
    assert_same(state_dict, tune_to_hf(family))


def test_dcp_load_of_a_torchtune_meta_folder():
    """``FullModelMetaCheckpointer``'s folder: Meta's names, read through the same folder format."""
    folder = TORCHTUNE / "llama3" / "meta" / "epoch_0"
    state_dict = hf_model(folder).state_dict()
    dcp.load(state_dict, checkpoint_id=folder)
    assert_same(state_dict, tune_to_hf("llama3"))


@pytest.mark.parametrize("family", ["llama3", "qwen2"])
def test_a_hugging_face_folder_into_torchtune_names(family, tmp_path):
    """The way back (``hf_to_tune``): a Hugging Face folder of the converted weights into
    torchtune's names."""
    model = hf_model(TORCHTUNE / family / "torchtune" / "epoch_0")
    model.load_state_dict(tune_to_hf(family))
    model.save_pretrained(tmp_path / "hf")
    state_dict = empty_like(tune(family))
    dcp.load(state_dict, checkpoint_id=tmp_path / "hf")
    assert_same(state_dict, tune(family))


def model_of_other_family(family: str) -> torch.nn.Module:
    """The transformers model of the *other* family, of the fixture's dimensions: a
    ``LlamaForCausalLM`` built with ``attention_bias=True`` (q/k/v slots for a Qwen2's biases) for
    the Qwen2 checkpoint, a ``Qwen2ForCausalLM`` for the Llama one."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = json.loads((TORCHTUNE / family / "torchtune" / "epoch_0" / "config.json").read_text())
    dims = {key: config[key] for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                         "num_attention_heads", "num_key_value_heads", "head_dim",
                                         "tie_word_embeddings")}
    other = AutoConfig.for_model("llama", attention_bias=True, **dims) if family == "qwen2" else \
        AutoConfig.for_model("qwen2", **dims)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(other).to(torch.bfloat16)


QUERY_AND_KEY = ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight")


@pytest.mark.parametrize("family", ["qwen2", "llama3"])
def test_a_family_the_biases_contradict_is_not_taken_from_the_target(family):
    """A torchtune state dict with no config beside it, into a model of the other family: the
    target's family would decide the rotary layout (a Qwen2's q/k permuted as a Llama's, or a
    Llama's left unpermuted), and the checkpoint's own q/k/v biases say it is not of that family.

    - strict: torch's own error, the hint on it saying to put the producer's config.json beside
      the weights, the target untouched;
    - non-strict: the query and key rows are not loaded (torch lists them missing), where before
      they were written permuted the wrong way, without an error.
    """
    model = model_of_other_family(family)
    before = {key: value.clone() for key, value in model.state_dict().items()}
    with pytest.raises(RuntimeError, match="Error\\(s\\) in loading state_dict") as error:
        model.load_state_dict(tune(family))
    said = "".join(error.value.__notes__)
    assert "q/k/v biases" in said and "config.json" in said and "self_attn.q_proj.weight" in said
    assert all(torch.equal(before[key], value) for key, value in model.state_dict().items())
    result = model.load_state_dict(tune(family), strict=False)
    assert set(QUERY_AND_KEY) <= set(result.missing_keys)
    assert all(torch.equal(model.state_dict()[key], before[key]) for key in QUERY_AND_KEY)


def test_dcp_load_of_a_torchtune_file_without_its_config_into_a_biased_llama(tmp_path):
    """``dcp.load`` of the Qwen2 ``.bin`` alone (no config.json beside it) into a
    ``LlamaForCausalLM`` with q/k/v biases: refused with the hint, the target untouched."""
    bin_file = writable_copy(TORCHTUNE / "qwen2" / "torchtune" / "epoch_0" / "model-00001-of-00001.bin",
                             tmp_path / "model-00001-of-00001.bin")
    state_dict = model_of_other_family("qwen2").state_dict()
    before = {key: value.clone() for key, value in state_dict.items()}
    with pytest.raises(BaseException) as error:
        dcp.load(state_dict, checkpoint_id=bin_file)
    said = str(error.value) + "".join(getattr(error.value, "__notes__", []))
    assert "config.json" in said and "self_attn.q_proj.weight" in said
    assert all(torch.equal(before[key], value) for key, value in state_dict.items())


# -- litgpt ----------------------------------------------------------------------------------------

#: Each release's fixture (its ``produce.py``): litgpt 0.5.13's ``attn.qkv`` (``[all q; all k; all
#: v]``), and 0.5.4's ``attn.attn`` (by query group, lit-gpt's layout until litgpt 0.5.5).
LITGPT_LAYOUTS = ["0.5.13", "0.5.4"]


def lit_file(release: str = "0.5.13") -> Path:
    return Path(__file__).parent / "fixtures" / f"litgpt_{release}" / "final" / "lit_model.pth"


def lit(release: str = "0.5.13") -> dict[str, torch.Tensor]:
    return torch.load(lit_file(release), weights_only=True)["model"]


def lit_to_hf(release: str = "0.5.13") -> dict[str, torch.Tensor]:
    """What that release's own ``convert_lit_checkpoint`` made of the weights (0.5.4's file
    re-stored as safetensors by its producer: its pickler is not ``weights_only``-loadable)."""
    if release == "0.5.4":
        return load_file(lit_file(release).parent.parent / "expected_hf.safetensors")
    return torch.load(LITGPT / "expected_hf" / "model.pth", weights_only=True)


def lit_llama(**heads) -> torch.nn.Module:
    """``LlamaForCausalLM`` of the litgpt model's dimensions (``model_config.yaml``'s)."""
    from transformers import AutoConfig, LlamaForCausalLM

    dims = {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8, **heads}
    config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=48, num_hidden_layers=2, vocab_size=37,
                                  tie_word_embeddings=False, **dims)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(torch.bfloat16)


def test_the_two_litgpt_layouts_are_the_two_fixtures():
    """0.5.13 stores ``attn.qkv``, 0.5.4 ``attn.attn``, and 0.5.4's rows are by query group: its
    converter's q rows are not the first 64 rows (so a load that cut it as ``[all q; all k; all
    v]`` would fail the tests below)."""
    assert "transformer.h.0.attn.qkv.weight" in lit() and "transformer.h.0.attn.attn.weight" not in lit()
    legacy = lit("0.5.4")["transformer.h.0.attn.attn.weight"]
    assert "transformer.h.0.attn.qkv.weight" not in lit("0.5.4")
    assert not torch.equal(legacy[:64], lit_to_hf("0.5.4")["model.layers.0.self_attn.q_proj.weight"])


@pytest.mark.parametrize("release", LITGPT_LAYOUTS)
def test_load_state_dict_of_a_litgpt_checkpoint_into_llama(release):
    """``load_state_dict(torch.load("lit_model.pth")["model"])``: ``attn.qkv`` cut into q, k, v by
    their sizes; ``attn.attn`` group by group, with the model's own head counts."""
    model = lit_llama()
    model.load_state_dict(lit(release))
    assert_same(model.state_dict(), lit_to_hf(release))


@pytest.mark.parametrize("release", LITGPT_LAYOUTS)
def test_dcp_load_of_a_litgpt_file_into_llama(release):
    """``dcp.load`` of ``lit_model.pth``: the ``{"model": ...}`` root, and the heads of the
    ``model_config.yaml`` beside it."""
    state_dict = lit_llama().state_dict()
    dcp.load(state_dict, checkpoint_id=lit_file(release))
    assert_same(state_dict, lit_to_hf(release))


@pytest.mark.parametrize("release", LITGPT_LAYOUTS)
def test_a_litgpt_near_miss_is_refused_naming_both_head_counts(release, tmp_path, capsys):
    """``convert --like`` a folder of 4 heads of 16 in 1 group: the same shapes as litgpt's 8 heads
    of 8 in 2 groups (model_config.yaml), which would load without an error and compute garbage."""
    lit_llama(num_attention_heads=4, num_key_value_heads=1, head_dim=16).save_pretrained(tmp_path / "like")
    assert main(["convert", str(lit_file(release)), str(tmp_path / "out.safetensors"), "--to",
                 "safetensors", "--like", str(tmp_path / "like")]) != 0
    said = capsys.readouterr().err
    assert "8 heads (n_head) in 2 key/value groups (n_query_groups), head_dim 8" in said
    assert "4 heads (num_attention_heads) in 1 key/value groups (num_key_value_heads), head_dim 16" in said
    assert not (tmp_path / "out.safetensors").exists()


@pytest.mark.parametrize("release", LITGPT_LAYOUTS)
def test_a_hugging_face_folder_into_litgpt_names(release, tmp_path):
    """The way back (litgpt's ``convert_hf_checkpoint``): q, k and v joined into ``attn.qkv``, or
    into ``attn.attn`` group by group."""
    model = lit_llama()
    model.load_state_dict(lit_to_hf(release))
    model.save_pretrained(tmp_path / "hf")
    state_dict = empty_like(lit(release))
    dcp.load(state_dict, checkpoint_id=tmp_path / "hf")
    assert_same(state_dict, lit(release))


@pytest.mark.parametrize("release", LITGPT_LAYOUTS)
def test_convert_a_litgpt_file_like_a_hugging_face_folder(release, tmp_path):
    lit_llama().save_pretrained(tmp_path / "like")
    out = tmp_path / "model.safetensors"
    assert main(["convert", str(lit_file(release)), str(out), "--to", "safetensors", "--like",
                 str(tmp_path / "like")]) == 0
    assert_same(load_file(out), lit_to_hf(release))


PRETRAIN = LITGPT / "pretrain"


def pretrain_to_hf() -> dict[str, torch.Tensor]:
    """What 0.5.13's ``convert_lit_checkpoint`` made of the ``litgpt pretrain`` file (its model)."""
    return torch.load(PRETRAIN / "expected_hf" / "model.pth", weights_only=True)


def test_a_litgpt_pretrain_file_holds_training_state_beside_the_model():
    """What ``litgpt pretrain`` saved (``produce_pretrain.py``): the model beside AdamW's state, the
    data loader's position and the counters, as ``litgpt.pretrain.save_checkpoint`` saves them."""
    saved = torch.load(PRETRAIN / "final" / "lit_model.pth", weights_only=True)
    assert set(saved) == {"model", "optimizer", "train_dataloader", "iter_num", "step_count"}
    assert saved["iter_num"] == 4 and saved["step_count"] == 2
    assert "exp_avg" in saved["optimizer"]["state"][0]


def test_load_state_dict_of_a_litgpt_pretrain_model_entry():
    model = lit_llama()
    model.load_state_dict(torch.load(PRETRAIN / "final" / "lit_model.pth", weights_only=True)["model"])
    assert_same(model.state_dict(), pretrain_to_hf())


def test_dcp_load_of_a_litgpt_pretrain_file_loads_its_model_entry(caplog):
    """``dcp.load`` of the file: its ``model`` entry, the optimizer's state set aside, which the
    load's summary says."""
    state_dict = lit_llama().state_dict()
    with caplog.at_level("INFO", logger="ckptshim"):
        dcp.load(state_dict, checkpoint_id=PRETRAIN / "final" / "lit_model.pth")
    assert_same(state_dict, pretrain_to_hf())
    assert "'optimizer' set aside: an optimizer's state, not weights" in caplog.text


def test_convert_a_litgpt_pretrain_file_like_a_hugging_face_folder(tmp_path, capsys):
    """``convert --like``: the model entry alone, bit for bit; the dry run says the optimizer's
    state is set aside and plans none of it."""
    lit_llama().save_pretrained(tmp_path / "like")
    source = str(PRETRAIN / "final" / "lit_model.pth")
    assert main(["plan", source, "--like", str(tmp_path / "like")]) == 0
    said = capsys.readouterr().out
    assert "'optimizer' set aside: an optimizer's state, not weights" in said
    assert "optimizer.state" not in said
    out = tmp_path / "model.safetensors"
    assert main(["convert", source, str(out), "--to", "safetensors", "--like", str(tmp_path / "like")]) == 0
    converted = load_file(out)
    assert set(converted) == set(pretrain_to_hf())
    assert_same(converted, pretrain_to_hf())


def test_attn_attn_is_not_renamed_to_attn_qkv(tmp_path):
    """0.5.4's ``attn.attn`` into a state dict of 0.5.13's names: one array, fused two ways (by
    query group, ``[all q; all k; all v]``), is no rename; without a plan that regroups it, the
    load is DCP's own refusal, the state dict untouched. (litgpt's own ``GPT`` regroups it on
    ``load_state_dict``: ckptshim leaves that load to it.)"""
    state_dict = empty_like(lit())
    with pytest.raises(BaseException) as error:
        dcp.load(state_dict, checkpoint_id=lit_file("0.5.4"))
    assert "attn.qkv.weight" in str(error.value) + "".join(getattr(error.value, "__notes__", []))
    assert all(not value.any() for value in state_dict.values())


@pytest.mark.parametrize("family", ["llama3", "qwen2"])
def test_convert_a_torchtune_folder_like_a_hugging_face_folder(family, tmp_path):
    hf_model(TORCHTUNE / family / "torchtune" / "epoch_0").save_pretrained(tmp_path / "like")
    out = tmp_path / "model.safetensors"
    assert main(["convert", str(TORCHTUNE / family / "torchtune" / "epoch_0"), str(out), "--to", "safetensors",
                 "--like", str(tmp_path / "like")]) == 0
    assert_same(load_file(out), tune_to_hf(family))


def test_a_torchtune_folder_missing_a_file_is_incomplete(tmp_path, capsys):
    """A two-file save with its second file gone: ``inspect`` names it, and a load refuses the
    folder, leaving the target untouched."""
    folder = writable_copy(TORCHTUNE / "llama3" / "torchtune" / "epoch_0", tmp_path / "epoch_0")
    (folder / "model-00001-of-00001.bin").rename(folder / "model-00001-of-00002.bin")
    main(["inspect", str(folder)])
    assert "model-00002-of-00002.bin: missing" in capsys.readouterr().out
    model = hf_model(folder)
    before = {key: value.clone() for key, value in model.state_dict().items()}
    with pytest.raises(BaseException, match=r"model-00002-of-00002\.bin"):
        dcp.load(model.state_dict(), checkpoint_id=folder)
    assert all(torch.equal(before[key], value) for key, value in model.state_dict().items())


def test_a_torchtune_folder_of_another_family_is_not_permuted_on_a_guess(tmp_path):
    """Its config.json names a family ckptshim has no rotary convention for: the query and key rows
    are not mapped, the load refused with the hint, and the target left untouched."""
    folder = writable_copy(TORCHTUNE / "llama3" / "torchtune" / "epoch_0", tmp_path / "epoch_0")
    config = json.loads((folder / "config.json").read_text())
    model = hf_model(folder)
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "gemma"}))
    before = {key: value.clone() for key, value in model.state_dict().items()}
    with pytest.raises(BaseException) as error:
        dcp.load(model.state_dict(), checkpoint_id=folder)
    said = str(error.value) + "".join(getattr(error.value, "__notes__", []))
    assert "model_type" in said and "self_attn.q_proj.weight" in said
    assert all(torch.equal(before[key], value) for key, value in model.state_dict().items())
