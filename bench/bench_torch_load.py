"""Cost of the ``load_state_dict`` hook on a ~1 GiB float32 model.

Three cases:

- ``native``: torch's own ``load_state_dict`` (hook uninstalled) of a state dict that matches;
- ``shimmed``: strict load of a state dict saved from ``torch.compile(model)`` (every key has
  ``_orig_mod.``) that lacks the persistent, derivable ``inv_freq`` buffer -- ckptshim remaps
  the keys and synthesizes the buffer;
- ``idle``: hook installed, state dict already matching (the hook's only cost is noticing that).

Each case runs in fresh subprocesses, rounds interleaved, for time per call and peak memory
(``ru_maxrss`` at the end minus ``ru_maxrss`` once the model and state dict are built). On a
busy machine those per-process times are dominated by whatever else runs, so one more process
times the three cases *paired*: each round loads all three (in a rotating order) into one
model, and the median of the per-round ratios is reported. Targets: shimmed/native time
<= 1.05, shimmed peak <= native peak + 5% of the model; idle/native time <= 1.02.

Run: ``python bench/bench_torch_load.py [--mib 1024] [--rounds 3] [--calls 9]``.
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


def _model(mib: int):
    import torch
    from torch import nn

    class Bench(nn.Module):
        """A few large linear layers and a rotary ``inv_freq`` kept in the state dict."""

        def __init__(self, layers: int) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers))
            self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 128, 2).float() / 128)))

    return Bench(max(1, mib * 2**20 // (WIDTH * WIDTH * 4)))


def _state_dict(model, case: str) -> dict:
    """A state dict with fresh values; for ``shimmed``, as saved from the compiled model."""
    import torch

    generator = torch.Generator().manual_seed(1)
    state = {}
    for key, tensor in model.state_dict().items():
        if case == "shimmed" and key == "inv_freq":
            continue  # the checkpoint lacks it; ckptshim keeps the model's own value
        value = torch.empty_like(tensor).uniform_(generator=generator)
        state[f"_orig_mod.{key}" if case == "shimmed" else key] = value
    return state


def _timed_load(model, state: dict, hooked: bool) -> float:
    import ckptshim

    (ckptshim.install if hooked else ckptshim.uninstall)(("torch",))
    start = time.perf_counter()
    result = model.load_state_dict(state, strict=True)
    elapsed = time.perf_counter() - start
    assert not result.missing_keys and not result.unexpected_keys
    return elapsed


def _check_loaded(model, state: dict) -> None:
    import torch

    loaded = model.state_dict()
    for key, tensor in state.items():
        assert torch.equal(loaded[key.removeprefix("_orig_mod.")], tensor), key


def case_worker(case: str, mib: int, calls: int) -> dict:
    """One case in this fresh process: build, then time ``calls`` loads."""
    model = _model(mib)
    state = _state_dict(model, case)
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = [_timed_load(model, state, hooked=case != "native") for _ in range(calls)]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - baseline
    _check_loaded(model, state)
    model_mib = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 2**20
    return {"times": times, "peak_extra_mib": peak / 1024, "model_mib": model_mib}


def paired_worker(mib: int, calls: int) -> dict:
    """All three cases on one model, in a rotating order; the ratios of each round."""
    model = _model(mib)
    loads = {"native": (_state_dict(model, "native"), False),
             "shimmed": (_state_dict(model, "shimmed"), True),
             "idle": (_state_dict(model, "native"), True)}
    ratios: dict[str, list[float]] = {"shimmed": [], "idle": []}
    for round_ in range(calls):
        order = CASES[round_ % 3:] + CASES[:round_ % 3]
        took = {case: _timed_load(model, *loads[case]) for case in order}
        for case in ratios:
            ratios[case].append(took[case] / took["native"])
    return {case: statistics.median(values) for case, values in ratios.items()}


def _run(*args: str) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024, help="model size (default 1024)")
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes per case")
    parser.add_argument("--calls", type=int, default=9, help="load_state_dict calls per process")
    parser.add_argument("--worker", choices=(*CASES, "paired"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    size = ("--mib", str(args.mib), "--calls", str(args.calls))
    if args.worker == "paired":
        print(json.dumps(paired_worker(args.mib, args.calls)))
        return 0
    if args.worker:
        print(json.dumps(case_worker(args.worker, args.mib, args.calls)))
        return 0

    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    runs: dict[str, list[dict]] = {case: [] for case in CASES}
    for _ in range(args.rounds):
        for case in CASES:
            runs[case].append(_run("--worker", case, *size))
    paired = _run("--worker", "paired", "--mib", str(args.mib), "--calls", str(3 * args.calls))
    print(f"load average after:  {' '.join(f'{x:.2f}' for x in os.getloadavg())}")

    model_mib = runs["native"][0]["model_mib"]
    print(f"model: {model_mib:.0f} MiB float32; per case {args.rounds} fresh processes x "
          f"{args.calls} calls; paired: {3 * args.calls} rounds in one process")
    print(f"{'case':<9}{'best s':>9}{'median s':>10}{'peak extra MiB':>16}")
    stats = {}
    for case in CASES:
        times = [t for run in runs[case] for t in run["times"]]
        peak = max(run["peak_extra_mib"] for run in runs[case])
        stats[case] = (min(times), statistics.median(times), peak)
        print(f"{case:<9}{stats[case][0]:>9.4f}{stats[case][1]:>10.4f}{peak:>16.1f}")
    for case in ("shimmed", "idle"):
        print(f"{case}/native per-process times: best {stats[case][0] / stats['native'][0]:.3f}, "
              f"median {stats[case][1] / stats['native'][1]:.3f} (machine noise included)")
    checks = [
        ("shimmed/native time, paired median", paired["shimmed"], 1.05),
        ("idle/native time, paired median", paired["idle"], 1.02),
        ("(shimmed - native peak) / model size", (stats["shimmed"][2] - stats["native"][2]) / model_mib, 0.05),
    ]
    missed = 0
    for name, value, limit in checks:
        missed += value > limit
        print(f"{name:<40}{value:>7.3f}  target <= {limit}  {'ok' if value <= limit else 'MISSED'}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
