"""The decoder hub: a load between two producers' names composed through the canonical model.

Meta's original layout against what transformers' own ``convert_llama_weights_to_hf.py`` made of
it (tests/fixtures/meta_llama, see its ``produce.py``: a tiny GQA Llama, 8 heads in 2 groups,
bfloat16), and Megatron-Core ``GPTModel`` names against a straightforward reimplementation of
Megatron-Bridge's documented QKV merge (``QKVMapping``: each query group's query heads, then its
key and value head) and gated-MLP merge (``linear_fc1 = [gate; up]``). Bit for bit, both ways.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from ckptshim.cli import main
from ckptshim.errors import PlanError
from ckptshim.inventory import Entry, Inventory, split_key
from ckptshim.planner import plan as make_plan
from ckptshim.rules.context import LoadContext
from ckptshim.rules.profiles import rules_for
from support.fixtures import writable_copy
from support.markers import QUIET

pytestmark = QUIET

FIXTURE = Path(__file__).parent / "fixtures" / "meta_llama"
MEGATRON = Path(__file__).parent / "fixtures" / "megatron_llama"
HEADS, GROUPS, HEAD_DIM, LAYERS = 8, 2, 4, 2


def llama() -> torch.nn.Module:
    """transformers' ``LlamaForCausalLM`` of the converter's config, with its own random values."""
    from transformers import AutoConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(AutoConfig.from_pretrained(FIXTURE / "hf_mp1")).to(torch.bfloat16)


def converted(mp: str = "mp1") -> dict[str, torch.Tensor]:
    """What transformers 4.46.3's ``convert_llama_weights_to_hf.py`` wrote from ``mp``."""
    return load_file(FIXTURE / f"hf_{mp}" / "model.safetensors")


def meta() -> dict[str, torch.Tensor]:
    return torch.load(FIXTURE / "mp1" / "consolidated.00.pth", weights_only=True)


def megatron(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``GPTModel``'s state dict of a Hugging Face Llama's, as Megatron-Bridge lays it out: the
    query, key and value fused per query group; gate and up side by side; the rest renamed."""
    out = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": hf["model.norm.weight"], "output_layer.weight": hf["lm_head.weight"]}
    for i in range(LAYERS):
        hf_layer, layer = f"model.layers.{i}.", f"decoder.layers.{i}."
        q, k, v = (hf[f"{hf_layer}self_attn.{name}_proj.weight"] for name in "qkv")
        hidden = q.shape[1]
        groups = [torch.cat([q.view(GROUPS, -1, hidden)[g], k.view(GROUPS, -1, hidden)[g],
                             v.view(GROUPS, -1, hidden)[g]]) for g in range(GROUPS)]
        out[f"{layer}self_attention.linear_qkv.weight"] = torch.cat(groups)
        out[f"{layer}self_attention.linear_proj.weight"] = hf[f"{hf_layer}self_attn.o_proj.weight"]
        out[f"{layer}mlp.linear_fc1.weight"] = torch.cat([hf[f"{hf_layer}mlp.gate_proj.weight"],
                                                          hf[f"{hf_layer}mlp.up_proj.weight"]])
        out[f"{layer}mlp.linear_fc2.weight"] = hf[f"{hf_layer}mlp.down_proj.weight"]
        out[f"{layer}input_layernorm.weight"] = hf[f"{hf_layer}input_layernorm.weight"]
        out[f"{layer}pre_mlp_layernorm.weight"] = hf[f"{hf_layer}post_attention_layernorm.weight"]
    return out


def assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Bit for bit; an expected value of another dtype (Megatron-Core keeps its RMSNorm weights in
    float32 in a bfloat16 model) as torch casts it."""
    assert set(expected) <= set(actual)
    different = [key for key, value in expected.items() if not torch.equal(actual[key], value.to(actual[key].dtype))]
    assert not different, different


def empty_like(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: torch.zeros_like(value) for key, value in state_dict.items()}


# -- Meta's original layout ------------------------------------------------------------------------


def test_load_state_dict_of_a_meta_checkpoint_into_llama():
    """``LlamaForCausalLM.load_state_dict(torch.load("consolidated.00.pth"))``: wq/wk permuted per
    head with the model's own head counts, exactly as the converter permutes them."""
    model = llama()
    model.load_state_dict(meta())
    assert_same(model.state_dict(), converted())


@pytest.mark.parametrize("mp", ["mp1", "mp2"])
def test_dcp_load_of_a_meta_folder_into_llama(mp):
    """``dcp.load(LlamaForCausalLM(...).state_dict(), checkpoint_id=<Meta folder>)``: the ranks
    merged as llama-models' ``reshard_mp`` merges them, wq/wk permuted with params.json's heads."""
    state_dict = llama().state_dict()
    dcp.load(state_dict, checkpoint_id=FIXTURE / mp)
    assert_same(state_dict, converted(mp))


@pytest.mark.parametrize("mp", ["mp1", "mp2"])
def test_dcp_load_of_a_meta_folder_into_torchtitan_names(mp):
    """torchtitan's Llama interleaves the rotary pairs as Meta does: every tensor is a rename."""
    titan = {"tok_embeddings.weight": "tok_embeddings.weight", "norm.weight": "norm.weight",
             "output.weight": "lm_head.weight"}
    rows = {"attention.wq": "attention.qkv_linear.wq", "attention.wk": "attention.qkv_linear.wk",
            "attention.wv": "attention.qkv_linear.wv", "attention.wo": "attention.wo",
            "feed_forward.w1": "feed_forward.w1", "feed_forward.w2": "feed_forward.w2",
            "feed_forward.w3": "feed_forward.w3", "attention_norm": "attention_norm", "ffn_norm": "ffn_norm"}
    titan.update({f"layers.{i}.{name}.weight": f"layers.{i}.{own}.weight" for i in range(LAYERS)
                  for name, own in rows.items()})
    original = meta()
    state_dict = {titan[key]: torch.zeros_like(value) for key, value in original.items()}
    dcp.load(state_dict, checkpoint_id=FIXTURE / mp)
    assert_same(state_dict, {titan[key]: value for key, value in original.items()})


def test_convert_like_a_hugging_face_folder(tmp_path):
    out = tmp_path / "model.safetensors"
    assert main(["convert", str(FIXTURE / "mp2"), str(out), "--to", "safetensors", "--like",
                 str(FIXTURE / "hf_mp1")]) == 0
    assert_same(load_file(out), converted("mp2"))


def test_inspect_names_the_producer_and_the_head_counts(capsys):
    assert main(["inspect", str(FIXTURE / "mp2")]) == 0
    assert "meta-llama (version model parallel 2, 8 heads in 2 key/value groups (params.json))" in capsys.readouterr().out


def test_a_folder_missing_a_rank_is_incomplete(tmp_path, capsys):
    folder = writable_copy(FIXTURE / "mp2", tmp_path / "mp2")
    (folder / "consolidated.01.pth").unlink()
    main(["inspect", str(folder)])
    assert "consolidated.01.pth is missing" in capsys.readouterr().out
    model = llama()
    before = {key: value.clone() for key, value in model.state_dict().items()}
    with pytest.raises(BaseException, match=r"consolidated\.01\.pth is missing"):
        dcp.load(model.state_dict(), checkpoint_id=folder)
    assert all(torch.equal(before[key], value) for key, value in model.state_dict().items())


def test_a_model_of_another_head_grouping_is_refused_naming_both(tmp_path, capsys):
    """The near miss: a Hugging Face folder whose config says 4 heads of 8 in 1 group -- the same
    shapes as params.json's 8 heads of 4 in 2 groups."""
    like = writable_copy(FIXTURE / "hf_mp1", tmp_path / "like")
    config = json.loads((like / "config.json").read_text())
    config.update(num_attention_heads=4, num_key_value_heads=1, head_dim=8)
    (like / "config.json").write_text(json.dumps(config))
    assert main(["convert", str(FIXTURE / "mp1"), str(tmp_path / "out.safetensors"), "--to", "safetensors",
                 "--like", str(like)]) != 0
    said = capsys.readouterr().err
    assert "params.json (the checkpoint's) says 8 heads (n_heads) in 2 key/value groups (n_kv_heads), head_dim 4" in said
    assert "4 heads (num_attention_heads) in 1 key/value groups (num_key_value_heads), head_dim 8" in said
    assert not (tmp_path / "out.safetensors").exists()


def test_dcp_load_of_a_hugging_face_folder_into_meta_names():
    """The way back: the converter's folder into Meta's names (heads from its config.json)."""
    state_dict = empty_like(meta())
    dcp.load(state_dict, checkpoint_id=FIXTURE / "hf_mp1")
    assert_same(state_dict, meta())


# -- Megatron-Core GPTModel ------------------------------------------------------------------------


def test_dcp_load_of_a_hugging_face_folder_into_gptmodel_names():
    expected = megatron(converted())
    state_dict = empty_like(expected)
    dcp.load(state_dict, checkpoint_id=FIXTURE / "hf_mp1")
    assert_same(state_dict, expected)


def test_load_state_dict_of_gptmodel_names_into_llama():
    model = llama()
    model.load_state_dict(megatron(converted()))
    assert_same(model.state_dict(), converted())


def test_meta_names_straight_into_gptmodel_names():
    """Meta -> canonical -> Megatron: the query and key heads from interleaved pairs to halves
    inside the query-group fusion, in one op per layer."""
    model_config = {"dim": 32, "n_heads": HEADS, "n_kv_heads": GROUPS}
    expected = megatron(converted())
    source = _inventory(meta())
    plan = make_plan(source, _inventory(expected),
                     rules_for(LoadContext(source, _inventory(expected), "torch", model_config=model_config)))
    assert plan.complete
    described = [op.describe() for op in plan.ops if op.kind == "join-groups"]
    assert described[0] == ("layers.0.attention.w{q,k,v}.weight -> join by query group (2 × [4 q, 1 k, 1 v]; q, k "
                            "rotary pairs <-> halves) -> decoder.layers.0.self_attention.linear_qkv.weight")


def test_the_plan_says_the_query_group_split():
    source, target = _inventory(megatron(converted())), _inventory(converted())
    config = {"num_attention_heads": HEADS, "num_query_groups": GROUPS, "kv_channels": HEAD_DIM}
    plan = make_plan(source, target, rules_for(LoadContext(source, target, "torch", model_config=config)))
    assert plan.complete
    assert ("decoder.layers.1.self_attention.linear_qkv.weight -> split by query group (2 × [4 q, 1 k, 1 v]) -> "
            "model.layers.1.self_attn.{q,k,v}_proj.weight") in [op.describe() for op in plan.ops]


# -- Megatron-Core checkpoints (torch_dist) --------------------------------------------------------


def gptmodel() -> dict[str, torch.Tensor]:
    """The ``GPTModel.state_dict()`` Megatron-Core's own load of the checkpoint gave."""
    return load_file(MEGATRON / "gptmodel.safetensors")


def split_by_query_group(gpt: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A ``GPTModel``'s state dict as ``LlamaForCausalLM``'s: Megatron-Bridge's documented QKV split
    (``linear_qkv`` viewed as ``[groups, heads per group + 2, head_dim, hidden]``: each group's
    query heads, then its key and value head) and ``linear_fc1`` cut into gate and up."""
    out = {"model.embed_tokens.weight": gpt["embedding.word_embeddings.weight"],
           "model.norm.weight": gpt["decoder.final_layernorm.weight"], "lm_head.weight": gpt["output_layer.weight"]}
    for i in range(LAYERS):
        layer, hf_layer = f"decoder.layers.{i}.", f"model.layers.{i}."
        qkv = gpt[f"{layer}self_attention.linear_qkv.weight"]
        grouped = qkv.view(GROUPS, HEADS // GROUPS + 2, HEAD_DIM, qkv.shape[1])
        out[f"{hf_layer}self_attn.q_proj.weight"] = grouped[:, :-2].reshape(-1, qkv.shape[1])
        out[f"{hf_layer}self_attn.k_proj.weight"] = grouped[:, -2].reshape(-1, qkv.shape[1])
        out[f"{hf_layer}self_attn.v_proj.weight"] = grouped[:, -1].reshape(-1, qkv.shape[1])
        out[f"{hf_layer}self_attn.o_proj.weight"] = gpt[f"{layer}self_attention.linear_proj.weight"]
        gate, up = gpt[f"{layer}mlp.linear_fc1.weight"].chunk(2)
        out[f"{hf_layer}mlp.gate_proj.weight"], out[f"{hf_layer}mlp.up_proj.weight"] = gate, up
        out[f"{hf_layer}mlp.down_proj.weight"] = gpt[f"{layer}mlp.linear_fc2.weight"]
        out[f"{hf_layer}input_layernorm.weight"] = gpt[f"{layer}input_layernorm.weight"]
        out[f"{hf_layer}post_attention_layernorm.weight"] = gpt[f"{layer}pre_mlp_layernorm.weight"]
    return out


def megatron_llama() -> torch.nn.Module:
    from transformers import AutoConfig, LlamaForCausalLM

    config = AutoConfig.for_model("llama", hidden_size=32, num_attention_heads=HEADS, num_key_value_heads=GROUPS,
                                  head_dim=HEAD_DIM, intermediate_size=86, num_hidden_layers=LAYERS, vocab_size=38,
                                  tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(torch.bfloat16)


@pytest.mark.parametrize("where", ["tp1/iter_0000007", "tp2/iter_0000007", "tp1", "tp2"])
def test_dcp_load_of_a_megatron_checkpoint_into_llama(where):
    """The iteration folder or the save root (``latest_checkpointed_iteration.txt``), TP 1 or 2:
    the heads from its run_config.yaml."""
    state_dict = megatron_llama().state_dict()
    dcp.load(state_dict, checkpoint_id=MEGATRON / where)
    assert_same(state_dict, split_by_query_group(gptmodel()))


def test_inspect_of_a_megatron_save_root_names_the_producer_and_the_head_counts(capsys):
    assert main(["inspect", str(MEGATRON / "tp2")]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{MEGATRON / 'tp2' / 'iter_0000007'}: torch-dcp")
    assert ("Megatron-Core wrote it, 8 heads (num_attention_heads) in 2 key/value groups (num_query_groups), "
            "head_dim 4 (run_config.yaml)") in out


def test_plan_of_a_megatron_save_root_like_llama_shows_the_composed_ops(tmp_path, capsys):
    """``ckptshim plan`` says each fused array's split once for every layer, the parts folded."""
    like = tmp_path / "like"
    megatron_llama().save_pretrained(like)
    assert main(["plan", str(MEGATRON / "tp1"), "--like", str(like)]) == 1  # its _extra_state objects are unexpected
    out = capsys.readouterr().out
    assert all("_extra_state" in line for line in out.splitlines() if line.endswith("-> unexpected"))
    assert ("decoder.layers.self_attention.linear_qkv.weight -> split by query group (2 × [4 q, 1 k, 1 v]) -> "
            "model.layers.{0..1}.self_attn.{q,k,v}_proj.weight") in out
    assert ("decoder.layers.mlp.linear_fc1.weight -> chunk(axis 1, sizes 86,86, each part stacked on axis 0) -> "
            "model.layers.{0..1}.mlp.{gate,up}_proj.weight") in out
    assert "missing" not in out


def test_convert_a_megatron_checkpoint_like_a_hugging_face_folder(tmp_path):
    like = tmp_path / "like"
    megatron_llama().save_pretrained(like)
    out = tmp_path / "model.safetensors"
    assert main(["convert", str(MEGATRON / "tp2" / "iter_0000007"), str(out), "--to", "safetensors",
                 "--like", str(like)]) == 0
    assert_same(load_file(out), split_by_query_group(gptmodel()))


def test_a_hugging_face_folder_back_into_gptmodel_names(tmp_path, monkeypatch):
    """``dcp.load`` into GPTModel's names, and ``convert --to dcp --like mod:fn``."""
    model = megatron_llama()
    model.load_state_dict(split_by_query_group(gptmodel()))
    model.save_pretrained(tmp_path / "hf")
    expected = {key: value.to(torch.bfloat16).to(value.dtype) for key, value in gptmodel().items()}
    state_dict = empty_like(expected)
    dcp.load(state_dict, checkpoint_id=tmp_path / "hf")
    assert_same(state_dict, expected)
    shapes = {key: (tuple(value.shape), str(value.dtype).removeprefix("torch.")) for key, value in expected.items()}
    (tmp_path / "gpt_names.py").write_text(
        "import torch\n\n\ndef state_dict():\n"
        f"    return {{key: torch.zeros(shape, dtype=getattr(torch, dtype)) for key, (shape, dtype) in {shapes!r}.items()}}\n")
    monkeypatch.chdir(tmp_path)
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "dcp"), "--to", "dcp", "--like",
                 "gpt_names:state_dict"]) == 0
    back = empty_like(expected)
    dcp.load(back, checkpoint_id=tmp_path / "dcp")
    assert_same(back, expected)


# -- near misses -----------------------------------------------------------------------------------


def test_a_near_miss_is_refused_naming_both_head_counts():
    """4 heads of 8 in 1 group have the shapes of 8 heads of 4 in 2 groups: loaded, they would
    compute garbage without an error. The two sides' metadata disagree, and the load says so."""
    source, target = _inventory(megatron(converted())), _inventory(converted())
    checkpoint = {"num_attention_heads": HEADS, "num_query_groups": GROUPS, "kv_channels": HEAD_DIM}
    model = {"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 8}
    with pytest.raises(PlanError, match=r"8 heads \(num_attention_heads\) in 2 key/value groups") as error:
        make_plan(source, target, rules_for(LoadContext(source, target, "torch", model_config=checkpoint,
                                                        target_config=model)))
    assert "4 heads (num_attention_heads) in 1 key/value groups (num_key_value_heads), head_dim 8" in str(error.value)


def test_without_head_counts_the_fused_array_stays_missing():
    source, target = _inventory(megatron(converted())), _inventory(converted())
    plan = make_plan(source, target, rules_for(LoadContext(source, target, "torch")))
    assert not plan.complete
    assert "run_config.yaml" in plan.hints[split_key("model.layers.0.self_attn.q_proj.weight")]


def _inventory(state_dict: dict[str, torch.Tensor]) -> Inventory:
    return Inventory([Entry(split_key(key), tuple(value.shape), "bfloat16") for key, value in state_dict.items()])
