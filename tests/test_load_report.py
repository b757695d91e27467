"""What a user reads when a load does not fit, and the report of one that loads (issue 27).

Each test is a load or a command as a user runs it, against checkpoints written by the real
library's own save path (transformers' ``save_pretrained``, ``torch.save``, ``dcp.save``): the
first line of ckptshim's note on the framework's own error, the advice under it, the grouped
listing of per-layer keys, the model-type headline, the INFO table, and ``CKPTSHIM_LOG``'s check.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

import ckptshim  # noqa: F401  (the hooks)
from ckptshim.cli import main
from support.native import diagnosis, failure, raised
from support.processes import environment

transformers = pytest.importorskip("transformers")

LAYERS = 8


def note(error: BaseException) -> list[str]:
    text = diagnosis(error)
    assert text, f"no ckptshim note on {type(error).__name__}: {error}"
    return text.removeprefix("ckptshim: ").splitlines()


class Stack(nn.Module):
    """A model of many layers, as a transformer is: ``layers.{0..7}.proj.weight``."""

    def __init__(self, width: int = 4, name: str = "proj") -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleDict({name: nn.Linear(width, width)}) for _ in range(LAYERS))


@pytest.fixture(scope="module")
def gpt2_and_llama(tmp_path_factory):
    """A tiny GPT-2 and a tiny Llama, each saved by ``save_pretrained`` (config.json included)."""
    root = tmp_path_factory.mktemp("models")
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0,
        eos_token_id=0)).save_pretrained(root / "gpt2")
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=16, intermediate_size=32, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=64)).save_pretrained(root / "llama")
    return root / "gpt2", root / "llama"


# -- the model type first ---------------------------------------------------------------------------


def test_plan_of_another_models_checkpoint_says_the_model_types_first(gpt2_and_llama, capsys):
    gpt2, llama = gpt2_and_llama
    assert main(["plan", str(gpt2), "--like", str(llama)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ("the checkpoint is a model of type gpt2, the target a model of type llama: "
                      "a checkpoint of another model, which no rule turns into this one.")
    assert "nearest" not in "\n".join(out)
    assert main(["plan", str(gpt2), "--like", str(llama), "--json"]) == 1
    info = json.loads(capsys.readouterr().out)
    assert info["headline"] == out[0] and not info["complete"]


def test_convert_onto_another_model_refuses_with_the_model_types_and_no_guesses(gpt2_and_llama, tmp_path, capsys):
    gpt2, llama = gpt2_and_llama
    assert main(["convert", str(gpt2), str(tmp_path / "out"), "--to", "safetensors", "--like", str(llama)]) == 1
    err = capsys.readouterr().err
    first, *rest = err.splitlines()
    assert first == (f"ckptshim: checkpoint {gpt2} does not fit target {llama}: the checkpoint is a model of "
                     "type gpt2, the target a model of type llama: a checkpoint of another model, which no "
                     "rule turns into this one.")
    assert "nearest" not in err and "non-strictly" not in err
    assert "  model.layers.{0..1}.self_attn.q_proj.weight" in rest  # grouped, without a guess beside it
    assert rest[-1] == ("Load a checkpoint of a llama model, or build the model from the checkpoint's own "
                        "config.json (a gpt2 model).")
    assert not (tmp_path / "out").exists()


def test_same_model_type_says_nothing_of_model_types(gpt2_and_llama, capsys):
    gpt2, _ = gpt2_and_llama
    assert main(["plan", str(gpt2), "--like", str(gpt2)]) == 0
    assert "model of type" not in capsys.readouterr().out


def test_a_like_module_returning_a_transformers_model_names_its_type(gpt2_and_llama, tmp_path, capsys, monkeypatch):
    gpt2, _ = gpt2_and_llama
    (tmp_path / "tiny_llama.py").write_text(
        "import transformers\n\ndef build():\n    return transformers.LlamaForCausalLM(transformers.LlamaConfig(\n"
        "        num_hidden_layers=2, hidden_size=16, intermediate_size=32, num_attention_heads=2,\n"
        "        num_key_value_heads=2, vocab_size=64))\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["plan", str(gpt2), "--like", "tiny_llama:build"]) == 1
    assert capsys.readouterr().out.splitlines()[0].startswith(
        "the checkpoint is a model of type gpt2, the target a model of type llama")


# -- advice that fits the case ----------------------------------------------------------------------


def test_shape_mismatch_note_shows_both_shapes_and_never_offers_a_non_strict_load(tmp_path):
    saved = Stack(width=5).state_dict()
    torch.save(saved, tmp_path / "wide.pt")
    model = Stack(width=4)
    with pytest.raises(RuntimeError) as raised:
        model.load_state_dict(torch.load(tmp_path / "wide.pt"))
    assert str(raised.value).startswith("Error(s) in loading state_dict for Stack:")  # torch's own
    lines = note(raised.value)
    assert lines[0] == "checkpoint state_dict does not fit target Stack module:"
    assert lines[1] == f"{2 * LAYERS} key(s) match by name but not by shape:"
    assert ("  layers.{0..7}.proj.weight: target shape (4, 4) but checkpoint layers.{0..7}.proj.weight "
            "has (5, 5)") in lines
    assert lines[-1] == ("A key whose shape differs loads in no mode, strict or not: build the target "
                         "with the checkpoint's configuration, or leave that key out.")
    assert "non-strict" not in diagnosis(raised.value) and "rule" not in diagnosis(raised.value)


def test_names_that_differ_get_the_callers_own_non_strict_load_and_grouped_keys(tmp_path):
    torch.save(Stack(name="dense").state_dict(), tmp_path / "old.pt")
    with pytest.raises(RuntimeError) as raised:
        Stack(name="proj").load_state_dict(torch.load(tmp_path / "old.pt"))
    lines = note(raised.value)
    assert lines[1] == f"{2 * LAYERS} key(s) the target needs are not in the checkpoint:"
    assert lines[2] == "  layers.{0..7}.proj.weight (nearest in checkpoint: layers.{0..7}.dense.weight)"
    assert "  layers.{0..7}.dense.weight" in lines
    assert len(lines) == 8  # header, two kinds of two grouped lines each, and the advice
    assert lines[-1] == ("The names differ and no rule of ckptshim maps them: rename the keys to the "
                         "target's before loading, or load non-strictly (load_state_dict(..., strict=False)), "
                         "which leaves what is missing as the target was initialised and ignores what has "
                         "no place. `ckptshim plan CHECKPOINT --like TARGET` lists every key.")


def test_accelerate_optimizer_folder_loaded_as_a_model_is_told_it_holds_optimizer_state(tmp_path):
    """Accelerate's ``save_fsdp_optimizer`` writes ``optimizer_0`` as ``dcp.save({"optimizer":
    optimizer state dict})``; the state dict here is torch's own, of a trained AdamW."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    folder = tmp_path / "optimizer_0"
    dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=folder)
    error = failure(raised(lambda: dcp.load(model.state_dict(), checkpoint_id=folder)))
    assert str(error) == "Missing key in checkpoint state_dict: 0.bias."  # DCP's own error
    lines = note(error)
    assert lines[0] == (f"checkpoint {folder} does not fit target the state dict passed to dcp.load: the "
                        "checkpoint holds optimizer state (state.<parameter>.exp_avg: exp_avg, exp_avg_sq, "
                        "step), not model weights.")
    assert "  {0..1}.weight" in lines
    assert "nearest" not in diagnosis(error) and "non-strictly" not in diagnosis(error)
    assert "pytorch_model_fsdp_0" in lines[-1] and "set_optimizer_state_dict" in lines[-1]


def test_dcp_missing_keys_offer_dcps_own_partial_load(tmp_path):
    dcp.save(Stack(name="dense").state_dict(), checkpoint_id=tmp_path / "ckpt")
    error = failure(raised(lambda: dcp.load(Stack(name="proj").state_dict(), checkpoint_id=tmp_path / "ckpt")))
    assert "planner=DefaultLoadPlanner(allow_partial_load=True)" in note(error)[-1]


# -- the report: grouped keys, the table, CKPTSHIM_LOG ----------------------------------------------


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=environment(env), check=False)


LOAD_INTO_COMPILED = f"""
import ckptshim, torch
from torch import nn
class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleDict({{"proj": nn.Linear(4, 4)}}) for _ in range({LAYERS}))
saved = Stack().state_dict()
model = torch.compile(Stack())
model.load_state_dict(saved)
print("loaded", all(torch.equal(model.state_dict()["_orig_mod." + k], v) for k, v in saved.items()))
"""


def test_info_shows_a_table_of_grouped_keys_and_default_stays_quiet():
    quiet = run_python(LOAD_INTO_COMPILED)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stdout.strip() == "loaded True" and "ckptshim" not in quiet.stderr
    info = run_python(LOAD_INTO_COMPILED, CKPTSHIM_LOG="info")
    assert info.returncode == 0, info.stderr
    lines = [line for line in info.stderr.splitlines() if line.startswith(("ckptshim:", "  "))]
    assert lines[0].startswith(f"ckptshim: load_state_dict(OptimizedModule): {2 * LAYERS} renamed (")
    assert lines[1].split() == ["Key", "|", "Status", "|", "Details"]
    rows = [" ".join(line.split()) for line in lines[3:]]
    assert rows == ["_orig_mod.layers.{0..7}.proj.weight | renamed | from layers.{0..7}.proj.weight",
                    "_orig_mod.layers.{0..7}.proj.bias | renamed | from layers.{0..7}.proj.bias"]


@pytest.mark.parametrize("value", ["WARNING", "off"])
def test_ckptshim_log_levels_that_print_no_load_summary(value):
    run = run_python(LOAD_INTO_COMPILED, CKPTSHIM_LOG=value)
    assert run.returncode == 0, run.stderr
    assert "renamed" not in run.stderr and "RuntimeWarning" not in run.stderr


def test_an_unknown_ckptshim_log_value_is_a_warning_naming_the_valid_ones_not_info():
    run = run_python(LOAD_INTO_COMPILED, CKPTSHIM_LOG="verbose")
    assert run.returncode == 0, run.stderr  # import ckptshim still works, and so does the load
    assert run.stdout.strip() == "loaded True"
    assert ("RuntimeWarning: CKPTSHIM_LOG='verbose' is not a level ckptshim knows; use debug, info, "
            "warning, or 0/off for none. ckptshim adds no log output.") in run.stderr
    assert "renamed" not in run.stderr


def test_plan_prints_a_table_and_inspect_groups_layers(tmp_path, capsys):
    from safetensors.torch import save_file

    save_file(Stack().state_dict(), tmp_path / "plain.safetensors")
    save_file({"_orig_mod." + k: v for k, v in Stack().state_dict().items()}, tmp_path / "compiled.safetensors")
    assert main(["plan", str(tmp_path / "plain.safetensors"), "--like", str(tmp_path / "compiled.safetensors")]) == 0
    out = [" ".join(line.split()) for line in capsys.readouterr().out.splitlines()]
    assert out[0].startswith(f"{2 * LAYERS} renamed (")
    assert "_orig_mod.layers.{0..7}.proj.weight | renamed | from layers.{0..7}.proj.weight" in out
    assert "layers.{0..7}.proj.weight -> rename -> _orig_mod.layers.{0..7}.proj.weight" in out  # the plan
    assert main(["inspect", str(tmp_path / "plain.safetensors")]) == 0
    out = [" ".join(line.split()) for line in capsys.readouterr().out.splitlines()]
    assert "layers.{0..7}.proj.weight float32 (4, 4) 64 B each, 8 arrays" in out
    assert not any(line.startswith("layers.3.") for line in out)


def test_table_gives_a_subtree_left_on_disk_one_row_and_keeps_keys_beside_loaded_ones(tmp_path, capsys):
    """A checkpoint holding an optimizer's state beside the model, planned into the model alone:
    the whole ``optim`` subtree is one row with its count; an extra key among the loaded layers
    is its own row."""
    from safetensors.torch import save_file

    model = Stack().state_dict()
    optim = {f"optim.{moment}.layers.{i}.proj.weight": torch.zeros(4, 4)
             for moment in ("exp_avg", "exp_avg_sq") for i in range(LAYERS)}
    save_file({**model, **optim, "layers.0.proj.scale": torch.ones(4)}, tmp_path / "full.safetensors")
    save_file({"_orig_mod." + k: v for k, v in model.items()}, tmp_path / "compiled.safetensors")
    incomplete = main(["plan", str(tmp_path / "full.safetensors"), "--like", str(tmp_path / "compiled.safetensors")])
    out = [" ".join(line.split()) for line in capsys.readouterr().out.splitlines()]
    assert incomplete == 1 and out[0].endswith(f", {2 * LAYERS + 1} unexpected")
    rows = [line for line in out if " | " in line]
    assert rows[-2:] == ["layers.0.proj.scale | unexpected |", f"optim.* | unexpected | {2 * LAYERS} keys"]
    assert "optim.exp_avg_sq.layers.{0..7}.proj.weight -> unexpected" in out  # the plan below has every key
