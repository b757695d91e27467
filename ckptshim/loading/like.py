"""``--like module:function``: a target layout from the user's own code instead of a checkpoint.

The function is called with no arguments and may return a torch ``nn.Module`` (its
``state_dict()`` is the target), a (nested) dict of tensors or arrays, or a JAX tree with
``jax.ShapeDtypeStruct`` leaves (an abstract state, as ``jax.eval_shape`` gives): only shapes
and dtypes are used, so an abstract tree costs no memory.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from ckptshim.errors import ShimError
from ckptshim.inventory import Entry, Inventory, dtype_name, flatten

_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class LikeError(ShimError):
    """``module:function`` could not be imported, called, or gave no arrays."""


def is_callable_spec(like: str | Path) -> bool:
    """True for ``package.module:function`` that is not also an existing path."""
    return bool(_SPEC.match(str(like))) and not Path(like).exists()


def _is_array(leaf: Any) -> bool:
    return hasattr(leaf, "shape") and hasattr(leaf, "dtype")


def target_inventory(spec: str) -> tuple[Inventory, str]:
    """The inventory the function's result describes, and its key separator ("." torch, "/" JAX)."""
    from importlib import import_module

    module_name, function_name = spec.split(":")
    try:
        function = getattr(import_module(module_name), function_name)
    except (ImportError, AttributeError) as error:
        raise LikeError(f"--like {spec}: cannot import it ({error}); run from the folder that "
                        "holds the module or put it on PYTHONPATH") from None
    result = function()
    if callable(getattr(result, "state_dict", None)):  # a torch nn.Module
        result = result.state_dict()
    flat = flatten(result, is_leaf=_is_array)
    torch_like = any(type(v).__module__.startswith("torch") for v in flat.values())
    if torch_like:  # state-dict keys are dotted names: "layers.0.w" is three components
        flat = {tuple(p for part in key for p in part.split(".")): v for key, v in flat.items()}
    if not torch_like and "jax" in sys.modules and not isinstance(result, dict):
        from ckptshim.execute.jax_tree import TargetTree  # pytrees beyond dicts (dataclasses, ...)

        inventory = TargetTree(result).inventory(spec)
    else:
        inventory = Inventory((Entry(key, tuple(int(d) for d in leaf.shape), dtype_name(leaf.dtype))
                               for key, leaf in flat.items() if _is_array(leaf)), spec)
    if not len(inventory):
        raise LikeError(f"--like {spec}: {function_name}() returned {type(result).__name__} with no "
                        "arrays; return a model, a state dict or an abstract tree")
    return inventory, "." if torch_like else "/"
