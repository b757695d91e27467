"""The loop the remote benchmarks share: a local server, a checkpoint written to a bucket on it, then
each case in fresh processes, rounds interleaved, each time printed beside the load average.

The servers are the test suite's (``tests/support/object_stores.py``: moto's S3 server, and for
``gs`` the patched GCS emulator or, with ``--server fake-gcs``, fake-gcs-server, the Go server),
each on this machine: the figures measure the servers' request handling as much as the
clients', so compare ratios within one run only.

Every case's process finds ckptshim's modules compiled, as a user does (pip compiles a wheel's
modules when it installs it, as it did torch's and gcsfs's): a checkout run with
``PYTHONDONTWRITEBYTECODE`` would otherwise compile each module ckptshim imports on its first
load inside the timed step, on every run (0.4-0.7 s on this machine, more under load), which a
download case never pays.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

WIDTH = 2048  # one 2048 x 2048 layer: 16 MiB in float32, 8 MiB in bfloat16
#: The dtypes the benchmarks' layers are stored in, and each one's bytes per element.
DTYPES = {"float32": 4, "bfloat16": 2}


def layered_state(layers: int, dtype: str = "float32") -> dict:
    """The remote benchmarks' model: ``layers.N.weight`` (``dtype`` ``WIDTH`` x ``WIDTH``, seeded
    values) and ``layers.N.bias`` (``WIDTH``) for each layer -- an ``nn.Linear`` stack's state."""
    import torch

    kind = getattr(torch, dtype)
    state = {}
    for i in range(layers):
        weight = torch.empty(WIDTH, WIDTH).uniform_(generator=torch.Generator().manual_seed(i))
        state[f"layers.{i}.weight"] = weight.to(kind)
        state[f"layers.{i}.bias"] = torch.full((WIDTH,), float(i), dtype=kind)
    return state


def layers_of(mib: int, dtype: str = "float32") -> int:
    return max(1, mib * 2**20 // (WIDTH * WIDTH * DTYPES[dtype]))


def described(layers: int, dtype: str = "float32") -> str:
    size = layers * (WIDTH * WIDTH + WIDTH) * DTYPES[dtype] / 2**20
    return f"{layers} x {WIDTH}x{WIDTH} {dtype} + biases ({size:.0f} MiB)"


def compile_ckptshim() -> None:
    """Compile ckptshim's modules into their ``__pycache__`` folders, as pip does when it installs
    a wheel, so that no case compiles them while timed. (A bytecode cache elsewhere,
    ``PYTHONPYCACHEPREFIX``, would not do: Python then looks for every module's bytecode there,
    and each case would compile gcsfs, google-auth and the rest of the client it imports.)"""
    import compileall

    if not compileall.compile_dir(str(ROOT / "ckptshim"), quiet=1):
        raise RuntimeError("ckptshim's modules do not compile")



def arguments(doc: str, cases: Sequence[str], rounds: int) -> argparse.ArgumentParser:
    """The options every remote benchmark takes (a script adds its own), and the hidden worker
    mode (``--case``, ``--url``) in which each case runs in its own process."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="checkpoint size (default 256)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="the layers' dtype (default float32)")
    parser.add_argument("--rounds", type=int, default=rounds, help=f"fresh processes per case (default {rounds})")
    parser.add_argument("--schemes", nargs="+", choices=("s3", "gs"), default=["s3", "gs"])
    parser.add_argument("--server", choices=("emulator", "fake-gcs"), default="emulator",
                        help="the gs server: the Python GCS emulator (default) or fake-gcs-server")
    parser.add_argument("--cases", nargs="+", choices=cases, default=list(cases))
    parser.add_argument("--case", choices=cases, help=argparse.SUPPRESS)  # worker mode
    parser.add_argument("--url", help=argparse.SUPPRESS)
    return parser


def worked(args: argparse.Namespace, worker: Callable[[str, str, int, str], dict]) -> bool:
    """In worker mode (``--case``): run that case (``worker(case, url, layers, dtype)``), print
    its JSON line, and say so."""
    if not args.case:
        return False
    print(json.dumps(worker(args.case, args.url, layers_of(args.mib, args.dtype), args.dtype)))
    return True


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def medians(scheme: str, write: Callable[[str, dict[str, str]], str], worker: Callable[[str, str], list[str]],
            cases: Sequence[str], rounds: int, server: str = "emulator") -> dict[str, float]:
    """Start ``scheme``'s server (for ``gs``, ``server``); ``write(bucket_url, env)`` puts the checkpoint there (in a
    subprocess of its own, with the client settings ``env``) and says what it wrote; then each
    case runs ``rounds`` times as ``worker(case, bucket_url)`` (an argv printing one JSON line
    with ``seconds``), ckptshim's modules compiled first. The median seconds of each case. Against fake-gcs-server each run's
    HTTP requests are counted too (its access log; ``BENCH_SHOW_REQUESTS=1`` lists them)."""
    from support import object_stores

    counting = scheme == "gs" and server == "fake-gcs"  # its access log counts each case's requests
    compile_ckptshim()
    store = object_stores.start(scheme, server if scheme == "gs" else None, access_log=counting)
    try:
        env = {**os.environ, **store.client_env()}
        url = store.new_bucket()
        start = time.perf_counter()
        what = write(url, env)
        print(f"{scheme} ({'moto' if scheme == 's3' else server}): {what} written in {time.perf_counter() - start:.1f} s; load average {load_average()}",
              flush=True)
        runs: dict[str, list[float]] = {case: [] for case in cases}
        for _ in range(rounds):
            for case in cases:
                load = os.getloadavg()[0]
                before = len(store.requests()) if counting else 0
                out = subprocess.run(worker(case, url), env=env, capture_output=True, text=True)
                if out.returncode:
                    raise RuntimeError(f"{case} failed:\n{out.stderr[-3000:]}")
                runs[case].append(json.loads(out.stdout.strip().splitlines()[-1])["seconds"])
                made = store.requests()[before:] if counting else []
                print(f"  {case}: {runs[case][-1]:.3f} s (load average {load:.2f})"
                      + (f", {len(made)} requests" if counting else ""), flush=True)
                if made and os.environ.get("BENCH_SHOW_REQUESTS"):
                    print("    " + "\n    ".join(made), flush=True)
    finally:
        store.stop()
    found = {case: statistics.median(seconds) for case, seconds in runs.items()}
    for case, seconds in found.items():
        print(f"{scheme} {case:10s} median {seconds:.3f} s")
    return found


def ratio(scheme: str, found: dict[str, float], case: str, base: str, target: float, strict: bool = False) -> bool:
    """Print ``case``/``base`` and whether it meets ``target`` (``<=``, or ``<`` when ``strict``);
    True when either case was not run."""
    if not {case, base} <= found.keys():
        return True
    value = found[case] / found[base]
    print(f"{scheme} {case}/{base}: {value:.3f}  (target {'<' if strict else '<='} {target})")
    return value < target if strict else value <= target
