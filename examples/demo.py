"""The ckptshim showcase: real "old" checkpoints, today's code, the normal framework calls.

Each story sets up a checkpoint in a temporary directory and loads it twice through the
framework's own call: once without the shim (showing the first line of the error users hit)
and once with it (showing ckptshim's one-line summary of what it did). Most stories write their
checkpoint with the installed framework. Three copy a real one from ``tests/fixtures`` because
the tool that writes it cannot be installed from PyPI: GPT-NeoX (a repository, run under
DeepSpeed), T5X (not on PyPI) and PaxML (its last release, 1.4, needs jax 0.4). The launcher story runs a
legacy script in a child process, plainly and then through ``ckptshim run``; the PaxML story
takes MaxText GPT-3's shapes from ``paxml_to_maxtext.py`` beside this file.
Run with ``make demo`` or ``python examples/demo.py``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import ckptshim

HERE = Path(__file__).resolve().parent
FIXTURES = HERE.parent / "tests" / "fixtures"


class _Collected(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        self.lines.append(message if record.levelno == logging.INFO else f"{record.levelname}: {message}")


@contextlib.contextmanager
def _summaries() -> Iterator[list[str]]:
    """Collect the ``ckptshim`` logger's lines (printed by this script, not by a framework):
    summaries as they are, warnings marked ``WARNING:``."""
    handler, shim_log = _Collected(), logging.getLogger("ckptshim")
    shim_log.addHandler(handler)
    shim_log.setLevel(logging.INFO)
    shim_log.propagate = False
    try:
        yield handler.lines
    finally:
        shim_log.removeHandler(handler)


@dataclass(frozen=True)
class InProcess:
    """A load in this process: without the shim means with its hooks uninstalled."""

    load: Callable[[], object]

    def without(self) -> None:
        ckptshim.uninstall()
        self.load()

    def with_shim(self) -> list[str]:
        ckptshim.install()
        with _summaries() as lines:
            self.load()
        return lines


_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*): (.*)$")


class ChildError(Exception):
    """A child Python's uncaught exception: the traceback's last ``Type: message`` line onwards."""

    def __init__(self, stderr: str) -> None:
        lines = stderr.strip().splitlines()
        last = max((i for i, line in enumerate(lines) if _EXCEPTION_LINE.match(line)), default=None)
        if last is None:
            self.kind, message = "child process failed", stderr.strip()
        else:
            self.kind, first = _EXCEPTION_LINE.match(lines[last]).groups()
            message = "\n".join([first, *lines[last + 1:]])
        super().__init__(message)


@dataclass(frozen=True)
class Launched:
    """An unedited script in a child Python: run plainly, then through ``ckptshim run``."""

    command: tuple[str, ...]

    def _run(self, *prefix: str) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTSHIM_")}
        result = subprocess.run([*prefix, *self.command], capture_output=True, text=True, env=env, check=False)
        if result.returncode != 0:
            raise ChildError(result.stderr)
        return result

    def without(self) -> None:
        self._run()

    def with_shim(self) -> list[str]:
        shimmed = self._run(sys.executable, "-m", "ckptshim", "run", "--log", "info", "--")
        return [line.removeprefix("ckptshim: ") for line in shimmed.stderr.splitlines()
                if line.startswith("ckptshim: ")]


STORIES: list[tuple[str, Callable[[Path], InProcess | Launched]]] = []


def story(title: str):
    """Register a story: a function that sets up its inputs in a folder and returns the load."""
    def register(prepare):
        STORIES.append((title, prepare))
        return prepare
    return register


def _tiny_model(seed: int):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))


def _fixture(name: str, tmp: Path) -> Path:
    """A copy of ``tests/fixtures/<name>`` (never load from the fixtures themselves)."""
    return Path(shutil.copytree(FIXTURES / name, tmp / Path(name).name, copy_function=shutil.copyfile))


def _abstract(tree):
    """What today's JAX code passes to a restore: shapes and dtypes of its train state."""
    import jax

    return jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype), tree)


def _orbax_restore(path: Path, target) -> Callable[[], object]:
    def restore():
        import orbax.checkpoint as ocp

        with ocp.StandardCheckpointer() as checkpointer:
            return checkpointer.restore(path, target)
    return restore


@story("torch.compile'd model loads a plain model's torch.save checkpoint")
def compiled_model(tmp: Path) -> InProcess:
    import torch

    torch.save(_tiny_model(0).state_dict(), tmp / "plain.pt")
    model = torch.compile(_tiny_model(1))  # keys are now "_orig_mod.0.weight", ...
    return InProcess(lambda: model.load_state_dict(torch.load(tmp / "plain.pt", weights_only=True)))


@story("old checkpoint with a now non-persistent rotary inv_freq buffer")
def legacy_inv_freq(tmp: Path) -> InProcess:
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
    return InProcess(lambda: model.load_state_dict(torch.load(tmp / "old.pt", weights_only=True)))


@story("DCP checkpoint of a plain model loads into the torch.compile'd model")
def dcp_into_compiled(tmp: Path) -> InProcess:
    import torch
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": _tiny_model(0).state_dict()}, checkpoint_id=tmp / "dcp")
    state_dict = torch.compile(_tiny_model(1)).state_dict()
    return InProcess(lambda: dcp.load({"model": state_dict}, checkpoint_id=tmp / "dcp"))


@story("legacy launch script (never imports ckptshim) resumes a compiled model: plain, then `ckptshim run`")
def launch_script(tmp: Path) -> Launched:
    import torch

    torch.save(_tiny_model(0).state_dict(), tmp / "plain.pt")
    return Launched((sys.executable, str(HERE / "legacy_scripts" / "train_legacy.py"), str(tmp / "plain.pt")))


@story("GPT-NeoX pipeline checkpoint (DeepSpeed layer files) loads into transformers' GPTNeoXForCausalLM")
def neox_into_transformers(tmp: Path) -> InProcess:
    import torch
    import transformers

    logging.getLogger("transformers").setLevel(logging.ERROR)
    run = _fixture("neox_deepspeed/pp1_mp1", tmp)  # written by GPT-NeoX under DeepSpeed 0.19.8
    # what NeoX's own convert_neox_to_hf.py reads: each pipeline layer file, keyed sequential.<i>.
    layer_files = sorted((run / "checkpoint" / "global_step0").glob("layer_*-model_00-model_states.pt"))
    state_dict = {f"sequential.{int(path.name.split('-')[0].removeprefix('layer_'))}.{key}": value
                  for path in layer_files for key, value in torch.load(path, weights_only=True).items()}
    model = transformers.GPTNeoXForCausalLM(transformers.AutoConfig.from_pretrained(run / "hf"))
    return InProcess(lambda: model.load_state_dict(state_dict))


@story("unscanned Orbax checkpoint (layers_0..3) restores into a scan_layers=True model")
def orbax_scan(tmp: Path) -> InProcess:
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    layers, rng = 4, np.random.default_rng(0)
    unscanned = {"params": {"decoder": {f"layers_{i}": {"mlp": {"wi": {"kernel": rng.standard_normal((8, 16), np.float32)}}}
                                        for i in range(layers)}}}
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp / "unscanned", unscanned)
    # MaxText with scan_layers=True: one `layers` subtree, params stacked on axis 1
    scanned = {"params": {"decoder": {"layers": {"mlp": {"wi": {"kernel": jax.ShapeDtypeStruct((8, layers, 16), np.float32)}}}}}}
    return InProcess(_orbax_restore(tmp / "unscanned", scanned))


@story("legacy T5X checkpoint (msgpack + tensorstore) restores with Orbax into today's T5X train state")
def t5x_legacy(tmp: Path) -> InProcess:
    import orbax.checkpoint as ocp

    legacy = _fixture("t5x_tiny_decoder/legacy_checkpointer", tmp) / "checkpoint_0"
    today = _fixture("t5x_tiny_decoder/orbax_checkpoint_manager", tmp) / "checkpoint_0" / "state"
    with ocp.StandardCheckpointer() as checkpointer:  # the train state today's T5X saves
        state = checkpointer.metadata(today).item_metadata.tree
    return InProcess(_orbax_restore(legacy, _abstract(state)))


@story("PaxML GPT-3 run (praxis Repeat, fused qkv) restores into MaxText GPT-3 params (scan_layers=True)")
def paxml_into_maxtext(tmp: Path) -> InProcess:
    import jax
    import numpy as np
    from paxml_to_maxtext import maxtext_params  # (examples/) MaxText GPT-3's shapes for this run's sizes

    step = _fixture("paxml_runs/TinySpmdRepeat/checkpoints/checkpoint_00000001", tmp)
    params = jax.tree.map(lambda shape: jax.ShapeDtypeStruct(shape, np.float32), maxtext_params(),
                          is_leaf=lambda node: isinstance(node, tuple))
    # the parameters alone, as MaxText's load_parameters_path restores them
    return InProcess(_orbax_restore(step / "state", {"params": {"params": params}}))


def _headline(error: BaseException) -> str:
    """The error as a user sees it first: its type and the line that names the keys."""
    failures = getattr(error, "failures", None)  # DCP's CheckpointException wraps each rank's error
    if isinstance(failures, dict) and failures:
        error = next(iter(failures.values()))
        error = error[0] if isinstance(error, tuple) else error  # (exception, traceback)
    head = " ".join(line.strip() for line in str(error).strip().splitlines()[:2])
    return f"{getattr(error, 'kind', type(error).__name__)}: {textwrap.shorten(head, 150)}"


def main() -> int:
    failures = 0
    for number, (title, prepare) in enumerate(STORIES, 1):
        print(f"\n[{number}] {title}", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            attempt = prepare(Path(tmp))
            try:
                attempt.without()
                print("    without ckptshim: loads (nothing to fix)")
            except BaseException as error:  # the error users hit (DCP's is a BaseException)
                print(f"    without ckptshim: {_headline(error)}")
            try:
                lines = attempt.with_shim()
            except Exception as error:
                failures += 1
                print(f"    with ckptshim:    FAILED: {_headline(error)}")
                continue
            summaries = [line for line in lines if not line.startswith("WARNING: ")]
            print(f"    with ckptshim:    {'; '.join(summaries) or 'loaded, nothing to change'}")
            for warning in sorted(set(lines) - set(summaries)):  # whole: it names what was left out
                print(textwrap.fill(warning, 110, initial_indent=" " * 6, subsequent_indent=" " * 8,
                                    break_on_hyphens=False, break_long_words=False))
    print(f"\n{len(STORIES) - failures} of {len(STORIES)} stories load with ckptshim.")
    return 1 if failures else 0


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")
    logging.getLogger("absl").setLevel(logging.ERROR)  # Orbax's notes on absent optional metadata
    sys.exit(main())
