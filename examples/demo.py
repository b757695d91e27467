"""The ckptshim showcase: real "old" checkpoints, today's code, the normal framework calls.

Each story writes its checkpoint with the installed framework into a temporary directory, then
loads it twice through the framework's own call: once with the shim switched off (showing the
error users hit) and once with it on (showing ckptshim's one-line summary of what it did).
Run with ``make demo`` or ``python examples/demo.py``.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import textwrap
import warnings
from collections.abc import Callable
from pathlib import Path

import ckptshim

STORIES: list[tuple[str, Callable[[Path], Callable[[], object]]]] = []


def story(title: str):
    """Register a story: a function that writes inputs and returns the load to attempt.

    The load runs twice: with the shim uninstalled (it must fail), then installed.
    """
    def register(prepare):
        STORIES.append((title, prepare))
        return prepare
    return register


class _Summaries(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _tiny_model(seed: int):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))


@story("torch.compile'd model loads a plain model's torch.save checkpoint")
def compiled_model(tmp: Path):
    import torch

    torch.save(_tiny_model(0).state_dict(), tmp / "plain.pt")
    model = torch.compile(_tiny_model(1))  # keys are now "_orig_mod.0.weight", ...
    return lambda: model.load_state_dict(torch.load(tmp / "plain.pt", weights_only=True))


@story("old checkpoint with a now non-persistent rotary inv_freq buffer")
def legacy_inv_freq(tmp: Path):
    import torch
    from torch import nn

    class Rotary(nn.Module):
        def __init__(self, persistent: bool) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)
            inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
            self.register_buffer("inv_freq", inv_freq, persistent=persistent)

    torch.save(Rotary(persistent=True).state_dict(), tmp / "old.pt")  # as transformers < 4.35 did
    model = Rotary(persistent=False)                                  # as transformers >= 4.35 does
    return lambda: model.load_state_dict(torch.load(tmp / "old.pt", weights_only=True))


@story("DCP checkpoint of a plain model loads into the torch.compile'd model")
def dcp_into_compiled(tmp: Path):
    import torch
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": _tiny_model(0).state_dict()}, checkpoint_id=tmp / "dcp")
    state_dict = torch.compile(_tiny_model(1)).state_dict()
    return lambda: dcp.load({"model": state_dict}, checkpoint_id=tmp / "dcp")


@story("unscanned Orbax checkpoint (layers_0..3) restores into a scan_layers=True model")
def orbax_scan(tmp: Path):
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    layers, rng = 4, np.random.default_rng(0)
    unscanned = {"params": {"decoder": {f"layers_{i}": {"mlp": {"wi": {"kernel": rng.standard_normal((8, 16), np.float32)}}}
                                        for i in range(layers)}}}
    path = tmp / "unscanned"
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, unscanned)
    # MaxText with scan_layers=True: one `layers` subtree, params stacked on axis 1
    scanned = {"params": {"decoder": {"layers": {"mlp": {"wi": {"kernel": jax.ShapeDtypeStruct((8, layers, 16), np.float32)}}}}}}

    def restore():
        with ocp.StandardCheckpointer() as checkpointer:
            return checkpointer.restore(path, scanned)
    return restore


def _headline(error: BaseException) -> str:
    """The error as a user sees it first: its type and the line that names the keys."""
    failures = getattr(error, "failures", None)  # DCP's CheckpointException wraps each rank's error
    if isinstance(failures, dict) and failures:
        error = next(iter(failures.values()))
        error = error[0] if isinstance(error, tuple) else error  # (exception, traceback)
    head = " ".join(str(error).strip().splitlines()[:2])
    return f"{type(error).__name__}: {textwrap.shorten(head, 150)}"


def main() -> int:
    summaries = _Summaries()
    shim_log = logging.getLogger("ckptshim")
    shim_log.addHandler(summaries)
    shim_log.setLevel(logging.INFO)
    shim_log.propagate = False  # printed by this script, not again by a framework's root handler
    failures = 0
    for number, (title, prepare) in enumerate(STORIES, 1):
        print(f"\n[{number}] {title}")
        with tempfile.TemporaryDirectory() as tmp:
            load = prepare(Path(tmp))
            ckptshim.uninstall()
            try:
                load()
                print("    without ckptshim: loads (nothing to fix)")
            except BaseException as error:  # the error users hit (DCP's is a BaseException)
                print(f"    without ckptshim: {_headline(error)}")
            ckptshim.install()
            summaries.lines.clear()
            try:
                load()
            except Exception as error:
                failures += 1
                print(f"    with ckptshim:    FAILED: {type(error).__name__}: {error}")
                continue
            print(f"    with ckptshim:    {'; '.join(summaries.lines) or 'loaded, nothing to change'}")
    print(f"\n{len(STORIES) - failures} of {len(STORIES)} stories load with ckptshim.")
    return 1 if failures else 0


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")
    sys.exit(main())
