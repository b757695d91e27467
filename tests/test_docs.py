"""The documentation site builds with every link resolved (``mkdocs build --strict``): a page
that links outside ``docs/`` or to a page that moved fails here, not on the published site."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_docs_build_strictly(tmp_path):
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                             str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "index.html").is_file()


def test_transformers_coverage_page_lists_the_installed_table():
    """docs/transformers.md lists every entry of the installed transformers' conversion mapping,
    translated or refused by its operations; a transformers release that adds a model type or an
    operation nobody translated fails here until the page is regenerated and its refusals reviewed."""
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "transformers_coverage.py"), "--check"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
