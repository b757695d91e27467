"""``dcp.load`` from ``s3://`` and ``gs://`` (local servers): ckptshim's remote reader against DCP's own.

One DCP checkpoint of a plain per-layer model (``layers.N.weight``, float32 2048 x 2048 = 16 MiB
each, ``--mib`` in all, plus as many small bias vectors) is written with ``dcp.save`` to a bucket
on each local server of the test suite (moto's S3 server, the GCS emulator of
``tests/support/gcs_emulator.py``). Each case then runs in a fresh subprocess, rounds interleaved:

- ``native``: DCP's own remote load (hooks uninstalled, its ``FsspecReader``) into the plain
  model: the framework's remote restore of the same bytes;
- ``matching``: the same load with the hooks on (nothing to remap: ckptshim reads the metadata,
  torch's ``FsspecReader`` the chunks);
- ``shimmed``: the load into ``torch.compile(model)`` (every key remapped), read by ckptshim's
  remote reader (byte ranges in parallel, straight into the parameters);
- ``download``: what a user does without a remote reader: fetch the checkpoint to a local folder
  with fsspec (``get``), then ``dcp.load`` it there into the compiled model through ckptshim.

Time is per process (one load call each after the imports), median over rounds. Targets:
shimmed/native and matching/native <= 1.1; shimmed < download. Every load is checked bit-exactly.
The servers are single processes on this machine: the figures measure the clients' request
handling as much as the bytes, so compare ratios within one run only, and say the load average.
Run: ``python bench/bench_remote_dcp.py [--mib 256] [--rounds 3] [--schemes s3 gs]``.
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
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

CASES = ("native", "matching", "shimmed", "download")
WIDTH = 2048  # one 2048 x 2048 float32 layer is 16 MiB


def _layer(index: int):
    import torch

    return torch.empty(WIDTH, WIDTH).uniform_(generator=torch.Generator().manual_seed(index))


def _state(layers: int) -> dict:
    import torch

    state = {}
    for i in range(layers):
        state[f"layers.{i}.weight"] = _layer(i)
        state[f"layers.{i}.bias"] = torch.full((WIDTH,), float(i))
    return state


def worker(case: str, url: str, layers: int) -> dict:
    """One case in this process; one JSON line on stdout."""
    warnings.simplefilter("ignore")
    import ckptshim
    import torch
    import torch.distributed.checkpoint as dcp

    if case == "native":
        ckptshim.uninstall()
    want = _state(layers)
    prefix = "" if case in ("native", "matching") else "_orig_mod."
    target = {prefix + key: torch.zeros_like(value) for key, value in want.items()}
    start = time.perf_counter()
    if case == "download":
        import fsspec

        fs, path = fsspec.core.url_to_fs(url)
        with tempfile.TemporaryDirectory() as folder:
            fs.get(path + "/", folder + "/", recursive=True)
            dcp.load(target, checkpoint_id=folder)
    else:
        dcp.load(target, checkpoint_id=url)
    seconds = time.perf_counter() - start
    assert all(torch.equal(target[prefix + key], value) for key, value in want.items()), "not bit-exact"
    return {"case": case, "seconds": seconds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="checkpoint size (default 256)")
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes per case")
    parser.add_argument("--schemes", nargs="+", choices=("s3", "gs"), default=["s3", "gs"])
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)  # worker mode
    parser.add_argument("--url", help=argparse.SUPPRESS)
    args = parser.parse_args()
    layers = max(1, args.mib * 2**20 // (WIDTH * WIDTH * 4))
    if args.case:
        print(json.dumps(worker(args.case, args.url, layers)))
        return 0

    from support import object_stores

    passed = True
    for scheme in args.schemes:
        store = object_stores.start(scheme)
        try:
            env = {**os.environ, **store.client_env()}
            url = store.new_bucket() + "/checkpoint"
            start = time.perf_counter()
            subprocess.run([sys.executable, "-c", _SAVE, url, str(layers), str(Path(__file__).resolve())],
                           env=env, check=True)
            print(f"{scheme}: {layers} x {WIDTH}x{WIDTH} float32 + biases ({layers * (WIDTH * WIDTH + WIDTH) * 4 / 2**20:.0f} "
                  f"MiB) written in {time.perf_counter() - start:.1f} s; load average "
                  f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
            runs: dict[str, list[tuple[float, float]]] = {case: [] for case in args.cases}
            for _ in range(args.rounds):
                for case in args.cases:
                    load = os.getloadavg()[0]
                    out = subprocess.run([sys.executable, __file__, "--case", case, "--url", url,
                                          "--mib", str(args.mib)], env=env, capture_output=True, text=True)
                    if out.returncode:
                        raise RuntimeError(f"{case} failed:\n{out.stderr[-3000:]}")
                    runs[case].append((json.loads(out.stdout.strip().splitlines()[-1])["seconds"], load))
                    print(f"  {case}: {runs[case][-1][0]:.2f} s (load average {load:.2f})", flush=True)
        finally:
            store.stop()
        median = {case: statistics.median(s for s, _ in found) for case, found in runs.items()}
        for case, seconds in median.items():
            print(f"{scheme} {case:9s} median {seconds:.3f} s")
        for case in ("matching", "shimmed"):
            if {case, "native"} <= median.keys():
                ratio = median[case] / median["native"]
                print(f"{scheme} {case}/native: {ratio:.3f}  (target <= 1.1)")
                passed &= ratio <= 1.1
        if {"shimmed", "download"} <= median.keys():
            print(f"{scheme} shimmed/download: {median['shimmed'] / median['download']:.3f}  (target < 1.0)")
            passed &= median["shimmed"] < median["download"]
    return 0 if passed else 1


_SAVE = """
import sys, warnings
warnings.simplefilter("ignore")
import importlib.util
spec = importlib.util.spec_from_file_location("bench_remote_dcp", sys.argv[3])
bench = importlib.util.module_from_spec(spec); spec.loader.exec_module(bench)
import torch.distributed.checkpoint as dcp
dcp.save(bench._state(int(sys.argv[2])), checkpoint_id=sys.argv[1])
"""

if __name__ == "__main__":
    sys.exit(main())
