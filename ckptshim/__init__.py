"""ckptshim: load old and foreign deep-learning checkpoints into today's PyTorch and JAX code.

``import ckptshim`` arranges for hooks to attach to each framework's load functions when that
framework is imported; it imports neither torch nor jax itself and costs a few milliseconds.
Set ``CKPTSHIM_DISABLE=1`` to turn it off. The public functions below, and ``__version__`` (read
from the installed distribution's metadata, the one place the version is written), are loaded on
first use.
"""

from __future__ import annotations

from ckptshim.errors import ShimError
from ckptshim.hooks.registry import install, uninstall

TYPE_CHECKING = False  # type checkers take it as True (importing typing would cost ~4 ms)
if TYPE_CHECKING:  # what type checkers and the API docs see; at run time, loaded on first use
    from ckptshim.api import convert, inspect, plan

__all__ = ["ShimError", "convert", "inspect", "install", "plan", "uninstall", "__version__"]
__version__: str  # read on first use (see __getattr__)

_LAZY = {
    "inspect": ("ckptshim.api", "inspect"),
    "plan": ("ckptshim.api", "plan"),
    "convert": ("ckptshim.api", "convert"),
}


def _version() -> str:
    """The installed distribution's version (pyproject.toml's); ``0+unknown`` for a source tree
    imported without being installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ckptshim")
    except PackageNotFoundError:
        return "0+unknown"


def __getattr__(name: str):
    if name == "__version__":
        globals()[name] = value = _version()
        return value
    if name in _LAZY:
        from importlib import import_module

        module, attribute = _LAZY[name]
        value = getattr(import_module(module), attribute)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ckptshim' has no attribute {name!r}")


def _bootstrap() -> None:
    import os

    if os.environ.get("CKPTSHIM_LOG", "").strip():  # configure_from_env reads (and checks) it
        from ckptshim.log import configure_from_env

        configure_from_env()
    install()


_bootstrap()
