"""``ckptshim enable-venv`` / ``disable-venv``: the ``.pth`` file that shims a whole environment.

Python's ``site`` module executes ``import`` lines of every ``*.pth`` file in site-packages at
start-up, before any user code. A ``ckptshim.pth`` there makes every interpreter of that virtual
environment import ckptshim — the same effect as ``ckptshim run``, for good. The file is written
atomically (temporary file, then rename) and removed only if it is the one ckptshim wrote.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import tempfile
from pathlib import Path

from ckptshim.errors import ShimError

PTH_NAME = "ckptshim.pth"
_MARKER = "# written by `ckptshim enable-venv`; remove with `ckptshim disable-venv`"
#: A no-op when ckptshim has been uninstalled, so a stale file never breaks start-up.
PTH_TEXT = (f"{_MARKER}\n"
            "import importlib.util; importlib.util.find_spec('ckptshim') and __import__('ckptshim')\n")


class VenvError(ShimError):
    """The ``.pth`` file cannot be written or removed safely."""


def in_venv() -> bool:
    return sys.prefix != sys.base_prefix


def pth_file(site_packages: str | Path | None = None) -> Path | None:
    """Where ``ckptshim.pth`` goes: this interpreter's site-packages (``None`` if unknown)."""
    where = site_packages or sysconfig.get_paths().get("purelib")
    return Path(where) / PTH_NAME if where else None


def enable(site_packages: str | Path | None = None, *, force: bool = False) -> Path:
    """Write ``ckptshim.pth``; outside a virtual environment only with ``force``."""
    if site_packages is None and not in_venv() and not force:
        raise VenvError(f"{sys.executable} is not a virtual environment's Python; enabling the shim "
                        "here would affect every program using this interpreter. Activate a venv, "
                        "or pass --force if that is what you want.")
    target = pth_file(site_packages)
    if target is None or not target.parent.is_dir():
        raise VenvError(f"no site-packages folder found ({target}); pass --site-packages DIR")
    _check_ours(target)
    fd, tmp = tempfile.mkstemp(prefix=".ckptshim-", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(PTH_TEXT)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def disable(site_packages: str | Path | None = None) -> Path | None:
    """Remove ``ckptshim.pth`` if ckptshim wrote it; return its path, or ``None`` if absent."""
    target = pth_file(site_packages)
    if target is None or not target.exists():
        return None
    _check_ours(target)
    target.unlink()
    return target


def _check_ours(target: Path) -> None:
    if target.exists() and not target.read_text(encoding="utf-8", errors="replace").startswith(_MARKER):
        raise VenvError(f"{target} exists but was not written by ckptshim; leaving it alone. "
                        "Inspect and remove it by hand if it is stale.")
