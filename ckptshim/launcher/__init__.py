"""``ckptshim run``: start an unedited launch command with the hooks in every Python process.

The command runs with :data:`BOOTSTRAP_DIR` first on ``PYTHONPATH``. That folder holds only a
``sitecustomize.py``, which Python imports at start-up in every interpreter inheriting the
environment, so torchrun's workers and any other Python child import ckptshim too. Options reach
the children through the same environment switches a user would set by hand.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from ckptshim.errors import ShimError

BOOTSTRAP_DIR = Path(__file__).resolve().parent / "bootstrap"


class LaunchError(ShimError):
    """The command to launch cannot be started."""


def child_environment(base: Mapping[str, str], *, disable_hooks: Sequence[str] = (),
                      strict: bool = False, log: str | None = None) -> dict[str, str]:
    """``base`` with the bootstrap folder first on PYTHONPATH (once) and the switches set."""
    env = dict(base)
    entries = [e for e in env.get("PYTHONPATH", "").split(os.pathsep) if e]
    entries = [e for e in entries if Path(e).resolve() != BOOTSTRAP_DIR]
    env["PYTHONPATH"] = os.pathsep.join([str(BOOTSTRAP_DIR), *entries])
    env["CKPTSHIM_BOOTSTRAP_HOME"] = str(BOOTSTRAP_DIR.parent.parent.parent)
    if disable_hooks:
        already = [n for n in env.get("CKPTSHIM_DISABLE_HOOKS", "").split(",") if n.strip()]
        env["CKPTSHIM_DISABLE_HOOKS"] = ",".join(dict.fromkeys([*already, *disable_hooks]))
    if strict:
        env["CKPTSHIM_STRICT"] = "1"
    if log:
        env["CKPTSHIM_LOG"] = log
    return env


def run(command: Sequence[str], env: Mapping[str, str], *, replace: bool = True) -> int:
    """Run ``command`` in ``env`` and return its exit code.

    With ``replace`` (the default on POSIX) the launcher *becomes* the command (``exec``), so
    signals, the terminal and the exit status are the command's own, with no process in between.
    """
    if not command:
        raise LaunchError("nothing to run: give the command after `--`, e.g. "
                          "`ckptshim run -- torchrun --nproc_per_node=2 train.py`")
    program = shutil.which(command[0], path=env.get("PATH"))
    if program is None:
        raise LaunchError(f"{command[0]!r}: command not found on PATH")
    if replace and os.name == "posix":
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(program, list(command), dict(env))
    return subprocess.run([program, *command[1:]], env=dict(env), check=False).returncode
