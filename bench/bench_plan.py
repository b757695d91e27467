"""Planner speed on a million keys: ``python bench/bench_plan.py [--layers N] [--leaves M] [--profile CASE]``.

Three cases, each 1,000 layers x 1,000 leaves (1,000,000 per-layer entries) by default:

- ``stack``:   MaxText-style per-layer checkpoint ``decoder/layers_{i}/block/w{j}`` (8, 16) ->
  stacked target ``decoder/layers/block/w{j}`` (8, L, 16), stacked on axis 1;
- ``unstack``: the reverse, stacked checkpoint -> per-layer target;
- ``rename``:  ``_orig_mod.layers.{i}.w{j}`` checkpoint -> plain ``layers.{i}.w{j}`` target
  (one million renames).

Prints the seconds to build the inventories and the seconds of each ``plan()`` call. The target
is under 2 s per planning call. ``--profile CASE`` prints the top of a cProfile of that call.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckptshim.inventory import Entry, Inventory  # noqa: E402
from ckptshim.planner import plan  # noqa: E402
from ckptshim.ops import Rename, Stack, Unstack  # noqa: E402

TARGET_SECONDS = 2.0
LAYER_SHAPE = (8, 16)


def per_layer_maxtext(layers: int, leaves: int) -> Inventory:
    names = [f"w{j}" for j in range(leaves)]
    return Inventory(Entry(("decoder", f"layers_{i}", "block", name), LAYER_SHAPE, "float32")
                     for i in range(layers) for name in names)


def stacked_maxtext(layers: int, leaves: int) -> Inventory:
    shape = (LAYER_SHAPE[0], layers, LAYER_SHAPE[1])
    return Inventory(Entry(("decoder", "layers", "block", f"w{j}"), shape, "float32")
                     for j in range(leaves))


def per_layer_torch(layers: int, leaves: int, prefix: tuple[str, ...] = ()) -> Inventory:
    names = [f"w{j}" for j in range(leaves)]
    return Inventory(Entry(prefix + ("layers", str(i), name), LAYER_SHAPE, "float32")
                     for i in range(layers) for name in names)


def build(layers: int, leaves: int) -> dict[str, tuple[Inventory, Inventory]]:
    per_layer, stacked = per_layer_maxtext(layers, leaves), stacked_maxtext(layers, leaves)
    return {
        "stack": (per_layer, stacked),
        "unstack": (stacked, per_layer),
        "rename": (per_layer_torch(layers, leaves, ("_orig_mod",)), per_layer_torch(layers, leaves)),
    }


def check(case: str, result, layers: int, leaves: int) -> None:
    """Cheap sanity checks, so the benchmark cannot time a plan that does the wrong thing."""
    assert result.complete, case
    kinds = {"stack": Stack, "unstack": Unstack, "rename": Rename}
    count = leaves if case != "rename" else layers * leaves
    assert len(result.ops) == count and all(isinstance(op, kinds[case]) for op in result.ops), case
    if case != "rename":
        assert {op.axis for op in result.ops} == {1}, case


def timed(case: str, source: Inventory, target: Inventory) -> tuple[float, object]:
    gc.collect()
    start = time.perf_counter()
    result = plan(source, target)
    return time.perf_counter() - start, result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=1000)
    parser.add_argument("--leaves", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=1, help="runs per case; the best is shown")
    parser.add_argument("--profile", choices=["stack", "unstack", "rename"],
                        help="print a cProfile of this case instead of timing all three")
    args = parser.parse_args()

    start = time.perf_counter()
    cases = build(args.layers, args.leaves)
    built = time.perf_counter() - start
    entries = args.layers * args.leaves
    print(f"built inventories ({entries:,} per-layer entries, 5 inventories): {built:.2f} s")

    if args.profile:
        source, target = cases[args.profile]
        gc.collect()  # as timed() does: else the collection owed by the build lands in plan()
        profiler = cProfile.Profile()
        profiler.enable()
        result = plan(source, target)
        profiler.disable()
        check(args.profile, result, args.layers, args.leaves)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(15)
        return 0

    slow = []
    for case, (source, target) in cases.items():
        best, result = min((timed(case, source, target) for _ in range(args.repeat)),
                           key=lambda pair: pair[0])
        check(case, result, args.layers, args.leaves)
        del result
        verdict = "ok" if best < TARGET_SECONDS else f"SLOWER than {TARGET_SECONDS} s"
        print(f"plan {case:<8} {len(source):>9,} -> {len(target):>9,} keys: {best:6.2f} s  {verdict}")
        if best >= TARGET_SECONDS:
            slow.append(case)
    return 1 if slow else 0


if __name__ == "__main__":
    sys.exit(main())
