"""A virtual environment holding what ``pip install ckptshim`` gives a user: the package built as a
wheel from this tree (not an editable install) and its own dependencies only -- no torch, no jax.

It is built once per test session (about 15 s with pip's cache warm), with the pins of
constraints.txt, by this venv's pip (``pip --python``), so it needs nothing beyond what ``make
dev`` installed. The package is built from a copy of the files a source distribution holds
(``pyproject.toml``, ``README.md``, ``LICENSE``, ``ckptshim/``), so nothing stale in the
repository (an old ``build/``) can slip into it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: What a source distribution of ckptshim holds.
SOURCE_FILES = ("pyproject.toml", "README.md", "LICENSE")


@dataclass(frozen=True)
class Venv:
    root: Path

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    def script(self, name: str = "ckptshim") -> Path:
        """A console script pip installed, as the user's shell finds it."""
        return self.root / "bin" / name

    def site_packages(self) -> Path:
        return next((self.root / "lib").glob("python3*/site-packages"))

    def run(self, argv: list[str | Path], cwd: Path, **env: str) -> subprocess.CompletedProcess:
        """``argv`` run from ``cwd`` with this venv's ``bin`` first on PATH, as after ``source
        bin/activate``; no PYTHONPATH and no CKPTSHIM_* switch leaks in from the test run."""
        base = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("CKPTSHIM_")}
        path = os.pathsep.join([str(self.root / "bin"), base.get("PATH", "/usr/bin:/bin")])
        return subprocess.run([str(a) for a in argv], cwd=cwd, capture_output=True, text=True,
                              env={**base, "PATH": path, "VIRTUAL_ENV": str(self.root), **env}, timeout=300)


def build_plain_venv(into: Path) -> Venv:
    """A venv with ckptshim installed from a wheel of this tree and nothing optional."""
    source = into / "source"
    source.mkdir(parents=True)
    for name in SOURCE_FILES:
        shutil.copy2(REPO / name, source / name)
    shutil.copytree(REPO / "ckptshim", source / "ckptshim", ignore=shutil.ignore_patterns("__pycache__"))
    venv = Venv(into / "venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv.root)], check=True, timeout=120)
    result = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv.python), "install", "--quiet",
                             "--constraint", str(REPO / "constraints.txt"), str(source)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return venv
