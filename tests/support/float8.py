"""torchao float8 training, as torchtitan sets it up, for the float8 tests (torchao must be installed).

:func:`float8` converts every Linear of a model with torchao's own ``convert_to_float8_training``
and FSDP2 float8 all-gather on, so each Linear weight becomes a ``WeightWithDynamicFloat8CastTensor``
around the high-precision weight; :func:`high_precision` is that weight (a DTensor's local shard
first), read through torchao's attribute, not through ckptshim. The model is the
``torch_dcp_single`` fixture's, whose seed-0 values are that fixture's ``torch_save/model.pt``.
"""

from __future__ import annotations

import torch
from torch import nn
from torchao.float8 import Float8LinearConfig, convert_to_float8_training
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

from support.fixtures import FIXTURES, fixture_module
from support.tensors import bits

TINY = FIXTURES / "torch_dcp_single"
build = fixture_module("torch_dcp_single/dcp_tiny_model.py").build


def float8(model: nn.Module) -> nn.Module:
    """``model`` with every Linear turned into torchao's Float8Linear (torchtitan's settings)."""
    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    return model


def reference() -> dict[str, torch.Tensor]:
    """The values every float8 checkpoint of the tests holds (``build(seed=0)``'s)."""
    return torch.load(TINY / "torch_save" / "model.pt", weights_only=True)


def high_precision(value: torch.Tensor) -> torch.Tensor:
    """The plain tensor behind a parameter: a DTensor's local shard, a float8 weight's ``_tensor``."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        value = value.to_local()
    if isinstance(value, WeightWithDynamicFloat8CastTensor):
        value = value._tensor
    assert type(value) in (torch.Tensor, nn.Parameter), type(value)
    return value.detach()


def plain_key(key: str) -> str:
    """A state-dict key without the ``model.`` level and ``torch.compile``'s ``_orig_mod.``."""
    return ".".join(part for part in key.split(".") if part != "_orig_mod").removeprefix("model.")


def mismatches(state_dict: dict, expected: dict[str, torch.Tensor]) -> list[str]:
    """Keys whose value is not bit for bit the expected one (the whole tensor, or, for a DTensor,
    this rank's shard of it)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    wrong = []
    for key, value in state_dict.items():
        want = expected[plain_key(key)]
        if isinstance(value, DTensor):
            want = distribute_tensor(want, value.device_mesh, value.placements).to_local()
        found = high_precision(value)
        if found.dtype != want.dtype or found.shape != want.shape or not torch.equal(bits(found), bits(want)):
            wrong.append(key)
    return wrong
