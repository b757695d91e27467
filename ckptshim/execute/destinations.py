"""Where a load's bytes land: the one way every writer puts values into a destination.

The plain tensor behind a destination (a DTensor's local shard, a float8 training weight's
high-precision tensor) is :func:`ckptshim.targets.tensors.values_of`'s -- the same memory, so
writing it is writing the destination -- and every writer (the torch executor's writes, the DCP
and format storage readers) writes through :func:`write`: into host memory with ``copy_``, into
device memory from the host through the bounded staging buffer (:mod:`ckptshim.execute.staging`).
Bytes read into an array become a tensor through :func:`as_tensor`, without a copy.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from ckptshim.errors import PlanError
from ckptshim.execute import staging
from ckptshim.targets.tensors import values_of


def as_tensor(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A tensor over ``array``'s memory, no copy (read-only maps included: only ever copied from);
    bfloat16 and float8 arrive as their storage bits and are viewed as ``dtype``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "The given NumPy array is not writable"
        tensor = torch.from_numpy(array)
    return tensor if tensor.dtype == dtype else tensor.view(dtype)


def write(destination: torch.Tensor, source: torch.Tensor) -> None:
    """Copy ``source``'s values into ``destination``'s (casting where the dtypes differ): plain
    host values bound for device memory through the staging buffer, everything else with ``copy_``."""
    target, values = values_of(destination), values_of(source)
    if target.shape != values.shape:  # a DTensor takes this rank's shard, never a whole value
        raise PlanError(f"a value of shape {list(values.shape)} cannot be written into a {type(destination).__name__} "
                        f"whose memory here holds {list(target.shape)}; ckptshim writes shards into sharded "
                        "tensors. This is a bug in ckptshim: please report it.")
    with torch.no_grad():
        if not in_host_memory(target) and values.device.type == "cpu" and type(values) is torch.Tensor:
            staging.copy(target, values)
        else:
            target.copy_(values)


def in_host_memory(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s memory is host memory, which ckptshim writes (or reads file bytes)
    into directly; any other destination is staged. (The one device check of every writer.)"""
    return tensor.device.type == "cpu"
