"""What a hooked call that steps aside costs, first and tenth call: ``python bench/bench_first_call.py [-n 5]``.

For each seam (``load_state_dict``, ``dcp.load``, Orbax ``StandardCheckpointer.restore``, Flax
``restore_checkpoint``) a checkpoint whose names and shapes match the destination is saved once
by the framework itself (1 MiB of float32). Then, in ``n`` fresh interpreters per mode, the
framework and (ON) ``import ckptshim`` are imported untimed, and the seam's call is timed on its
first and on its tenth call: ON (ckptshim imported, hooks on) against OFF (ckptshim not
imported), the two modes interleaved so that a change in the machine's load hits both. Bytecode
is written as an installed package has it (the first, untimed round writes any that is missing).
Prints the medians and ON minus OFF against the 30 ms budget of a first call (exit status 1 when
a seam is over it), and ON minus OFF in CPU time of the process, the figure a busy machine
inflates least (wall time there includes waiting for a core).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SEAMS = ("load_state_dict", "dcp.load", "orbax restore", "flax restore")
BUDGET_MS = 30.0
CALLS = 10
ROWS, COLS = 256, 1024  # 1 MiB of float32


def _env(on: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTSHIM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


# -- the child: one seam, one mode, one fresh interpreter ------------------------------------------


def _torch_model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(COLS, ROWS, bias=False))


def _prepare(seam: str, folder: Path):
    """Import the framework and build the destination; the call to time, as a closure."""
    if seam == "load_state_dict":
        model = _torch_model()
        state = {k: v.clone() for k, v in model.state_dict().items()}
        return lambda: model.load_state_dict(state)
    if seam == "dcp.load":
        import torch.distributed.checkpoint as dcp

        model = _torch_model()
        return lambda: dcp.load(model.state_dict(), checkpoint_id=str(folder / "dcp"))
    if seam == "orbax restore":
        import jax
        import numpy as np
        import orbax.checkpoint as ocp

        abstract = {"dense": {"kernel": jax.ShapeDtypeStruct((ROWS, COLS), np.float32)}}
        checkpointer = ocp.StandardCheckpointer()
        return lambda: checkpointer.restore(folder / "orbax", abstract)
    if seam == "flax restore":
        import numpy as np
        from flax.training import checkpoints

        target = {"dense": {"kernel": np.zeros((ROWS, COLS), np.float32)}}
        return lambda: checkpoints.restore_checkpoint(str(folder / "flax"), target)
    raise ValueError(seam)


def child(seam: str, folder: Path, on: bool) -> None:
    if on:
        import ckptshim  # noqa: F401  (hooks attach as the framework is imported)
    call = _prepare(seam, folder)
    times, cpu = [], []
    for _ in range(CALLS):
        start, start_cpu = time.perf_counter(), time.process_time()
        call()
        times.append((time.perf_counter() - start) * 1000)
        cpu.append((time.process_time() - start_cpu) * 1000)
    print(json.dumps({"first": times[0], "tenth": times[-1], "first_cpu": cpu[0]}))


# -- the parent ------------------------------------------------------------------------------------


def save(folder: Path) -> None:
    """Every seam's checkpoint, written by its framework (in a child: no ckptshim here)."""
    code = f"""
import sys; sys.path.insert(0, {str(REPO / "bench")!r})
from pathlib import Path
from bench_first_call import _torch_model, ROWS, COLS
import numpy as np, torch, torch.distributed.checkpoint as dcp
folder = Path({str(folder)!r})
dcp.save(_torch_model().state_dict(), checkpoint_id=str(folder / "dcp"))
kernel = np.random.default_rng(0).standard_normal((ROWS, COLS), dtype=np.float32)
import orbax.checkpoint as ocp
with ocp.StandardCheckpointer() as c:
    c.save(folder / "orbax", {{"dense": {{"kernel": kernel}}}})
from flax.training import checkpoints
checkpoints.save_checkpoint(str(folder / "flax"), {{"dense": {{"kernel": kernel}}}}, step=1)
"""
    subprocess.run([sys.executable, "-c", code], check=True, env=_env(False), timeout=600)


def one_run(seam: str, folder: Path, on: bool) -> dict[str, float]:
    result = subprocess.run([sys.executable, __file__, "--child", seam, str(folder), "on" if on else "off"],
                            capture_output=True, text=True, env=_env(on), timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"{seam} ({'ON' if on else 'OFF'}) failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        child(sys.argv[2], Path(sys.argv[3]), sys.argv[4] == "on")
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=5, help="fresh interpreters per seam and mode")
    parser.add_argument("--seam", choices=SEAMS, action="append", help="only these seams")
    args = parser.parse_args()
    over = False
    with tempfile.TemporaryDirectory(prefix="ckptshim-first-call-") as tmp:
        folder = Path(tmp)
        save(folder)
        print(f"load average {os.getloadavg()[0]:.1f}; medians of {args.n} fresh processes, ms")
        print(f"{'seam':<16} {'first OFF':>10} {'first ON':>10} {'ON-OFF':>8} {'CPU':>8}   {'10th OFF':>9} {'10th ON':>9}")
        for seam in args.seam or SEAMS:
            for on in (False, True):  # untimed: bytecode written, file cache warm
                one_run(seam, folder, on)
            runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
            for _ in range(args.n):  # interleaved, so that a change in the machine's load hits both modes
                for on in (False, True):
                    runs[on].append(one_run(seam, folder, on))
            med = {(on, which): statistics.median(r[which] for r in runs[on])
                   for on in (False, True) for which in ("first", "tenth", "first_cpu")}
            extra = med[True, "first"] - med[False, "first"]
            over |= extra > BUDGET_MS
            print(f"{seam:<16} {med[False, 'first']:>10.1f} {med[True, 'first']:>10.1f} {extra:>+8.1f} "
                  f"{med[True, 'first_cpu'] - med[False, 'first_cpu']:>+8.1f}   "
                  f"{med[False, 'tenth']:>9.2f} {med[True, 'tenth']:>9.2f}"
                  + ("   <- over the 30 ms budget" if extra > BUDGET_MS else ""))
        print(f"load average {os.getloadavg()[0]:.1f}")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
