"""Loads that went wrong without a word, or broke where torch alone loads (issue 15), as regression
tests through the real libraries: torch modules, checkpoints written by ``torch.save``, DDP,
safetensors and transformers' ``save_pretrained``, loaded through the hooked calls.

Every refusal is checked to leave the destination exactly as it was; every load ckptshim has no
plan for, to be torch's own (its error, its writes), with ckptshim's diagnosis as a note.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import ckptshim
from ckptshim.errors import AmbiguousNameError
from ckptshim.formats.detect import open_checkpoint
from support.fixtures import FIXTURES
from support.markers import QUIET
from support.native import diagnosis, natively, raised, same_error

pytestmark = QUIET


def fingerprint(module: nn.Module) -> dict[str, str]:
    """Every parameter and buffer: dtype, shape and a hash of its bytes."""
    return {name: f"{t.dtype}{list(t.shape)}" + hashlib.sha256(
                t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()
            for name, t in [*module.named_parameters(), *module.named_buffers()]}


def saved(state: dict, path: Path) -> dict:
    """``state`` as a checkpoint file gives it back: ``torch.save``, then ``torch.load(weights_only=True)``."""
    torch.save(state, path)
    return torch.load(path, weights_only=True)


@pytest.fixture
def shim_log(caplog):
    caplog.set_level(logging.INFO, logger="ckptshim")
    return caplog



# -- a trained attention.bias is not the causal-mask buffer --------------------------------------


class Block(nn.Module):
    """An attention projection that happens to be named ``attention``."""

    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.attention = nn.Linear(8, 8, bias=bias)
        self.norm = nn.LayerNorm(8)


class Net(nn.Module):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.layer = Block(bias)


@pytest.mark.parametrize("strict_mode", ["", "1"])
def test_trained_attention_bias_is_not_dropped_as_the_causal_mask(tmp_path, monkeypatch, strict_mode):
    monkeypatch.setenv("CKPTSHIM_STRICT", strict_mode)
    torch.manual_seed(0)
    checkpoint = saved(Net(bias=True).state_dict(), tmp_path / "trained.pt")
    model, strict_native = Net(bias=False), Net(bias=False)
    # strict: not the mask, so no plan -- torch's own "unexpected key", with ckptshim's reason as a note
    error = same_error(raised(lambda: model.load_state_dict(checkpoint)),
                       raised(lambda: natively(lambda: strict_native.load_state_dict(checkpoint))))
    assert 'Unexpected key(s) in state_dict: "layer.attention.bias"' in str(error)
    assert re.search(r"'layer\.attention\.bias' is named like the derivable buffer 'attention\.bias'.*"
                     r"shaped \[8\], not a square causal mask", diagnosis(error))
    assert fingerprint(model) == fingerprint(strict_native)

    # non-strict: exactly what torch alone does -- the weights loaded, the bias listed as unexpected
    native_model = Net(bias=False)
    native = natively(lambda: native_model.load_state_dict(checkpoint, strict=False))
    result = model.load_state_dict(checkpoint, strict=False)
    assert result == native and result.unexpected_keys == ["layer.attention.bias"]
    assert fingerprint(model) == fingerprint(native_model)


def test_legacy_buffers_are_dropped_only_when_their_values_are_the_derived_ones(shim_log):
    """A causal ``attention.bias`` of a sliding window, an ``inv_freq`` of another rotary base and a
    ``masked_bias`` that is no family's constant are not what the rules derive: refused."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                           intermediate_size=64)
    torch.manual_seed(0)
    model = GPTNeoXForCausalLM(config)
    legacy = {"gpt_neox.layers.0.attention.bias": torch.ones(8, 8, dtype=torch.bool).tril()[None, None],
              "gpt_neox.layers.0.attention.masked_bias": torch.tensor(-1e9),
              "gpt_neox.layers.0.attention.rotary_emb.inv_freq": model.gpt_neox.rotary_emb.inv_freq.clone()}
    model.load_state_dict({**model.state_dict(), **legacy})
    assert "3 dropped (attention.bias, attention.masked_bias, inv_freq)" in shim_log.text

    window = torch.ones(8, 8, dtype=torch.bool).tril() & ~torch.ones(8, 8, dtype=torch.bool).tril(-4)
    wrong = {"attention.bias": (window[None, None], "not a lower-triangular mask of ones"),
             "attention.masked_bias": (torch.tensor(-3.0), "-3.0, none of the constants"),
             "attention.rotary_emb.inv_freq": (legacy["gpt_neox.layers.0.attention.rotary_emb.inv_freq"] / 2,
                                               "not equal to the target's own inv_freq")}
    before = fingerprint(model)
    for name, (value, why) in wrong.items():  # not the derived value: torch's own "unexpected key"
        state = {**model.state_dict(), **legacy, f"gpt_neox.layers.0.{name}": value}
        error = same_error(raised(lambda: model.load_state_dict(state)),
                           raised(lambda: natively(lambda: model.load_state_dict(state))))
        assert f'"gpt_neox.layers.0.{name}"' in str(error) and why in diagnosis(error)
        assert fingerprint(model) == before  # every other value the state dict gives is the model's own


def test_a_state_dicts_trained_attention_bias_is_not_kept_as_a_derived_buffer(tmp_path):
    """``set_model_state_dict`` and ``dcp.load`` plan against state dicts, where nothing says what
    is a buffer: a trained ``attention.bias`` the checkpoint lacks is missing, not 'kept'."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    torch.manual_seed(1)
    checkpoint = saved({"_orig_mod." + k: v for k, v in Net(bias=False).state_dict().items()},
                       tmp_path / "compiled.pt")
    model = Net(bias=True)
    before = fingerprint(model)
    with pytest.raises(RuntimeError, match=r"layer\.attention\.bias"):
        set_model_state_dict(model, checkpoint, options=StateDictOptions(strict=True))
    assert fingerprint(model) == before

    state = model.state_dict()
    with pytest.raises(BaseException, match=r"layer\.attention\.bias"):  # DCP's CheckpointException
        dcp.load(state, checkpoint_id=str(tmp_path / "compiled.pt"))
    assert fingerprint(model) == before


# -- DDP's module. prefix against a submodule literally named module -------------------------------


class Holder(nn.Module):
    """A top-level ``weight`` and a submodule literally named ``module``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4))
        self.module = nn.Linear(4, 4, bias=False)


@pytest.mark.parametrize("strict", [True, False])
def test_ddp_checkpoint_into_a_model_with_a_submodule_named_module_is_ambiguous(tmp_path, process_group, strict):
    torch.manual_seed(2)
    trained = nn.parallel.DistributedDataParallel(Holder())
    checkpoint = saved(trained.state_dict(), tmp_path / "ddp.pt")
    assert sorted(checkpoint) == ["module.module.weight", "module.weight"]
    model = Holder()
    before = fingerprint(model)
    with pytest.raises(AmbiguousNameError, match=r"checkpoint key 'module\.weight' has two readings: by its "
                                                 r"exact name it is target 'module\.weight', and without "
                                                 r"wrapper components it is 'weight'.*'module\.module\.weight'"):
        model.load_state_dict(checkpoint, strict=strict)
    assert fingerprint(model) == before

    # the same checkpoint into the DDP-wrapped model it was saved from loads as it is
    again = nn.parallel.DistributedDataParallel(Holder())
    again.load_state_dict(checkpoint, strict=strict)
    assert torch.equal(again.module.weight, trained.module.weight)
    assert torch.equal(again.module.module.weight, trained.module.module.weight)


# -- a Hugging Face folder holding model.safetensors and an index of other files -------------------


def _tiny_gptneox():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                           intermediate_size=64)
    torch.manual_seed(3)
    return GPTNeoXForCausalLM(config)


@pytest.mark.parametrize("index", ["pytorch_model.bin.index.json", "model.safetensors.index.json"])
def test_hugging_face_folder_reads_the_file_transformers_reads(tmp_path, index):
    """``save_pretrained`` writes ``model.safetensors``; an index of other (zeroed) shards beside
    it is what an older save left. transformers reads ``model.safetensors``: so does ckptshim."""
    import torch.distributed.checkpoint as dcp
    from huggingface_hub import save_torch_state_dict
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from transformers import GPTNeoXForCausalLM

    folder = tmp_path / "model"
    _tiny_gptneox().save_pretrained(folder)
    stale = {k: torch.zeros_like(v) for k, v in GPTNeoXForCausalLM.from_pretrained(folder).state_dict().items()}
    (tmp_path / "stale").mkdir()
    save_torch_state_dict(stale, tmp_path / "stale", max_shard_size=20_000,
                          safe_serialization=index.startswith("model.safetensors"))
    for path in (tmp_path / "stale").iterdir():
        path.rename(folder / path.name)
    assert (folder / index).is_file() and (folder / "model.safetensors").is_file()

    loaded = GPTNeoXForCausalLM.from_pretrained(folder).state_dict()  # what transformers reads ...
    expected = load_file(folder / "model.safetensors")  # ... is this file, not the index's shards
    assert all(torch.equal(loaded[key], value) for key, value in expected.items() if key in loaded)
    assert open_checkpoint(folder).version == "model.safetensors"
    state = _tiny_gptneox().state_dict()
    dcp.load(state, checkpoint_id=str(folder), planner=DefaultLoadPlanner(allow_partial_load=True))
    assert set(state) - set(expected) == {"lm_head.weight"}  # saved as embed_out.weight, a rename DCP lacks
    for key, value in expected.items():
        if key in state:
            assert torch.equal(state[key], value), key


def test_hugging_face_folder_follows_config_transformers_weights(tmp_path):
    """``config.json``'s ``transformers_weights`` names the weights file ahead of the usual names."""
    from transformers import GPTNeoXForCausalLM
    from safetensors.torch import save_file

    folder = tmp_path / "model"
    _tiny_gptneox().save_pretrained(folder)
    chosen = {k: v + 1 for k, v in GPTNeoXForCausalLM.from_pretrained(folder).state_dict().items()}
    save_file(chosen, folder / "chosen.safetensors")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "transformers_weights": "chosen.safetensors"}))
    expected = GPTNeoXForCausalLM.from_pretrained(folder).state_dict()
    assert all(torch.equal(expected[k], v) for k, v in chosen.items())
    checkpoint = open_checkpoint(folder)
    assert checkpoint.version == "chosen.safetensors"
    assert all(torch.equal(torch.from_numpy(checkpoint.read(e).copy()), chosen[".".join(e.key)])
               for e in checkpoint.inventory.values())


# -- CKPTSHIM_STRICT=1 refuses every narrowing cast -------------------------------------------------------


@pytest.mark.parametrize("call", ["load_state_dict", "set_model_state_dict", "dcp.load"])
def test_strict_mode_refuses_a_narrowing_cast_where_names_already_match(tmp_path, monkeypatch, call):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    monkeypatch.setenv("CKPTSHIM_STRICT", "1")
    torch.manual_seed(4)
    path = tmp_path / "fp32.pt"
    torch.save(nn.Linear(4, 4).state_dict(), path)
    model = nn.Linear(4, 4).to(torch.bfloat16)
    before = fingerprint(model)
    loads = {"load_state_dict": lambda: model.load_state_dict(torch.load(path, weights_only=True)),
             "set_model_state_dict": lambda: set_model_state_dict(model, torch.load(path, weights_only=True)),
             "dcp.load": lambda: dcp.load(model.state_dict(), checkpoint_id=str(path))}
    with pytest.raises(BaseException, match=r"2 key\(s\) match by name and shape but not by dtype") as error:
        loads[call]()
    assert "not by shape" not in str(error.value)
    assert "weight: target dtype bfloat16 but checkpoint weight has float32" in str(error.value)
    assert fingerprint(model) == before


def test_without_strict_mode_a_cast_loads_and_is_reported(tmp_path, shim_log):
    torch.manual_seed(5)
    source = nn.Linear(4, 4)
    model = nn.Linear(4, 4).to(torch.bfloat16)
    model.load_state_dict(saved(source.state_dict(), tmp_path / "fp32.pt"))
    assert torch.equal(model.weight, source.weight.to(torch.bfloat16))
    assert "load_state_dict(Linear): 2 cast (float32 -> bfloat16)" in shim_log.text


# -- load_state_dict(strict=False) with non-tensor entries, as torch does -------------------------------


def test_non_strict_load_with_a_non_tensor_entry_is_torchs(tmp_path):
    torch.manual_seed(6)
    trained = nn.Linear(4, 4)
    checkpoint = saved({**trained.state_dict(), "epoch": 3}, tmp_path / "with_epoch.pt")
    native_model, model = nn.Linear(4, 4), nn.Linear(4, 4)
    native = natively(lambda: native_model.load_state_dict(checkpoint, strict=False))
    assert model.load_state_dict(checkpoint, strict=False) == native
    assert native.unexpected_keys == ["epoch"] and fingerprint(model) == fingerprint(native_model)

    # the same beside keys ckptshim renames: the weights load, `epoch` is reported as torch reports it
    compiled = {"_orig_mod." + k: v for k, v in checkpoint.items() if k != "epoch"} | {"epoch": 3}
    renamed = nn.Linear(4, 4)
    assert renamed.load_state_dict(compiled, strict=False).unexpected_keys == ["epoch"]
    assert torch.equal(renamed.weight, trained.weight) and torch.equal(renamed.bias, trained.bias)

    # where torch refuses a non-tensor, ckptshim has no plan: torch's own error, with a note
    for state, strict in ((compiled, True), ({**compiled, "weight": 3}, False)):
        fresh = nn.Linear(4, 4)
        native_model = copy.deepcopy(fresh)
        error = same_error(raised(lambda: fresh.load_state_dict(state, strict=strict)),
                           raised(lambda: natively(lambda: native_model.load_state_dict(state, strict=strict))))
        assert "is a int, not a tensor" in diagnosis(error)
        assert fingerprint(fresh) == fingerprint(native_model)


def test_the_real_pythia_checkpoint_still_loads_with_every_legacy_buffer_checked(shim_log):
    """transformers 4.30's GPT-NeoX buffers are what the rules say: a causal mask, -1e9, and the
    model's own ``inv_freq`` -- so they are dropped, and every weight loads bit for bit."""
    from safetensors.torch import load_file
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    folder = FIXTURES / "hf_gptneox_tf4.30.2" / "safetensors"
    checkpoint = load_file(folder / "model.safetensors")
    shim_log.set_level(logging.DEBUG, logger="ckptshim")
    model = GPTNeoXForCausalLM(GPTNeoXConfig.from_pretrained(folder))
    result = model.load_state_dict(checkpoint)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert "gpt_neox.layers.{0..1}.attention.bias -> drop(attention.bias) once its value is checked" in shim_log.text
    assert torch.equal(model.lm_head.weight, checkpoint["embed_out.weight"])
