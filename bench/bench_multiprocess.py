"""A restore across 4 JAX processes vs the same restore in 1, through ckptshim and natively.

The ~1 GiB checkpoints of ``bench_orbax_restore.py`` (``--layers``, 64 by default: unscanned, and
the same values scanned) are written once, by one process (``--written-by 1``: one zarr chunk
per array) or by a launch of 4 processes (``--written-by 4``, the default: each array sharded by
rows over their 8 devices, so one chunk per device's rows, each process writing its own
``ocdbt.process_<i>``, as a multi-host job saves). Then each case runs as one launch of
real ``jax.distributed`` processes on localhost (``tests/support/jax_processes.py``, as
``tests/test_jax_multiprocess.py`` does: 2 CPU devices per process, gloo collectives), once with
1 process and once with 4, rounds interleaved:

- ``shimmed``: the unscanned checkpoint restored through the Orbax hook into a scanned target;
- ``native``: ckptshim disabled, the scanned checkpoint restored by Orbax into the same target.

The target's arrays are sharded by rows over every device of the launch, so each of 4 processes
holds a quarter. The page cache is dropped for the checkpoints before each launch; every process
then times its restore (started together, after a barrier) and reads ``/proc/self/io`` around
it: ``read_bytes`` (fetched from the disk; pages one process brought in are not fetched again
by another, so the split between processes is a race) and ``rchar`` (asked of read calls,
cache or not: what each process itself needed).
Reported: the restore's wall time (the slowest process's) per case and process count, and each
process's bytes read as a share of the checkpoint's bytes on disk (1/N is the ideal). The
machine has 2 cores: 4 processes share them, so the 4-process time is not expected to be lower.
Run: ``python bench/bench_multiprocess.py [--layers 64] [--rounds 3] [--written-by 4|1] [--dir /tmp/...]``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from support import jax_processes  # noqa: E402
from support.pagecache import drop_cache, io_counters  # noqa: E402

COUNTS = (1, 4)
CASES = ("shimmed", "native")


def save(root: Path, layers: int) -> None:
    """One process of the writing launch: every array sharded by rows over all devices, so each
    process writes the chunks of its own rows."""
    process, count, _ = jax_processes.join()
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from bench_orbax_restore import _layer

    rows = NamedSharding(jax.make_mesh((jax.device_count(),), ("x",)), P("x"))

    def sharded(value: np.ndarray):
        return jax.make_array_from_callback(value.shape, rows, lambda index: value[index])

    def stacked(*xs):  # the layers on axis 1, from the rows this process holds of each
        def block(index: tuple) -> np.ndarray:
            return np.stack([next(np.asarray(s.data) for s in x.addressable_shards if s.index[0] == index[0])
                             for x in xs], axis=1)
        return jax.make_array_from_callback(xs[0].shape[:1] + (len(xs),) + xs[0].shape[1:], rows, block)

    per_layer = [jax.tree_util.tree_map(sharded, _layer(i)) for i in range(layers)]
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(root / "unscanned", {"params": {"decoder": {
            f"layers_{i}": layer for i, layer in enumerate(per_layer)}}})
        checkpointer.wait_until_finished()
        checkpointer.save(root / "scanned", {"params": {"decoder": {
            "layers": jax.tree_util.tree_map(stacked, *per_layer)}}})
        checkpointer.wait_until_finished()
    os.sync()


def restore(case: str, root: Path, layers: int, out: Path) -> None:
    """One process of a launch: restore, time it, count its reads; ``out/process<i>.json``."""
    if case == "native":
        os.environ["CKPTSHIM_DISABLE"] = "1"
    process, count, _ = jax_processes.join()
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec as P

    importlib.import_module("ckptshim")  # installs the hooks (off with CKPTSHIM_DISABLE)
    from bench_orbax_restore import EMB, MLP, _layer

    rows = NamedSharding(jax.make_mesh((jax.device_count(),), ("x",)), P("x"))
    shapes = {"mlp": {"wi": (EMB, layers, MLP), "wo": (MLP, layers, EMB)}, "norm": {"scale": (EMB, layers)}}
    target = {"params": {"decoder": {"layers": jax.tree_util.tree_map(
        lambda shape: jax.ShapeDtypeStruct(shape, np.float32, sharding=rows), shapes,
        is_leaf=lambda x: isinstance(x, tuple))}}}
    source = root / ("unscanned" if case == "shimmed" else "scanned")
    checkpointer = ocp.StandardCheckpointer()
    multihost_utils.sync_global_devices("start")
    before, start = io_counters(), time.perf_counter()
    restored = checkpointer.restore(source, target)
    jax.block_until_ready(restored)
    seconds = time.perf_counter() - start
    after = io_counters()
    layer = _layer(layers - 1)  # the last layer's rows this process holds, checked exactly
    for name, leaf in (("wi", restored["params"]["decoder"]["layers"]["mlp"]["wi"]),
                       ("wo", restored["params"]["decoder"]["layers"]["mlp"]["wo"])):
        for shard in leaf.addressable_shards:
            want = layer["mlp"][name][shard.index[0]]
            assert np.array_equal(np.asarray(shard.data)[:, layers - 1], want), (name, shard.index)
    (out / f"process{process}.json").write_text(json.dumps({
        "seconds": seconds, "read_bytes": after["read_bytes"] - before["read_bytes"],
        "rchar": after["rchar"] - before["rchar"], "devices": jax.device_count(), "processes": count}))
    multihost_utils.sync_global_devices("done")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where to write the checkpoints")
    parser.add_argument("--written-by", type=int, choices=(1, 4), default=4, help="processes that save")
    parser.add_argument("--restore", nargs=3, metavar=("CASE", "DIR", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--save", metavar="DIR", help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if rest and args.save:  # a launched process: <id> <count> <port> --save DIR --layers N
        save(Path(args.save), args.layers)
        return 0
    if rest:  # a launched process: <id> <count> <port> --restore CASE DIR OUT --layers N
        case, root, out = args.restore
        restore(case, Path(root), args.layers, Path(out))
        return 0

    here = Path(__file__).resolve().parent
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        start = time.perf_counter()
        if args.written_by == 1:
            subprocess.run([sys.executable, str(here / "bench_orbax_restore.py"), "--write", tmp, "--scanned",
                            "--layers", str(args.layers)], check=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
        else:
            ran = jax_processes.launch(__file__, args.written_by, ["--save", tmp, "--layers", str(args.layers)])
            if ran.hung or any(ran.returncodes):
                print("\n----\n".join(log[-3000:] for log in ran.logs))
                return 1
        stored = {name: sum(f.stat().st_size for f in (root / name).rglob("*") if f.is_file())
                  for name in ("unscanned", "scanned")}
        print(f"{args.layers} layers, written by {args.written_by} process(es), checkpoints of {stored['unscanned'] / 2**30:.2f} GiB (unscanned) and "
              f"{stored['scanned'] / 2**30:.2f} GiB (scanned) written in {time.perf_counter() - start:.0f} s",
              flush=True)
        runs: dict[tuple[str, int], list[list[dict]]] = {}
        for round_ in range(args.rounds):
            for case in CASES:
                for count in COUNTS if round_ % 2 == 0 else COUNTS[::-1]:
                    out = root / f"out_{case}_{count}_{round_}"
                    out.mkdir()
                    drop_cache(root)
                    load = os.getloadavg()[0]
                    ran = jax_processes.launch(__file__, count, ["--restore", case, tmp, str(out),
                                                                 "--layers", str(args.layers)], timeout=600)
                    if ran.hung or any(ran.returncodes):
                        print("\n----\n".join(log[-3000:] for log in ran.logs))
                        return 1
                    results = [json.loads((out / f"process{i}.json").read_text()) | {"load": load}
                               for i in range(count)]
                    runs.setdefault((case, count), []).append(results)
                    print(f"  {case} x{count}: {max(r['seconds'] for r in results):.2f} s "
                          f"(launch {ran.seconds:.1f} s, load average {load:.2f})", flush=True)
    for (case, count), rounds in sorted(runs.items()):
        seconds = statistics.median(max(r["seconds"] for r in results) for results in rounds)
        size = stored["unscanned" if case == "shimmed" else "scanned"]
        shares = [statistics.median(results[i]["read_bytes"] / size for results in rounds) for i in range(count)]
        asked = [statistics.median(results[i]["rchar"] / size for results in rounds) for i in range(count)]
        print(f"{case:8s} {count} process(es): restore {seconds:6.2f} s; per process, share of the "
              f"checkpoint read from disk {' '.join(f'{s:.3f}' for s in shares)}, asked of read calls "
              f"{' '.join(f'{s:.3f}' for s in asked)} (1/{count} = {1 / count:.3f}); load average "
              + " ".join(f"{results[0]['load']:.2f}" for results in rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
