"""ckptshim's unpickler allows what ``torch.load(weights_only=True)`` allows, as torch decides it at
run time: never stricter than torch on what torch itself writes.

``torch.Size`` is on torch's own list and DeepSpeed's ``*_model_states.pt`` hold it (``param_shapes``),
so a ``torch.save`` file holding one is inspected, converted and read by ``dcp.load``; tensors
torch stores in untyped storages (``float8``, ``uint16``: ``_rebuild_tensor_v3``) are read bit
for bit; what torch allows and ckptshim does not read is refused as unread, never as unsafe; and
what torch refuses stays refused, by name, without running it.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict

import numpy as np
import pytest
import torch

import ckptshim
from ckptshim.cli import main
from ckptshim.errors import UnknownFormatError, UnsafeCheckpointError
from ckptshim.formats import torch_globals
from ckptshim.formats.detect import open_checkpoint
from support.markers import QUIET

pytestmark = QUIET


def deepspeed_style(path):
    """A model-states file as DeepSpeed's engine writes it: the module's state dict, and the shape
    of every parameter as a ``torch.Size`` (``param_shapes``, one dict per parameter group)."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    state = module.state_dict()
    torch.save({"module": state, "param_shapes": [OrderedDict((k, v.shape) for k, v in state.items())],
                "ds_version": "0.19.8", "global_steps": 3}, path)
    return module, state


def test_torch_size_is_allowed_because_torch_allows_it(tmp_path):
    path = tmp_path / "mp_rank_00_model_states.pt"
    _, state = deepspeed_style(path)
    assert torch.load(path, weights_only=True)["param_shapes"][0]["0.weight"] == torch.Size([3, 4])
    checkpoint = open_checkpoint(path)
    assert {".".join(key) for key in checkpoint.inventory} == {f"module.{k}" for k in state}
    for key, entry in checkpoint.inventory.items():
        assert np.array_equal(checkpoint.read(entry), state[".".join(key[1:])].numpy())


def test_torch_size_file_is_inspected_converted_and_read_by_dcp_load(tmp_path, capsys):
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    path = tmp_path / "model_states.pt"
    module, state = deepspeed_style(path)
    assert main(["inspect", str(path)]) == 0
    assert "module.0.weight" in capsys.readouterr().out

    out = ckptshim.convert(path, tmp_path / "model.safetensors", "safetensors", progress=False)
    assert {k: v.tolist() for k, v in load_file(out).items()} == {f"module.{k}": v.tolist() for k, v in state.items()}

    target = {"module": {k: torch.zeros_like(v) for k, v in state.items()}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, checkpoint_id=path)
    assert all(torch.equal(target["module"][k], v) for k, v in state.items())


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32])
def test_tensors_torch_keeps_in_untyped_storages_read_bit_for_bit(tmp_path, dtype):
    """torch writes these through ``_rebuild_tensor_v3`` and an ``UntypedStorage``; a view of one
    of them shares its storage."""
    torch.manual_seed(1)
    whole = torch.randint(0, 100, (6, 4)).to(dtype)
    path = tmp_path / "untyped.pt"
    torch.save({"whole": whole, "rows": whole[2:5]}, path)
    checkpoint = open_checkpoint(path)
    for name, expected in torch.load(path, weights_only=True).items():
        entry = checkpoint.inventory[(name,)]
        assert (entry.dtype, entry.shape) == (str(dtype).removeprefix("torch."), tuple(expected.shape))
        read = torch.from_numpy(np.ascontiguousarray(checkpoint.read(entry))).view(dtype)
        assert torch.equal(read.view(torch.uint8), expected.contiguous().view(torch.uint8)), name


def test_every_builder_is_for_a_global_torch_allows():
    """ckptshim builds stand-ins only for globals on torch's own list; whether one is allowed is
    torch's answer, read at run time."""
    from torch._weights_only_unpickler import _get_allowed_globals

    assert set(torch_globals.BUILDERS) <= set(_get_allowed_globals())
    assert set(torch_globals.allowed_globals("x")) == set(_get_allowed_globals())


def test_what_torch_allows_and_ckptshim_does_not_read_is_unread_not_unsafe(tmp_path):
    path = tmp_path / "sparse.pt"
    torch.save({"s": torch.eye(3).to_sparse()}, path)
    torch.load(path, weights_only=True)  # torch allows it
    with pytest.raises(UnknownFormatError, match=r"torch\._utils\._rebuild_sparse_tensor, which "
                                                 r"torch\.load\(weights_only=True\) allows but ckptshim does not read"):
        open_checkpoint(path)


class Hook:
    """A global torch's list does not hold."""


def test_what_torch_refuses_stays_refused_by_name(tmp_path):
    path = tmp_path / "hook.pt"
    torch.save({"w": torch.zeros(2), "hook": Hook()}, path)
    with pytest.raises(Exception, match="Unsupported global"):
        torch.load(path, weights_only=True)
    with pytest.raises(UnsafeCheckpointError, match=rf"needs {__name__}\.Hook to unpickle"):
        open_checkpoint(path)
