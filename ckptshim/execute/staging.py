"""Host bytes into device memory through one bounded buffer: never a host copy larger than it.

``device_tensor.copy_(host_view)`` is a DMA only from pinned (page-locked) memory; from ordinary
memory the driver stages the bytes itself, and from a non-contiguous view (a block of a memory
map, a column shard) torch first makes a contiguous host copy of the whole tensor. :func:`copy`
instead cuts the copy into blocks of at most :data:`CAPACITY` bytes and moves each through one
buffer per thread -- pinned when the destination is a CUDA tensor -- so a load holds at most that
much staged host memory, whatever the size of the tensor, and the source is read once, in order.

A block is copied into the buffer in the source's dtype and then into the destination, which
casts on its own device when the dtypes differ. Each device copy completes before the buffer is
refilled (a synchronous copy from pinned memory), so the buffer is always safe to reuse.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator

import torch

#: Bytes staged at a time, per loading thread.
CAPACITY = 64 << 20

_buffers = threading.local()


def copy(destination: torch.Tensor, source: torch.Tensor) -> None:
    """Copy the host tensor ``source`` into ``destination`` (the same shape; any strides, dtype
    and device) block by block through the staging buffer of :data:`CAPACITY` bytes."""
    capacity = CAPACITY
    if source.element_size() > capacity:
        raise ValueError(f"a staging buffer of {capacity} bytes cannot hold one {source.dtype} element")
    buffer = _buffer(capacity, pinned=destination.device.type == "cuda" and torch.cuda.is_available())
    with torch.no_grad():
        for index in blocks(tuple(source.shape), source.element_size(), capacity):
            part = source[index]
            staged = buffer[:part.numel() * part.element_size()].view(part.dtype).view(part.shape)
            staged.copy_(part)
            destination[index].copy_(staged)


def blocks(shape: tuple[int, ...], itemsize: int, capacity: int) -> Iterator[tuple[slice, ...]]:
    """Index tuples that cut an array of ``shape`` into blocks of at most ``capacity`` bytes, in
    order: as many whole rows of the first axis as fit, or, when one row does not, each row
    cut the same way along the next axis. Every index keeps every axis (``slice(i, i + 1)``)."""
    if not shape or math.prod(shape) * itemsize <= capacity:
        yield ()
        return
    row = math.prod(shape[1:]) * itemsize
    if row <= capacity:
        step = capacity // row
        for start in range(0, shape[0], step):
            yield (slice(start, min(start + step, shape[0])),)
        return
    for i in range(shape[0]):
        for rest in blocks(shape[1:], itemsize, capacity):
            yield (slice(i, i + 1), *rest)


def _buffer(capacity: int, pinned: bool) -> torch.Tensor:
    """This thread's staging buffer of ``capacity`` bytes, kept for its next copy (one at a time)."""
    kept = getattr(_buffers, "kept", None)
    if kept is None or kept.numel() != capacity or kept.is_pinned() != pinned:
        kept = _buffers.kept = torch.empty(capacity, dtype=torch.uint8, pin_memory=pinned)
    return kept
