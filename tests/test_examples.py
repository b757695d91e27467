"""Every script in examples/ runs to completion and prints what it claims, so the examples never rot."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.py"))

#: Lines (stdout and stderr together) an example must print beyond running to completion.
MUST_PRINT = {
    "legacy_launch_script.py": ["without ckptshim: exit 1", "with ckptshim run: exit 0: resumed",
                                "ckptshim: load_state_dict(OptimizedModule): 4 renamed"],
    "maxtext_scan_orbax.py": ["ckptshim: orbax StandardCheckpointer.restore(", "unscanned -> scanned, bit-exact",
                              "scanned -> unscanned, bit-exact", "8 stacked (axis 1)"],
    "paxml_to_maxtext.py": ["without ckptshim: Metadata file (named _METADATA) does not exist",
                            "9 split (axes 1; perm 1,0,2,3)", "combined_qkv[:, 1], 0, 1), bit-exact"],
    "pythia_neox_buffers.py": ["legacy buffers dropped, every weight loaded",
                               "missing inv_freq kept at the module's own computed value"],
    "t5x_legacy_orbax.py": ["without ckptshim: Metadata file (named _METADATA) does not exist",
                            "read by ckptshim as t5x (legacy msgpack v3)", "bit-exact with the Orbax-era step",
                            "today's Orbax alone restores the converted step, bit-exact"],
    "torch_compile_dcp.py": ["ckptshim: torch.distributed.checkpoint.load: 4 renamed",
                             "with ckptshim: 4 tensors loaded into the compiled model"],
}


def check_demo(out: str) -> None:
    """The showcase: for every story the native error without the shim, its summary with it."""
    stories = out.count("\n[")
    assert stories >= 8 and out.count("without ckptshim: ") == stories
    assert "without ckptshim: loads" not in out  # each story shows a real native failure
    assert out.count("with ckptshim:    ") == stories
    assert "loaded, nothing to change" not in out  # each story's summary says what the shim did
    assert f"{stories} of {stories} stories load with ckptshim." in out


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(script: Path) -> None:
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=600, check=False)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "FAILED" not in out
    if script.name == "demo.py":
        check_demo(result.stdout)
    for line in MUST_PRINT.get(script.name, ()):
        assert line in out, (line, out)
