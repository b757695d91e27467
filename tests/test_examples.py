"""Every script in examples/ runs to completion, so the examples never rot."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.py"))


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(script: Path) -> None:
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=600, check=False)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "FAILED" not in out
    if script.name == "demo.py":  # the showcase prints the native error, then the shim's summary
        stories = out.count("\n[")
        assert stories >= 4 and out.count("without ckptshim: ") == stories
        assert "without ckptshim: loads" not in out  # each story shows a real native failure
        assert out.count("with ckptshim:    ") == stories
        assert f"{stories} of {stories} stories load with ckptshim." in out
