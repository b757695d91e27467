"""``dcp.load`` with ckptshim on a ~1 GiB checkpoint (``--mib``), single process, page cache hot or cold.

One DCP checkpoint of a plain per-layer model (``{"model": state_dict}``, float32
``layers.N.weight`` of 4096 x 4096 = 64 MiB each) is written once with ``dcp.save``. Each case
then runs in fresh subprocesses, several rounds interleaved:

- ``native``: DCP's own load (hooks uninstalled) into the plain model: keys match;
- ``matching``: the same load with the hooks on (the idle case: names and shapes already match,
  so DCP's own planner plans on the stored metadata; ckptshim reads the metadata through its
  unpickler and the chunks straight into the destination);
- ``shimmed``: load into ``torch.compile(model)``: every key needs ``_orig_mod.`` remapping;
- ``stacked``: load into a model whose layers are one stacked ``[N, 4096, 4096]`` parameter;
- ``raw``: a sequential read of the same files, 8 MiB at a time, into one buffer (the ceiling
  for these bytes: the page cache's, or with ``--cold`` the disk's).

Time is per load call: the first (which also faults in the freshly allocated model) and the
median of the later ones (warm), each the median over rounds. Peak memory is the process's
high-water mark after the loads minus its resident size before the model was allocated (the
baseline). With ``--cold`` the page cache is dropped for the checkpoint's files
(``posix_fadvise(DONTNEED)`` on each) before every load call and every raw read, and each load
call is paired with a raw read of the same files just before it, in the same process (this
machine's disk swings by 2x from minute to minute): the median of raw time / load time is the
load's throughput as a fraction of the raw read's. (The first call of a process also faults in
the freshly allocated model; the later ones show the read alone.) Targets: matching/native and
shimmed/native time <= 1.0, matching peak <= native's; stacked
peak <= model bytes + 10% (+ 5% from ``--mib 4096`` on, where the fixed costs no longer count);
cold, stacked and shimmed throughput >= 0.9 of raw. Every load is checked bit-exactly afterwards.
Run: ``python bench/bench_dcp_load.py [--mib 1024|half] [--rounds 3] [--calls 3] [--cases ...]
[--cold]`` (``--mib half``: half of ``MemTotal``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from memory import reset_peak, status_kib  # noqa: E402
from support.pagecache import drop_cache, raw_read  # noqa: E402

CASES = ("native", "matching", "shimmed", "stacked", "raw")
WIDTH = 4096  # one 4096 x 4096 float32 layer is 64 MiB


def _layer(index: int):
    import torch

    return torch.empty(WIDTH, WIDTH).uniform_(generator=torch.Generator().manual_seed(index))


def _model(layers: int, stacked: bool):
    import torch
    from torch import nn

    root = nn.Module()
    if stacked:
        root.layers = nn.Module()
        root.layers.weight = nn.Parameter(torch.empty(layers, WIDTH, WIDTH))
    else:
        root.layers = nn.ModuleList(nn.Module() for _ in range(layers))
        for layer in root.layers:
            layer.weight = nn.Parameter(torch.empty(WIDTH, WIDTH))
    return root


def save(folder: Path, layers: int) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": {f"layers.{i}.weight": _layer(i) for i in range(layers)}},
             checkpoint_id=folder)


def _raw_read(folder: Path, times: int, cold: bool) -> list[float]:
    seconds = []
    for _ in range(times):
        if cold:
            drop_cache(folder)
        seconds.append(raw_read(folder)[1])
    return seconds


def worker(case: str, folder: Path, layers: int, calls: int, cold: bool) -> dict:
    """One case in this process; one JSON line on stdout."""
    warnings.simplefilter("ignore")
    import ckptshim

    if case == "raw":
        return {"case": case, "times": _raw_read(folder, max(calls, 2), cold), "peak_extra_kib": 0}
    import torch
    import torch.distributed.checkpoint as dcp

    if case == "native":
        ckptshim.uninstall()
    if case == "shimmed":
        import torch._dynamo  # noqa: F401  (torch.compile's own import is not the load's memory)
    baseline = reset_peak()
    model = _model(layers, stacked=case == "stacked")
    if case == "shimmed":
        model = torch.compile(model)  # no forward: keys gain _orig_mod., nothing compiles
    state_dict = model.state_dict()
    times = []
    raw_times = []
    for _ in range(calls):
        if cold:  # the disk's speed now, paired with the load that follows (it swings by 2x)
            raw_times += _raw_read(folder, 1, cold)
            drop_cache(folder)
        start = time.perf_counter()
        dcp.load({"model": state_dict}, checkpoint_id=folder)
        times.append(time.perf_counter() - start)
    peak = status_kib("VmHWM") - baseline
    weights = [v for v in state_dict.values()]
    loaded = weights[0].unbind(0) if case == "stacked" else weights
    assert all(torch.equal(tensor, _layer(i)) for i, tensor in enumerate(loaded)), "not bit-exact"
    model_bytes = sum(t.numel() * t.element_size() for t in state_dict.values())
    return {"case": case, "times": times, "raw_times": raw_times, "peak_extra_kib": peak,
            "model_mib": model_bytes / 2**20}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", default="1024", help="checkpoint size (default 1024), or 'half' (of MemTotal)")
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes per case")
    parser.add_argument("--calls", type=int, default=3, help="dcp.load calls per process")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--cold", action="store_true", help="drop the checkpoint's pages before every load")
    parser.add_argument("--dir", type=Path, default=None, help="where to write the checkpoint")
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)  # worker mode
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mib == "half":
        with open("/proc/meminfo") as f:
            mib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:")) // 1024 // 2
    else:
        mib = int(args.mib)
    layers = max(1, mib * 2**20 // (WIDTH * WIDTH * 4))
    if args.case:
        print(json.dumps(worker(args.case, args.folder, layers, args.calls, args.cold)))
        return 0

    folder = Path(tempfile.mkdtemp(prefix="bench_dcp_", dir=args.dir)) / "checkpoint"
    try:
        start = time.perf_counter()
        save(folder, layers)
        os.sync()  # written back, so that dropping the pages drops them all
        written = time.perf_counter() - start
        size = sum(f.stat().st_size for f in folder.iterdir())
        print(f"checkpoint: {layers} x {WIDTH}x{WIDTH} float32, {size / 2**30:.3f} GiB on disk, written "
              f"in {written:.0f} s; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
        runs: dict[str, list[dict]] = {case: [] for case in args.cases}
        for _ in range(args.rounds):
            for case in args.cases:
                load = os.getloadavg()[0]
                out = subprocess.run([sys.executable, __file__, "--case", case, "--folder", str(folder),
                                      "--mib", str(mib), "--calls", str(args.calls)] + ["--cold"] * args.cold,
                                     capture_output=True, text=True, check=True)
                runs[case].append(json.loads(out.stdout.strip().splitlines()[-1]) | {"load": load})
                print(f"  {case}: {' '.join(f'{t:.2f}' for t in runs[case][-1]['times'])} s "
                      f"(load average {load:.2f})", flush=True)
    finally:
        shutil.rmtree(folder.parent)

    summary = {}
    for case, results in runs.items():
        first = statistics.median(r["times"][0] for r in results)
        warm = statistics.median([t for r in results for t in r["times"][1:]] or [first])
        summary[case] = {"first_s": first, "warm_s": warm, "gib_per_s": size / 2**30 / warm,
                         "peak_extra_mib": max(r["peak_extra_kib"] for r in results) / 1024}
        print(f"{case:8s} first {first:.3f} s  warm {warm:.3f} s = {summary[case]['gib_per_s']:5.2f} GiB/s  "
              f"peak over baseline {summary[case]['peak_extra_mib']:7.1f} MiB")
    passed = True
    for case in ("matching", "shimmed"):
        if {case, "native"} <= summary.keys():
            ratio = max(summary[case][t] / summary["native"][t] for t in ("first_s", "warm_s"))
            print(f"{case}/native time: first {summary[case]['first_s'] / summary['native']['first_s']:.3f}, "
                  f"warm {summary[case]['warm_s'] / summary['native']['warm_s']:.3f}  (target <= 1.0)")
            passed &= ratio <= 1.0
    if {"matching", "native"} <= summary.keys():
        print(f"matching peak - native peak: {summary['matching']['peak_extra_mib'] - summary['native']['peak_extra_mib']:+.1f} "
              "MiB  (target <= 0)")
        passed &= summary["matching"]["peak_extra_mib"] <= summary["native"]["peak_extra_mib"]
    for case in ("native", "matching", "shimmed", "stacked"):
        if case in summary:
            model_mib = next(r["model_mib"] for r in runs[case])
            print(f"{case} peak / model bytes: {summary[case]['peak_extra_mib'] / model_mib:.3f}")
    if "stacked" in summary:
        limit = 1.05 if mib >= 4096 else 1.10
        stacked_peak = summary["stacked"]["peak_extra_mib"] / next(r["model_mib"] for r in runs["stacked"])
        print(f"stacked peak / model bytes: {stacked_peak:.3f}  (target <= {limit:.2f})")
        passed &= stacked_peak <= limit
    if "raw" in summary and not args.cold:
        print(f"warm throughput vs raw page-cache read ({summary['raw']['gib_per_s']:.2f} GiB/s): "
              + ", ".join(f"{case} {summary[case]['gib_per_s'] / summary['raw']['gib_per_s']:.0%}"
                          for case in summary if case != "raw"))
    if args.cold:
        for case, results in runs.items():
            if case == "raw":
                continue
            pairs = [(raw, load) for r in results for raw, load in zip(r["raw_times"], r["times"])]
            first = statistics.median(raw / load for raw, load in pairs[::args.calls])
            later = statistics.median([raw / load for i, (raw, load) in enumerate(pairs) if i % args.calls]
                                      or [first])
            print(f"cold {case}: throughput / paired raw read: first call {first:.0%}, later calls {later:.0%} "
                  f"(raw {' '.join(f'{size / 2**30 / raw:.2f}' for raw, _ in pairs)} GiB/s)"
                  + ("  (target >= 90%)" if case in ("shimmed", "stacked") else ""))
            if case in ("shimmed", "stacked"):
                passed &= later >= 0.9
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
