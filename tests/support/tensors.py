"""Comparing torch tensors bit for bit."""

from __future__ import annotations

import torch


def bits(value: torch.Tensor) -> torch.Tensor:
    """``value``'s bytes on the host, in C order: equal for two tensors only if every bit is (a NaN
    equals itself, -0.0 differs from 0.0)."""
    return value.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
