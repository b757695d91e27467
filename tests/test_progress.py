"""What a long hooked load shows: one tqdm bar per load over the bytes it reads (an Orbax restore,
a ``dcp.load`` of a DCP folder or of a format only ckptshim reads), on a terminal only, on rank 0
only under torchrun, and its one summary line, once.

A bar needs stderr to be a terminal, so these loads run in a child process whose stderr is a
pseudo-terminal (as ``test_convert.py``'s bar does); the fixtures are small, so
``CKPTSHIM_PROGRESS_MIN_BYTES`` lowers the threshold (1 GiB by default) to show one.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from ckptshim.api import inspect
from support.fixtures import copy_fixture
from support import processes
from support.processes import environment

RESTORE = """
import os, sys
import jax, orbax.checkpoint as ocp
import ckptshim
unscanned, scanned = sys.argv[1], sys.argv[2]
with ocp.StandardCheckpointer() as checkpointer:
    stored = checkpointer.restore(scanned)
    target = {"params": jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                                     stored["params"])}
    checkpointer.restore(unscanned, target)
print("restored", file=sys.stderr, flush=True)
"""

DCP_LOAD = """
import sys
import torch, torch.distributed.checkpoint as dcp
import ckptshim
from ckptshim.api import inspect
checkpoint = inspect(sys.argv[1])
state = {"model": {".".join(k[1:]): torch.empty(e.shape, dtype=getattr(torch, e.dtype))
                   for k, e in checkpoint.inventory.items() if k[0] == "model"}}
compiled = {"model": {"_orig_mod." + k: v for k, v in state["model"].items()}}
dcp.load(compiled, checkpoint_id=sys.argv[1])
print("loaded", file=sys.stderr, flush=True)
"""


def on_a_terminal(code: str, *argv: str, **env: str) -> str:
    """What ``python -c code argv...`` writes to stderr when stderr is a terminal."""
    base = {k: v for k, v in environment().items() if not k.startswith("CKPTSHIM_")}
    return processes.on_a_terminal(["-c", code, *argv], {**base, "JAX_PLATFORMS": "cpu", **env})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = copy_fixture("maxtext_runs", tmp_path_factory.mktemp("runs"))
    return [str(root / name / "checkpoints" / "1" / "items") for name in ("tiny_unscanned", "tiny_scanned")]


def bars(shown: str, description: str) -> list[str]:
    """Each bar as the terminal is left showing it: tqdm redraws a bar's line after ``\r`` and
    ends it with a newline when the bar closes, so one line per bar, its last drawing."""
    return [line.split("\r")[-1] for line in shown.split("\n") if description in line]


def in_bytes(total: int) -> str:
    """How a bar over ``total`` bytes ends: ``396k/396k`` (KiB, as ``from_pretrained``'s bars)."""
    from tqdm import tqdm

    size = tqdm.format_sizeof(total, divisor=1024)
    return f"{size}/{size} ["


def test_a_restore_over_the_threshold_shows_one_bar_to_its_end(runs):
    shown = on_a_terminal(RESTORE, *runs, CKPTSHIM_PROGRESS_MIN_BYTES="1")
    (bar,) = bars(shown, "ckptshim: restoring")  # the native restore of the scanned run shows none
    assert "100%|" in bar, shown


@pytest.mark.parametrize("env", [{}, {"CKPTSHIM_PROGRESS_MIN_BYTES": "1", "CKPTSHIM_PROGRESS": "0"}],
                         ids=["under the 1 GiB default", "CKPTSHIM_PROGRESS=0"])
def test_no_bar_under_the_threshold_or_when_switched_off(runs, env):
    shown = on_a_terminal(RESTORE, *runs, **env)
    assert "restored" in shown and "%|" not in shown, shown


def test_no_bar_when_stderr_is_not_a_terminal(runs):
    env = {**{k: v for k, v in environment().items() if not k.startswith("CKPTSHIM_")},
           "JAX_PLATFORMS": "cpu", "CKPTSHIM_PROGRESS_MIN_BYTES": "1"}
    result = subprocess.run([sys.executable, "-c", RESTORE, *runs], capture_output=True, text=True, env=env,
                            timeout=180)
    assert result.returncode == 0 and "restored" in result.stderr and "%|" not in result.stderr, result.stderr


def test_a_dcp_load_through_ckptshim_shows_one_bar_over_its_bytes(tmp_path):
    checkpoint = copy_fixture("torch_dcp_single/dcp_plain", tmp_path)
    shown = on_a_terminal(DCP_LOAD, str(checkpoint), CKPTSHIM_PROGRESS_MIN_BYTES="1")
    (bar,) = bars(shown, "ckptshim: dcp.load")
    assert "100%|" in bar and in_bytes(inspect(checkpoint).inventory.total_bytes) in bar, shown
    assert "loaded" in shown


FOREIGN_DCP_LOAD = """
import sys
import torch, torch.distributed.checkpoint as dcp
import ckptshim
from ckptshim.api import inspect
state = {".".join(k): torch.empty(e.shape, dtype=getattr(torch, e.dtype)) for k, e in inspect(sys.argv[1]).inventory.items()}
dcp.load(state, checkpoint_id=sys.argv[1])
print("loaded", file=sys.stderr, flush=True)
"""


def test_a_dcp_load_of_a_safetensors_file_shows_one_bar_over_its_bytes(tmp_path):
    """The other storage reader: a format DCP cannot read, read by ckptshim."""
    weights = copy_fixture("hf_gptneox_tf4.30.2/safetensors/model.safetensors", tmp_path)
    shown = on_a_terminal(FOREIGN_DCP_LOAD, str(weights), CKPTSHIM_PROGRESS_MIN_BYTES="1")
    (bar,) = bars(shown, "ckptshim: dcp.load")
    assert "100%|" in bar and in_bytes(inspect(weights).inventory.total_bytes) in bar, shown


def test_under_torchrun_only_rank_0_shows_its_bar(tmp_path):
    """Two ranks each read the whole checkpoint, both on one terminal: one bar, rank 0's."""
    checkpoint = copy_fixture("torch_dcp_single/dcp_plain", tmp_path)
    env = {**{k: v for k, v in environment().items() if not k.startswith("CKPTSHIM_")},
           "CKPTSHIM_PROGRESS_MIN_BYTES": "1", "OMP_NUM_THREADS": "1"}
    shown = processes.on_a_terminal(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                                     processes.worker("progress_dcp_worker.py"), str(checkpoint)], env, timeout=240)
    assert "loaded on rank 0" in shown and "loaded on rank 1" in shown, shown
    (bar,) = bars(shown, "ckptshim: dcp.load")
    assert "100%|" in bar and in_bytes(inspect(checkpoint).inventory.total_bytes) in bar, shown


def test_the_summary_line_is_printed_once_when_the_application_logs_too(runs):
    """CKPTSHIM_LOG asks for ckptshim's lines on stderr; a root handler prints them too (Orbax's
    import calls logging.basicConfig, and so may the application) -- each appears once."""
    code = "import logging; logging.basicConfig(level=logging.INFO)\n" + RESTORE
    env = {**{k: v for k, v in environment().items() if not k.startswith("CKPTSHIM_")},
           "JAX_PLATFORMS": "cpu", "CKPTSHIM_LOG": "info"}
    result = subprocess.run([sys.executable, "-c", code, *runs], capture_output=True, text=True, env=env, timeout=180)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if "27 stacked" in line or "stacked (axis 1)" in line]
    assert len(lines) == 1, result.stderr


def test_the_summary_line_is_printed_by_ckptshim_when_nothing_else_would(runs):
    """The application's root logger writes elsewhere (a file; here nowhere): ckptshim's own
    handler prints the line."""
    env = {**{k: v for k, v in environment().items() if not k.startswith("CKPTSHIM_")},
           "JAX_PLATFORMS": "cpu", "CKPTSHIM_LOG": "info"}
    code = "import logging; logging.getLogger().addHandler(logging.NullHandler())\n" + RESTORE
    result = subprocess.run([sys.executable, "-c", code, *runs], capture_output=True, text=True, env=env, timeout=180)
    lines = [line for line in result.stderr.splitlines() if "stacked (axis 1)" in line]
    assert len(lines) == 1 and lines[0].startswith("ckptshim: "), result.stderr
