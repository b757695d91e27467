"""Restoring an unscanned Orbax checkpoint into a scanned target, vs Orbax's own restore.

A decoder-style tree (per layer ``mlp/wi`` [1024, 2048] and ``mlp/wo`` [2048, 1024] float32,
16 MiB; plus a norm scale; 64 layers, about 1 GiB, by default; ``--gib N`` for N GiB, ``--gib
half`` for half of ``MemTotal``) is saved with today's ``StandardCheckpointer``: unscanned
(``decoder/layers_{i}/...``) and, when a case needs it, scanned (the same values stacked on axis
1, MaxText's ``param_scan_axis``). Cases, each in fresh subprocesses, rounds interleaved:

- ``native``: ckptshim disabled, ``StandardCheckpointer.restore(scanned, scanned target)``;
- ``shimmed``: ``StandardCheckpointer.restore(unscanned, scanned target)`` through ckptshim,
  which stacks the layers while reading;
- ``idle``: ckptshim installed, scanned into scanned (its only cost: reading the metadata to
  see that the layout matches);
- ``native_unscanned``: ckptshim disabled, the unscanned checkpoint into its own unscanned
  layout (what Orbax alone does with the checkpoint ``shimmed`` reads);
- ``native_refused``: ckptshim disabled, unscanned into the scanned target, which Orbax refuses
  (its error is reported);
- ``download`` (with ``--gs``): what a user does without a remote reader: fetch the unscanned
  checkpoint to a local folder (fsspec ``get``), then restore it there into the scanned target
  through ckptshim; timed together.

Reported per case: median time, GiB/s of restored bytes, and peak RSS over the process baseline
(the high-water mark ``VmHWM`` after restoring, reset to the resident size once jax, Orbax and
the abstract target are set up), also as a multiple of the restored bytes. With ``--cold`` the
page cache is dropped for the checkpoint's files (``posix_fadvise(DONTNEED)`` on each) before
every restore, and each restore is paired with a raw read just before it, in the same process,
of the same files (every file of the checkpoint it reads, sequentially, 8 MiB at a time, into one
buffer; dropped again after): the restore's read throughput (bytes on disk over its time) as a
fraction of the raw read's (this machine's disk swings by 2x from minute to minute).
Targets: shimmed/native time <= 1.1; shimmed peak <= 1.1x the restored bytes (1.05x with
``--gib``); cold, shimmed throughput >= 0.9 of raw. Every case's arrays are hashed layer by
layer (layout-independently) and must agree. On a busy machine per-process times swing by 2x;
``--paired N`` also alternates native and idle N rounds each in one process (the hooks toggled
with ``ckptshim.uninstall()``/``install()``), and times the idle hook's decision alone (what it
adds to Orbax's restore): target 1 + decision/native <= 1.02.

With ``--gs`` the checkpoints, once written, are uploaded to a bucket of the test suite's GCS
emulator (``tests/support/object_stores.py``; with the ``commit_success.txt`` Orbax's own save
writes on ``gs://``) and every case restores from the ``gs://`` URL: arrays through
tensorstore's ``gcs`` driver, the rest through gcsfs, for Orbax and ckptshim alike. ``--server
fake-gcs`` runs fake-gcs-server, the Go server, instead of the Python emulator.

Run: ``python bench/bench_orbax_restore.py [--layers 64 | --gib N|half] [--rounds 3] [--cases ...]
[--paired N] [--cold | --gs] [--dir /tmp/...]``. The default cases are native, shimmed and idle; with ``--gib``,
shimmed, native_unscanned and native_refused (native of the scanned checkpoint peaks near 2x
the restored bytes, more than half the machine's memory can hold). Orbax's save needs about 2x
the arrays' bytes of memory, so the largest checkpoint it can write is about a quarter of the
machine's memory (``--gib 6`` on 24 GiB).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from memory import reset_peak, status_kib  # noqa: E402
from remote_rounds import compile_ckptshim  # noqa: E402
from support.pagecache import drop_cache, raw_read  # noqa: E402

EMB, MLP = 1024, 2048
LAYER_BYTES = (2 * EMB * MLP + EMB) * 4
CASES = ("native", "shimmed", "idle", "native_unscanned", "native_refused", "download")
SMALL_CASES, LARGE_CASES = ("native", "shimmed", "idle"), ("shimmed", "native_unscanned", "native_refused")
SCANNED_CASES = ("native", "idle")  # the cases that read the scanned checkpoint


def _layer(i: int):
    import numpy as np

    rng = np.random.default_rng(i)
    return {"mlp": {"wi": rng.standard_normal((EMB, MLP), dtype=np.float32),
                    "wo": rng.standard_normal((MLP, EMB), dtype=np.float32)},
            "norm": {"scale": rng.standard_normal(EMB, dtype=np.float32)}}


def _write(root: Path, layers: int, scanned: bool) -> None:
    """The unscanned checkpoint, and the scanned one when asked (run in its own process).

    Orbax's save holds about twice the arrays' bytes of its own (a copy, and the compressed
    chunks until the OCDBT commit), so the values it saves are kept in a file-backed map
    (reclaimable page cache, not process memory): a checkpoint of a quarter of the machine's
    memory can be written.
    """
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    with tempfile.TemporaryFile(dir=root) as scratch:
        scratch.truncate(layers * LAYER_BYTES)
        offset = 0

        def mapped(value: np.ndarray) -> np.ndarray:
            nonlocal offset
            out = np.memmap(scratch, value.dtype, "r+", offset, value.shape)
            out[...] = value
            offset += value.nbytes
            return out

        per_layer = [jax.tree_util.tree_map(mapped, _layer(i)) for i in range(layers)]
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(root / "unscanned", {"params": {"decoder": {
                f"layers_{i}": layer for i, layer in enumerate(per_layer)}}})
            checkpointer.wait_until_finished()
            if scanned:
                stacked = jax.tree_util.tree_map(lambda *xs: np.stack(xs, axis=1), *per_layer)
                checkpointer.save(root / "scanned", {"params": {"decoder": {"layers": stacked}}})
                checkpointer.wait_until_finished()
    os.sync()  # written back, so that dropping the pages drops them all


def _layer_hashes(restored: dict, layers: int, scanned: bool) -> list[str]:
    """One hash per (layer, array), the same for a scanned and an unscanned tree."""
    import jax
    import numpy as np

    decoder = restored["params"]["decoder"]
    hashes = []
    for i in range(layers):
        layer = decoder["layers"] if scanned else decoder[f"layers_{i}"]
        for path, leaf in sorted(jax.tree_util.tree_leaves_with_path(layer), key=lambda pair: str(pair[0])):
            value = np.asarray(leaf)
            value = value[:, i] if scanned else value
            hashes.append(hashlib.blake2b(np.ascontiguousarray(value).tobytes(), digest_size=8).hexdigest())
    return hashes


def _target(layers: int, scanned: bool) -> dict:
    """The abstract target: jax arrays on the first device, layers stacked on axis 1 or not."""
    import jax
    import numpy as np

    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    if scanned:
        tree = {"layers": {"mlp": {"wi": (EMB, layers, MLP), "wo": (MLP, layers, EMB)}, "norm": {"scale": (EMB, layers)}}}
    else:
        tree = {f"layers_{i}": {"mlp": {"wi": (EMB, MLP), "wo": (MLP, EMB)}, "norm": {"scale": (EMB,)}}
                for i in range(layers)}
    return {"params": {"decoder": jax.tree_util.tree_map(
        lambda shape: jax.ShapeDtypeStruct(shape, np.float32, sharding=device), tree,
        is_leaf=lambda x: isinstance(x, tuple))}}


def _at(root: str, name: str) -> Path | str:
    """The checkpoint ``name`` below ``root``: a local folder, or a ``gs://`` URL kept a URL."""
    return f"{root}/{name}" if "://" in root else Path(root) / name


def _paired(root: str, layers: int, rounds: int) -> dict:
    """``native`` and ``idle`` alternated in this one process (the hooks off for ``native`` with
    ``ckptshim.uninstall()``), page cache warm, after one restore not counted: the median of the
    per-round idle/native ratios. And what the idle hook adds, timed alone: its decision (open
    the item's metadata, plan against the target, see that Orbax restores it), as a fraction of
    native's median time -- the part of the ratio a shared machine's noise cannot hide."""
    import ckptshim
    import jax
    import orbax.checkpoint as ocp

    from ckptshim.hooks.orbax import request_of
    from ckptshim.loading import orbax as loading
    from ckptshim.storage import Location

    target = _target(layers, scanned=True)

    def restore() -> float:
        start = time.perf_counter()
        jax.block_until_ready(ocp.StandardCheckpointer().restore(_at(root, "scanned"), target))
        return time.perf_counter() - start

    ckptshim.uninstall()
    restore()  # compiles and warms what every later restore reuses
    times: dict[str, list[float]] = {"native": [], "idle": []}
    for round_ in range(rounds):
        for case in ("native", "idle") if round_ % 2 == 0 else ("idle", "native"):
            (ckptshim.uninstall if case == "native" else ckptshim.install)()
            times[case].append(restore())
    ckptshim.install()
    request = request_of(ocp.args.StandardRestore(target))
    decisions = []
    for _ in range(rounds):
        start = time.perf_counter()
        loading.restore_item(Location.of(str(_at(root, "scanned"))), request, "bench", lambda: None)
        decisions.append(time.perf_counter() - start)
    native = statistics.median(times["native"])
    return {"rounds": rounds, "native_seconds": round(native, 3),
            "idle_seconds": round(statistics.median(times["idle"]), 3),
            "idle_over_native": round(statistics.median(i / n for i, n in zip(times["idle"], times["native"])), 3),
            "decision_seconds": round(statistics.median(decisions), 4),
            "decision_over_native": round(statistics.median(decisions) / native, 4)}


def _measure(root: str, case: str, layers: int, cold: bool) -> dict:
    """One restore in this (fresh) process: time, peak RSS over baseline, hashes."""
    if case.startswith("native"):
        os.environ["CKPTSHIM_DISABLE"] = "1"
    importlib.import_module("ckptshim")  # installs the hooks (off with CKPTSHIM_DISABLE)
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    scanned = case != "native_unscanned"
    target = _target(layers, scanned)
    source = _at(root, "scanned" if case in SCANNED_CASES else "unscanned")
    raw = None
    if cold:
        drop_cache(source)
        raw = raw_read(source)
        drop_cache(source)
    checkpointer = ocp.StandardCheckpointer()
    baseline = reset_peak()
    start = time.perf_counter()
    if case == "download":
        import fsspec

        downloaded = tempfile.mkdtemp(prefix="bench-orbax-download-")
        fs, path = fsspec.core.url_to_fs(str(source))
        fs.get(path + "/", downloaded + "/", recursive=True)
        source = Path(downloaded)
    try:
        restored = checkpointer.restore(source, target)
        jax.block_until_ready(restored)
    except Exception as error:
        if case != "native_refused":
            raise
        return {"case": case, "seconds": time.perf_counter() - start, "refused": type(error).__name__,
                "message": str(error).strip().splitlines()[0][:300],
                "peak_over_baseline": (status_kib("VmHWM") - baseline) * 1024}
    elapsed = time.perf_counter() - start
    peak = (status_kib("VmHWM") - baseline) * 1024
    if case == "download":
        shutil.rmtree(source)
    if case == "native_refused":
        raise AssertionError("Orbax restored an unscanned checkpoint into a scanned target")
    restored_bytes = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(restored))
    return {"case": case, "seconds": elapsed, "peak_over_baseline": peak, "restored_bytes": restored_bytes,
            "hashes": _layer_hashes(restored, layers, scanned), "raw": raw}


def _layers(args) -> int:
    if args.gib is None:
        return args.layers
    if args.gib == "half":
        with open("/proc/meminfo") as f:
            total_kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
        return total_kib * 1024 // 2 // LAYER_BYTES
    return int(float(args.gib) * 2**30 // LAYER_BYTES)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--gib", help="checkpoint size in GiB instead of --layers, or 'half' (of MemTotal)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cases", nargs="+", choices=CASES, help="default: native shimmed idle; "
                        "with --gib: shimmed native_unscanned native_refused")
    parser.add_argument("--cold", action="store_true", help="drop the checkpoints' pages before every case")
    parser.add_argument("--dir", type=Path, default=None, help="where to write the checkpoints")
    parser.add_argument("--gs", action="store_true",
                        help="restore from a bucket of the test suite's GCS emulator (the checkpoints uploaded)")
    parser.add_argument("--server", choices=("emulator", "fake-gcs"), default="emulator",
                        help="with --gs: the GCS server, the Python emulator (default) or fake-gcs-server")
    parser.add_argument("--paired", type=int, default=0, metavar="ROUNDS",
                        help="also time native and idle alternated in one process, ROUNDS rounds")
    parser.add_argument("--show-requests", action="store_true",
                        help="with --gs --server fake-gcs: list each case's HTTP requests (its last run)")
    parser.add_argument("--measure", nargs=2, metavar=("DIR", "CASE"), help=argparse.SUPPRESS)
    parser.add_argument("--write", metavar="DIR", help=argparse.SUPPRESS)
    parser.add_argument("--scanned", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    layers = _layers(args)
    if args.measure:
        measure = _measure(args.measure[0], args.measure[1], layers, args.cold) if args.measure[1] != "paired" \
            else _paired(args.measure[0], layers, args.paired)
        print(json.dumps(measure))
        return 0
    if args.write:
        _write(Path(args.write), layers, args.scanned)
        return 0
    cases = tuple(args.cases or (SMALL_CASES if args.gib is None else LARGE_CASES))

    if args.gs and args.cold:
        parser.error("--cold drops local page cache; it means nothing with --gs")
    if "download" in cases and not args.gs:
        parser.error("download fetches the checkpoint from a bucket: it needs --gs")
    compile_ckptshim()  # as a wheel's install does: no case compiles ckptshim's modules while timed
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp, contextlib.ExitStack() as stack:
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        write = [sys.executable, __file__, "--write", tmp, "--layers", str(layers)]
        start = time.perf_counter()
        subprocess.run(write + (["--scanned"] if set(cases) & set(SCANNED_CASES) or args.paired else []),
                       check=True, env=env)
        written = time.perf_counter() - start
        stored = sum(f.stat().st_size for f in (Path(tmp) / "unscanned").rglob("*") if f.is_file())
        print(f"{layers} layers, {layers * LAYER_BYTES / 2**30:.2f} GiB of arrays, unscanned checkpoint "
              f"{stored / 2**30:.2f} GiB on disk, written in {written:.0f} s; "
              f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
        root = tmp
        if args.gs:
            from support import object_stores

            store = object_stores.start("gs", args.server, access_log=args.server == "fake-gcs")
            stack.callback(store.stop)
            env |= store.client_env()
            root = store.new_bucket() + "/run"
            start = time.perf_counter()
            subprocess.run([sys.executable, "-c", _UPLOAD, tmp, root], check=True, env=env)
            print(f"uploaded to {root} in {time.perf_counter() - start:.0f} s", flush=True)
        runs: dict[str, list[dict]] = {case: [] for case in cases}
        requests: dict[str, list[str]] = {}  # each case's HTTP requests, fake-gcs-server's access log
        counting = args.gs and args.server == "fake-gcs"
        for round_ in range(args.rounds):
            for case in cases[round_ % len(cases):] + cases[:round_ % len(cases)]:
                load = os.getloadavg()[0]
                before = len(store.requests()) if counting else 0
                out = subprocess.run([sys.executable, __file__, "--measure", root, case, "--layers", str(layers)]
                                     + ["--cold"] * args.cold,
                                     check=True, env=env, capture_output=True, text=True).stdout
                runs[case].append(json.loads(out.strip().splitlines()[-1]) | {"load": load})
                if counting:
                    requests[case] = store.requests()[before:]
                    runs[case][-1]["requests"] = len(requests[case])
                print(f"  {case}: {runs[case][-1]['seconds']:.2f} s (load average {load:.2f})"
                      + (f", {len(requests[case])} requests" if case in requests else ""), flush=True)
        if args.show_requests:
            for case, made in requests.items():
                print(f"{case}: the requests of its last run\n  " + "\n  ".join(made), flush=True)
        if args.paired:
            load = os.getloadavg()[0]
            out = subprocess.run([sys.executable, __file__, "--measure", root, "paired", "--layers", str(layers),
                                  "--paired", str(args.paired)], check=True, env=env, capture_output=True, text=True)
            paired = json.loads(out.stdout.strip().splitlines()[-1]) | {"load": load}
    hashes = {json.dumps(run["hashes"]) for case in cases for run in runs[case] if "hashes" in run}
    assert len(hashes) == 1, "the cases restored different values"
    restored = layers * LAYER_BYTES
    report: dict = {"restored_GiB": round(restored / 2**30, 3), "stored_GiB": round(stored / 2**30, 3),
                    "layers": layers, "cold": args.cold, "where": f"gs ({args.server})" if args.gs else "local"}
    for case in cases:
        seconds = statistics.median(run["seconds"] for run in runs[case])
        peak = statistics.median(run["peak_over_baseline"] for run in runs[case])
        report[case] = {"seconds": round(seconds, 3), "GiB_per_s": round(restored / 2**30 / seconds, 3),
                        "peak_over_baseline_GiB": round(peak / 2**30, 3),
                        "peak_over_restored": round(peak / restored, 3),
                        "load_average": [round(run["load"], 2) for run in runs[case]]}
        if "requests" in runs[case][0]:
            report[case]["requests"] = [run["requests"] for run in runs[case]]
        if "refused" in runs[case][0]:
            report[case] |= {"refused": runs[case][0]["refused"], "message": runs[case][0]["message"]}
    passed = True
    if "shimmed" in cases:
        limit = 1.1 if args.gib is None else 1.05
        report["shimmed_peak_target"] = limit
        passed &= report["shimmed"]["peak_over_restored"] <= limit
    if "native" in cases and "shimmed" in cases:
        report["shimmed_over_native_time"] = round(report["shimmed"]["seconds"] / report["native"]["seconds"], 3)
        passed &= report["shimmed_over_native_time"] <= 1.1
    if "native" in cases and "idle" in cases:
        report["idle_over_native_time"] = round(report["idle"]["seconds"] / report["native"]["seconds"], 3)
    if args.paired:
        report["paired"] = paired
        passed &= 1 + paired["decision_over_native"] <= 1.02
    if args.cold:
        for case in cases:
            pairs = [(run["raw"][0], run["raw"][1], run["seconds"]) for run in runs[case] if run.get("raw")]
            if pairs and "refused" not in runs[case][0]:
                report[case]["cold_raw_GiB_per_s"] = [round(size / seconds / 2**30, 3) for size, seconds, _ in pairs]
                report[case]["cold_over_raw_throughput"] = round(statistics.median(
                    raw / restore for _, raw, restore in pairs), 3)
        if "shimmed" in cases:
            passed &= report["shimmed"]["cold_over_raw_throughput"] >= 0.9
    print(json.dumps(report, indent=1))
    return 0 if passed else 1


#: Upload the written checkpoints (argv[1]) below a bucket URL (argv[2]), with the
#: ``commit_success.txt`` Orbax's own save writes into every item it commits on ``gs://``.
_UPLOAD = """
import sys
from pathlib import Path
import fsspec
local, url = Path(sys.argv[1]), sys.argv[2]
fs = fsspec.filesystem("gs")
for name in ("unscanned", "scanned"):
    if (local / name).is_dir():
        (local / name / "commit_success.txt").write_text(f"Checkpoint commit was successful to {url}/{name}")
        fs.put(str(local / name), f"{url}/{name}", recursive=True)
"""

if __name__ == "__main__":
    sys.exit(main())
