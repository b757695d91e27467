"""``torch.nn.Module.load_state_dict`` with ckptshim: real checkpoints, real torch/transformers.

Every load is compared bit-exactly (``torch.equal``) with the checkpoint's tensors, every
refused load is checked to leave each tensor of the module exactly as it was, and every load
ckptshim has no plan for is checked to be torch's own: its error, its writes, with ckptshim's
diagnosis as a note.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import shutil
import warnings
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

import ckptshim
from ckptshim.errors import CorruptCheckpointError, PlanError, ShimError, UnsafeCheckpointError
from support.native import diagnosis, natively, raised, same_error
from ckptshim.execute.torch import prepare
from ckptshim.formats import torch_pickle
from ckptshim.formats.detect import open_checkpoint
from ckptshim.inventory import Entry, Inventory, dtype_name, split_key
from ckptshim.planner import plan

FIXTURES = Path(__file__).parent / "fixtures"
NEOX_TF4 = FIXTURES / "hf_gptneox_tf4.30.2"
NEOX_TF5 = FIXTURES / "hf_gptneox_tf5_resaved" / "save_pretrained_default"
TINY = FIXTURES / "torch_dcp_single"


# -- helpers -------------------------------------------------------------------------------------


def fingerprint(module: nn.Module) -> dict[str, tuple]:
    """Every parameter and buffer (non-persistent ones too): dtype, shape and a hash of its bytes."""
    out = {}
    for kind, named in (("p", module.named_parameters(remove_duplicate=False)),
                        ("b", module.named_buffers(remove_duplicate=False))):
        for name, tensor in named:
            data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            out[f"{kind}:{name}"] = (tensor.dtype, tuple(tensor.shape), hashlib.sha256(data).hexdigest())
    return out


def assert_holds(module: nn.Module, expected: dict[str, torch.Tensor], rename=lambda key: key) -> None:
    """The module's state dict holds exactly ``expected`` (under ``rename``d keys), bit for bit."""
    actual = module.state_dict()
    assert sorted(actual) == sorted(rename(key) for key in expected)
    for key, tensor in expected.items():
        assert torch.equal(actual[rename(key)], tensor), key


@pytest.fixture(scope="session")
def tiny():
    """The model behind the torch_dcp_single fixture (its producer's own module)."""
    spec = importlib.util.spec_from_file_location("dcp_tiny_model", TINY / "dcp_tiny_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def tiny_checkpoint() -> dict[str, torch.Tensor]:
    return torch.load(TINY / "torch_save" / "model.pt", weights_only=True)


@pytest.fixture(scope="session")
def compiled(tiny):
    """One torch.compile'd model for the session (compiling is lazy; its forward never runs)."""
    return torch.compile(tiny.build(seed=1))



@pytest.fixture
def shim_log(caplog):
    caplog.set_level(logging.INFO, logger="ckptshim")
    return caplog


# -- transformers GPT-NeoX: legacy buffers and the embed_out -> lm_head rename -------------------


def _read_tf4(kind: str) -> dict[str, torch.Tensor]:
    if kind == "pytorch_model.bin":
        return torch.load(NEOX_TF4 / "pytorch_model_bin" / kind, weights_only=True)
    return load_file(NEOX_TF4 / "safetensors" / kind)


@pytest.mark.parametrize("kind", ["pytorch_model.bin", "model.safetensors"])
def test_transformers_4_30_checkpoint_loads_strictly_into_transformers_5(kind, shim_log):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    checkpoint = _read_tf4(kind)
    assert "embed_out.weight" in checkpoint and "gpt_neox.layers.0.attention.masked_bias" in checkpoint
    torch.manual_seed(99)
    model = GPTNeoXForCausalLM(GPTNeoXConfig.from_pretrained(NEOX_TF4 / "pytorch_model_bin")).eval()
    inv_freq = model.gpt_neox.rotary_emb.inv_freq.clone()

    result = model.load_state_dict(checkpoint)

    assert result.missing_keys == [] and result.unexpected_keys == []
    legacy = ("attention.bias", "attention.masked_bias", "rotary_emb.inv_freq")
    expected = {k: v for k, v in checkpoint.items() if not k.endswith(legacy)}
    assert len(expected) == len(checkpoint) - 6
    assert_holds(model, expected, rename=lambda k: "lm_head.weight" if k == "embed_out.weight" else k)
    assert torch.equal(model.gpt_neox.rotary_emb.inv_freq, inv_freq)  # the model's own, untouched
    assert ("load_state_dict(GPTNeoXForCausalLM): 1 renamed (embed_out.weight -> lm_head.weight), "
            "6 dropped (attention.bias, attention.masked_bias, inv_freq)") in shim_log.text

    ids = torch.from_numpy(np.load(NEOX_TF4 / "ref_input_ids.npy"))
    with torch.no_grad():
        logits = model(ids).logits.numpy()
    assert np.abs(logits - np.load(NEOX_TF4 / "ref_logits.npy")).max() <= 1e-5


def test_conversion_mapping_applies_to_a_model_inside_a_container():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    checkpoint = {f"lm.{k}": v for k, v in _read_tf4("pytorch_model.bin").items()}
    container = nn.Module()
    container.lm = GPTNeoXForCausalLM(GPTNeoXConfig.from_pretrained(NEOX_TF4 / "pytorch_model_bin"))
    container.load_state_dict(checkpoint)
    assert torch.equal(container.lm.lm_head.weight, checkpoint["lm.embed_out.weight"])


class MegatronRotary(nn.Module):
    """GPT-NeoX (megatron) ``RotaryEmbedding``: ``inv_freq`` is a persistent buffer."""

    def __init__(self, dim: int, base: float = 10000) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq)


class NeoXStyleLM(nn.Module):
    """A GPT-NeoX-style model under Hugging Face names, with a rotary buffer per layer."""

    def __init__(self, vocab: int, hidden: int, layers: int, heads: int, rotary_pct: float) -> None:
        super().__init__()
        rotary_dim = int(hidden // heads * rotary_pct)

        def layer() -> nn.Module:
            block = nn.Module()
            block.input_layernorm = nn.LayerNorm(hidden)
            block.post_attention_layernorm = nn.LayerNorm(hidden)
            block.attention = nn.Module()
            block.attention.query_key_value = nn.Linear(hidden, 3 * hidden)
            block.attention.dense = nn.Linear(hidden, hidden)
            block.attention.rotary_emb = MegatronRotary(rotary_dim)
            block.mlp = nn.Module()
            block.mlp.dense_h_to_4h = nn.Linear(hidden, 4 * hidden)
            block.mlp.dense_4h_to_h = nn.Linear(4 * hidden, hidden)
            return block

        self.gpt_neox = nn.Module()
        self.gpt_neox.embed_in = nn.Embedding(vocab, hidden)
        self.gpt_neox.layers = nn.ModuleList(layer() for _ in range(layers))
        self.gpt_neox.final_layer_norm = nn.LayerNorm(hidden)
        self.embed_out = nn.Linear(hidden, vocab, bias=False)


def test_transformers_5_checkpoint_loads_into_module_with_persistent_inv_freq(shim_log):
    checkpoint = load_file(NEOX_TF5 / "model.safetensors")
    assert not any(key.endswith("inv_freq") for key in checkpoint)
    model = NeoXStyleLM(vocab=256, hidden=64, layers=2, heads=4, rotary_pct=0.25)

    result = model.load_state_dict(checkpoint, strict=True)

    assert result.missing_keys == [] and result.unexpected_keys == []
    formula = 1.0 / (10000 ** (torch.arange(0, 4, 2).float() / 4))
    for index in range(2):
        assert torch.equal(model.state_dict()[f"gpt_neox.layers.{index}.attention.rotary_emb.inv_freq"], formula)
    params = dict(model.named_parameters())
    assert sorted(params) == sorted(checkpoint)
    assert all(torch.equal(params[key], checkpoint[key]) for key in checkpoint)
    assert "2 synthesized" in shim_log.text


# -- wrappers: torch.compile, DDP, activation checkpointing, nested ------------------------------


def test_plain_checkpoint_into_compiled_model(compiled, tiny_checkpoint):
    result = compiled.load_state_dict(tiny_checkpoint)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert_holds(compiled, tiny_checkpoint, rename=lambda key: "_orig_mod." + key)


def test_compiled_state_dict_into_plain_model(tiny, compiled):
    saved = compiled.state_dict()
    assert all(key.startswith("_orig_mod.") for key in saved)
    plain = tiny.build(seed=2)
    plain.load_state_dict(saved)
    assert_holds(plain, {k.removeprefix("_orig_mod."): v for k, v in saved.items()})


class Scaled(nn.Module):
    def __init__(self, persistent: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 0.5), persistent=persistent)


def test_checkpoint_key_for_a_non_persistent_buffer_is_dropped(shim_log):
    old = Scaled(persistent=True)  # an older version of the module kept `scale` in its state dict
    old.scale.fill_(2.0)
    model = Scaled(persistent=False)
    model.load_state_dict(old.state_dict())
    assert torch.equal(model.proj.weight, old.proj.weight)
    assert torch.equal(model.scale, torch.full((4,), 0.5))  # the module's own value, not the file's
    assert "load_state_dict(Scaled): 1 dropped (not persistent in target)" in shim_log.text


def test_dtype_differences_are_cast_or_refused(tiny, tiny_checkpoint):
    half = {"_orig_mod." + k: v.bfloat16() if v.is_floating_point() else v for k, v in tiny_checkpoint.items()}
    model = tiny.build(seed=16)
    model.load_state_dict(half)
    assert_holds(model, {k.removeprefix("_orig_mod."): v.float() if v.is_floating_point() else v
                         for k, v in half.items()})

    half["_orig_mod.ln_f.weight"] = half["_orig_mod.ln_f.weight"].to(torch.complex64)
    before = fingerprint(model)
    with pytest.raises(PlanError, match="imaginary part"):
        model.load_state_dict(half)
    assert fingerprint(model) == before


def test_ddp_both_ways(tiny, tiny_checkpoint, process_group):
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(tiny.build(seed=3))
    ddp.load_state_dict(tiny_checkpoint)
    assert_holds(ddp, tiny_checkpoint, rename=lambda key: "module." + key)

    plain = tiny.build(seed=4)
    plain.load_state_dict(ddp.state_dict())
    assert_holds(plain, tiny_checkpoint)


def _checkpoint_wrapped(tiny, seed: int, compile_first: bool = False) -> nn.Module:
    model = tiny.build(seed=seed)
    for index, block in enumerate(model.layers):
        model.layers[index] = checkpoint_wrapper(torch.compile(block) if compile_first and index == 0 else block)
    return model


def test_checkpoint_wrapped_model(tiny, tiny_checkpoint):
    model = _checkpoint_wrapped(tiny, seed=5)
    model.load_state_dict(tiny_checkpoint)  # its own load hook re-adds the wrapper's prefix
    assert_holds(model, tiny_checkpoint)

    # a dict that spells out the hop (as `named_parameters` does) loads too: torch alone would
    # add the prefix a second time
    internal = {k.replace("layers.0.", "layers.0._checkpoint_wrapped_module.")
                 .replace("layers.1.", "layers.1._checkpoint_wrapped_module."): v
                for k, v in tiny.build(seed=6).state_dict().items()}
    model.load_state_dict(internal)
    assert_holds(model, {k.replace("_checkpoint_wrapped_module.", ""): v for k, v in internal.items()})


def test_compiled_block_inside_checkpoint_wrapper(tiny, tiny_checkpoint):
    model = _checkpoint_wrapped(tiny, seed=7, compile_first=True)
    assert "layers.0._orig_mod.qkv.weight" in model.state_dict()

    model.load_state_dict(tiny_checkpoint)
    assert_holds(model, tiny_checkpoint, rename=lambda k: k.replace("layers.0.", "layers.0._orig_mod."))

    plain = tiny.build(seed=8)
    plain.load_state_dict(model.state_dict())
    assert_holds(plain, tiny_checkpoint)


# -- stacked layers: per-expert parameters <-> one stacked parameter -----------------------------

EXPERTS, ROWS, COLS = 4, 4, 6  # ROWS == EXPERTS: the shapes alone allow axis 0 or 1


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(ROWS, COLS))


class StackedExperts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(EXPERTS, ROWS, COLS))


class MoE(nn.Module):
    def __init__(self, stacked: bool, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList()
        for _ in range(2):
            block = nn.Module()
            block.router = nn.Linear(ROWS, EXPERTS)
            block.experts = StackedExperts() if stacked else nn.ModuleList(Expert() for _ in range(EXPERTS))
            self.layers.append(block)


def test_per_expert_checkpoint_into_stacked_experts_and_back(shim_log):
    per_expert = MoE(stacked=False, seed=0)
    checkpoint = per_expert.state_dict()
    assert "layers.1.experts.3.w1" in checkpoint
    stacked = MoE(stacked=True, seed=1)
    storage = {name: p.data_ptr() for name, p in stacked.named_parameters()}

    stacked.load_state_dict(checkpoint)

    assert {name: p.data_ptr() for name, p in stacked.named_parameters()} == storage  # in place
    for layer in range(2):
        whole = stacked.layers[layer].experts.w1
        for expert in range(EXPERTS):
            assert torch.equal(whole[expert], checkpoint[f"layers.{layer}.experts.{expert}.w1"])
        assert torch.equal(stacked.layers[layer].router.weight, checkpoint[f"layers.{layer}.router.weight"])
    assert "8 stacked" in shim_log.text

    back = MoE(stacked=False, seed=2)
    back.load_state_dict(stacked.state_dict())
    assert_holds(back, checkpoint)


def test_stacked_load_that_lacks_a_key_is_torchs_own_failure():
    """Stacking cannot make a checkpoint that lacks a key fit a strict load: torch's own call runs,
    with its error and its writes, and ckptshim's diagnosis names the key it found missing."""
    checkpoint = MoE(stacked=False, seed=0).state_dict()
    del checkpoint["layers.1.router.bias"]
    stacked, native_model = MoE(stacked=True, seed=1), MoE(stacked=True, seed=1)
    error = same_error(raised(lambda: stacked.load_state_dict(checkpoint)),
                       raised(lambda: natively(lambda: native_model.load_state_dict(checkpoint))))
    assert "layers.1.router.bias" in diagnosis(error)
    assert fingerprint(stacked) == fingerprint(native_model)


def test_per_expert_checkpoint_into_stacked_model_on_meta_with_assign():
    checkpoint = MoE(stacked=False, seed=0).state_dict()
    with torch.device("meta"):
        stacked = MoE(stacked=True, seed=1)
    stacked.load_state_dict(checkpoint, assign=True)
    whole = stacked.layers[1].experts.w1
    assert not whole.is_meta and isinstance(whole, nn.Parameter)
    assert all(torch.equal(whole[e], checkpoint[f"layers.1.experts.{e}.w1"]) for e in range(EXPERTS))


def test_executor_writes_a_file_checkpoint_in_place(tiny, tiny_checkpoint):
    """The executor on its own: ckptshim's reader as the source, a DDP-named model as target."""
    checkpoint = open_checkpoint(TINY / "torch_save" / "model.pt")
    holder = nn.Module()
    holder.module = tiny.build(seed=9)
    destinations = {split_key(k): v for k, v in holder.state_dict(keep_vars=True).items()}
    target = Inventory(Entry(k, tuple(v.shape), dtype_name(v.dtype)) for k, v in destinations.items())
    the_plan = plan(checkpoint.inventory, target)
    pointers = {k: v.data_ptr() for k, v in destinations.items()}

    def fetch(key):
        with warnings.catch_warnings():  # torch warns that a read-only memory map is not writable
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(checkpoint.read(checkpoint.inventory[key]))

    prepare(the_plan, fetch, destinations).write()

    assert {k: v.data_ptr() for k, v in destinations.items()} == pointers
    assert_holds(holder, tiny_checkpoint, rename=lambda key: "module." + key)


# -- no plan: torch's own call, its own error, with ckptshim's diagnosis as a note -----------------


@pytest.mark.parametrize("strict", [True, False])
def test_wrong_shape_is_torchs_size_mismatch_with_a_note(tiny, tiny_checkpoint, strict):
    """No rule mends a shape: torch's own ``size mismatch`` (in both modes, as torch raises it),
    torch's writes, and ckptshim's diagnosis as a note that says so."""
    tiny_checkpoint["layers.1.fc1.weight"] = tiny_checkpoint["layers.1.fc1.weight"][:, :-1]
    model, native_model = tiny.build(seed=10), tiny.build(seed=10)
    error = same_error(raised(lambda: model.load_state_dict(tiny_checkpoint, strict=strict)),
                       raised(lambda: natively(lambda: native_model.load_state_dict(tiny_checkpoint, strict=strict))))
    assert "size mismatch for layers.1.fc1.weight" in str(error)
    assert ("layers.1.fc1.weight: target shape (128, 64) but checkpoint layers.1.fc1.weight has (128, 63)"
            in diagnosis(error))
    assert "loads in no mode, strict or not" in diagnosis(error)
    assert fingerprint(model) == fingerprint(native_model)


def test_missing_parameter_strict_names_it_and_its_nearest_candidates(compiled, tiny_checkpoint):
    """Renaming cannot make up for a key the checkpoint lacks: torch's own error, unchanged,
    with the key ckptshim found missing and its nearest candidates as a note."""
    del tiny_checkpoint["ln_f.bias"]
    before = fingerprint(compiled)
    error = same_error(raised(lambda: compiled.load_state_dict(tiny_checkpoint)),
                       raised(lambda: natively(lambda: compiled.load_state_dict(tiny_checkpoint))))
    assert str(error).startswith("Error(s) in loading state_dict for OptimizedModule:")
    assert "_orig_mod.ln_f.bias (nearest in checkpoint: " in diagnosis(error)
    assert fingerprint(compiled) == before  # no name matched: torch wrote nothing


def test_non_strict_load_reports_what_did_not_match(tiny, compiled, tiny_checkpoint):
    """What a non-strict load leaves is reported as torch reports it had the names matched: a
    key the checkpoint lacks as missing, one the module has no place for (a legacy buffer too) as
    unexpected."""
    del tiny_checkpoint["ln_f.bias"]
    tiny_checkpoint["head.extra"] = torch.zeros(3)
    tiny_checkpoint["layers.0.attention.masked_bias"] = torch.tensor(-1e9)  # legacy: not loaded
    expected = {k: v for k, v in tiny_checkpoint.items() if k not in ("head.extra", "layers.0.attention.masked_bias")}
    bias = compiled.state_dict()["_orig_mod.ln_f.bias"].clone()

    result = compiled.load_state_dict(tiny_checkpoint, strict=False)

    assert result.missing_keys == ["_orig_mod.ln_f.bias"]
    assert sorted(result.unexpected_keys) == ["head.extra", "layers.0.attention.masked_bias"]
    state = compiled.state_dict()
    assert all(torch.equal(state["_orig_mod." + k], v) for k, v in expected.items())
    assert torch.equal(state["_orig_mod.ln_f.bias"], bias)


# -- refusals: each a clear error, the model unchanged ------------------------------------------


def test_two_checkpoint_keys_for_one_parameter_is_ambiguous(tiny, tiny_checkpoint, process_group):
    from torch.nn.parallel import DistributedDataParallel

    tiny_checkpoint["_orig_mod.lm_head.weight"] = torch.zeros_like(tiny_checkpoint["lm_head.weight"])
    ddp = DistributedDataParallel(tiny.build(seed=11))
    before = fingerprint(ddp)
    with pytest.raises(PlanError, match=r"'lm_head\.weight' and '_orig_mod\.lm_head\.weight' both mean 'lm_head\.weight'"):
        ddp.load_state_dict(tiny_checkpoint, strict=False)
    assert fingerprint(ddp) == before


class Payload:
    """A global that ``weights_only`` does not allow; unpickling it would run ``__setstate__``."""

    ran = False

    def __setstate__(self, state) -> None:
        Payload.ran = True


def test_pickle_with_a_forbidden_global_is_refused_naming_it(tiny, tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"lm_head.weight": torch.zeros(256, 64), "payload": Payload()}, path)
    model = tiny.build(seed=12)
    before = fingerprint(model)
    with pytest.raises(UnsafeCheckpointError, match=rf"{__name__}\.Payload"):
        open_checkpoint(path)
    assert not Payload.ran
    assert fingerprint(model) == before


def test_truncated_file_is_refused(tiny, tmp_path):
    path = tmp_path / "model.pt"
    shutil.copyfile(TINY / "torch_save" / "model.pt", path)
    with open(path, "r+b") as file:
        file.truncate(path.stat().st_size // 2)
    model = tiny.build(seed=13)
    before = fingerprint(model)
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        torch_pickle.open_checkpoint(path)
    with pytest.raises(ShimError, match="truncated"):  # detection no longer recognises the zip
        open_checkpoint(path)
    with pytest.raises(RuntimeError):
        model.load_state_dict(torch.load(path, weights_only=True))
    assert fingerprint(model) == before


def test_non_tensor_value_in_a_strict_load_is_torchs_unexpected_key(tiny, tiny_checkpoint):
    tiny_checkpoint["_orig_mod.note"] = "trained for 3 epochs"
    model, native_model = tiny.build(seed=14), tiny.build(seed=14)
    error = same_error(raised(lambda: model.load_state_dict(tiny_checkpoint)),
                       raised(lambda: natively(lambda: native_model.load_state_dict(tiny_checkpoint))))
    assert 'Unexpected key(s) in state_dict: "_orig_mod.note"' in str(error)
    assert "state_dict['_orig_mod.note'] is a str, not a tensor" in diagnosis(error)
    assert fingerprint(model) == fingerprint(native_model)


# -- what modules do on load themselves keeps working --------------------------------------------


class Versioned(nn.Linear):
    """A module that upgrades old checkpoints by the version in ``state_dict._metadata``."""

    _version = 2
    seen: list = []

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args) -> None:
        Versioned.seen.append(local_metadata.get("version"))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)


def test_version_metadata_follows_the_renamed_keys():
    saved = nn.Sequential(Versioned(3, 3)).state_dict()
    holder = nn.Module()
    holder.module = nn.Sequential(Versioned(3, 3))
    Versioned.seen.clear()
    holder.load_state_dict(saved)
    assert Versioned.seen == [2]
    assert torch.equal(holder.module[0].weight, saved["0.weight"])


def test_module_that_completes_its_own_state_dict_is_left_to_torch():
    """BatchNorm keeps its own ``num_batches_tracked`` for checkpoints older than its version 2."""
    torch.manual_seed(0)
    old = nn.BatchNorm1d(4)
    old.running_mean.normal_()
    saved = old.state_dict()
    del saved["num_batches_tracked"]
    saved._metadata[""]["version"] = 1
    model = nn.BatchNorm1d(4)
    model.num_batches_tracked.fill_(5)
    model.load_state_dict(saved)  # strict: ckptshim alone would call num_batches_tracked missing
    assert model.num_batches_tracked.item() == 5
    assert torch.equal(model.running_mean, saved["running_mean"])


class Positions(nn.Module):
    def __init__(self, rotary: bool = False) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("position_ids", torch.arange(8).expand((1, -1)))
        if rotary:
            self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 4, 2).float() / 4)))


def test_meta_buffer_is_recomputed_or_refused():
    checkpoint = {k: v for k, v in Positions().state_dict().items() if k.startswith("proj.")}
    with torch.device("meta"):
        model = Positions()
    model.load_state_dict(checkpoint, assign=True)
    assert torch.equal(model.position_ids, torch.arange(8).expand((1, -1)))
    assert torch.equal(model.proj.weight, checkpoint["proj.weight"])

    with torch.device("meta"):
        rotary = Positions(rotary=True)
    with pytest.raises(PlanError, match=r"'inv_freq' is a buffer on the meta device"):
        rotary.load_state_dict(checkpoint, assign=True)
    assert rotary.proj.weight.is_meta


# -- install / uninstall ---------------------------------------------------------------------------


def test_uninstall_brings_back_torchs_error_and_install_restores_the_shim(compiled, tiny_checkpoint):
    ckptshim.uninstall(("torch",))
    try:
        assert not hasattr(nn.Module.__dict__["load_state_dict"], "__wrapped__")
        with pytest.raises(RuntimeError, match="Missing key") as error:
            compiled.load_state_dict(tiny_checkpoint)
        assert not isinstance(error.value, ShimError)
    finally:
        ckptshim.install(("torch",))
        ckptshim.install(("torch",))  # idempotent
    assert hasattr(nn.Module.__dict__["load_state_dict"], "__wrapped__")
    compiled.load_state_dict(tiny_checkpoint)
    assert_holds(compiled, tiny_checkpoint, rename=lambda key: "_orig_mod." + key)


def test_matching_state_dict_goes_straight_to_torch(tiny, tiny_checkpoint, shim_log):
    shim_log.set_level(logging.DEBUG, logger="ckptshim")  # a planned load would log its plan here
    model = tiny.build(seed=15)
    result = model.load_state_dict(OrderedDict(tiny_checkpoint))
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert_holds(model, tiny_checkpoint)
    assert shim_log.text == ""
