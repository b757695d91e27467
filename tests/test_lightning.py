"""Lightning checkpoints into the bare models: an exact root prefix is set aside, nothing less.

A real ``Trainer.fit`` of one step and ``Trainer.save_checkpoint`` write the ``.ckpt`` files.
Lightning saves the ``LightningModule``'s state dict, so every key carries the attribute that
holds the model: ``model.`` for a plain module, ``model.model.*`` and ``model.lm_head.*`` for a
Hugging Face Llama inside it.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest
import torch
from torch import nn

import ckptshim  # noqa: F401  (the load_state_dict hook)
from support.markers import QUIET
from support.native import diagnosis, natively, raised, same_error

L = pytest.importorskip("lightning")

pytestmark = [QUIET, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def plain_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1))


class Wrapped(L.LightningModule):
    """A LightningModule that trains ``model`` on a regression target of its outputs."""

    def __init__(self, model: nn.Module, inputs: torch.Tensor) -> None:
        super().__init__()
        self.model = model
        self.inputs = inputs

    def training_step(self, batch, index):
        (x,) = batch
        out = self.model(x)
        return (out.logits if hasattr(out, "logits") else out).float().pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def save(model: nn.Module, inputs: torch.Tensor, path: Path) -> dict[str, torch.Tensor]:
    """Train one step and save the checkpoint; the model's state dict after training."""
    trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", devices=1)
    module = Wrapped(model, inputs)
    trainer.fit(module, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs), batch_size=2))
    trainer.save_checkpoint(path)
    return {key: value.clone() for key, value in model.state_dict().items()}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, dict[str, torch.Tensor]]]:
    folder = tmp_path_factory.mktemp("lightning")
    torch.manual_seed(0)
    return {"plain": (folder / "plain.ckpt", save(plain_model(), torch.randn(4, 4), folder / "plain.ckpt")),
            "llama": (folder / "llama.ckpt", save(llama(), torch.randint(0, 32, (4, 6)), folder / "llama.ckpt"))}


def state_dict(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)["state_dict"]


@pytest.mark.parametrize("name, build", [("plain", plain_model), ("llama", llama)])
def test_the_lightning_prefix_is_set_aside(checkpoints, caplog, name, build):
    caplog.set_level(logging.INFO, logger="ckptshim")
    path, trained = checkpoints[name]
    saved = state_dict(path)
    assert all(key.startswith("model.") for key in saved)
    torch.manual_seed(1)
    model = build()
    result = model.load_state_dict(saved)  # strict
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert all(torch.equal(model.state_dict()[key], value) for key, value in trained.items())
    assert "root prefix 'model.' removed from every checkpoint key" in caplog.text


def test_and_added_where_the_target_is_the_one_that_carries_it(checkpoints):
    """The bare model's keys into a LightningModule (``model.`` on every target key)."""
    _, trained = checkpoints["plain"]
    module = Wrapped(plain_model(), torch.zeros(1, 4))
    module.load_state_dict(trained)
    assert all(torch.equal(module.model.state_dict()[key], value) for key, value in trained.items())


def test_anything_less_than_exact_is_torchs_own_error(checkpoints):
    """One more parameter in the target: the prefix does not make the key sets equal, so it is
    not set aside, and no plan makes the load fit: torch's own error, with ckptshim's note naming
    the key it found missing. The same for a layer of another shape."""
    path, _ = checkpoints["plain"]
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2), nn.Linear(2, 2))
    native_model = copy.deepcopy(model)
    error = same_error(raised(lambda: model.load_state_dict(state_dict(path))),
                       raised(lambda: natively(lambda: native_model.load_state_dict(state_dict(path)))))
    assert "  {0,2..3}.weight (nearest in checkpoint: " in diagnosis(error)  # 3.weight among them
    assert all(torch.equal(model.state_dict()[key], value) for key, value in native_model.state_dict().items())
    other_shape = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    error = same_error(raised(lambda: other_shape.load_state_dict(state_dict(path))),
                       raised(lambda: natively(lambda: copy.deepcopy(other_shape).load_state_dict(state_dict(path)))))
    assert "  model.{0,2}.weight" in diagnosis(error)  # model.2.weight among them


# -- the root prefix composes with every other rule --------------------------------------------------


class PerLayer(nn.Module):
    """Two layers kept one module each (``layers.{0,1}.weight``)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class Stacked(nn.Module):
    """The same two layers stacked along axis 0 (``layers.weight`` is ``[2, 4, 4]``)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Module()
        self.layers.weight = nn.Parameter(torch.randn(2, 4, 4))
        self.layers.bias = nn.Parameter(torch.randn(2, 4))


@pytest.fixture(scope="module")
def per_layer(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    path = tmp_path_factory.mktemp("lightning_layers") / "per_layer.ckpt"
    torch.manual_seed(2)
    return path, save(PerLayer(), torch.randn(4, 4), path)


def bare_load(build, saved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the checkpoint loads as into the unwrapped model (the root prefix alone)."""
    torch.manual_seed(3)
    model = build()
    model.load_state_dict(saved)
    return {key: value.clone() for key, value in model.state_dict().items()}


@pytest.mark.parametrize("name, build", [("plain", plain_model), ("llama", llama)])
def test_into_a_compiled_model_root_and_wrapper_prefix_together(checkpoints, caplog, name, build):
    """The issue's case: Lightning's ``model.`` on every checkpoint key, ``_orig_mod.`` on every
    key of the ``torch.compile``d target. Each rule alone is exact, so together they are."""
    caplog.set_level(logging.INFO, logger="ckptshim")
    path, trained = checkpoints[name]
    saved = state_dict(path)
    unwrapped = bare_load(build, saved)
    torch.manual_seed(4)
    compiled = torch.compile(build())
    result = compiled.load_state_dict(saved)  # strict
    assert result.missing_keys == [] and result.unexpected_keys == []
    loaded = compiled._orig_mod.state_dict()
    assert loaded.keys() == unwrapped.keys() == trained.keys()
    assert all(torch.equal(loaded[key], unwrapped[key]) and torch.equal(loaded[key], trained[key]) for key in trained)
    assert "root prefix 'model.' removed from every checkpoint key" in caplog.text


def test_the_bare_keys_into_a_compiled_lightning_module(checkpoints):
    """The other way round: the bare model's keys into a compiled ``LightningModule`` (``model.``
    added to, and ``_orig_mod.`` set aside from, every target key)."""
    _, trained = checkpoints["plain"]
    compiled = torch.compile(Wrapped(plain_model(), torch.zeros(1, 4)))
    compiled.load_state_dict(trained)
    assert all(torch.equal(compiled._orig_mod.model.state_dict()[key], value) for key, value in trained.items())


@pytest.mark.parametrize("compiled", [False, True], ids=["stacked", "stacked-compiled"])
def test_root_prefix_and_stacking_together(per_layer, caplog, compiled):
    """A Lightning checkpoint of one module per layer into a model that stacks the layers (and is
    compiled): prefix removed, layers stacked along axis 0, bit for bit what each layer held."""
    caplog.set_level(logging.INFO, logger="ckptshim")
    path, trained = per_layer
    saved = state_dict(path)
    unwrapped = bare_load(PerLayer, saved)
    model = Stacked()
    target = torch.compile(model) if compiled else model
    result = target.load_state_dict(saved)  # strict
    assert result.missing_keys == [] and result.unexpected_keys == []
    for leaf in ("weight", "bias"):
        expected = torch.stack([unwrapped[f"layers.{i}.{leaf}"] for i in range(2)])
        assert torch.equal(getattr(model.layers, leaf), expected)
        assert torch.equal(expected, torch.stack([trained[f"layers.{i}.{leaf}"] for i in range(2)]))
    assert "root prefix 'model.' removed from every checkpoint key" in caplog.text
    assert "stacked" in caplog.text


def test_a_partial_fit_under_the_prefix_is_still_torchs_own_error(per_layer):
    """The root prefix is taken only where the whole plan with it fits: one layer more in the
    stacked target, and torch's own error stands (with ckptshim's note), nothing written."""
    path, _ = per_layer
    model, native_model = Stacked(), Stacked()
    model.layers.weight = nn.Parameter(torch.randn(3, 4, 4))
    native_model.layers.weight = nn.Parameter(model.layers.weight.detach().clone())
    native_model.layers.bias = nn.Parameter(model.layers.bias.detach().clone())
    error = same_error(raised(lambda: model.load_state_dict(state_dict(path))),
                       raised(lambda: natively(lambda: native_model.load_state_dict(state_dict(path)))))
    assert "layers.weight" in diagnosis(error)
    assert all(torch.equal(model.state_dict()[key], value) for key, value in native_model.state_dict().items())
