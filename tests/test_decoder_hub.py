"""The decoder hub: a load between two producers' names composed through the canonical model.

Meta's original layout against what transformers' own ``convert_llama_weights_to_hf.py`` made of
it (tests/fixtures/meta_llama, see its ``produce.py``: a tiny GQA Llama, 8 heads in 2 groups,
bfloat16), and Megatron-Core ``GPTModel`` checkpoints against Megatron-Bridge's own conversions
of them (tests/fixtures/megatron_llama, see its ``produce.py``: Bridge's import of a tiny GQA Llama
at TP 1 and 2, its ``export_ckpt`` of each, and the ``GPTModel`` its import built; and
``produce_zarr.py``: those checkpoints re-saved by Megatron-Core 0.12.3's zarr backend, with the
float32 norms that version's ``GPTModel`` keeps). Bit for bit, both ways.
"""

from __future__ import annotations

import json
import logging
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


def assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Bit for bit, dtypes included."""
    assert set(expected) <= set(actual)
    different = [key for key, value in expected.items()
                 if actual[key].dtype != value.dtype or not torch.equal(actual[key], value)]
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


# -- Megatron-Core GPTModel checkpoints against Megatron-Bridge ------------------------------------


def bridge_import() -> dict[str, torch.Tensor]:
    """The ``GPTModel.state_dict()`` Megatron-Bridge's import built from ``megatron_llama/hf``."""
    return load_file(MEGATRON / "gptmodel.safetensors")


def bridge_export(tp: int) -> dict[str, torch.Tensor]:
    """What Megatron-Bridge's ``export_ckpt`` wrote of the TP ``tp`` checkpoint."""
    return load_file(MEGATRON / f"hf_tp{tp}" / "model.safetensors")


def megatron_llama() -> torch.nn.Module:
    """transformers' ``LlamaForCausalLM`` of the config Bridge exported, with its own random values."""
    from transformers import AutoConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(AutoConfig.from_pretrained(MEGATRON / "hf_tp1")).to(torch.bfloat16)


def gptmodel_entries(intermediate: int) -> Inventory:
    """``GPTModel``'s names and shapes as Bridge's import has them, for an FFN ``intermediate`` wide
    (the Meta fixture's is 85, Bridge's 86): names and shapes only, no values."""
    widths = {"mlp.linear_fc1.weight": (2 * intermediate, 32), "mlp.linear_fc2.weight": (32, intermediate)}
    return Inventory([Entry(split_key(key), widths.get(key.split(".", 3)[-1], tuple(value.shape)), "bfloat16")
                      for key, value in bridge_import().items()])


@pytest.mark.parametrize("where", ["tp1/iter_0000000", "tp2/iter_0000000", "tp1", "tp2", "zarr_tp1/iter_0000000",
                                   "zarr_tp2/iter_0000000", "zarr_tp1", "zarr_tp2"])
def test_dcp_load_of_a_megatron_checkpoint_into_llama(where):
    """The iteration folder or the save root (``latest_checkpointed_iteration.txt``), TP 1 or 2,
    torch_dist or zarr: the heads from Bridge's run_config.yaml; the values Bridge's
    ``export_ckpt`` wrote of the torch_dist checkpoint (the zarr ones hold its values, the norms
    widened to float32, and are cast back)."""
    state_dict = megatron_llama().state_dict()
    dcp.load(state_dict, checkpoint_id=MEGATRON / where)
    assert_same(state_dict, bridge_export(int(where.removeprefix("zarr_")[2])))


@pytest.mark.parametrize("where", ["tp1_fp32norm", "tp1_fp32norm/iter_0000000"])
def test_float32_norms_are_cast_as_bridge_casts_them(where):
    """Bridge's import into a model no ``Float16Module`` wraps keeps the RMSNorm weights in float32
    (values bfloat16 cannot hold); its ``export_ckpt`` rounds them to bfloat16. So does the load."""
    source = load_file(MEGATRON / "hf_fp32norm" / "model.safetensors")
    norms = [key for key in source if "norm" in key]
    assert {source[key].dtype for key in norms} == {torch.float32}
    assert not all(torch.equal(source[key].to(torch.bfloat16).float(), source[key]) for key in norms)
    expected = load_file(MEGATRON / "hf_tp1_fp32norm" / "model.safetensors")
    state_dict = megatron_llama().state_dict()
    dcp.load(state_dict, checkpoint_id=MEGATRON / where)
    assert_same(state_dict, expected)


def test_the_load_table_names_each_norm_it_casts(caplog):
    with caplog.at_level(logging.INFO, logger="ckptshim"):
        dcp.load(megatron_llama().state_dict(), checkpoint_id=MEGATRON / "zarr_tp1")
    rows = [" ".join(line.split()) for record in caplog.records for line in record.getMessage().splitlines()]
    assert "5 cast (float32 -> bfloat16)" in "\n".join(rows)
    for norm in ("model.layers.{0..1}.input_layernorm.weight", "model.layers.{0..1}.post_attention_layernorm.weight",
                 "model.norm.weight"):
        assert f"{norm} | cast | float32 -> bfloat16" in rows, rows


def test_load_state_dict_of_megatron_core_0_12s_gptmodel_into_llama():
    """The ``GPTModel.state_dict()`` Megatron-Core 0.12.3 loaded from the zarr checkpoint (its
    RMSNorm weights float32) into ``LlamaForCausalLM``: Bridge's export, bit for bit."""
    state = torch.load(MEGATRON / "gptmodel_zarr.pt", weights_only=True)
    assert {str(v.dtype) for k, v in state.items() if "norm" in k} == {"torch.float32"}
    model = megatron_llama()
    model.load_state_dict(state)
    assert_same(model.state_dict(), bridge_export(1))


def test_load_state_dict_of_gptmodel_names_into_llama():
    model = megatron_llama()
    model.load_state_dict(bridge_import())
    assert_same(model.state_dict(), bridge_export(1))


def test_inspect_of_a_megatron_save_root_names_the_producer_and_the_head_counts(capsys):
    assert main(["inspect", str(MEGATRON / "tp2")]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{MEGATRON / 'tp2' / 'iter_0000000'}: torch-dcp")
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
    out = tmp_path / "model.safetensors"
    assert main(["convert", str(MEGATRON / "tp2" / "iter_0000000"), str(out), "--to", "safetensors",
                 "--like", str(MEGATRON / "hf_tp1")]) == 0
    assert_same(load_file(out), bridge_export(2))


@pytest.mark.parametrize("run_config", [True, False])
def test_convert_a_zarr_checkpoint_like_a_hugging_face_folder(tmp_path, run_config):
    """``convert`` copies each array as stored (it never casts): the float32 norms stay float32,
    holding Bridge's bfloat16 values exactly. Without run_config.yaml the heads come from the
    ``--like`` folder's config.json."""
    source = writable_copy(MEGATRON / "zarr_tp2" / "iter_0000000", tmp_path / "iter_0000000")
    if not run_config:
        (source / "run_config.yaml").unlink()
    out = tmp_path / "model.safetensors"
    assert main(["convert", str(source), str(out), "--to", "safetensors", "--like", str(MEGATRON / "hf_tp1")]) == 0
    converted, expected = load_file(out), bridge_export(2)
    norms = {key for key in expected if "norm" in key}
    assert len(norms) == 5 and {converted[key].dtype for key in norms} == {torch.float32}
    assert_same({key: value.to(torch.bfloat16) if key in norms else value for key, value in converted.items()},
                expected)
    assert all(torch.equal(converted[key], expected[key].float()) for key in norms)


def test_dcp_load_of_a_hugging_face_folder_into_gptmodel_names():
    """The way back: the folder Bridge imported, into ``GPTModel``'s names (heads from its
    config.json), against what Bridge's import built of it."""
    state_dict = empty_like(bridge_import())
    dcp.load(state_dict, checkpoint_id=MEGATRON / "hf")
    assert_same(state_dict, bridge_import())


def test_dcp_load_of_a_hugging_face_folder_into_megatron_core_0_12s_gptmodel():
    """Into a ``GPTModel`` whose RMSNorm weights are float32 (Megatron-Core 0.12.3's): the
    bfloat16 norms widened, as 0.12.3's own load of Bridge's import of the folder gives them."""
    expected = torch.load(MEGATRON / "gptmodel_zarr.pt", weights_only=True)
    state_dict = empty_like(expected)
    dcp.load(state_dict, checkpoint_id=MEGATRON / "hf")
    assert_same(state_dict, expected)


def test_convert_a_hugging_face_folder_to_dcp_like_a_gptmodel(tmp_path, monkeypatch):
    """``convert --to dcp --like mod:fn``, the function giving a ``GPTModel``'s state dict."""
    expected = bridge_import()
    shapes = {key: (tuple(value.shape), str(value.dtype).removeprefix("torch.")) for key, value in expected.items()}
    (tmp_path / "gpt_names.py").write_text(
        "import torch\n\n\ndef state_dict():\n"
        f"    return {{key: torch.zeros(shape, dtype=getattr(torch, dtype)) for key, (shape, dtype) in {shapes!r}.items()}}\n")
    monkeypatch.chdir(tmp_path)
    assert main(["convert", str(MEGATRON / "hf"), str(tmp_path / "dcp"), "--to", "dcp", "--like",
                 "gpt_names:state_dict"]) == 0
    back = empty_like(expected)
    dcp.load(back, checkpoint_id=tmp_path / "dcp")
    assert_same(back, expected)


def test_meta_names_straight_into_gptmodel_names():
    """Meta -> canonical -> Megatron: the query and key heads from interleaved pairs to halves
    inside the query-group fusion, in one op per layer."""
    model_config = {"dim": 32, "n_heads": HEADS, "n_kv_heads": GROUPS}
    source, target = _inventory(meta()), gptmodel_entries(85)
    plan = make_plan(source, target, rules_for(LoadContext(source, target, "torch", model_config=model_config)))
    assert plan.complete
    described = [op.describe() for op in plan.ops if op.kind == "join-groups"]
    assert described[0] == ("layers.0.attention.w{q,k,v}.weight -> join by query group (2 × [4 q, 1 k, 1 v]; q, k "
                            "rotary pairs <-> halves) -> decoder.layers.0.self_attention.linear_qkv.weight")


def test_the_plan_says_the_query_group_split():
    source, target = _inventory(bridge_import()), _inventory(bridge_export(1))
    config = {"num_attention_heads": HEADS, "num_query_groups": GROUPS, "kv_channels": HEAD_DIM}
    plan = make_plan(source, target, rules_for(LoadContext(source, target, "torch", model_config=config)))
    assert plan.complete
    assert ("decoder.layers.1.self_attention.linear_qkv.weight -> split by query group (2 × [4 q, 1 k, 1 v]) -> "
            "model.layers.1.self_attn.{q,k,v}_proj.weight") in [op.describe() for op in plan.ops]


# -- near misses -----------------------------------------------------------------------------------


def test_a_near_miss_is_refused_naming_both_head_counts():
    """4 heads of 8 in 1 group have the shapes of 8 heads of 4 in 2 groups: loaded, they would
    compute garbage without an error. The two sides' metadata disagree, and the load says so."""
    source, target = _inventory(bridge_import()), _inventory(bridge_export(1))
    checkpoint = {"num_attention_heads": HEADS, "num_query_groups": GROUPS, "kv_channels": HEAD_DIM}
    model = {"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 8}
    with pytest.raises(PlanError, match=r"8 heads \(num_attention_heads\) in 2 key/value groups") as error:
        make_plan(source, target, rules_for(LoadContext(source, target, "torch", model_config=checkpoint,
                                                        target_config=model)))
    assert "4 heads (num_attention_heads) in 1 key/value groups (num_key_value_heads), head_dim 8" in str(error.value)


def test_without_head_counts_the_fused_array_stays_missing():
    source, target = _inventory(bridge_import()), _inventory(bridge_export(1))
    plan = make_plan(source, target, rules_for(LoadContext(source, target, "torch")))
    assert not plan.complete
    assert "run_config.yaml" in plan.hints[split_key("model.layers.0.self_attn.q_proj.weight")]


def _inventory(state_dict: dict[str, torch.Tensor]) -> Inventory:
    return Inventory([Entry(split_key(key), tuple(value.shape), "bfloat16") for key, value in state_dict.items()])
