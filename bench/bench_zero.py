"""A DeepSpeed ZeRO-3 checkpoint of ~1 GiB of fp32 masters (``--mib``), against ``zero_to_fp32``.

The checkpoint is written once into ``--dir`` (reused when it is already there) by DeepSpeed's
real engine on CPU: 2 ranks on gloo, ZeRO-3, fp32, torch's Adam, one training step, then
``engine.save_checkpoint``. The model is ``--mib / 16`` layers of ``Linear(2048, 2048)`` with a
bias (16 MiB each), so each rank's optimizer file holds half of every parameter's fp32 master and
of both Adam moments. Each case then runs in a fresh subprocess, rounds interleaved:

- ``zero_to_fp32``: DeepSpeed's own converter,
  ``convert_zero_checkpoint_to_fp32_state_dict(save_dir, out, safe_serialization=True)``;
- ``convert``: ``ckptshim convert SAVE_DIR out --to safetensors`` (the CLI's ``main``, in process);
- ``dcp.load``: ``dcp.load(model.state_dict(), checkpoint_id=SAVE_DIR)`` with ``import ckptshim``,
  into the model built on the meta device then ``to_empty`` (its pages untouched until the load).

Every process imports torch, ckptshim and (for ``zero_to_fp32``) DeepSpeed before it measures, so
time and peak memory are the step's alone. Peak memory is the high-water mark (``VmHWM``) over the
resident size just before the step (for ``dcp.load``, before the model is allocated: the model is
part of that load's peak). A touched page of a memory-mapped file counts there too, so the
resident mapped pages at the end (``RssFile``) are reported beside it. After the timing, each case
hashes every tensor it produced (the written safetensors files, or the loaded state dict), and all
three must agree bit for bit with ``zero_to_fp32``'s.

Targets (issue 25): ``convert`` and ``dcp.load`` faster than ``zero_to_fp32`` (median over rounds),
and their peaks at most the model's bytes + 10%. Exit status 1 when one is missed.
Run: ``python bench/bench_zero.py [--mib 1024] [--rounds 3] [--dir /tmp/bench_zero]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from memory import reset_peak, status_kib  # noqa: E402

CASES = ("zero_to_fp32", "convert", "dcp.load")
WIDTH = 2048  # one Linear(2048, 2048) is 16 MiB of fp32 weight
RANKS = 2


def _model(layers: int, device: str = "cpu"):
    from torch import nn

    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH, device=device) for _ in range(layers)))


def write_rank(save_dir: Path, layers: int, rank: int, port: int) -> None:
    """One rank of DeepSpeed's engine: one Adam step on a ZeRO-3 model, then its checkpoint."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(RANKS), LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    import deepspeed
    import torch

    from support.deepspeed_cpu import init_distributed_on_gloo

    init_distributed_on_gloo(verbose=False)
    torch.manual_seed(0)
    model = _model(layers)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "train_batch_size": RANKS, "steps_per_print": 10**6,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": 3}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    del model
    inputs = torch.randn(1, WIDTH, generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(inputs).square().mean())
    engine.step()
    engine.save_checkpoint(str(save_dir))


def write(save_dir: Path, layers: int) -> float:
    """The checkpoint, written by ``RANKS`` processes; returns the seconds it took."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    partial = save_dir.with_name(save_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    start = time.perf_counter()
    ranks = [subprocess.Popen([sys.executable, __file__, "--write-rank", str(rank), "--port", str(port),
                               "--save-dir", str(partial), "--layers", str(layers)],
                              stdout=subprocess.DEVNULL, env=os.environ | {"DS_ACCELERATOR": "cpu"})
             for rank in range(RANKS)]
    if any(process.wait() for process in ranks):
        raise SystemExit("a DeepSpeed rank failed while writing the checkpoint (its stderr is above)")
    partial.rename(save_dir)  # only a whole checkpoint is ever reused
    return time.perf_counter() - start


def _digests(tensors) -> dict[str, str]:
    """``name -> dtype, shape and sha256 of the bytes`` for each ``(name, tensor)``."""
    import torch

    return {name: f"{tensor.dtype} {list(tensor.shape)} "
                  f"{hashlib.sha256(tensor.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()}"
            for name, tensor in tensors}


def _safetensors_digests(folder: Path) -> dict[str, str]:
    from safetensors import safe_open

    digests = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, "pt") as opened:
            digests |= _digests((name, opened.get_tensor(name)) for name in opened.keys())
    return digests


def worker(case: str, save_dir: Path, out: Path, layers: int) -> dict:
    """One case in this process: the step timed and measured, then its tensors hashed."""
    warnings.simplefilter("ignore")
    import torch  # noqa: F401  (every case's imports come before the measurement)

    import ckptshim  # noqa: F401  (attaches the hooks)
    import ckptshim.cli
    import safetensors.torch  # noqa: F401

    if case == "zero_to_fp32":
        from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict
    if case == "dcp.load":
        import torch.distributed.checkpoint as dcp

        model = _model(layers, device="meta")
    shutil.rmtree(out, ignore_errors=True)
    baseline = reset_peak()
    start = time.perf_counter()
    if case == "zero_to_fp32":
        convert_zero_checkpoint_to_fp32_state_dict(str(save_dir), str(out), safe_serialization=True)
    elif case == "convert":
        if ckptshim.cli.main(["convert", str(save_dir), str(out), "--to", "safetensors", "--no-progress"]):
            raise SystemExit("ckptshim convert failed")
    else:
        model.to_empty(device="cpu")
        state_dict = model.state_dict()
        dcp.load(state_dict, checkpoint_id=str(save_dir))
    seconds = time.perf_counter() - start
    peak = status_kib("VmHWM") - baseline
    mapped = status_kib("RssFile")
    digests = _digests(state_dict.items()) if case == "dcp.load" else _safetensors_digests(out)
    shutil.rmtree(out, ignore_errors=True)
    return {"case": case, "seconds": seconds, "peak_kib": peak, "mapped_kib": mapped, "digests": digests}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024, help="fp32 masters in MiB (default 1024)")
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes per case")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--dir", type=Path, default=Path("/tmp/bench_zero"),
                        help="where the checkpoint is written once and reused")
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)  # worker modes
    parser.add_argument("--write-rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--save-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.write_rank is not None:
        write_rank(args.save_dir, args.layers, args.write_rank, args.port)
        return 0
    if args.case:
        print(json.dumps(worker(args.case, args.save_dir, args.out, args.layers)))
        return 0

    layers = max(1, args.mib // 16)
    model_bytes = layers * (WIDTH * WIDTH + WIDTH) * 4
    save_dir = args.dir / f"zero3_ws{RANKS}_{layers}x{WIDTH}"
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    if save_dir.is_dir():
        print(f"checkpoint: reusing {save_dir}; load average {load}", flush=True)
    else:
        written = write(save_dir, layers)
        print(f"checkpoint: written in {written:.0f} s by {RANKS} DeepSpeed ranks; load average {load}", flush=True)
    size = sum(f.stat().st_size for f in save_dir.rglob("*") if f.is_file())
    print(f"  {layers} x Linear({WIDTH}, {WIDTH}) = {model_bytes / 2**20:.0f} MiB of fp32 masters, "
          f"{size / 2**30:.2f} GiB on disk (masters and both Adam moments)", flush=True)

    runs: dict[str, list[dict]] = {case: [] for case in args.cases}
    for _ in range(args.rounds):
        for case in args.cases:
            load = os.getloadavg()[0]
            out = subprocess.run([sys.executable, __file__, "--case", case, "--save-dir", str(save_dir),
                                  "--out", str(args.dir / "out"), "--layers", str(layers)],
                                 stdout=subprocess.PIPE, text=True, check=True)
            runs[case].append(json.loads(out.stdout.strip().splitlines()[-1]) | {"load": load})
            result = runs[case][-1]
            print(f"  {case}: {result['seconds']:.2f} s, peak {result['peak_kib'] / 1024:.0f} MiB "
                  f"(load average {load:.2f})", flush=True)

    passed = True
    reference = runs["zero_to_fp32"][0]["digests"] if "zero_to_fp32" in runs else None
    summary = {}
    for case, results in runs.items():
        seconds = statistics.median(r["seconds"] for r in results)
        peak = max(r["peak_kib"] for r in results) * 1024 / model_bytes
        mapped = max(r["mapped_kib"] for r in results) / 1024
        loads = [r["load"] for r in results]
        exact = reference is None or all(r["digests"] == reference for r in results)
        summary[case] = seconds
        rounds = " ".join(f"{r['seconds']:.2f}" for r in results)
        print(f"{case:12s} {seconds:6.2f} s (rounds {rounds}), "
              f"peak {peak:.2f} x model bytes, mapped pages at the end {mapped:.0f} MiB, "
              f"load average {min(loads):.1f}-{max(loads):.1f}, "
              f"{'bit for bit as zero_to_fp32' if exact else 'DIFFERS from zero_to_fp32'}")
        passed &= exact
        if case != "zero_to_fp32":
            print(f"  {case} peak / model bytes: {peak:.3f}  (target <= 1.10)")
            passed &= peak <= 1.10
    if reference is not None:
        assert len(reference) == 2 * layers, "zero_to_fp32 wrote other tensors than the model's"
        for case in ("convert", "dcp.load"):
            if case in summary:
                ratio = summary[case] / summary["zero_to_fp32"]
                print(f"{case} / zero_to_fp32 time: {ratio:.3f}  (target < 1.0)")
                passed &= ratio < 1.0
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
