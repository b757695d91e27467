"""ckptshim: load old and foreign deep-learning checkpoints into today's PyTorch and JAX code.

``import ckptshim`` arranges for hooks to attach to each framework's load functions when that
framework is imported; it imports neither torch nor jax itself and costs a few milliseconds.
Set ``CKPTSHIM_DISABLE=1`` to turn it off. The public functions below are imported on first use.
"""

from __future__ import annotations

from ckptshim.errors import ShimError
from ckptshim.hooks.registry import install, uninstall

__all__ = ["ShimError", "convert", "inspect", "install", "plan", "uninstall", "__version__"]
__version__ = "0.1.0"

_LAZY = {
    "inspect": ("ckptshim.api", "inspect"),
    "plan": ("ckptshim.api", "plan"),
    "convert": ("ckptshim.api", "convert"),
}


def __getattr__(name: str):
    if name in _LAZY:
        from importlib import import_module

        module, attribute = _LAZY[name]
        value = getattr(import_module(module), attribute)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ckptshim' has no attribute {name!r}")


def _bootstrap() -> None:
    from ckptshim import config

    if config.log_level() is not None:
        from ckptshim.log import configure_from_env

        configure_from_env()
    install()


_bootstrap()
