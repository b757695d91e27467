"""The tensors behind a destination: what holds its values, whatever wraps them.

A destination can be a tensor subclass that keeps its values in another tensor: a DTensor
(FSDP2, tensor parallelism) keeps this rank's shard as its local tensor; torchao's float8
training weight (``WeightWithDynamicFloat8CastTensor``, see :mod:`ckptshim.layouts.subclasses`)
keeps the high-precision weight it casts from; FSDP2 over float8 nests one in the other.
:func:`values_of` finds the plain tensor holding a destination's values, for the loading layer
(which tensors are one: tied weights) and the writers alike.
"""

from __future__ import annotations

import sys

import torch

from ckptshim.errors import PlanError
from ckptshim.layouts.subclasses import values_attribute


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



def is_dtensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor. A DTensor exists only once ``torch.distributed.tensor``
    is imported, so a process that never did is not made to: that import costs a plain
    ``load_state_dict`` about 40 MiB and a third of its time (``bench_torch_load``)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)
