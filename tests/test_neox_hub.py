"""GPT-NeoX on the decoder hub: its pipeline names, Hugging Face's GPT-NeoX names and NeoX's
older MLP names are three namings of one canonical model, a load between two of them composed
through it; a load between GPT-NeoX and a Llama-shaped model is refused, naming the weights one
side has and the other lacks; the head counts come from each side's metadata (the pipeline
checkpoint's saved args, ``config.json``), and a near miss is refused naming both.

The loads themselves (logits against NeoX's own and transformers' forward passes, DeepSpeed's
real ``load_state_dir``) are ``tests/test_neox.py``'s.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckptshim.cli import main
from ckptshim.formats.detect import open_checkpoint
from ckptshim.inventory import Entry, Inventory, split_key
from ckptshim.planner import plan as make_plan
from ckptshim.rules.context import LoadContext
from ckptshim.rules.profiles import neox, rules_for
from support.fixtures import FIXTURES, copy_fixture

NEOX = FIXTURES / "neox_deepspeed"
HF5 = FIXTURES / "hf_gptneox_tf5_resaved" / "save_pretrained_default"
LAYERS = 2


def run_json(capsys, *argv: str) -> tuple[int, dict]:
    capsys.readouterr()
    code = main(list(argv))
    return code, json.loads(capsys.readouterr().out)


def test_plan_shows_the_hub_composition(capsys):
    """``ckptshim plan`` of an older NeoX checkpoint like its Hugging Face conversion: one rename
    per tensor, composed through the canonical model, the pair named."""
    run = NEOX / "old_pp1_mp1"
    code, info = run_json(capsys, "plan", str(run / "checkpoint"), "--like", str(run / "hf"), "--json")
    assert code == 0 and info["complete"]
    assert info["summary"].startswith("28 renamed")
    assert info["summary"].endswith("GPT-NeoX (mlp.dense_h_to_4h) -> Hugging Face GPT-NeoX names")
    assert ("sequential.{2..3}.mlp.dense_h_to_4h.weight -> rename -> gpt_neox.layers.{0..1}.mlp.dense_h_to_4h.weight"
            in info["lines"])
    assert "sequential.5.norm.bias -> rename -> gpt_neox.final_layer_norm.bias" in info["lines"]


def test_older_neox_names_into_todays_rename_only_the_mlp(capsys):
    """NeoX before 2024 into today's: the MLP's names differ, every other key is the same."""
    code, info = run_json(capsys, "plan", str(NEOX / "old_pp1_mp1" / "checkpoint"), "--like",
                          str(NEOX / "pp1_mp1" / "checkpoint"), "--json")
    assert code == 0 and info["complete"]
    assert info["summary"].startswith("8 renamed"), info["summary"]
    assert "sequential.{2..3}.mlp.dense_h_to_4h.bias -> rename -> sequential.{2..3}.mlp.linear1.bias" in info["lines"]


def test_a_near_miss_is_refused_naming_both_head_counts(tmp_path, capsys):
    """The pipeline checkpoint's args say 4 heads; a Hugging Face folder of the same shapes whose
    config.json says 8 would take the per-head interleaved query_key_value as other heads."""
    like = copy_fixture("neox_deepspeed/pp1_mp1/hf", tmp_path, "hf")
    config = json.loads((like / "config.json").read_text())
    (like / "config.json").write_text(json.dumps({**config, "num_attention_heads": 8}))
    capsys.readouterr()
    assert main(["plan", str(NEOX / "pp1_mp1" / "checkpoint"), "--like", str(like)]) != 0
    error = capsys.readouterr().err
    assert "says 4 heads (num_attention_heads)" in error, error
    assert "says 8 heads (num_attention_heads)" in error, error


def test_gpt_neox_weights_into_a_llama_are_refused_naming_the_slots():
    """A GPT-NeoX (LayerNorm with biases, biased linears, an ungated MLP) into
    ``LlamaForCausalLM`` of the same sizes: its up/down projections fit by name and shape, and
    loading them would leave the gate at its random values and drop every bias."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=256,
                                         num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError) as error:  # torch's own error, what ckptshim knows added to it
        model.load_state_dict(load_file(HF5 / "model.safetensors"))
    text = str(error.value) + "\n".join(getattr(error.value, "__notes__", []))
    assert ("model.layers.{0..1}.mlp.gate_proj.weight (the target (Hugging Face) has a gated MLP (gate, up, down), "
            "which the checkpoint (Hugging Face GPT-NeoX) lacks") in text, text
    assert ("model.layers.{0..1}.input_layernorm.weight (the checkpoint (Hugging Face GPT-NeoX) has LayerNorm (with a "
            "bias) before the attention (gpt_neox.layers.0.input_layernorm.bias), which the target") in text, text
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_llama_into_neox_pipeline_names_is_refused_naming_the_slots():
    """The other way: each NeoX key that says so names what the Llama has and NeoX lacks, or the
    other way round; nothing is composed, and the plan is incomplete."""
    llama = open_checkpoint(FIXTURES / "meta_llama" / "hf_mp1").inventory
    pipeline = open_checkpoint(NEOX / "pp1_mp1" / "checkpoint").inventory
    plan = make_plan(llama, pipeline, rules_for(LoadContext(llama, pipeline, "torch")))
    assert not plan.complete and not plan.ops
    assert plan.hints[split_key("sequential.3.mlp.linear1.weight")].startswith(
        "the checkpoint (Hugging Face) has a gated MLP (gate, up, down) (model.layers.0.mlp.gate_proj.weight), "
        "which the target (GPT-NeoX) has no place for")
    assert plan.hints[split_key("sequential.5.norm.bias")].startswith(
        "the target (GPT-NeoX) has a final LayerNorm (with a bias), which the checkpoint (Hugging Face) lacks")


def test_the_pipeline_places_the_final_norm_and_output_layer_by_the_layer_count():
    """NeoX's final norm and output layer sit in the layer list, past the last layer: named by
    the layer count, and a key named like them elsewhere is not taken for them."""
    assert neox.NEOX.key((None, "norm"), LAYERS) == split_key("sequential.5.norm.weight")
    assert neox.NEOX.key((None, "head"), LAYERS) == split_key("sequential.6.final_linear.weight")
    assert neox.pipeline_key(split_key("gpt_neox.layers.1.attention.masked_bias"), neox.HF, LAYERS) == \
        split_key("sequential.3.attention.masked_bias")
    keys = ["sequential.0.word_embeddings.weight", *(f"sequential.{i}.mlp.linear1.weight" for i in (2, 3)),
            "sequential.5.norm.weight", "sequential.6.final_linear.weight"]
    found = neox.NEOX.units(Inventory([Entry(split_key(key), (4, 4), "float32") for key in keys]))
    assert {unit for unit in found if unit[0] is None} == {(None, "embed"), (None, "norm"), (None, "head")}
    moved = [key.replace("sequential.5.", "sequential.9.") for key in keys]
    found = neox.NEOX.units(Inventory([Entry(split_key(key), (4, 4), "float32") for key in moved]))
    assert (None, "norm") not in found and (None, "head") in found

