"""A transformers-4 MoE checkpoint (~1 GiB, per-expert files) into transformers 5's fused model:
ckptshim against transformers' own ``from_pretrained`` of the same folder, in the same run.

The checkpoint is a Mixtral (float32) written by transformers 5's own ``save_pretrained``, which
saves in the original layout (``block_sparse_moe.experts.{e}.w1/w2/w3.weight``, one tensor per
expert), sharded into safetensors files of about 256 MiB. Each case runs in fresh subprocesses,
rounds interleaved, and checks its model bit for bit against ``from_pretrained``'s:

- ``from_pretrained``: ``AutoModelForCausalLM.from_pretrained(folder)`` (hooks off: it is
  transformers' own load);
- ``load_state_dict``: the model built without initialising its weights (on the meta device,
  then ``to_empty``), ``load_file`` of each shard (memory maps), one strict
  ``model.load_state_dict`` of them all -- ckptshim fuses every expert through views;
- ``dcp.load``: the same model, ``dcp.load(model.state_dict(), checkpoint_id=folder)`` -- ckptshim
  reads each tensor with one ``pread`` straight into its place.

Time is the whole load, from the config to a loaded model (the model's code imported before,
in every case). Peak memory is the process's high-water mark (``VmHWM``) after the load minus its
resident size before it (the baseline). That counts the checkpoint's pages wherever a memory map
of the files was touched: ``load_file`` maps each shard and the state dict the user holds keeps
them mapped (clean page cache, shared with the kernel's, which it may drop at any time); so the
mapped pages still held at the end (``RssFile`` growth) are reported beside it, and the peak
less them is what the load itself allocated. Targets: load_state_dict / from_pretrained time
<= 1.0; load_state_dict peak less the state dict's mapped pages <= model bytes + 10%; dcp.load,
which maps nothing, peak <= model bytes + 10%.
Run: ``python bench/bench_moe_load.py [--mib 1024] [--rounds 5]``.
"""

from __future__ import annotations

import argparse
import importlib
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

from memory import reset_peak, status_kib

CASES = ("from_pretrained", "load_state_dict", "dcp.load")
HIDDEN, INTERMEDIATE, EXPERTS, VOCAB = 1024, 2304, 8, 8192


def _config(mib: int):
    from transformers import MixtralConfig

    per_layer = 3 * EXPERTS * HIDDEN * INTERMEDIATE * 4 + 4 * HIDDEN * HIDDEN * 4
    layers = max(1, (mib * 2**20 - 2 * VOCAB * HIDDEN * 4) // per_layer)
    return MixtralConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=layers,
                         num_attention_heads=16, num_key_value_heads=16, num_local_experts=EXPERTS,
                         num_experts_per_tok=2, tie_word_embeddings=False)


def save(folder: Path, mib: int) -> int:
    """Write the checkpoint in the transformers-4 layout; returns the model's bytes."""
    import torch
    from transformers import MixtralForCausalLM

    with torch.device("meta"):
        model = MixtralForCausalLM(_config(mib))
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.normal_(generator=generator)
    model.save_pretrained(folder, max_shard_size="256MB")  # transformers 5 saves the original layout
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def _baseline() -> tuple[int, int]:
    """Resident size and file-backed resident size now, the high-water mark reset to them."""
    return reset_peak(), status_kib("RssFile")


def _empty_model(folder: Path):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    return model.to_empty(device="cpu")


def worker(case: str, folder: Path) -> dict:
    """One case in this process; one JSON line on stdout."""
    warnings.simplefilter("ignore")
    import ckptshim
    import torch
    import torch.distributed.checkpoint as dcp
    import transformers
    from safetensors.torch import load_file

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    importlib.import_module("transformers.models.mixtral.modeling_mixtral")  # the model's code: not the load's cost
    if case == "from_pretrained":
        ckptshim.uninstall()
    baseline, file_baseline = _baseline()
    start = time.perf_counter()
    if case == "from_pretrained":
        model = transformers.AutoModelForCausalLM.from_pretrained(folder)
        state = None
    else:
        model = _empty_model(folder)
        if case == "load_state_dict":
            state = {}
            for shard in sorted(folder.glob("*.safetensors")):
                state.update(load_file(shard))
            model.load_state_dict(state)
        else:
            state = None
            dcp.load(model.state_dict(), checkpoint_id=folder)
    elapsed = time.perf_counter() - start
    peak = status_kib("VmHWM") - baseline
    mapped = status_kib("RssFile") - file_baseline
    del state
    loaded = model.state_dict()
    ckptshim.uninstall()
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder).state_dict()
    assert loaded.keys() == reference.keys() and all(torch.equal(loaded[k], v) for k, v in reference.items()), \
        "not bit-exact"
    model_bytes = sum(t.numel() * t.element_size() for t in loaded.values())
    return {"case": case, "seconds": elapsed, "peak_kib": peak, "mapped_kib": mapped, "model_mib": model_bytes / 2**20}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024, help="checkpoint size (default 1024)")
    parser.add_argument("--rounds", type=int, default=5, help="fresh processes per case")
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)  # worker mode
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        print(json.dumps(worker(args.case, args.folder)))
        return 0

    folder = Path(tempfile.mkdtemp(prefix="bench_moe_")) / "mixtral_tf4_layout"
    try:
        model_bytes = save(folder, args.mib)
        size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        shards = len(list(folder.glob("*.safetensors")))
        print(f"checkpoint: Mixtral, {_config(args.mib).num_hidden_layers} layers x {EXPERTS} experts, per-expert "
              f"keys, {shards} safetensors shards, {size / 2**30:.3f} GiB; model {model_bytes / 2**20:.0f} MiB; "
              f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        runs: dict[str, list[dict]] = {case: [] for case in CASES}
        for _ in range(args.rounds):
            for case in CASES:
                out = subprocess.run([sys.executable, __file__, "--case", case, "--folder", str(folder)],
                                     capture_output=True, text=True, check=True)
                runs[case].append(json.loads(out.stdout.strip().splitlines()[-1]))
    finally:
        shutil.rmtree(folder.parent)

    model_mib = model_bytes / 2**20
    summary = {}
    for case, results in runs.items():
        seconds = statistics.median(r["seconds"] for r in results)
        peak = max(r["peak_kib"] for r in results) / 1024
        mapped = max(r["mapped_kib"] for r in results) / 1024
        summary[case] = {"seconds": seconds, "peak_mib": peak, "mapped_mib": mapped}
        rounds = " ".join(f"{r['seconds']:.2f}" for r in results)
        print(f"{case:16s} {seconds:6.3f} s (rounds: {rounds})   peak over baseline {peak:7.1f} MiB = "
              f"{peak / model_mib:.2f} x model (of which mapped checkpoint pages still held: {mapped:6.1f} MiB)")
    ratio = summary["load_state_dict"]["seconds"] / summary["from_pretrained"]["seconds"]
    own = (summary["load_state_dict"]["peak_mib"] - summary["load_state_dict"]["mapped_mib"]) / model_mib
    dcp_peak = summary["dcp.load"]["peak_mib"] / model_mib
    print(f"load_state_dict / from_pretrained time: {ratio:.3f}  (target <= 1.0); dcp.load / from_pretrained: "
          f"{summary['dcp.load']['seconds'] / summary['from_pretrained']['seconds']:.3f}")
    print(f"load_state_dict peak / model bytes: {summary['load_state_dict']['peak_mib'] / model_mib:.3f} with the "
          f"state dict's mapped pages, {own:.3f} without (target <= 1.10)")
    print(f"dcp.load peak / model bytes: {dcp_peak:.3f} (target <= 1.10); from_pretrained: "
          f"{summary['from_pretrained']['peak_mib'] / model_mib:.3f} (with its mapped pages), "
          f"{(summary['from_pretrained']['peak_mib'] - summary['from_pretrained']['mapped_mib']) / model_mib:.3f} without")
    return 0 if ratio <= 1.0 and own <= 1.10 and dcp_peak <= 1.10 else 1


if __name__ == "__main__":
    sys.exit(main())
