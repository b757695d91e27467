"""torchao float8 training checkpoints -- the torchtitan story -- through ckptshim's hooks.

torchtitan converts every Linear with torchao's ``convert_to_float8_training`` (FSDP2 float8
all-gather on: each weight becomes a ``WeightWithDynamicFloat8CastTensor`` around the
high-precision weight), compiles, shards with FSDP2 and saves with DCP. Real libraries
throughout: torchao's conversion, ``torch.compile``, FSDP2 on two gloo ranks under one
``torchrun`` launch (``tests/workers/float8_worker.py``), checkpoints written by ``dcp.save`` and
``torch.save``. Every load is compared bit for bit, shard by shard, with the saved values (the
``torch_dcp_single`` fixture's, which the float8 models are built from).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")
pytest.importorskip("torchao.float8")

import ckptshim  # noqa: E402
from ckptshim.cli import main  # noqa: E402
from ckptshim.formats import torch_pickle  # noqa: E402
from support.float8 import build, float8, high_precision, mismatches, reference  # noqa: E402
from support.markers import QUIET  # noqa: E402
from support.processes import environment, worker  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.checkpoint import CheckpointException  # noqa: E402
from torch.distributed.checkpoint.state_dict import set_model_state_dict  # noqa: E402
from torchao.float8.float8_training_tensor import LinearMMConfig  # noqa: E402
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor  # noqa: E402

pytestmark = QUIET

#: The models a float8 checkpoint is loaded into, each built with another seed than the saved one.
DESTINATIONS = {
    "compiled float8": lambda: torch.compile(float8(build(seed=5))),
    "float8": lambda: float8(build(seed=5)),
    "plain": lambda: build(seed=5),
    "compiled plain": lambda: torch.compile(build(seed=5)),
}


@pytest.fixture(autouse=True)
def _hooks_on():
    ckptshim.install()
    yield
    ckptshim.install()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """The compiled float8 model (seed 0) saved in one process: by ``dcp.save`` (as
    ``{"model": ...}``, torchtitan's layout) and by ``torch.save`` of its state dict."""
    out = tmp_path_factory.mktemp("float8")
    state_dict = torch.compile(float8(build(seed=0))).state_dict()
    assert isinstance(state_dict["_orig_mod.layers.0.qkv.weight"], WeightWithDynamicFloat8CastTensor)
    dcp.save({"model": state_dict}, checkpoint_id=out / "compiled_float8")
    torch.save(state_dict, out / "compiled_float8.pt")
    return {"dcp": out / "compiled_float8", "torch_save": out / "compiled_float8.pt", "root": out}


@pytest.fixture(scope="module")
def two_ranks(saved) -> Path:
    """One torchrun launch for every two-rank case; it leaves ``fsdp2_float8`` (seed 0, FSDP2 over
    float8, uncompiled, two ranks' files) and each rank's results."""
    out = saved["root"] / "two_ranks"
    out.mkdir()
    env = {k: v for k, v in environment().items() if not k.startswith("CKPTSHIM_")}
    try:
        run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                              worker("float8_worker.py"), str(out), str(saved["dcp"])],
                             capture_output=True, text=True, timeout=300, env=env, check=False)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"the two ranks hung: {error.stdout}{error.stderr}")
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    return out


def load(model: nn.Module, checkpoint: Path) -> nn.Module:
    dcp.load({"model": model.state_dict()}, checkpoint_id=checkpoint)
    return model


# -- dcp.load: every direction of the issue -------------------------------------------------------


@pytest.mark.parametrize("rank", [0, 1])
def test_every_two_rank_case_passes_on_every_rank(two_ranks, rank):
    """FSDP2 float8 into FSDP2 float8 (as torch loads it, and with ckptshim); compiled FSDP2 float8
    resuming a checkpoint saved before compile was on; a compiled one-process float8 checkpoint
    resharded into FSDP2 float8 -- each rank's shards bit for bit."""
    results = json.loads((two_ranks / f"rank{rank}.json").read_text())
    assert len(results) == 4
    failed = {case: text for case, text in results.items() if text != "ok"}
    assert not failed, "\n".join(f"{case}:\n{text}" for case, text in failed.items())


@pytest.mark.parametrize("destination", DESTINATIONS)
def test_compiled_float8_checkpoint(saved, destination):
    model = load(DESTINATIONS[destination](), saved["dcp"])
    assert not mismatches(model.state_dict(), reference())


@pytest.mark.parametrize("destination", DESTINATIONS)
def test_two_rank_fsdp2_float8_checkpoint_in_one_process(two_ranks, destination):
    model = load(DESTINATIONS[destination](), two_ranks / "fsdp2_float8")
    assert not mismatches(model.state_dict(), reference())


def test_same_names_load_as_torch_loads_them(saved):
    """Where names agree torch loads the float8 checkpoint alone; ckptshim loads the same values
    (it refused the chunks before, although torch's registry allowed the subclass)."""
    ckptshim.uninstall()
    alone = load(DESTINATIONS["compiled float8"](), saved["dcp"])
    ckptshim.install()
    shimmed = load(DESTINATIONS["compiled float8"](), saved["dcp"])
    assert not mismatches(alone.state_dict(), reference()) and not mismatches(shimmed.state_dict(), reference())


# -- torch.save files of float8 models --------------------------------------------------------------


def test_torch_save_reads_as_torch_load_weights_only_does(saved):
    """ckptshim's reading of a float8 state dict is what ``torch.load(weights_only=True)`` returns:
    the float8 weights as their high-precision tensors, bit for bit."""
    loaded = torch.load(saved["torch_save"], weights_only=True)
    checkpoint = torch_pickle.open_checkpoint(saved["torch_save"])
    assert {".".join(key) for key in checkpoint.inventory} == set(loaded)
    for key, entry in checkpoint.inventory.items():
        expected = high_precision(loaded[".".join(key)])
        assert (entry.shape, entry.dtype) == (tuple(expected.shape), str(expected.dtype).removeprefix("torch."))
        assert torch.equal(torch.from_numpy(checkpoint.read(entry).copy()), expected), key


def test_inspect_lists_float8_weights_as_their_values(saved, capsys):
    assert main(["inspect", str(saved["torch_save"]), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    entries = {entry["key"]: entry for entry in info["entries"]}
    assert info["complete"] and entries["_orig_mod.layers.0.qkv.weight"]["dtype"] == "float32"


@pytest.mark.parametrize("destination", DESTINATIONS)
def test_torch_save_file_through_every_torch_call(saved, destination):
    """``load_state_dict`` and ``set_model_state_dict`` of what ``torch.load(weights_only=True)``
    returns (float8 subclasses as sources), and ``dcp.load`` of the file itself."""
    for call in (lambda m: m.load_state_dict(torch.load(saved["torch_save"], weights_only=True)),
                 lambda m: set_model_state_dict(m, torch.load(saved["torch_save"], weights_only=True)),
                 lambda m: dcp.load(m.state_dict(), checkpoint_id=saved["torch_save"])):
        model = DESTINATIONS[destination]()
        call(model)
        assert not mismatches(model.state_dict(), reference())


# -- stacked layers with float8 on either side ------------------------------------------------------


class PerLayer(nn.Module):
    """Three Linear layers, float8 like torchtitan's, saved per layer."""

    def __init__(self, converted: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(32, 32, bias=False) for _ in range(3)])
        if converted:
            float8(self)


class Stacked(nn.Module):
    """The same weights stacked along a leading layer axis (zeros: a load must fill them), as a
    plain parameter or as a float8 training weight around the stacked tensor."""

    def __init__(self, converted: bool) -> None:
        super().__init__()
        self.layers = nn.Module()
        weight = torch.zeros(3, 32, 32)
        if converted:
            weight = WeightWithDynamicFloat8CastTensor(weight, LinearMMConfig(), torch.float8_e4m3fn)
        self.layers.weight = nn.Parameter(weight)


def per_layer_values(model: PerLayer) -> torch.Tensor:
    return torch.stack([high_precision(layer.weight) for layer in model.layers])


CALLS = {
    "load_state_dict": lambda model, source, folder: model.load_state_dict(source.state_dict()),
    "set_model_state_dict": lambda model, source, folder: set_model_state_dict(model, source.state_dict()),
    "dcp.load": lambda model, source, folder: dcp.load(model.state_dict(), checkpoint_id=folder),
}


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("converted", [False, True], ids=["plain", "float8"])
def test_float8_layers_stack_into_one_parameter(tmp_path, call, converted):
    torch.manual_seed(0)
    source = PerLayer(converted=True)
    dcp.save(source.state_dict(), checkpoint_id=tmp_path)
    model = Stacked(converted)
    CALLS[call](model, source, tmp_path)
    assert isinstance(model.layers.weight, WeightWithDynamicFloat8CastTensor) == converted
    assert torch.equal(high_precision(model.layers.weight), per_layer_values(source))


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("converted", [False, True], ids=["plain", "float8"])
def test_a_stacked_float8_parameter_unstacks_into_layers(tmp_path, call, converted):
    torch.manual_seed(0)
    source = Stacked(converted=True)
    high_precision(source.layers.weight).copy_(torch.randn(3, 32, 32))
    dcp.save(source.state_dict(), checkpoint_id=tmp_path)
    model = PerLayer(converted)
    CALLS[call](model, source, tmp_path)
    assert torch.equal(per_layer_values(model), high_precision(source.layers.weight))


def test_a_failed_float8_load_leaves_the_weights_unchanged(saved):
    """A shape that does not fit is refused before the first write, float8 weights included."""
    model = float8(build(seed=5))
    model.lm_head.weight = nn.Parameter(WeightWithDynamicFloat8CastTensor(
        torch.zeros(300, 64), LinearMMConfig(), torch.float8_e4m3fn))
    before = {key: high_precision(value).clone() for key, value in model.state_dict().items()}
    with pytest.raises(CheckpointException):
        load(model, saved["dcp"])
    assert all(torch.equal(high_precision(value), before[key]) for key, value in model.state_dict().items())
