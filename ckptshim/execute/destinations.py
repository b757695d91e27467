"""Where a load's bytes land: the plain tensor behind each destination, and the one way every
writer puts values into it.

A destination can be a tensor subclass that keeps its values in another tensor: a DTensor
(FSDP2, tensor parallelism) keeps this rank's shard as its local tensor; torchao's float8
training weight (``WeightWithDynamicFloat8CastTensor``, see :mod:`ckptshim.rules.subclasses`)
keeps the high-precision weight it casts from; FSDP2 over float8 nests one in the other.
:func:`values_of` finds the plain tensor holding a destination's values -- the same memory, so
writing it is writing the destination -- and every writer (the torch executor's writes, the DCP
and format storage readers) writes through :func:`write`: into host memory with ``copy_``, into
device memory from the host through the bounded staging buffer (:mod:`ckptshim.execute.staging`).
"""

from __future__ import annotations

import sys

import torch

from ckptshim.errors import PlanError
from ckptshim.execute import staging
from ckptshim.rules.subclasses import values_attribute


def values_of(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor holding ``tensor``'s values in the same memory, detached: a DTensor's local
    shard, a known wrapper's inner tensor (repeatedly: FSDP2 over float8), else ``tensor`` itself.

    A subclass ckptshim does not know is returned as it is: its own ``copy_`` then decides how it
    takes values, as it does in torch's own loaders.
    """
    with torch.no_grad():
        while True:
            if is_dtensor(tensor):
                tensor = tensor.to_local()
                continue
            kind = type(tensor)
            attribute = values_attribute(f"{kind.__module__}.{kind.__qualname__}")
            if attribute is None:
                return tensor.detach() if kind in (torch.Tensor, torch.nn.Parameter) else tensor
            inner = getattr(tensor, attribute, None)
            if not isinstance(inner, torch.Tensor) or inner.shape != tensor.shape or inner.dtype != tensor.dtype:
                raise PlanError(
                    f"a {kind.__name__} {tensor.dtype}{list(tensor.shape)} whose {attribute} is not a tensor of "
                    "that dtype and shape, so ckptshim cannot tell where its values are; the tensor "
                    "subclass is not the one ckptshim knows (a changed library version?).")
            tensor = inner


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


def is_dtensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor. A DTensor exists only once ``torch.distributed.tensor``
    is imported, so a process that never did is not made to: that import costs a plain
    ``load_state_dict`` about 40 MiB and a third of its time (``bench_torch_load``)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)
