"""transformers 4 checkpoints into transformers 5 models (and back), through every load path.

The fixtures (tests/fixtures/transformers4_moe, written by transformers 4.57's own
``save_pretrained``; see its ``produce.py``) keep MoE experts one module per expert, which
transformers 5 fuses (``mlp.experts.gate_up_proj``); the tied Llama has no ``lm_head.weight``
on disk. Every load is compared bit for bit with what transformers 5's ``from_pretrained``
makes of the same folder, and the model's output with transformers 4's.
"""

from __future__ import annotations

import functools
import json
import logging
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch import nn

import ckptshim
from ckptshim.errors import PlanError
from ckptshim.inventory import Entry, Inventory, split_key
from ckptshim.ops import Concat, Rename, Stack
from ckptshim.planner import plan, summary
from ckptshim.rules import DEFAULT_RULES
from ckptshim.rules.profiles.transformers_mapping import ConversionLayout, Conversions
from support.fixtures import FIXTURES, array_sha256, expected_arrays, writable_copy
from support.markers import QUIET
from support.native import diagnosis, natively, raised, same_error
from support.processes import environment, worker

pytestmark = QUIET

FIXTURE = FIXTURES / "transformers4_moe"
MODELS = ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss", "llama_tied"]
KINDS = ["safetensors", "bin"]
WEIGHTS = {"safetensors": "model.safetensors", "bin": "pytorch_model.bin", "save_model": "model.safetensors"}


def weights(name: str, kind: str = "safetensors") -> Path:
    return FIXTURE / name / kind / WEIGHTS[kind]


def read(name: str, kind: str = "safetensors") -> dict[str, torch.Tensor]:
    """The fixture's state dict, as a user reads it."""
    path = weights(name, kind)
    return torch.load(path, weights_only=True) if kind == "bin" else load_file(path)


@functools.lru_cache(maxsize=None)
def reference(name: str, kind: str = "safetensors") -> dict[str, torch.Tensor]:
    """What transformers 5's own ``from_pretrained`` loads from the fixture folder."""
    from transformers import AutoModelForCausalLM

    return dict(AutoModelForCausalLM.from_pretrained(weights(name, kind).parent).state_dict())


def fresh(name: str, **overrides) -> nn.Module:
    """transformers 5's model for the fixture's config, with other values than the checkpoint's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(FIXTURE / name / "safetensors", **overrides)
    torch.manual_seed(1234)
    return AutoModelForCausalLM.from_config(config, dtype=next(iter(reference(name).values())).dtype).eval()


def assert_from_pretrained(model: nn.Module, name: str, kind: str = "safetensors") -> None:
    """The model holds exactly what ``from_pretrained`` gives, bit for bit, and computes the logits
    transformers 4 computed on the producer's machine. A bfloat16 model's logits are compared to
    two units of bfloat16's last place: its matrix products round differently on another CPU
    (AVX2 here, AVX-512 where the reference was computed), whatever the weights."""
    expected, actual = reference(name, kind), model.state_dict()
    assert actual.keys() == expected.keys()
    different = [key for key, value in expected.items() if not torch.equal(actual[key], value)]
    assert not different, different
    ids = torch.from_numpy(np.load(FIXTURE / "ref_input_ids.npy"))
    with torch.no_grad():
        logits = model(ids).logits
    dtype = next(iter(expected.values())).dtype
    atol = 1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
    np.testing.assert_allclose(logits.float().numpy(), np.load(FIXTURE / name / "ref_logits.npy"), atol=atol, rtol=0)


def fingerprint(model: nn.Module) -> dict[str, torch.Tensor]:
    return {key: value.clone() for key, value in model.state_dict().items()}


@pytest.fixture
def shim_log(caplog):
    caplog.set_level(logging.INFO, logger="ckptshim")
    return caplog


# -- the fixture -----------------------------------------------------------------------------------


def test_fixture_files_hold_what_the_manifest_lists():
    """Every array of every file reads back with the manifest's hash; the safetensors and bin
    copies of a model hold the same arrays (the tied Llama's bin keeps both names)."""
    expected = expected_arrays("transformers4_moe")
    for name in MODELS:
        for kind in KINDS + (["save_model"] if name == "llama_tied" else []):
            for key, tensor in read(name, kind).items():
                bits = tensor.view(torch.uint16) if tensor.dtype == torch.bfloat16 else tensor
                assert array_sha256(bits.numpy()) == expected[f"{name}/{kind}/{key}"]["sha256"], (name, kind, key)
        safetensors, binary = read(name, "safetensors"), read(name, "bin")
        assert set(safetensors) <= set(binary)
        assert all(torch.equal(safetensors[key], binary[key]) for key in safetensors)
    assert "lm_head.weight" not in read("llama_tied") and "lm_head.weight" in read("llama_tied", "save_model")
    assert "model.layers.0.block_sparse_moe.experts.3.w3.weight" in read("mixtral")


# -- into transformers 5 ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", MODELS)
def test_load_state_dict_equals_from_pretrained(name, kind):
    model = fresh(name)
    result = model.load_state_dict(read(name, kind))  # strict
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert_from_pretrained(model, name, kind)


def test_load_state_dict_says_what_it_did(shim_log):
    fresh("mixtral").load_state_dict(read("mixtral"))
    assert ("load_state_dict(MixtralForCausalLM): 2 renamed (model.layers.{0..1}.block_sparse_moe.gate.weight -> "
            "model.layers.{0..1}.mlp.gate.weight), 16 concatenated (axis 1, sizes 48,48, each part stacked on "
            "axis 0), 8 stacked (axis 0)") in shim_log.text


@pytest.mark.parametrize("compiled", [False, True], ids=["plain", "compiled"])
@pytest.mark.parametrize("root", ["model", "net"])
def test_a_root_prefix_composes_with_the_mapping(shim_log, root, compiled):
    """transformers 4's Mixtral under a ``LightningModule``'s attribute (``model.`` or ``net.``:
    every key of its state dict carries it) into transformers 5's Mixtral, compiled or not: the
    root prefix set aside, the wrapper prefix, the conversion table's renames, stacks and fused
    experts, all together; bit for bit what the unwrapped load and ``from_pretrained`` give.
    (transformers' own mapping takes ``model.`` for the model's ``base_model_prefix``, so only
    ``net.`` needs the root prefix.)"""
    unwrapped = fresh("mixtral")
    unwrapped.load_state_dict(read("mixtral"))
    model = fresh("mixtral")
    target = torch.compile(model) if compiled else model
    result = target.load_state_dict({f"{root}.{key}": value for key, value in read("mixtral").items()})  # strict
    assert result.missing_keys == [] and result.unexpected_keys == []
    expected = unwrapped.state_dict()
    assert all(torch.equal(value, expected[key]) for key, value in model.state_dict().items())
    assert_from_pretrained(model, "mixtral")
    assert "16 concatenated" in shim_log.text
    if root == "net":
        assert "root prefix 'net.' removed from every checkpoint key" in shim_log.text


@pytest.mark.parametrize("source", ["folder", "safetensors", "bin"])
@pytest.mark.parametrize("name", MODELS)
def test_dcp_load_equals_from_pretrained(name, source):
    """``dcp.load`` of a plain state dict knows no module: the folder's config.json (beside a
    single file) names the model and so its mapping."""
    model = fresh(name)
    location = FIXTURE / name / "safetensors" if source == "folder" else weights(name, source)
    dcp.load(model.state_dict(), checkpoint_id=location)
    assert_from_pretrained(model, name)


@pytest.mark.parametrize("source", ["folder", "safetensors", "dcp"])
def test_dcp_load_reads_config_json_once(tmp_path, monkeypatch, source):
    """One ``dcp.load`` reads the checkpoint's ``config.json`` once: the folder's format reads it
    while opening (the weights file it may name), and the planner takes it from the opened
    checkpoint instead of reading it again."""
    from ckptshim.formats import hf_dir
    from ckptshim.storage.local import LocalFiles

    location = FIXTURE / "mixtral" / "safetensors"
    if source == "safetensors":
        location = weights("mixtral")
    elif source == "dcp":
        location = tmp_path / "dcp"
        dcp.save(read("mixtral"), checkpoint_id=location)
        shutil.copy(FIXTURE / "mixtral" / "safetensors" / "config.json", location)
    reads: list[Path] = []
    real = LocalFiles.read_ranges

    def counted(self, ranges, buffers):  # every local read of a file's bytes comes here
        reads.extend(Path(str(where.location)) for where in ranges if where.location.name == hf_dir.CONFIG)
        return real(self, ranges, buffers)

    monkeypatch.setattr(LocalFiles, "read_ranges", counted)
    model = fresh("mixtral")
    dcp.load(model.state_dict(), checkpoint_id=location)
    assert_from_pretrained(model, "mixtral")
    assert len(reads) == 1, reads


@pytest.mark.parametrize("name", ["mixtral", "deepseek_v3", "llama_tied"])
def test_dcp_load_of_a_dcp_checkpoint_with_its_config(tmp_path, name):
    """A DCP checkpoint of the transformers-4 state dict (as a trainer saves it), config.json inside."""
    folder = tmp_path / "dcp"
    dcp.save(read(name), checkpoint_id=folder)
    shutil.copy(FIXTURE / name / "safetensors" / "config.json", folder)
    model = fresh(name)
    dcp.load(model.state_dict(), checkpoint_id=folder)
    assert_from_pretrained(model, name)


def test_without_module_or_config_only_the_key_sets_count(tmp_path):
    """No module and no config.json: nothing says the keys are Mixtral's experts, so the fused
    target keys are refused by name and nothing is written."""
    lone = writable_copy(weights("mixtral"), tmp_path / "model.safetensors")
    model = fresh("mixtral")
    before = fingerprint(model)
    with pytest.raises(BaseException, match=r"experts\.gate_up_proj") as error:
        dcp.load(model.state_dict(), checkpoint_id=lone)
    assert "not in the checkpoint" in str(error.value)
    assert all(torch.equal(before[key], value) for key, value in model.state_dict().items())


@pytest.mark.parametrize("name", MODELS)
def test_set_model_state_dict_equals_from_pretrained(name):
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    model = fresh(name)
    set_model_state_dict(model, read(name))
    assert_from_pretrained(model, name)


def test_gpt_neox_resaved_by_transformers_5_loads_through_dcp():
    """The issue's example: the folder transformers 5 re-saved keeps ``embed_out.weight``, which
    its mapping renames to ``lm_head.weight``; ``dcp.load`` reads the mapping from config.json."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    folder = FIXTURES / "hf_gptneox_tf5_resaved" / "save_pretrained_default"
    model = GPTNeoXForCausalLM(GPTNeoXConfig.from_pretrained(folder))
    dcp.load(model.state_dict(), checkpoint_id=folder)
    stored = load_file(folder / "model.safetensors")
    assert torch.equal(model.lm_head.weight, stored["embed_out.weight"])
    assert all(torch.equal(model.state_dict()[key], value) for key, value in stored.items() if key != "embed_out.weight")


# -- back to transformers 4's layout ---------------------------------------------------------------


@pytest.fixture(scope="module")
def v5_folders(tmp_path_factory) -> dict[str, Path]:
    """Each model as transformers 5 keeps it, saved without reverting its conversions."""
    from transformers import AutoModelForCausalLM

    out = {}
    for name in MODELS:
        folder = tmp_path_factory.mktemp(name)
        AutoModelForCausalLM.from_pretrained(FIXTURE / name / "safetensors").save_pretrained(
            folder, save_original_format=False)
        out[name] = folder
    return out


@pytest.mark.parametrize("name", MODELS)
def test_convert_back_to_the_original_files(tmp_path, v5_folders, name):
    """``ckptshim convert`` of the transformers-5 layout ``--like`` the transformers-4 folder
    inverts every op: the very arrays transformers 4 saved, under its names."""
    assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" not in load_file(v5_folders["mixtral"] / "model.safetensors")
    out = ckptshim.convert(v5_folders[name], tmp_path / "back.safetensors", "safetensors",
                           like=FIXTURE / name / "safetensors")
    back, original = load_file(out), read(name)
    assert back.keys() == original.keys()
    assert all(torch.equal(back[key], value) for key, value in original.items())


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "deepseek_v3"])
def test_dcp_load_of_transformers_5_files_into_transformers_4_keys(v5_folders, name):
    """Code of the transformers-4 era asks for per-expert keys; the transformers-5 folder's
    config.json names the mapping, run backwards (as ``save_pretrained`` reverts it)."""
    original = read(name)
    state_dict = {key: torch.zeros_like(value) for key, value in original.items()}
    dcp.load(state_dict, checkpoint_id=v5_folders[name])
    assert all(torch.equal(state_dict[key], value) for key, value in original.items())


@pytest.mark.parametrize("name", MODELS)
def test_convert_forward_equals_from_pretrained(tmp_path, v5_folders, name):
    """``ckptshim convert --like`` a transformers-5 folder writes what ``from_pretrained`` loads
    (a tied head is transformers' to tie, so both leave it out)."""
    out = ckptshim.convert(FIXTURE / name / "safetensors", tmp_path / "v5.safetensors", "safetensors",
                           like=v5_folders[name])
    converted, expected = load_file(out), load_file(v5_folders[name] / "model.safetensors")
    assert converted.keys() == expected.keys()
    assert all(torch.equal(converted[key], reference(name)[key]) for key in expected)


def test_plan_cli_shows_the_fused_experts(v5_folders, capsys):
    from ckptshim import cli

    code = cli.main(["plan", str(FIXTURE / "mixtral" / "safetensors"), "--like", str(v5_folders["mixtral"])])
    shown = capsys.readouterr()
    assert code == 0, shown.err
    assert ("model.layers.{0..1}.block_sparse_moe.experts.{0..3}.w1.weight, "
            "model.layers.{0..1}.block_sparse_moe.experts.{0..3}.w3.weight") not in shown.out  # one line per layer
    assert ("model.layers.0.block_sparse_moe.experts.{0..3}.w1.weight, model.layers.0.block_sparse_moe.experts."
            "{0..3}.w3.weight -> concat(axis 1, sizes 48,48, each part stacked on axis 0) -> "
            "model.layers.0.mlp.experts.gate_up_proj") in shown.out


# -- tied weights ----------------------------------------------------------------------------------


def test_save_model_keeps_the_other_name_of_the_tied_pair():
    """``safetensors.torch.save_model`` kept ``lm_head.weight``: it fills the tied embedding too."""
    model = fresh("llama_tied")
    model.load_state_dict(read("llama_tied", "save_model"))
    assert_from_pretrained(model, "llama_tied")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model = fresh("llama_tied")
    dcp.load(model.state_dict(), checkpoint_id=weights("llama_tied", "save_model"))
    assert_from_pretrained(model, "llama_tied")


def test_an_untied_model_still_needs_its_head():
    """No twin to fill it from: torch's own "missing key", its writes, ckptshim's note."""
    model, native_model = fresh("llama_tied", tie_word_embeddings=False), fresh("llama_tied", tie_word_embeddings=False)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    error = same_error(raised(lambda: model.load_state_dict(read("llama_tied"))),
                       raised(lambda: natively(lambda: native_model.load_state_dict(read("llama_tied")))))
    assert 'Missing key(s) in state_dict: "lm_head.weight"' in str(error) and "lm_head.weight" in diagnosis(error)
    assert all(torch.equal(native_model.state_dict()[key], value) for key, value in model.state_dict().items())


class TiedLM(nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)
        if tied:
            self.head.weight = self.embed.weight


def test_names_alone_never_tie():
    """A plain module: the parameter shared by two names is filled from the one the checkpoint
    has; two parameters of the same shape that are not shared stay torch's "missing key"."""
    checkpoint = {"embed.weight": torch.randn(16, 8)}
    tied = TiedLM(tied=True)
    tied.load_state_dict(checkpoint)
    assert torch.equal(tied.head.weight, checkpoint["embed.weight"])
    untied = TiedLM(tied=False)
    error = same_error(raised(lambda: untied.load_state_dict(checkpoint)),
                       raised(lambda: natively(lambda: TiedLM(tied=False).load_state_dict(checkpoint))))
    assert "head.weight (nearest in checkpoint: embed.weight)" in diagnosis(error)


@pytest.mark.parametrize("strict", [True, False])
def test_a_non_strict_load_keeps_torchs_missing_keys_for_a_tied_twin(strict):
    """Where torch loads on its own (non-strict), its result stands: the twin the checkpoint lacks
    is listed missing, as torch lists it, and holds the loaded value through its storage. Where
    torch refuses (strict), ckptshim fills it from its twin and says so."""
    checkpoint = {"embed.weight": torch.randn(16, 8)}
    model, native_model = TiedLM(tied=True), TiedLM(tied=True)
    native_model.load_state_dict(model.state_dict())
    if strict:
        assert "head.weight" in str(raised(lambda: natively(lambda: native_model.load_state_dict(checkpoint))))
        result = model.load_state_dict(checkpoint)
        assert result.missing_keys == [] and result.unexpected_keys == []
    else:
        result = model.load_state_dict(checkpoint, strict=False)
        assert result == natively(lambda: native_model.load_state_dict(checkpoint, strict=False))
        assert result.missing_keys == ["head.weight"]
    assert torch.equal(model.head.weight, checkpoint["embed.weight"]) and model.head.weight is model.embed.weight


@pytest.mark.parametrize("name", ["tied", "llama_tied"])
def test_safetensors_load_model_of_tied_weights_is_torchs(tmp_path, name):
    """``safetensors.torch.load_model`` loads non-strictly and checks the missing keys against the
    model's shared tensors (it raises where a shared name is not reported missing): with ckptshim
    it loads as without it."""
    from safetensors.torch import load_model, save_model

    if name == "tied":
        torch.manual_seed(3)
        source, path = TiedLM(tied=True), tmp_path / "tied.safetensors"
        save_model(source, path)
        make = lambda: TiedLM(tied=True)  # noqa: E731
    else:
        source, path, make = None, weights("llama_tied", "save_model"), lambda: fresh("llama_tied")
    model, native_model = make(), make()
    native = natively(lambda: load_model(native_model, path))
    assert load_model(model, path) == native
    assert all(torch.equal(value, native_model.state_dict()[key]) for key, value in model.state_dict().items())
    if source is not None:
        assert torch.equal(model.embed.weight, source.embed.weight)


def test_assign_keeps_the_pair_tied():
    with torch.device("meta"):
        model = TiedLM(tied=True)
    checkpoint = {"head.weight": torch.randn(16, 8)}
    model.load_state_dict(checkpoint, assign=True)
    assert torch.equal(model.embed.weight, checkpoint["head.weight"])
    assert model.embed.weight.data_ptr() == model.head.weight.data_ptr()


# -- refusals -------------------------------------------------------------------------------------


def test_a_missing_expert_is_refused_before_anything_is_written():
    model = fresh("mixtral")
    before = fingerprint(model)
    checkpoint = {k: v for k, v in read("mixtral").items() if ".experts.1." not in k}
    with pytest.raises(PlanError, match=r"not indices 0\.\.N-1"):
        model.load_state_dict(checkpoint)
    checkpoint = {k: v for k, v in read("mixtral").items() if "experts.3.w1" not in k}
    with pytest.raises(PlanError, match=r"stacks 3 and 4 experts"):
        model.load_state_dict(checkpoint)
    assert all(torch.equal(before[key], value) for key, value in model.state_dict().items())


def test_a_model_of_other_dimensions_is_refused():
    model = fresh("mixtral", intermediate_size=40)
    with pytest.raises(PlanError, match=r"gate_up_proj.*does not fit these shapes"):
        model.load_state_dict(read("mixtral"))


def test_a_checkpoint_mixing_both_generations_loads_either_way(v5_folders):
    """Layer 0 per expert, layer 1 fused: into transformers 5 layer 0 is fused, into
    transformers-4 keys layer 1 is taken apart; each op names its own keys."""
    fused = load_file(v5_folders["mixtral"] / "model.safetensors")
    mixed = {k: v for k, v in read("mixtral").items() if ".layers.1." not in k}
    mixed.update({k: v for k, v in fused.items() if ".layers.1." in k})
    into_v5 = plan(_inventory(mixed), _inventory(fused), _rules_of("mixtral"))
    assert into_v5.complete and "8 concatenated" in summary(into_v5)
    into_v4 = plan(_inventory(mixed), _inventory(read("mixtral")), _rules_of("mixtral"))
    assert into_v4.complete and "8 chunked" in summary(into_v4)


def test_a_key_both_sides_have_is_not_renamed():
    """Both sides hold ``a.x.weight`` and ``a.y.weight``: renaming either onto the other would
    swap them; each loads under its own name."""
    from transformers.core_model_loading import WeightRenaming

    keys = {"a.x.weight": (2,), "a.y.weight": (2,)}
    found = _layout_plan([WeightRenaming(r"\.x\.", ".y.")], keys, keys)
    assert found.complete and found.is_identity


def _inventory(state_dict: dict[str, torch.Tensor]) -> Inventory:
    return Inventory([Entry(split_key(k), tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in state_dict.items()], "sd")


def _rules_of(name: str):
    from transformers import AutoConfig, conversion_mapping

    config = AutoConfig.from_pretrained(FIXTURE / name / "safetensors")
    transforms = tuple(conversion_mapping.get_checkpoint_conversion_mapping(config.model_type))
    return DEFAULT_RULES.extend(layouts=(ConversionLayout(Conversions(transforms, config, name)),))


def _layout_plan(transforms, source: dict[str, tuple], target: dict[str, tuple], config=None):
    def inventory(keys):
        return Inventory([Entry(split_key(k), shape, "float32") for k, shape in keys.items()], "keys")
    rules = DEFAULT_RULES.extend(layouts=(ConversionLayout(Conversions(tuple(transforms), config, "test")),))
    return plan(inventory(source), inventory(target), rules)


def test_a_converter_ckptshim_cannot_express_is_refused_by_name():
    from transformers.core_model_loading import Chunk as TfChunk, PermuteForRope, WeightConverter

    converter = WeightConverter("attn.qkv.weight", ["attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight"],
                                operations=[TfChunk(dim=0), PermuteForRope(permute_layer_names=["q_proj", "k_proj"])])
    with pytest.raises(PlanError, match=r"Chunk \+ PermuteForRope, which ckptshim cannot express"):
        _layout_plan([converter], {"attn.qkv.weight": (12, 4)},
                     {f"attn.{p}_proj.weight": (4, 4) for p in "qkv"})


def test_regex_renames_with_groups_become_exact_renames():
    """transformers' own renaming runs over the actual keys: capture groups, anchors, a prefix
    change; each renamed key that the target has becomes one rename, the rest are left alone."""
    from transformers.core_model_loading import PrefixChange, WeightRenaming

    transforms = [WeightRenaming(r"(^|model\.)layers\.", r"\1language_model.layers."),
                  WeightRenaming(r"\.(feed_forward|shared_experts)\.w1\.", r".\1.gate_proj."),
                  PrefixChange(prefix_to_remove="backbone")]
    source = {"layers.0.feed_forward.w1.weight": (4, 4), "model.layers.1.shared_experts.w1.weight": (4, 4),
              "backbone.norm.weight": (4,), "other.weight": (2,)}
    target = {"language_model.layers.0.feed_forward.gate_proj.weight": (4, 4),
              "model.language_model.layers.1.shared_experts.gate_proj.weight": (4, 4),
              "norm.weight": (4,), "other.weight": (2,)}
    found = _layout_plan(transforms, source, target)
    assert found.complete
    renames = {(".".join(op.source), ".".join(op.target)) for op in found.ops if op.tally() is not None}
    assert renames == {("layers.0.feed_forward.w1.weight", "language_model.layers.0.feed_forward.gate_proj.weight"),
                       ("model.layers.1.shared_experts.w1.weight",
                        "model.language_model.layers.1.shared_experts.gate_proj.weight"),
                       ("backbone.norm.weight", "norm.weight")}


def _converters():
    from transformers import LlamaConfig
    from transformers.core_model_loading import (
        Chunk as TfChunk,
        Concatenate,
        Interleave,
        MergeModulelist,
        PermuteForRope,
        Split,
        Transpose,
        WeightConverter,
    )

    config = LlamaConfig(num_attention_heads=2)
    experts = {f"e.{i}.{w}.weight": (3, 4) for i in range(3) for w in ("w1", "w3")}
    return [
        ("permute_for_rope", WeightConverter("wq.weight", "q.weight", operations=[PermuteForRope()]),
         {"wq.weight": (16, 3)}, {"q.weight": (16, 3)}, config),
        ("permute_back", WeightConverter("q.weight", "wq.weight", operations=[PermuteForRope(inverse=True)]),
         {"q.weight": (16, 3)}, {"wq.weight": (16, 3)}, config),
        ("interleave", WeightConverter("w13.weight", "gate_up.weight", operations=[Interleave(dim=1)]),
         {"w13.weight": (3, 8, 2)}, {"gate_up.weight": (3, 8, 2)}, None),
        ("deinterleave", WeightConverter("gu.weight", "w13.weight", operations=[Interleave(dim=0, inverse=True)]),
         {"gu.weight": (6, 2)}, {"w13.weight": (6, 2)}, None),
        ("transpose", WeightConverter("w.weight", "t.weight", operations=[Transpose(1, 2)]),
         {"w.weight": (2, 3, 4)}, {"t.weight": (2, 4, 3)}, None),
        ("chunk", WeightConverter("qkv.weight", ["q.weight", "k.weight", "v.weight"], operations=[TfChunk(dim=1)]),
         {"qkv.weight": (2, 9)}, {"q.weight": (2, 3), "k.weight": (2, 3), "v.weight": (2, 3)}, None),
        ("split", WeightConverter("qkv.weight", ["q.weight", "k.weight", "v.weight"], operations=[Split(dim=0)]),
         {"qkv.weight": (8, 2)}, {"q.weight": (4, 2), "k.weight": (2, 2), "v.weight": (2, 2)}, None),
        ("concatenate", WeightConverter(["q.weight", "k.weight"], "qk.weight", operations=[Concatenate(dim=0)]),
         {"q.weight": (4, 2), "k.weight": (2, 2)}, {"qk.weight": (6, 2)}, None),
        ("experts", WeightConverter([".e.*.w1.weight", ".e.*.w3.weight"], ".e.gate_up_proj",
                                    operations=[MergeModulelist(dim=0), Concatenate(dim=1)]),
         {f"m.{k}": v for k, v in experts.items()}, {"m.e.gate_up_proj": (3, 6, 4)}, None),
    ]


@pytest.mark.parametrize("case", _converters(), ids=lambda case: case[0])
def test_each_translated_op_moves_every_value_as_transformers_does(case):
    """transformers' own ``convert`` of real tensors and ckptshim's torch executor of the op it
    became give the same arrays, bit for bit."""
    from transformers.core_model_loading import WeightConverter, rename_source_key

    from ckptshim.execute.torch import prepare

    _, converter, source, target, config = case
    generator = torch.Generator().manual_seed(0)
    values = {key: torch.randn(shape, generator=generator) for key, shape in source.items()}
    found = _layout_plan([converter], source, target, config)
    destinations = {split_key(key): torch.zeros(shape) for key, shape in target.items()}
    prepare(found, lambda key: values[".".join(key)], destinations).write()
    # transformers' way: its renaming collects the keys, its converter converts them
    collected = WeightConverter(converter.source_patterns, converter.target_patterns, operations=converter.operations)
    renamed = None
    for key in sorted(values, key=lambda k: [int(p) if p.isdigit() else p for p in k.split(".")]):
        renamed, pattern = rename_source_key(key, [], [collected])
        collected.add_tensor(renamed, key, pattern, lambda key=key: values[key])
    model = types.SimpleNamespace(get_parameter=lambda name: torch.empty(target[name]))  # Split reads sizes
    expected = collected.convert(renamed, model=model, config=config)
    assert set(expected) == set(target)
    for key, value in expected.items():
        value = value[0] if isinstance(value, list) else value
        assert torch.equal(destinations[split_key(key)], value), key


def test_the_table_round_trips_for_a_sample_of_its_classes():
    """tools/transformers_roundtrip.py on classes that use each kind of transform (scoped prefix
    changes, sub-models, Chunk, Split, Concatenate, Interleave, PermuteForRope, an index-offset
    rename, a base-model prefix): transformers' own way back, planned onto the model by ckptshim,
    accounts for every key; the chains ckptshim cannot express are refused by name."""
    classes = ["Qwen2VLForConditionalGeneration", "LlavaForConditionalGeneration", "Dinov2Model",
               "KimiLinearForCausalLM", "Molmo2TextModel", "RfDetrForInstanceSegmentation",
               "MistralLarge4ForConditionalGeneration", "Inkling2ForCausalLM", "Kimi_K25Model", "InklingModel"]
    run = subprocess.run([sys.executable, str(Path(__file__).parent.parent / "tools" / "transformers_roundtrip.py"),
                          "--json", "--only", ",".join(classes)],
                         capture_output=True, text=True, env=environment(), timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    outcomes = json.loads(run.stdout.strip().splitlines()[-1])
    assert outcomes.pop("Kimi_K25Model") == "refused: Chunk + PermuteForRope"
    assert outcomes.pop("InklingModel") == "refused: Interleave + Chunk"
    assert set(outcomes.values()) == {"complete"}, outcomes


def test_moe_fusion_is_one_concat_of_stacks():
    """Mixtral's converter: every expert's w1 stacked beside every expert's w3, in expert order
    (experts 10 and 2 sort as numbers, as transformers sorts them)."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    experts = 11
    source = {f"layers.0.block_sparse_moe.experts.{e}.{w}.weight": (3, 4) for e in range(experts) for w in ("w1", "w2", "w3")}
    target = {"layers.0.mlp.experts.gate_up_proj": (experts, 6, 4), "layers.0.mlp.experts.down_proj": (experts, 3, 4)}
    found = _layout_plan(get_checkpoint_conversion_mapping("mixtral"), source, target)
    concat = next(op for op in found.ops if isinstance(op, Concat))
    assert concat.stack_axis == 0 and concat.axis == 1 and concat.sizes == (3, 3)
    assert [".".join(key[-4:-2]) for key in concat.sources] == (
        [f"experts.{e}" for e in range(experts)] * 2)
    assert [key[-2] for key in concat.sources] == ["w1"] * experts + ["w3"] * experts
    stack = next(op for op in found.ops if isinstance(op, Stack))
    assert [int(key[-3]) for key in stack.sources] == list(range(experts))
    assert "22 concatenated" in summary(found) and not any(isinstance(op, Rename) and op.tally() for op in found.ops[2:])


# -- FSDP2 across two ranks -----------------------------------------------------------------------


def test_fsdp2_two_ranks_each_read_their_own_rows(tmp_path):
    """Two gloo ranks shard transformers 5's Mixtral with ``fully_shard``; ``dcp.load`` of the
    transformers-4 folder gives each rank exactly its rows, and each rank reads about half of the
    file (``rchar``), not all of it; ``set_model_state_dict`` of the full per-expert dict too."""
    folder = writable_copy(FIXTURE / "mixtral" / "safetensors", tmp_path / "ckpt")
    out = tmp_path / "out"
    out.mkdir()
    env = {k: v for k, v in environment().items() if not k.startswith("CKPTSHIM_")}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          worker("moe_worker.py"), str(folder), str(out)],
                         capture_output=True, text=True, timeout=300, env=env, check=False)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    size = (folder / "model.safetensors").stat().st_size
    for rank in (0, 1):
        result = json.loads((out / f"rank{rank}.json").read_text())
        assert result["dcp_load"] == "ok" and result["set_model_state_dict"] == "ok", result
        assert result["shard_bytes"] <= result["read_bytes"] <= 0.6 * size, (result, size)


@pytest.mark.parametrize("damage", [b'{"model_type": "mixtral", "model_type": "llama"}', b'{"model_type": ',
                                    b'{"a": ' * 3000])
def test_a_damaged_config_is_refused_naming_it(tmp_path, damage):
    """config.json is read from the checkpoint's folder like any of its bytes: a key named twice,
    cut short, nested too deep -- refused naming the file, before anything is written."""
    folder = writable_copy(FIXTURE / "mixtral" / "safetensors", tmp_path / "ckpt")
    (folder / "config.json").write_bytes(damage)
    model = fresh("mixtral")
    before = fingerprint(model)
    with pytest.raises(BaseException, match=r"config\.json: not valid JSON"):
        dcp.load(model.state_dict(), checkpoint_id=folder)
    assert all(torch.equal(before[key], value) for key, value in model.state_dict().items())


def test_a_config_linked_from_outside_the_folder_is_refused(tmp_path):
    """config.json is one of the checkpoint's files: a link to a file elsewhere is not read."""
    from ckptshim.errors import UnsafeCheckpointError
    from ckptshim.formats.hf_dir import model_config

    folder = writable_copy(FIXTURE / "mixtral" / "safetensors", tmp_path / "ckpt")
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text((folder / "config.json").read_text())
    (folder / "config.json").unlink()
    (folder / "config.json").symlink_to(elsewhere)
    with pytest.raises(UnsafeCheckpointError, match="lies outside the checkpoint"):
        model_config(folder)


@pytest.mark.parametrize("config", [
    {}, {"model_type": 3}, {"architectures": "MixtralForCausalLM"}, {"model_type": "no_such_model"},
    {"architectures": ["NoSuchClass", 7, None]}, {"model_type": "mixtral", "num_attention_heads": "four"},
    {"architectures": ["MixtralForCausalLM"], "model_type": "no_such_model"},
    {"architectures": ["GPTNeoXForCausalLM"]}, {"model_type": "mixtral", "architectures": ["NoSuchClass"]},
])
def test_any_config_names_a_mapping_or_none(config):
    """A config.json holds what its writer put there: only a model type or class name that
    transformers' table has names a mapping (``mixtral`` is a model type there,
    ``GPTNeoXForCausalLM`` a class); nothing else raises (a config object it cannot build leaves
    the ops that need one to refuse by themselves)."""
    from ckptshim.rules.profiles.transformers_mapping import from_config

    found = from_config(config, "config.json")
    named = config.get("model_type") == "mixtral" or config.get("architectures") == ["GPTNeoXForCausalLM"]
    assert (found is not None) == named
