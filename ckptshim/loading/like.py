"""``--like module:function``: a target layout from the user's own code instead of a checkpoint.

The function is called with no arguments and may return a torch ``nn.Module`` (its
``state_dict()`` is the target), a (nested) dict of tensors or arrays, or a JAX tree with
``jax.ShapeDtypeStruct`` leaves (an abstract state, as ``jax.eval_shape`` gives): only shapes
and dtypes are used, so an abstract tree costs no memory. The module is looked for in the current
folder first, then on ``sys.path`` (``PYTHONPATH``), from ``python -m ckptshim`` and from the
``ckptshim`` command alike.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from ckptshim import extras
from ckptshim.errors import ShimError
from ckptshim.inventory import Entry, Inventory, dtype_name, flatten

_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class LikeError(ShimError):
    """``module:function`` could not be imported, called, or gave no arrays."""


def is_callable_spec(like: str | Path) -> bool:
    """True for ``package.module:function`` that is not also an existing path."""
    return bool(_SPEC.match(str(like))) and not Path(like).exists()


@contextlib.contextmanager
def _current_folder_importable() -> Iterator[None]:
    """The current folder first on ``sys.path`` while the user's module is imported and called,
    as ``python -m`` would have it (the ``ckptshim`` console script's ``sys.path`` starts with the
    script's own folder instead); as it was afterwards."""
    folder = os.getcwd()
    added = folder not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, folder)
    try:
        yield
    finally:
        if added and folder in sys.path:
            sys.path.remove(folder)


def _import(spec: str, module_name: str) -> ModuleType:
    """The user's module; its own failures to import what it needs say so (and, for a framework,
    which extra installs it) rather than that the module itself was not found."""
    from importlib import import_module

    try:
        return import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name and (module_name + ".").startswith(error.name + "."):
            raise LikeError(f"--like {spec}: no module {error.name!r} in the current folder "
                            f"({os.getcwd()}) or on PYTHONPATH; run from the folder that holds "
                            "it or add that folder to PYTHONPATH") from None
        raise extras.missing(error, f"--like {spec}") or LikeError(
            f"--like {spec}: importing {module_name} failed: {error}") from error
    except ImportError as error:  # e.g. a name its own imports ask for that is not there
        raise LikeError(f"--like {spec}: importing {module_name} failed: {error}") from error


def _is_array(leaf: Any) -> bool:
    return hasattr(leaf, "shape") and hasattr(leaf, "dtype")


def target_inventory(spec: str) -> tuple[Inventory, str]:
    """The inventory the function's result describes, and its key separator ("." torch, "/" JAX)."""
    module_name, function_name = spec.split(":")
    with _current_folder_importable():
        function = getattr(_import(spec, module_name), function_name, None)
        if not callable(function):
            raise LikeError(f"--like {spec}: module {module_name} has no function {function_name!r}; "
                            "name one that takes no arguments and returns a model, a state dict "
                            "or an abstract tree")
        result = function()
    model_type = getattr(getattr(result, "config", None), "model_type", None)  # a transformers model's
    if callable(getattr(result, "state_dict", None)):  # a torch nn.Module
        result = result.state_dict()
    flat = flatten(result, is_leaf=_is_array)
    torch_like = any(type(v).__module__.startswith("torch") for v in flat.values())
    if torch_like:  # state-dict keys are dotted names: "layers.0.w" is three components
        flat = {tuple(p for part in key for p in part.split(".")): v for key, v in flat.items()}
    if not torch_like and "jax" in sys.modules and not isinstance(result, dict):
        from ckptshim.targets.jax_tree import TargetTree  # pytrees beyond dicts (dataclasses, ...)

        inventory = TargetTree(result).inventory(spec)
    else:
        inventory = Inventory((Entry(key, tuple(int(d) for d in leaf.shape), dtype_name(leaf.dtype))
                               for key, leaf in flat.items() if _is_array(leaf)), spec)
    if not len(inventory):
        raise LikeError(f"--like {spec}: {function_name}() returned {type(result).__name__} with no "
                        "arrays; return a model, a state dict or an abstract tree")
    if isinstance(model_type, str):
        inventory.model_type = model_type
    return inventory, "." if torch_like else "/"
