"""Cost of the ``load_state_dict`` hook on a ~1 GiB float32 model.

Three cases, each measured in fresh subprocesses (so one case's allocations cannot lower
another's peak), several rounds interleaved (so drifting machine load hits all cases alike):

- ``native``: torch's own ``load_state_dict`` (hook uninstalled) of a state dict that matches;
- ``shimmed``: strict load of a state dict saved from ``torch.compile(model)`` (every key has
  ``_orig_mod.``) that lacks the persistent, derivable ``inv_freq`` buffer -- ckptshim remaps
  the keys and synthesizes the buffer;
- ``idle``: hook installed, state dict already matching (the hook's only cost is noticing that).

Time is per ``load_state_dict`` call (best and median of all calls); peak memory is
``ru_maxrss`` at the end minus ``ru_maxrss`` after building the model and the state dict.
Targets: shimmed/native time <= 1.05 and peak <= native + 5% of the model's size; idle/native
time <= 1.02. Run: ``python bench/bench_torch_load.py [--mib 1024] [--rounds 3] [--calls 7]``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

CASES = ("native", "shimmed", "idle")
WIDTH = 8192  # one 8192 x 8192 float32 layer is 256 MiB


def _model(layers: int, width: int):
    import torch
    from torch import nn

    class Bench(nn.Module):
        """A few large linear layers and a rotary ``inv_freq`` kept in the state dict."""

        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(layers))
            self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 128, 2).float() / 128)))

    return Bench()


def _state_dict(model, case: str) -> dict:
    import torch

    generator = torch.Generator().manual_seed(1)
    state = {}
    for key, tensor in model.state_dict().items():
        if case == "shimmed" and key == "inv_freq":
            continue  # the compiled model's checkpoint lacks it; ckptshim synthesizes it
        value = torch.empty_like(tensor).uniform_(generator=generator)
        state[f"_orig_mod.{key}" if case == "shimmed" else key] = value
    return state


def _peak_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def worker(case: str, mib: int, calls: int) -> dict:
    """One case in this process: build, then time ``calls`` loads; one JSON line on stdout."""
    import ckptshim
    import torch

    if case == "native":
        ckptshim.uninstall(("torch",))
    layers = max(1, mib * 2**20 // (WIDTH * WIDTH * 4))
    model = _model(layers, WIDTH)
    state = _state_dict(model, case)
    baseline = _peak_kib()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        result = model.load_state_dict(state, strict=True)
        times.append(time.perf_counter() - start)
        assert not result.missing_keys and not result.unexpected_keys
    loaded = model.state_dict()
    for key, tensor in state.items():  # loaded bit-exactly
        assert torch.equal(loaded[key.removeprefix("_orig_mod.")], tensor), key
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return {"case": case, "times": times, "peak_extra_kib": _peak_kib() - baseline,
            "model_mib": model_bytes / 2**20,
            "check_s": _idle_check_seconds(model, state) if case == "idle" else None}


def _idle_check_seconds(model, state) -> float:
    """What the hook spends deciding that a matching state dict needs nothing (median)."""
    from ckptshim.hooks.torch_module import _fits, _layout

    times = []
    for _ in range(200):
        start = time.perf_counter()
        _fits(state, _layout(model).tensors)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024, help="model size (default 1024)")
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes per case")
    parser.add_argument("--calls", type=int, default=7, help="load_state_dict calls per process")
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)  # worker mode
    args = parser.parse_args()
    if args.case:
        print(json.dumps(worker(args.case, args.mib, args.calls)))
        return 0

    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    runs: dict[str, list[dict]] = {case: [] for case in CASES}
    for _ in range(args.rounds):
        for case in CASES:
            out = subprocess.run([sys.executable, __file__, "--case", case, "--mib", str(args.mib),
                                  "--calls", str(args.calls)],
                                 capture_output=True, text=True, check=True)
            runs[case].append(json.loads(out.stdout.strip().splitlines()[-1]))

    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    model_mib = runs["native"][0]["model_mib"]
    stats = {}
    for case, results in runs.items():
        times = [t for r in results for t in r["times"]]
        stats[case] = {"best": min(times), "median": statistics.median(times),
                       "peak_mib": max(r["peak_extra_kib"] for r in results) / 1024}
    print(f"model: {model_mib:.0f} MiB float32; {args.rounds} processes x {args.calls} calls per case")
    print(f"{'case':<9}{'best s':>10}{'median s':>10}{'peak extra MiB':>16}")
    for case in CASES:
        s = stats[case]
        print(f"{case:<9}{s['best']:>10.4f}{s['median']:>10.4f}{s['peak_mib']:>16.1f}")
    native = stats["native"]
    check_s = statistics.median(r["check_s"] for r in runs["idle"])
    print(f"hook's idle check: {check_s * 1e6:.0f} us per call = {check_s / native['best']:.5%} "
          "of the best native load (the rest of any idle/native gap is machine noise)")
    checks = [
        ("shimmed/native time (median)", stats["shimmed"]["median"] / native["median"], 1.05),
        ("shimmed/native time (best)", stats["shimmed"]["best"] / native["best"], 1.05),
        ("idle/native time (median)", stats["idle"]["median"] / native["median"], 1.02),
        ("idle/native time (best)", stats["idle"]["best"] / native["best"], 1.02),
        ("shimmed peak - native peak, share of model",
         (stats["shimmed"]["peak_mib"] - native["peak_mib"]) / model_mib, 0.05),
    ]
    failed = 0
    for name, value, limit in checks:
        ok = value <= limit
        failed += not ok
        print(f"{name:<44}{value:>8.3f}  (target <= {limit}) {'ok' if ok else 'MISSED'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
