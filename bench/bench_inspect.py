"""``ckptshim inspect`` and ``ckptshim plan`` on checkpoints of up to 100,000 tiny arrays.

For each size (``--arrays``, default 25,000, 50,000 and 100,000: layers x ``--leaves`` 100),
two real checkpoints of small float32 arrays are written, each by its library's own save, in a
process of its own (the write is timed: at this size the save, not ckptshim, is slow):

- ``orbax``: Orbax's ``PyTreeCheckpointHandler`` save (OCDBT, zarr v2, what ``StandardCheckpointer``
  writes) of an unscanned tree
  ``params/decoder/layers_{i}/w{j}`` of 4 elements each, and a scanned tree of the same leaves
  stacked on axis 1 as the layout to plan into;
- ``orbax_folders``: the same without OCDBT (``PyTreeCheckpointHandler(use_ocdbt=False)``): one
  zarr folder per array, as Orbax wrote before OCDBT (not in the default ``--formats``: 100,000
  folders take minutes to write);
- ``dcp``: ``torch.distributed.checkpoint.save`` of ``{"model": {"layers.{i}.w{j}": ...}}`` of
  2,048 elements each, and a stacked ``layers.w{j}`` ``[L, 2048]`` state dict as the layout to
  plan into. (DCP's ``.metadata`` pickle takes about 100 opcodes per tensor, which ckptshim's
  metadata budget counts at 64 bytes each: about 6.4 KB per tensor, granted per byte of
  arrays plus 256 MiB. 100,000 tensors of 4 elements are refused as a metadata bomb; of 2,048
  (8 KB) they pass.)

Then, each in a fresh process (``python -m ckptshim``, output to ``/dev/null``), ``inspect --json``
of the per-layer checkpoint and ``plan --json`` of it ``--like`` the stacked one: wall time and
the process's peak RSS (``wait4``'s ``ru_maxrss``, interpreter and imports included; the first
line shows what those alone cost), and its CPU time (user + system: what a busy machine changes
least), each the best of ``--repeat``. Memory should grow linearly with the
metadata: the bytes per array between the smallest and the largest size are printed. Target:
each command under 10 s at 100,000 arrays. The planner alone on a million keys is
``bench_plan.py``.
Run: ``python bench/bench_inspect.py [--arrays 25000 50000 100000] [--repeat 2] [--dir /tmp]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_SECONDS = 10.0
FORMATS = ("orbax", "orbax_folders", "dcp")
ELEMENTS = {"orbax": 4, "orbax_folders": 4, "dcp": 2048}  # per array (see above for DCP's)


def write(fmt: str, folder: Path, layers: int, leaves: int, stacked: bool) -> None:
    """One checkpoint, by the library's own save (run in a process of its own)."""
    if fmt.startswith("orbax"):
        import numpy as np
        import orbax.checkpoint as ocp

        if stacked:
            tree = {"layers": {f"w{j}": np.zeros((ELEMENTS[fmt], layers), np.float32) for j in range(leaves)}}
        else:
            tree = {f"layers_{i}": {f"w{j}": np.full((ELEMENTS[fmt],), i * leaves + j, np.float32)
                                    for j in range(leaves)}
                    for i in range(layers)}
        handler = ocp.PyTreeCheckpointHandler(use_ocdbt=fmt == "orbax")
        ocp.Checkpointer(handler).save(folder, args=ocp.args.PyTreeSave({"params": {"decoder": tree}}))
    else:
        import warnings

        import torch
        import torch.distributed.checkpoint as dcp

        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        if stacked:
            state = {f"layers.w{j}": torch.zeros(layers, ELEMENTS[fmt]) for j in range(leaves)}
        else:
            state = {f"layers.{i}.w{j}": torch.full((ELEMENTS[fmt],), float(i * leaves + j))
                     for i in range(layers) for j in range(leaves)}
        dcp.save({"model": state}, checkpoint_id=folder)


def timed(argv: list[str]) -> tuple[float, float, int]:
    """Wall seconds, CPU seconds (user + system) and peak RSS in bytes of one fresh process; it
    must succeed."""
    with tempfile.TemporaryFile() as stderr:
        start = time.perf_counter()
        process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=stderr)
        _, status, usage = os.wait4(process.pid, 0)
        seconds = time.perf_counter() - start
        process.returncode = os.waitstatus_to_exitcode(status)
        if process.returncode != 0:
            stderr.seek(0)
            raise SystemExit(f"{' '.join(argv)} failed:\n{stderr.read().decode()[-3000:]}")
    return seconds, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024


def best(argv: list[str], repeat: int) -> tuple[float, float, int]:
    """The best of ``repeat`` runs, each figure on its own."""
    runs = [timed(argv) for _ in range(repeat)]
    return tuple(min(run[i] for run in runs) for i in range(3))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arrays", type=int, nargs="+", default=[25_000, 50_000, 100_000])
    parser.add_argument("--leaves", type=int, default=100, help="arrays per layer")
    parser.add_argument("--repeat", type=int, default=2, help="fresh processes per command; the best is shown")
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=["orbax", "dcp"])
    parser.add_argument("--dir", type=Path, default=None, help="where to write the checkpoints")
    parser.add_argument("--write", nargs=4, metavar=("FORMAT", "DIR", "LAYERS", "STACKED"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.write:
        fmt, folder, layers, stacked = args.write
        write(fmt, Path(folder), int(layers), args.leaves, stacked == "stacked")
        return 0

    python = sys.executable
    seconds, cpu, rss = best([python, "-c", "import ckptshim.cli, tensorstore, numpy"], args.repeat)
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; python + ckptshim.cli + "
          f"tensorstore imported: {seconds:.2f} s (CPU {cpu:.2f} s), {rss / 2**20:.0f} MiB")
    slow = False
    peaks: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for arrays in sorted(args.arrays):
        layers = max(1, arrays // args.leaves)
        for fmt in args.formats:
            root = Path(tempfile.mkdtemp(prefix=f"bench_inspect_{fmt}_", dir=args.dir))
            try:
                per_layer, stacked = root / "per_layer", root / "stacked"
                env = dict(os.environ, JAX_PLATFORMS="cpu")
                start = time.perf_counter()
                subprocess.run([python, __file__, "--leaves", str(args.leaves), "--write", fmt, str(per_layer),
                                str(layers), "per_layer"], check=True, env=env)
                written = time.perf_counter() - start
                subprocess.run([python, __file__, "--leaves", str(args.leaves), "--write", fmt, str(stacked),
                                str(layers), "stacked"], check=True, env=env)
                metadata = sum(f.stat().st_size for f in per_layer.rglob("*") if f.is_file()
                               and f.name in ("_METADATA", ".metadata"))
                stored = sum(f.stat().st_size for f in per_layer.rglob("*") if f.is_file())
                print(f"{fmt:5s} {layers * args.leaves:>7,} arrays: written in {written:5.1f} s "
                      f"({stored / 2**20:.1f} MiB, of it metadata {metadata / 2**20:.1f} MiB); "
                      f"load average {os.getloadavg()[0]:.2f}")
                for command, argv in (("inspect", ["inspect", "--json", str(per_layer)]),
                                      ("plan", ["plan", "--json", str(per_layer), "--like", str(stacked)])):
                    load = os.getloadavg()[0]
                    seconds, cpu, rss = best([python, "-m", "ckptshim", *argv], args.repeat)
                    peaks.setdefault((fmt, command), []).append((layers * args.leaves, rss))
                    verdict = "ok" if seconds < TARGET_SECONDS else f"SLOWER than {TARGET_SECONDS} s"
                    print(f"      {command:8s} {seconds:6.2f} s (CPU {cpu:5.2f} s)  peak RSS {rss / 2**20:7.1f} MiB  "
                          f"{verdict}  (load average {load:.2f})", flush=True)
                    slow |= seconds >= TARGET_SECONDS
            finally:
                shutil.rmtree(root)
    for (fmt, command), points in peaks.items():
        if len(points) > 1:
            (a0, r0), (a1, r1) = points[0], points[-1]
            print(f"{fmt} {command}: {(r1 - r0) / (a1 - a0):,.0f} bytes of peak RSS per array "
                  f"(from {a0:,} to {a1:,} arrays)")
    return 1 if slow else 0


if __name__ == "__main__":
    sys.exit(main())
