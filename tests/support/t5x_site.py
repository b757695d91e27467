"""The T5X stand-in made importable as ``t5x.checkpoints``, with ckptshim's hook attached.

t5x is not on PyPI; ``tests/support/t5x_standin/checkpoints.py`` reproduces the functions
ckptshim hooks (see its docstring). Tests that need ``import t5x.checkpoints`` enter
:func:`standin_t5x`, which registers the stand-in as that module (no ``sys.path`` change) and
attaches the hook to it, as ``import t5x.checkpoints`` of the real package would.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ckptshim.hooks import registry

STANDIN = Path(__file__).parent / "t5x_standin" / "checkpoints.py"


def _forget_t5x() -> None:
    for name in ("t5x", "t5x.checkpoints"):
        sys.modules.pop(name, None)


@contextmanager
def standin_t5x() -> Iterator[object]:
    """Import the stand-in as ``t5x.checkpoints``, hooked, and undo it all on exit. A hook still
    on an earlier stand-in (another module object) is taken off first, or installing would
    find its patches active and leave this one unhooked."""
    registry.uninstall(["t5x"])
    _forget_t5x()
    package = types.ModuleType("t5x", "Stand-in t5x package for ckptshim tests.")
    package.__path__ = []  # a package, so that `import t5x.checkpoints` looks the submodule up
    spec = importlib.util.spec_from_file_location("t5x.checkpoints", STANDIN)
    checkpoints = importlib.util.module_from_spec(spec)
    sys.modules["t5x"], sys.modules["t5x.checkpoints"] = package, checkpoints
    try:
        spec.loader.exec_module(checkpoints)
        package.checkpoints = checkpoints
        registry.install(["t5x"])  # the module is imported: the hook attaches now
        assert registry.states()["t5x"].startswith("active"), registry.states()
        import t5x.checkpoints

        yield t5x.checkpoints
    finally:
        registry.uninstall(["t5x"])
        _forget_t5x()
