"""The T5X stand-in made importable as ``t5x.checkpoints``, with ckptshim's hook attached.

t5x is not on PyPI; ``tests/t5x_standin/checkpoints.py`` reproduces the functions ckptshim
hooks (see its docstring). Tests that need ``import t5x.checkpoints`` enter :func:`standin_t5x`.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ckptshim.hooks import registry

STANDIN = Path(__file__).parent / "t5x_standin" / "checkpoints.py"


def _forget_t5x() -> None:
    for name in ("t5x", "t5x.checkpoints"):
        sys.modules.pop(name, None)


@contextmanager
def standin_t5x(site: Path) -> Iterator[object]:
    """Write the stand-in package under ``site``, import it hooked, and undo it all on exit."""
    (site / "t5x").mkdir(parents=True)
    (site / "t5x" / "__init__.py").write_text('"""Stand-in t5x package for ckptshim tests."""\n')
    shutil.copy(STANDIN, site / "t5x" / "checkpoints.py")
    sys.path.insert(0, str(site))
    _forget_t5x()
    registry.install(["t5x"])
    try:
        import t5x.checkpoints

        assert registry.states()["t5x"].startswith("active"), registry.states()
        yield t5x.checkpoints
    finally:
        registry.uninstall(["t5x"])
        sys.path.remove(str(site))
        _forget_t5x()
