"""Comparing torch tensors bit for bit, whole or as the shards of FSDP2 DTensors."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch


def bits(value: torch.Tensor) -> torch.Tensor:
    """``value``'s bytes on the host, in C order: equal for two tensors only if every bit is (a NaN
    equals itself, -0.0 differs from 0.0)."""
    return value.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def fsdp_row_shards(state_dict: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> int:
    """Assert that each FSDP2 DTensor's local shard equals its rows of ``expected[key]``; return
    the bytes of this rank's shards (a tied pair's once)."""
    from torch.distributed.tensor import DTensor

    local_bytes, seen = 0, set()
    for key, value in state_dict.items():
        assert isinstance(value, DTensor), key
        local = value.to_local()
        per_rank = -(-value.shape[0] // value.device_mesh.size())  # FSDP2 pads the last rank's rows
        start = min(value.device_mesh.get_local_rank() * per_rank, value.shape[0])
        assert torch.equal(local, expected[key][start:start + local.shape[0]]), key
        if local.data_ptr() not in seen:
            seen.add(local.data_ptr())
            local_bytes += local.numel() * local.element_size()
    return local_bytes


def fsdp_dcp_load(build: Callable[[], torch.nn.Module], folder: Path, expected: dict[str, torch.Tensor]) -> dict:
    """``dcp.load`` of ``folder`` into a fresh FSDP2-sharded ``build()``, after one load that pays
    for lazy imports: the bytes this rank read (``rchar``), its shards' bytes, and ``dcp_load``:
    ``"ok"`` or the shard that differs from ``expected``."""
    import torch.distributed.checkpoint as dcp

    from support.pagecache import io_counters

    dcp.load(build().state_dict(), checkpoint_id=folder)
    model = build()
    before = io_counters()["rchar"]
    dcp.load(model.state_dict(), checkpoint_id=folder)
    results: dict = {"read_bytes": io_counters()["rchar"] - before}
    try:
        results["shard_bytes"] = fsdp_row_shards(model.state_dict(), expected)
        results["dcp_load"] = "ok"
    except AssertionError as error:
        results["dcp_load"] = f"shard differs: {error}"
    return results
