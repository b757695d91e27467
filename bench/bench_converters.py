"""Meta's original Llama layout and a Megatron-Core ``GPTModel`` checkpoint (~1 GiB each,
bfloat16) into ``LlamaForCausalLM``'s state dict: ckptshim's ``dcp.load`` of the folder against
what a user runs without it -- a converter, then a load of what it wrote.

Both checkpoints are written by the fixtures' own producers (``tests/fixtures/meta_llama`` and
``tests/fixtures/megatron_llama``: ``produce.py``'s tensors and save paths, at larger widths) in
their throwaway virtualenv (``--producer-python``: transformers 4.46.3, llama-models 0.3.0,
megatron-core 0.16.1, as the producers' docstrings set it up). Each step runs in a fresh
subprocess:

- ``ckptshim``: ``dcp.load(LlamaForCausalLM state dict, checkpoint_id=folder)``;
- Meta, ``convert``: transformers 4.46.3's ``convert_llama_weights_to_hf.write_model`` (the last
  release that ships it); ``load``: ``load_state_dict`` of what it wrote
  (``safetensors.torch.load_file``), hooks off. The two loads must agree bit for bit.
- Megatron, ``convert``: the part of any Megatron -> Hugging Face converter that is Megatron's own
  -- ``megatron.core.dist_checkpointing.load`` into a ``GPTModel`` and a plain
  ``safetensors`` save of its state dict -- without the name mapping and query-group split
  (Megatron-Bridge's ``export_ckpt`` adds those; it is not reimplemented here), so its figures
  are a lower bound of the converter's; ``load``: what it wrote copied into a state dict of its
  shapes (``load_file``, as ``load_state_dict`` copies), hooks off. ckptshim's values are checked against Megatron-Core's own load by
  ``tests/test_decoder_hub.py``, not here.

Each prints its wall time and its peak resident memory (``VmHWM``, reset to the resident size
just before the step: what is counted is what the step adds; the loads' state dict is allocated
and touched before). Run: ``python bench/bench_converters.py --producer-python
/tmp/meta33/bin/python [--mib 1024] [--rounds 3] [--family meta|megatron|both]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
#: The model: Llama 3 1B-like widths, the layer count set by ``--mib``.
DIM, HEADS, KV_HEADS, VOCAB, MULTIPLE_OF = 2048, 16, 8, 32000, 256
FFN = 5632  # transformers' compute_intermediate_size(2048, 1.0, 256), as write_model computes it

COMMON = """
import hashlib, json, sys, time
sys.path[:0] = [ARGS_BENCH]
from memory import reset_peak, status_kib
ARGS = json.loads(sys.argv[1])
"""
TARGET = """
import torch
from transformers import AutoConfig, LlamaForCausalLM
def target(hf_config):
    with torch.device("meta"):
        model = LlamaForCausalLM(AutoConfig.for_model("llama", **hf_config))
    model.to_empty(device="cpu")
    state = {k: v.zero_() for k, v in model.to(torch.bfloat16).state_dict().items()}
    return model, state
def digest(state):
    return hashlib.sha256(b"".join(hashlib.sha256(state[k].view(torch.uint16).numpy().tobytes()).digest()
                                   for k in sorted(state))).hexdigest()
"""
STEPS = {
    "write": COMMON + """
sys.path[:0] = [ARGS["producer"]]
import produce, torch
produce.PARAMS.update(ARGS["params"]); produce.FFN = ARGS["ffn"]
whole = {name: produce.seeded(name, shape) for name, shape in produce.shapes().items()}
torch.save(whole, ARGS["meta"] + "/consolidated.00.pth")
open(ARGS["meta"] + "/params.json", "w").write(json.dumps(produce.PARAMS))
print(json.dumps({"bytes": sum(t.numel() * 2 for t in whole.values())}))
""",
    "convert": COMMON + """
import shutil
from transformers.models.llama.convert_llama_weights_to_hf import write_model
shutil.rmtree(ARGS["hf"], ignore_errors=True)
base = reset_peak(); start = time.perf_counter()
write_model(ARGS["hf"], ARGS["meta"], safe_serialization=True, llama_version="3", vocab_size=ARGS["vocab"],
            num_shards=1)
print(json.dumps({"seconds": time.perf_counter() - start, "peak": (status_kib("VmHWM") - base) * 1024}))
""",
    "write_megatron": COMMON + """
import os, pathlib
sys.path[:0] = [ARGS["producer"]]
import produce
produce.CONFIG.update(ARGS["megatron"]); produce.VOCAB = ARGS["vocab"]; produce.HERE = pathlib.Path(ARGS["root"])
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29581", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
produce.worker(1)
print(json.dumps({}))
""",
    "convert_megatron": COMMON + """
import os
sys.path[:0] = [ARGS["producer"]]
import produce
produce.CONFIG.update(ARGS["megatron"]); produce.VOCAB = ARGS["vocab"]
torch = produce.cpu_only_torch()
from megatron.core import dist_checkpointing, parallel_state
from safetensors.torch import save_file
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29582")
torch.distributed.init_process_group("gloo", rank=0, world_size=1)
parallel_state.initialize_model_parallel(1, 1)
model = produce.build()
base = reset_peak(); start = time.perf_counter()
loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, ARGS["root"] + "/tp1/iter_0000007")
model.load_state_dict(loaded["model"])
os.makedirs(ARGS["hf"], exist_ok=True)
save_file({k: v.contiguous() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)
           and not k.endswith("_extra_state")}, ARGS["hf"] + "/model.safetensors")
print(json.dumps({"seconds": time.perf_counter() - start, "peak": (status_kib("VmHWM") - base) * 1024}))
""",
    "load_megatron": COMMON + """
import torch
from safetensors import safe_open
from safetensors.torch import load_file
with safe_open(ARGS["hf"] + "/model.safetensors", "pt") as f:  # a state dict of the saved shapes, touched
    state = {k: torch.zeros(f.get_slice(k).get_shape(), dtype=torch.bfloat16) for k in f.keys()}
base = reset_peak(); start = time.perf_counter()
for key, value in load_file(ARGS["hf"] + "/model.safetensors").items():
    state[key].copy_(value)
print(json.dumps({"seconds": time.perf_counter() - start, "peak": (status_kib("VmHWM") - base) * 1024}))
""",
    "load": COMMON + TARGET + """
from safetensors.torch import load_file
model, state = target(ARGS["hf_config"]); base = reset_peak(); start = time.perf_counter()
model.load_state_dict(load_file(ARGS["hf"] + "/model.safetensors"))
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "peak": (status_kib("VmHWM") - base) * 1024, "digest": digest(model.state_dict())}))
""",
    "ckptshim": COMMON + TARGET + """
import ckptshim, torch.distributed.checkpoint as dcp
model, state = target(ARGS["hf_config"]); base = reset_peak(); start = time.perf_counter()
dcp.load(state, checkpoint_id=ARGS["checkpoint"])
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "peak": (status_kib("VmHWM") - base) * 1024, "digest": digest(state)}))
""",
}


def step(name: str, python: str, args: dict) -> dict:
    env = ({**os.environ, "PYTHONPATH": str(ROOT)} if name.startswith("ckptshim")
           else {**os.environ, "CKPTSHIM_DISABLE": "1", "OMP_NUM_THREADS": "1"} if name.startswith("write")
           else {**os.environ, "CKPTSHIM_DISABLE": "1"})
    code = STEPS[name].replace("ARGS_BENCH", repr(str(ROOT / "bench")))
    run = subprocess.run([python, "-c", code, json.dumps(args)], capture_output=True, text=True, env=env, cwd=ROOT,
                         check=False)
    if run.returncode != 0:
        raise SystemExit(f"{name} failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def report(family: str, runs: dict[str, list[dict]]) -> None:
    for name, found in runs.items():
        print(f"{family:8} {name:9} {statistics.median(r['seconds'] for r in found):7.2f} s (best "
              f"{min(r['seconds'] for r in found):.2f}), peak +{max(r['peak'] for r in found) / 2**20:.0f} MiB")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--producer-python", required=True, help="the producers' venv (see the module docstring)")
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--family", choices=("meta", "megatron", "both"), default="both")
    options = parser.parse_args()
    python = options.producer_python
    per_layer = (2 * DIM * DIM + 2 * DIM * DIM * KV_HEADS // HEADS + 3 * DIM * FFN) * 2
    layers = max(1, (options.mib * 2**20 - 2 * VOCAB * DIM * 2) // per_layer)
    hf_config = {"hidden_size": DIM, "intermediate_size": FFN, "num_hidden_layers": layers,
                 "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "vocab_size": VOCAB,
                 "tie_word_embeddings": False}
    print(f"{layers} layers; load average {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory(prefix="bench-converters-") as tmp:
        if options.family in ("meta", "both"):
            args = {"producer": str(FIXTURES / "meta_llama"), "meta": f"{tmp}/meta", "hf": f"{tmp}/hf_meta",
                    "params": {"dim": DIM, "n_layers": layers, "n_heads": HEADS, "n_kv_heads": KV_HEADS,
                               "vocab_size": VOCAB, "multiple_of": MULTIPLE_OF},
                    "ffn": FFN, "vocab": VOCAB, "hf_config": hf_config}
            os.mkdir(args["meta"])
            print(f"Meta: {step('write', python, args)['bytes'] / 2**30:.2f} GiB")
            runs: dict[str, list[dict]] = {"ckptshim": [], "convert": [], "load": []}
            for _ in range(options.rounds):
                runs["ckptshim"].append(step("ckptshim", sys.executable, {**args, "checkpoint": args["meta"]}))
                runs["convert"].append(step("convert", python, args))
                runs["load"].append(step("load", sys.executable, args))
            if {r["digest"] for r in runs["ckptshim"] + runs["load"]} != {runs["load"][0]["digest"]}:
                raise SystemExit("ckptshim's load and the converter's differ")
            report("Meta", runs)
            print(f"load average: {os.getloadavg()[0]:.1f}; the two loads equal bit for bit")
        if options.family in ("megatron", "both"):
            args = {"producer": str(FIXTURES / "megatron_llama"), "root": f"{tmp}/megatron", "hf": f"{tmp}/hf_megatron",
                    "vocab": VOCAB, "hf_config": hf_config,
                    "megatron": {"num_layers": layers, "hidden_size": DIM, "num_attention_heads": HEADS,
                                 "num_query_groups": KV_HEADS, "kv_channels": DIM // HEADS, "ffn_hidden_size": FFN}}
            step("write_megatron", python, args)
            runs = {"ckptshim": [], "convert": [], "load": []}
            for _ in range(options.rounds):
                runs["ckptshim"].append(step("ckptshim", sys.executable, {**args, "checkpoint": args["root"] + "/tp1"}))
                runs["convert"].append(step("convert_megatron", python, args))
                runs["load"].append(step("load_megatron", sys.executable, args))
            report("Megatron", runs)
            print(f"load average: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
