"""The Megatron-Core profile: a ``dist_checkpointing`` folder (torch_dist at TP 1/2 x PP 1/2, and
the legacy zarr backend) into a plain model's ``GPTModel.state_dict()`` names through ``dcp.load``
and ``set_model_state_dict``, listed by ``inspect`` and written by ``convert`` under those names --
and only when the folder's own ``metadata.json`` says Megatron-Core wrote it.

Fixtures: ``fixtures/megatron_core`` (Megatron-Core 0.16.1 / 0.12.3 on CPU); the references are the
plain ``GPTModel.state_dict()`` Megatron-Core's own ``dist_checkpointing.load`` gave a TP1/PP1
model from each folder (see its README).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import ckptshim  # noqa: F401  (attaches the hooks)
from ckptshim.cli import main
from ckptshim.formats.detect import open_checkpoint
from ckptshim.inventory import join_key
from support.fixtures import FIXTURES, array_sha256, copy_fixture

MEGATRON = FIXTURES / "megatron_core"
MANIFEST = json.loads((MEGATRON / "manifest.json").read_text())
REFERENCE = {row["key"]: row for row in MANIFEST["keys"]}
VARIANTS = list(MANIFEST["variants"])
TORCH_DIST = [v for v in VARIANTS if v.startswith("torch_dist/")]
#: The modules of each layer whose ``_extra_state`` GPTModel.state_dict() holds (``None`` under the
#: local spec: Megatron-Core's ColumnParallelLinear/RowParallelLinear), and the output layer's.
LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
LAYERS = 4


def _references(variant: str) -> dict[str, dict]:
    prefix = f"{variant}/"
    return {key[len(prefix):]: row for key, row in REFERENCE.items() if key.startswith(prefix)}


def _sha(tensor: torch.Tensor) -> str:
    return array_sha256((tensor.view(torch.uint16) if tensor.dtype == torch.bfloat16 else tensor).numpy())


def _plain_state_dict(variant: str, extra_state: bool = False) -> dict:
    """What a TP1/PP1 ``GPTModel.state_dict()`` holds (zeros), with its ``_extra_state`` entries if asked."""
    state: dict = {name: torch.zeros(row["shape"], dtype=getattr(torch, row["dtype"]))
                   for name, row in _references(variant).items()}
    if extra_state:
        state.update({f"decoder.layers.{i}.{m}._extra_state": None for i in range(LAYERS) for m in LINEARS})
        state["output_layer._extra_state"] = None
    return state


def _assert_megatrons_values(state: dict, variant: str) -> None:
    references = _references(variant)
    assert {k for k, v in state.items() if isinstance(v, torch.Tensor)} == set(references)
    for name, row in references.items():
        assert (list(state[name].shape), _sha(state[name])) == (row["shape"], row["sha256"]), name


@pytest.mark.parametrize("variant", VARIANTS)
def test_dcp_load_into_plain_names_is_megatrons_own_load(variant: str, caplog) -> None:
    state = _plain_state_dict(variant)
    with caplog.at_level(logging.INFO, logger="ckptshim"):
        dcp.load(state, checkpoint_id=MEGATRON / variant)
    _assert_megatrons_values(state, variant)
    assert any("48 unstacked" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("variant", ["torch_dist/tp2_pp2", "torch_dist/tp1_pp1_bf16", "zarr/tp2_pp1"])
def test_extra_state_keeps_the_targets_own_values(variant: str, caplog) -> None:
    """The stored ``_extra_state`` objects are left unread (torch_dist pickles each as a list of
    the saving rank's objects); the target's own values stay, and the summary counts them."""
    state = _plain_state_dict(variant, extra_state=True)
    own = {key: f"own {key}" for key in state if key.endswith("_extra_state")}
    state.update(own)
    with caplog.at_level(logging.INFO, logger="ckptshim"):
        dcp.load(state, checkpoint_id=MEGATRON / variant)
    _assert_megatrons_values(state, variant)
    assert {key: state[key] for key in own} == own
    assert any("17 synthesized" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


class _Linear(nn.Module):
    """A linear's parameters with an extra state that is ``None``, as Megatron-Core's local-spec
    ``ColumnParallelLinear``/``RowParallelLinear`` have it."""

    def get_extra_state(self):
        return None

    def set_extra_state(self, state) -> None:
        assert state is None, state


def _plain_model(variant: str) -> nn.Module:
    """A module whose ``state_dict()`` is a TP1/PP1 ``GPTModel``'s: the same names, shapes, dtypes."""
    root = nn.Module()
    for name, row in _references(variant).items():
        *path, leaf = name.split(".")
        module = root
        for depth, part in enumerate(path):
            if not hasattr(module, part):
                linear = part.startswith("linear_") or path[:depth + 1] == ["output_layer"]
                module.add_module(part, _Linear() if linear else nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, nn.Parameter(torch.zeros(row["shape"], dtype=getattr(torch, row["dtype"]))))
    return root


@pytest.mark.parametrize("variant", ["torch_dist/tp2_pp1", "torch_dist/tp1_pp2", "zarr/tp1_pp1"])
def test_get_dcp_load_set_model_state_dict(variant: str) -> None:
    """The DCP user's three calls on a plain model (``_extra_state`` entries included)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    model = _plain_model(variant)
    state = get_model_state_dict(model)
    assert "decoder.layers.3.mlp.linear_fc2._extra_state" in state and "output_layer._extra_state" in state
    dcp.load(state, checkpoint_id=MEGATRON / variant)
    set_model_state_dict(model, state)
    _assert_megatrons_values({k: v.detach() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)},
                             variant)


def test_names_alone_never_fire(tmp_path: Path) -> None:
    """Without Megatron-Core's metadata.json the same DCP folder is plain DCP: the layer norms
    stay under their stored names, and DCP fails as it does without ckptshim."""
    root = copy_fixture("megatron_core/torch_dist/tp1_pp1", tmp_path, "ckpt")
    (root / "metadata.json").unlink()
    state = _plain_state_dict("torch_dist/tp1_pp1")
    with pytest.raises(BaseException, match="Missing key in checkpoint state_dict: decoder.layers.0.input_layernorm.bias"):
        dcp.load(state, checkpoint_id=root)
    assert all(not value.any() for value in state.values())  # nothing loaded


def test_another_producers_fused_names_are_not_renamed(tmp_path: Path) -> None:
    """A plain DCP checkpoint whose keys read like Megatron-Core's TE-fused layer norms."""
    dcp.save({"block.self_attention.linear_qkv.layer_norm_weight": torch.ones(3)}, checkpoint_id=tmp_path / "c")
    state = {"block.input_layernorm.weight": torch.zeros(3)}
    with pytest.raises(BaseException, match="Missing key in checkpoint state_dict: block.input_layernorm.weight"):
        dcp.load(state, checkpoint_id=tmp_path / "c")


@pytest.mark.parametrize("variant", ["torch_dist/tp2_pp2", "zarr/tp2_pp1"])
def test_inspect_lists_the_model_names_and_says_so(variant: str, capsys) -> None:
    assert main(["inspect", str(MEGATRON / variant)]) == 0
    out = capsys.readouterr().out
    assert ("53 arrays listed as the model names them (GPTModel.state_dict()): Megatron-Core's stacked layers "
            "one per global layer index, the local spec's layer norms under their own names; 16 stored "
            "_extra_state object(s) left out:") in out
    rows = out.splitlines()[2:]
    listed: list[str] = []
    while len(listed) < 53:  # per-layer rows come grouped: decoder.layers.{0..3}.input_layernorm.weight
        listed += _expanded(rows.pop(0).split()[0])
    assert sorted(listed) == sorted(_references(variant))
    assert "float32" not in rows[0]  # the stored arrays are not listed besides


def _expanded(key: str) -> list[str]:
    """The keys a grouped listing row stands for (each ``{a..b}`` a run of layer indices)."""
    import re

    match = re.search(r"\{(\d+)\.\.(\d+)\}", key)
    if match is None:
        return [key]
    return [expanded for index in range(int(match[1]), int(match[2]) + 1)
            for expanded in _expanded(key[:match.start()] + str(index) + key[match.end():])]


@pytest.mark.parametrize("variant", ["torch_dist/tp2_pp2", "torch_dist/tp1_pp1_bf16", "zarr/tp2_pp1"])
def test_convert_to_safetensors_writes_the_model_names(variant: str, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    assert main(["convert", str(MEGATRON / variant), str(tmp_path / "out"), "--to", "safetensors",
                 "--no-progress"]) == 0
    written = {}
    for file in sorted((tmp_path / "out").glob("*.safetensors")):
        written.update(load_file(file))
    _assert_megatrons_values(written, variant)


def test_convert_like_a_target_still_maps(tmp_path: Path) -> None:
    """``--like`` a plain checkpoint of the model's names: the profile's plan onto it."""
    from safetensors.torch import load_file, save_file

    like = tmp_path / "like.safetensors"
    save_file(_plain_state_dict("torch_dist/tp1_pp1"), str(like))
    assert main(["convert", str(MEGATRON / "torch_dist" / "tp2_pp1"), str(tmp_path / "out.safetensors"),
                 "--to", "safetensors", "--like", str(like), "--no-progress"]) == 0
    _assert_megatrons_values(load_file(tmp_path / "out.safetensors"), "torch_dist/tp2_pp1")


def test_stored_inventory_is_unchanged() -> None:
    """The reader itself still lists Megatron-Core's stored keys (``plan``/``--like`` map from them)."""
    checkpoint = open_checkpoint(MEGATRON / "torch_dist" / "tp1_pp2")
    keys = {join_key(key) for key in checkpoint.inventory}
    assert "decoder.layers.self_attention.linear_qkv.layer_norm_weight" in keys
    assert not any(".layers.0." in key for key in keys)


def test_missing_stage_file_is_named_before_anything_is_written(tmp_path: Path) -> None:
    root = copy_fixture("megatron_core/torch_dist/tp1_pp2", tmp_path, "ckpt")
    (root / "__1_0.distcp").unlink()
    state = _plain_state_dict("torch_dist/tp1_pp2")
    with pytest.raises(BaseException, match="__1_0.distcp"):
        dcp.load(state, checkpoint_id=root)
    assert all(not value.any() for value in state.values())
    shutil.rmtree(root)
