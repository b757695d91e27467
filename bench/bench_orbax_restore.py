"""Restoring a ~1 GiB unscanned Orbax checkpoint into a scanned target, vs Orbax's own restore.

A 64-layer decoder-style tree (per layer ``mlp/wi`` [1024, 2048] and ``mlp/wo`` [2048, 1024]
float32, 16 MiB; plus a norm scale) is saved twice with today's ``StandardCheckpointer``: once
unscanned (``decoder/layers_{i}/...``) and once scanned (the same values stacked on axis 1,
MaxText's ``param_scan_axis``). Cases, each in fresh subprocesses, rounds interleaved:

- ``native``: ckptshim disabled, ``StandardCheckpointer.restore(scanned, scanned target)``;
- ``shimmed``: ``StandardCheckpointer.restore(unscanned, scanned target)`` through ckptshim,
  which stacks the layers while reading;
- ``idle``: ckptshim installed, scanned into scanned (its only cost: reading the metadata to
  see that the layout matches).

Reported per case: median time, GiB/s of restored bytes, and peak RSS over the process baseline
(``ru_maxrss`` after restoring minus RSS once jax, Orbax and the abstract target are set up),
also as a multiple of the restored bytes. Targets: shimmed/native time <= 1.1; shimmed peak
<= 1.1x the restored bytes. Every case's arrays are checksummed and must agree.

Run: ``python bench/bench_orbax_restore.py [--layers 64] [--rounds 3] [--dir /tmp/...]``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

EMB, MLP = 1024, 2048
CASES = ("native", "shimmed", "idle")


def _layer(i: int):
    import numpy as np

    rng = np.random.default_rng(i)
    return {"mlp": {"wi": rng.standard_normal((EMB, MLP), dtype=np.float32),
                    "wo": rng.standard_normal((MLP, EMB), dtype=np.float32)},
            "norm": {"scale": rng.standard_normal(EMB, dtype=np.float32)}}


def _write(root: Path, layers: int) -> None:
    """Both checkpoints (run in its own process: it holds the tree twice while saving)."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    per_layer = [_layer(i) for i in range(layers)]
    unscanned = {"params": {"decoder": {f"layers_{i}": layer for i, layer in enumerate(per_layer)}}}
    stacked = jax.tree_util.tree_map(lambda *xs: np.stack(xs, axis=1), *per_layer)
    scanned = {"params": {"decoder": {"layers": stacked}}}
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(root / "unscanned", unscanned)
        checkpointer.save(root / "scanned", scanned)
        checkpointer.wait_until_finished()


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _measure(root: Path, case: str, layers: int) -> dict:
    """One restore in this (fresh) process: time, peak RSS over baseline, checksum."""
    if case == "native":
        os.environ["CKPTSHIM_DISABLE"] = "1"
    import ckptshim  # noqa: F401
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shapes = {"wi": (EMB, layers, MLP), "wo": (MLP, layers, EMB)}
    target = {"params": {"decoder": {"layers": {
        "mlp": {name: jax.ShapeDtypeStruct(shape, np.float32, sharding=device) for name, shape in shapes.items()},
        "norm": {"scale": jax.ShapeDtypeStruct((EMB, layers), np.float32, sharding=device)}}}}}
    source = root / ("unscanned" if case == "shimmed" else "scanned")
    checkpointer = ocp.StandardCheckpointer()
    baseline = _rss_bytes()
    start = time.perf_counter()
    restored = checkpointer.restore(source, target)
    jax.block_until_ready(restored)
    elapsed = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    leaves = jax.tree_util.tree_leaves(restored)
    restored_bytes = sum(leaf.nbytes for leaf in leaves)
    checksum = [float(np.asarray(leaf, dtype=np.float64).sum()) for leaf in leaves]
    return {"case": case, "seconds": elapsed, "peak_over_baseline": peak - baseline,
            "restored_bytes": restored_bytes, "checksum": checksum}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where to write the checkpoints")
    parser.add_argument("--measure", nargs=2, metavar=("DIR", "CASE"), help=argparse.SUPPRESS)
    parser.add_argument("--write", metavar="DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(_measure(Path(args.measure[0]), args.measure[1], args.layers)))
        return
    if args.write:
        _write(Path(args.write), args.layers)
        return

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        subprocess.run([sys.executable, __file__, "--write", tmp, "--layers", str(args.layers)], check=True, env=env)
        runs: dict[str, list[dict]] = {case: [] for case in CASES}
        for round_ in range(args.rounds):
            for case in CASES[round_ % len(CASES):] + CASES[:round_ % len(CASES)]:
                out = subprocess.run([sys.executable, __file__, "--measure", tmp, case, "--layers", str(args.layers)],
                                     check=True, env=env, capture_output=True, text=True).stdout
                runs[case].append(json.loads(out.strip().splitlines()[-1]))
    checksums = {json.dumps(run["checksum"]) for case in CASES for run in runs[case]}
    assert len(checksums) == 1, "the cases restored different values"
    restored = runs["native"][0]["restored_bytes"]
    report = {"restored_GiB": restored / 2**30, "layers": args.layers}
    for case in CASES:
        seconds = statistics.median(run["seconds"] for run in runs[case])
        peak = statistics.median(run["peak_over_baseline"] for run in runs[case])
        report[case] = {"seconds": round(seconds, 3), "GiB_per_s": round(restored / 2**30 / seconds, 3),
                        "peak_over_baseline_GiB": round(peak / 2**30, 3),
                        "peak_over_restored": round(peak / restored, 3)}
    report["shimmed_over_native_time"] = round(report["shimmed"]["seconds"] / report["native"]["seconds"], 3)
    report["idle_over_native_time"] = round(report["idle"]["seconds"] / report["native"]["seconds"], 3)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
