"""The conventions of each kind of call, as profiles: what every torch load and every JAX
restore plans with, whatever the model."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckptshim.rules.context import LoadContext
from ckptshim.rules.flax_names import LINEN_NNX
from ckptshim.rules.layers import TORCH_SCAN_AXES
from ckptshim.rules.roots import root_prefix


@dataclass(frozen=True)
class TorchModules:
    """torch modules stack layer lists on axis 0; a root prefix one side carries (Lightning's
    ``model.``) is a candidate the planner takes where it is exact. ``dcp.load`` checks no value
    while it plans and reads only what the state dict asks for, so there a checkpoint key named
    like a derivable buffer is unexpected, not dropped."""

    name: str = "torch modules"

    def applies(self, context: LoadContext) -> bool:
        return context.backend == "torch"

    def rules(self, context: LoadContext) -> Mapping[str, Any]:
        return {"scan_axes": TORCH_SCAN_AXES, "root": root_prefix(context.source, context.target),
                "drop_derivable": context.call != "dcp"}


@dataclass(frozen=True)
class JaxTrees:
    """Linen and NNX spellings are one name; a restore leaves every checkpoint key the target
    does not ask for on disk and reads no value it could check, so nothing is dropped as
    derivable."""

    name: str = "JAX trees"

    def applies(self, context: LoadContext) -> bool:
        return context.backend == "jax"

    def rules(self, context: LoadContext) -> Mapping[str, Any]:
        return {"aliases": LINEN_NNX, "drop_derivable": False}


TORCH_MODULES = TorchModules()
JAX_TREES = JaxTrees()
