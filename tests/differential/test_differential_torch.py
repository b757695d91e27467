"""Every torch checkpoint the suite has, through every torch call ckptshim hooks, compared with the
call alone (see ``compare_loads``).

Each checkpoint goes into the model it was written from (for the Hugging Face folders, today's
model class of their ``config.json``), through ``load_state_dict``, ``set_model_state_dict`` and
``dcp.load``, strict and not; GPT-NeoX pipeline layer files into their layers, as DeepSpeed's
``load_state_dir`` loads them. What the checkpoint holds comes from its own library, not from
ckptshim: ``from_pretrained`` for the Hugging Face folders, ``torch.load`` for the rest.
"""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Callable, Mapping
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from compare_loads import Load, compare, module_tensors, prints
from support.fixtures import FIXTURES, fixture_module, writable_copy

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning",
                                        "ignore::DeprecationWarning")

TINY = FIXTURES / "torch_dcp_single"
HF_FOLDERS = {
    "tf4.30 bin": FIXTURES / "hf_gptneox_tf4.30.2" / "pytorch_model_bin",
    "tf4.30 safetensors": FIXTURES / "hf_gptneox_tf4.30.2" / "safetensors",
    "tf5 resaved": FIXTURES / "hf_gptneox_tf5_resaved" / "save_pretrained_default",
    "tf5 resaved (safe_serialization=False)": FIXTURES / "hf_gptneox_tf5_resaved" / "save_pretrained_safe_false",
    **{f"neox {run} hf": FIXTURES / "neox_deepspeed" / run / "hf" for run in ("pp1_mp1", "pp2_mp2", "old_pp1_mp1")},
}
STRICT = [True, False]


# -- destinations and what they hold --------------------------------------------------------------


def flat_tensors(state: Mapping[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    """A (nested) state dict's tensors under DCP's flat names."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if isinstance(value, Mapping):
            out.update(flat_tensors(value, f"{prefix}{key}."))
        elif isinstance(value, torch.Tensor):
            out[f"{prefix}{key}"] = value
    return out


@cache
def tiny_module():
    return fixture_module("torch_dcp_single/dcp_tiny_model.py")


@cache
def _tiny_checkpoint() -> dict[str, torch.Tensor]:
    return torch.load(TINY / "torch_save" / "model.pt", weights_only=True)


def tiny_checkpoint() -> dict[str, torch.Tensor]:
    """The torch_save fixture's tensors, in a new dict each time (set_model_state_dict rewrites
    the dict it is given in place)."""
    return dict(_tiny_checkpoint())


@cache
def hf_truth(folder: Path) -> dict[str, tuple]:
    """What transformers itself loads from ``folder``: the model's state dict after ``from_pretrained``."""
    from transformers import GPTNeoXForCausalLM

    return prints(GPTNeoXForCausalLM.from_pretrained(folder).state_dict())


def hf_model(folder: Path) -> Callable[[], nn.Module]:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig.from_pretrained(folder)

    def fresh() -> nn.Module:
        torch.manual_seed(1234)
        return GPTNeoXForCausalLM(config).eval()
    return fresh


def read_folder(folder: Path) -> dict[str, torch.Tensor]:
    """The folder's weights as its own library reads them (no ckptshim involved)."""
    from safetensors.torch import load_file

    if (folder / "model.safetensors").is_file():
        return load_file(folder / "model.safetensors")
    return torch.load(folder / "pytorch_model.bin", weights_only=True)


# -- the three calls ----------------------------------------------------------------------------------


def module_load(name: str, fresh: Callable[[], nn.Module], state_dict: Callable[[], Mapping[str, Any]],
                strict: bool, truth: Mapping[str, tuple]) -> Load:
    return Load(f"{name}: load_state_dict(strict={strict})", fresh,
                lambda model: model.load_state_dict(state_dict(), strict=strict),
                module_tensors, lambda model, _: module_tensors(model), truth, complete=strict)


def setter_load(name: str, fresh: Callable[[], nn.Module], state_dict: Callable[[], Mapping[str, Any]],
                strict: bool, truth: Mapping[str, tuple]) -> Load:
    from torch.distributed.checkpoint import state_dict as setters

    def call(model: nn.Module) -> Any:
        return setters.set_model_state_dict(model, state_dict(), options=setters.StateDictOptions(strict=strict))
    return Load(f"{name}: set_model_state_dict(strict={strict})", fresh, call,
                module_tensors, lambda model, _: module_tensors(model), truth, complete=strict)


def dcp_load(name: str, fresh: Callable[[], dict], checkpoint: Path, strict: bool,
             truth: Mapping[str, tuple]) -> Load:
    """``dcp.load`` into a state dict, in place; not strict: ``DefaultLoadPlanner(allow_partial_load=True)``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    def call(state: dict) -> Any:
        return dcp.load(state, checkpoint_id=str(checkpoint),
                        planner=DefaultLoadPlanner(allow_partial_load=not strict))
    return Load(f"{name}: dcp.load(allow_partial_load={not strict})", fresh, call,
                flat_tensors, lambda state, _: flat_tensors(state), truth, complete=strict)


def model_state(fresh_model: Callable[[], nn.Module], nest: str | None = None) -> Callable[[], dict]:
    def fresh() -> dict:
        state = fresh_model().state_dict()
        return {nest: state} if nest else state
    return fresh


def nested_truth(truth: Mapping[str, tuple], nest: str | None) -> dict[str, tuple]:
    return {f"{nest}.{key}" if nest else key: value for key, value in truth.items()}


# -- Hugging Face GPT-NeoX folders ------------------------------------------------------------------


@pytest.mark.parametrize("strict", STRICT)
@pytest.mark.parametrize("folder", HF_FOLDERS.values(), ids=HF_FOLDERS.keys())
def test_hugging_face_folders(folder, strict):
    fresh, truth, name = hf_model(folder), hf_truth(folder), folder.relative_to(FIXTURES)
    verdicts = [compare(module_load(str(name), fresh, lambda: read_folder(folder), strict, truth)),
                compare(setter_load(str(name), fresh, lambda: read_folder(folder), strict, truth)),
                compare(dcp_load(str(name), model_state(fresh), folder, strict, truth))]
    assert all(verdicts)


# -- the torch_dcp_single model and its checkpoints ----------------------------------------------------


def tiny_fresh(compiled: bool = False) -> Callable[[], nn.Module]:
    def fresh() -> nn.Module:
        model = tiny_module().build(seed=21)
        return torch.compile(model) if compiled else model
    return fresh


def tiny_truth(prefix: str = "") -> dict[str, tuple]:
    return {prefix + key: value for key, value in prints(tiny_checkpoint()).items()}


@pytest.mark.parametrize("strict", STRICT)
def test_torch_save_file(strict):
    name = "torch_dcp_single/torch_save/model.pt"
    compare(module_load(name, tiny_fresh(), lambda: torch.load(TINY / "torch_save" / "model.pt",
                                                                weights_only=True), strict, tiny_truth()))
    compare(setter_load(name, tiny_fresh(), tiny_checkpoint, strict, tiny_truth()))
    compare(dcp_load(name, model_state(tiny_fresh()), TINY / "torch_save" / "model.pt", strict, tiny_truth()))


@pytest.mark.parametrize("strict", STRICT)
@pytest.mark.parametrize("folder, nest, compiled", [
    ("dcp_plain", "model", False), ("dcp_plain_toplevel", None, False), ("dcp_compiled", "model", True)])
def test_dcp_folders(folder, nest, compiled, strict):
    truth = tiny_truth("_orig_mod." if compiled else "")
    compare(dcp_load(f"torch_dcp_single/{folder}", model_state(tiny_fresh(compiled), nest), TINY / folder,
                     strict, nested_truth(truth, nest)))


# -- checkpoints the tests build with the libraries' own save paths -----------------------------------


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """A sharded Hugging Face folder (huggingface_hub's ``save_torch_state_dict``, as
    ``save_pretrained`` shards); a folder holding ``model.safetensors`` beside a stale
    ``pytorch_model.bin`` index of other values; a safetensors file of the tiny model."""
    from huggingface_hub import save_torch_state_dict
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("built")
    source = HF_FOLDERS["tf4.30 safetensors"]
    sharded = root / "hf_sharded"
    sharded.mkdir()
    save_torch_state_dict(read_folder(source), sharded, max_shard_size=300_000)
    shutil.copy(source / "config.json", sharded)

    both = root / "hf_safetensors_beside_a_stale_index"
    writable_copy(HF_FOLDERS["tf5 resaved"], both)
    stale = {key: torch.zeros_like(value) for key, value in read_folder(both).items()}
    torch.save(stale, both / "pytorch_model-00001-of-00001.bin")
    (both / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": dict.fromkeys(stale, "pytorch_model-00001-of-00001.bin")}))

    tiny = root / "tiny.safetensors"
    save_file(tiny_checkpoint(), tiny)
    return {"hf_sharded": sharded, "both": both, "tiny": tiny}


@pytest.mark.parametrize("strict", STRICT)
def test_built_hugging_face_folders(built, strict):
    for folder in (built["hf_sharded"], built["both"]):
        compare(dcp_load(folder.name, model_state(hf_model(folder)), folder, strict, hf_truth(folder)))


@pytest.mark.parametrize("strict", STRICT)
def test_built_safetensors_file(built, strict):
    from safetensors.torch import load_file

    compare(module_load("tiny.safetensors", tiny_fresh(), lambda: load_file(built["tiny"]), strict, tiny_truth()))
    compare(dcp_load("tiny.safetensors", model_state(tiny_fresh()), built["tiny"], strict, tiny_truth()))


# -- GPT-NeoX pipeline layer files, as DeepSpeed's load_state_dir loads them ------------------------------


@pytest.mark.parametrize("strict", STRICT)
@pytest.mark.parametrize("run, degree", [("pp1_mp1", 1), ("pp2_mp2", 2)])
def test_neox_pipeline_layer_files(run, degree, strict):
    """Each ``layer_XX-model_YY-model_states.pt`` into its GPT-NeoX pipeline layer (built at the
    run's tensor-parallel degree) -- the ``load_state_dict`` DeepSpeed's ``load_state_dir`` makes
    for each layer of a matching checkpoint."""
    from test_neox import neox_layers

    torch.manual_seed(5)
    layers = neox_layers(tp=degree)
    folder = FIXTURES / "neox_deepspeed" / run / "checkpoint" / "global_step0"
    for path in sorted(folder.glob("layer_*-model_*-model_states.pt")):
        layer = layers[int(path.name.split("-")[0].removeprefix("layer_"))]

        def read(path: Path = path) -> dict[str, torch.Tensor]:
            return torch.load(path, weights_only=True)
        compare(module_load(f"{run}/{path.name}", lambda layer=layer: copy.deepcopy(layer), read, strict,
                            prints(read())))



# -- torchao float8 training checkpoints (the torchtitan story) ------------------------------------


def float8_model(seed: int, compiled: bool, converted: bool) -> Callable[[], nn.Module]:
    def fresh() -> nn.Module:
        from support.float8 import float8

        model = tiny_module().build(seed=seed)
        model = float8(model) if converted else model
        return torch.compile(model) if compiled else model
    return fresh


FLOAT8_DESTINATIONS = {"compiled float8": (True, True), "float8": (False, True), "plain": (False, False),
                       "compiled plain": (True, False)}


@pytest.fixture(scope="module")
def float8_saved(tmp_path_factory) -> dict[str, Path]:
    """The compiled float8 tiny model with the torch_save fixture's values (seed 0), saved by
    ``dcp.save`` as ``{"model": ...}`` (torchtitan's layout) and by ``torch.save``."""
    pytest.importorskip("torchao.float8")
    import torch.distributed.checkpoint as dcp

    root = tmp_path_factory.mktemp("float8")
    state = float8_model(0, compiled=True, converted=True)().state_dict()
    dcp.save({"model": state}, checkpoint_id=root / "dcp")
    torch.save(state, root / "model.pt")
    return {"dcp": root / "dcp", "torch_save": root / "model.pt"}


@pytest.mark.parametrize("strict", STRICT)
@pytest.mark.parametrize("destination", FLOAT8_DESTINATIONS)
def test_float8_checkpoints(float8_saved, destination, strict):
    """Its own compiled float8 model loads it natively (ckptshim identically); the others through
    ckptshim's plan. ``torch.load(weights_only=True)`` hands the float8 weights as torchao's
    subclass to ``load_state_dict`` and ``set_model_state_dict``."""
    compiled, converted = FLOAT8_DESTINATIONS[destination]
    fresh, truth = float8_model(21, compiled, converted), tiny_truth("_orig_mod." if compiled else "")
    name = f"compiled float8 -> {destination}"

    def read() -> dict[str, torch.Tensor]:
        return torch.load(float8_saved["torch_save"], weights_only=True)
    compare(dcp_load(f"{name} (dcp)", model_state(fresh, "model"), float8_saved["dcp"], strict,
                     nested_truth(truth, "model")))
    compare(dcp_load(f"{name} (torch.save)", model_state(fresh), float8_saved["torch_save"], strict, truth))
    compare(module_load(f"{name} (torch.save)", fresh, read, strict, truth))
    compare(setter_load(f"{name} (torch.save)", fresh, read, strict, truth))


# -- loads ckptshim has no plan for, and tied twins: the framework's own errors and return values ---------


class TiedLM(nn.Module):
    """An embedding and an output head that share one parameter (``tie_word_embeddings``)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight


def tied_fresh() -> nn.Module:
    torch.manual_seed(31)
    return TiedLM()


@pytest.mark.parametrize("strict", STRICT)
@pytest.mark.parametrize("kept", ["embed.weight", "head.weight"])
def test_tied_twin_the_checkpoint_lacks(tmp_path, strict, kept):
    """``safetensors.torch.save_model`` keeps one name of a tied pair: torch alone refuses the
    strict load and lists the other name missing in the non-strict one; ckptshim fills it in the
    first (a plan it logs) and leaves torch's list as it is in the second."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(32)
    path = tmp_path / "tied.safetensors"
    save_file({kept: torch.randn(16, 8)}, path)
    truth = prints({name: load_file(path)[kept] for name in ("embed.weight", "head.weight")})
    compare(module_load(f"tied, {kept} kept", tied_fresh, lambda: load_file(path), strict, truth))
    compare(setter_load(f"tied, {kept} kept", tied_fresh, lambda: load_file(path), strict, truth))


@pytest.mark.parametrize("strict", STRICT)
def test_state_dicts_no_plan_mends(strict):
    """A shape that differs, a value that is not a tensor, a key no rule accounts for: torch's own
    call and error, with ckptshim's diagnosis at most as a note."""
    import numpy as np

    truth = tiny_truth()
    narrow = lambda: {**tiny_checkpoint(), "layers.1.fc1.weight": torch.zeros(128, 63)}  # noqa: E731
    array = lambda: {**tiny_checkpoint(), "ln_f.bias": np.zeros(64, np.float32)}  # noqa: E731
    extra = lambda: {**tiny_checkpoint(), "note": "trained for 3 epochs"}  # noqa: E731
    for what, state in (("narrow fc1", narrow), ("ndarray bias", array), ("a str", extra)):
        compare(module_load(f"tiny with {what}", tiny_fresh(), state, strict, truth))
        compare(setter_load(f"tiny with {what}", tiny_fresh(), state, strict, truth))


@pytest.fixture(scope="module")
def compressed(tmp_path_factory) -> Path:
    """The tiny model saved by ``dcp.save`` through DCP's ``ZStandard`` stream extension."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint._extension import ZStandard

    folder = tmp_path_factory.mktemp("zstd") / "dcp"
    dcp.save({"model": tiny_checkpoint()}, storage_writer=FileSystemWriter(folder, _extensions=[ZStandard()]))
    return folder


@pytest.mark.parametrize("strict", STRICT)
@pytest.mark.parametrize("compiled", [False, True])
def test_dcp_stream_extension(compressed, strict, compiled):
    truth = nested_truth(tiny_truth("_orig_mod." if compiled else ""), "model")
    compare(dcp_load(f"ZStandard dcp (compiled={compiled})", model_state(tiny_fresh(compiled), "model"),
                     compressed, strict, truth))
