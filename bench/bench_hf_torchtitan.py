"""A Hugging Face Llama folder (~1 GiB, bfloat16) into a torchtitan Llama 3 state dict (float32):
ckptshim's ``dcp.load`` of the folder against torchtitan's ``convert_from_hf.py`` plus DCP's native
load of what it wrote.

torchtitan cannot be installed beside ckptshim's pinned environment (docs/torchtitan.md), so the
converter runs in a virtualenv of its own (``--torchtitan-python``, set up as
``tests/fixtures/hf_to_torchtitan/produce.py`` says), with the flavor of this model added to
torchtitan's table in-process by that producer's ``register_flavor``; the script is the real one
(``--convert-from-hf``). Each step runs in a fresh subprocess:

- ``ckptshim``: ``dcp.load({torchtitan name: empty float32 tensor}, checkpoint_id=folder)``;
- ``convert_from_hf``: the script's ``convert_from_hf(folder, dcp_dir, "llama3", flavor)``;
- ``native``: ``dcp.load`` of ``dcp_dir`` into the same state dict, hooks off.

Each prints its wall time, its peak resident memory (``VmHWM``) over its resident size before the
step (the loads' state dict is allocated and touched before: what is counted is what the load
adds), and a hash of every tensor it loaded; the two loads must agree bit for bit. Goal:
ckptshim's load faster than the converter alone, and adding no more to the peak than DCP's
native load of the converted checkpoint does (its largest staging buffer is one tensor's stored
bytes: the cast reads each block as stored, then copies it in).
Run: ``python bench/bench_hf_torchtitan.py --torchtitan-python /tmp/tt/bin/python
--convert-from-hf /tmp/convert_from_hf.py [--mib 1024] [--rounds 3]``.
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
PRODUCER = ROOT / "tests" / "fixtures" / "hf_to_torchtitan" / "produce.py"
HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, VOCAB = 2048, 5632, 16, 8, 32000

#: Code each step's subprocess runs; ``ARGS`` is the JSON of its arguments.
COMMON = """
import hashlib, json, sys, time
def vm(field):
    return next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith(field + ':'))
ARGS = json.loads(sys.argv[1])
"""
TARGET = """
import torch
from safetensors import safe_open
from ckptshim.inventory import join_key, split_key
from ckptshim.rules.profiles.torchtitan import torchtitan_name
def target(folder):
    with safe_open(f"{folder}/model.safetensors", "pt") as f:
        return {join_key(torchtitan_name(split_key(k))): torch.zeros(f.get_slice(k).get_shape())
                for k in f.keys()}
def digest(state):
    return hashlib.sha256(b"".join(hashlib.sha256(state[k].numpy().tobytes()).digest() for k in sorted(state))).hexdigest()
"""
STEPS = {
    "ckptshim": COMMON + TARGET + """
import ckptshim, torch.distributed.checkpoint as dcp
state = target(ARGS["folder"]); base = vm("VmRSS"); start = time.perf_counter()
dcp.load(state, checkpoint_id=ARGS["folder"])
print(json.dumps({"seconds": time.perf_counter() - start, "peak": vm("VmHWM") - base, "digest": digest(state)}))
""",
    "native": COMMON + TARGET + """
import torch.distributed.checkpoint as dcp
state = target(ARGS["folder"]); base = vm("VmRSS"); start = time.perf_counter()
dcp.load(state, checkpoint_id=ARGS["dcp"])
print(json.dumps({"seconds": time.perf_counter() - start, "peak": vm("VmHWM") - base, "digest": digest(state)}))
""",
    "convert_from_hf": COMMON + """
import importlib.util, shutil
def module(path):
    spec = importlib.util.spec_from_file_location(path.rsplit("/", 1)[-1][:-3], path)
    found = importlib.util.module_from_spec(spec); spec.loader.exec_module(found); return found
producer, script = module(ARGS["producer"]), module(ARGS["script"])
producer.register_flavor("llama3", json.load(open(ARGS["folder"] + "/config.json")))
shutil.rmtree(ARGS["dcp"], ignore_errors=True)
base = vm("VmRSS"); start = time.perf_counter()
script.convert_from_hf(ARGS["folder"], ARGS["dcp"], "llama3", producer.FLAVOR)
print(json.dumps({"seconds": time.perf_counter() - start, "peak": vm("VmHWM") - base}))
""",
}


def save(folder: Path, mib: int) -> tuple[int, int]:
    """Write the Hugging Face folder (bfloat16); returns its bytes and the float32 state dict's."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    per_layer = (2 * HIDDEN * HIDDEN + 2 * HIDDEN * HIDDEN * KV_HEADS // HEADS + 3 * HIDDEN * INTERMEDIATE) * 2
    layers = max(1, (mib * 2**20 - 2 * VOCAB * HIDDEN * 2) // per_layer)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=layers,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=4096,
                         rope_theta=500000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="100GB")
    elements = sum(t.numel() for t in model.state_dict().values())
    return elements * 2, elements * 4


def step(name: str, python: str, args: dict) -> dict:
    env = None if name != "native" else {**os.environ, "CKPTSHIM_DISABLE": "1"}
    run = subprocess.run([python, "-c", STEPS[name], json.dumps(args)], capture_output=True, text=True,
                         env=env, cwd=ROOT, check=False)
    if run.returncode != 0:
        raise SystemExit(f"{name} failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torchtitan-python", required=True)
    parser.add_argument("--convert-from-hf", required=True, type=Path)
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    options = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-hf-titan-") as tmp:
        folder, out = Path(tmp) / "hf", Path(tmp) / "dcp"
        file_bytes, state_bytes = save(folder, options.mib)
        print(f"Hugging Face folder {file_bytes / 2**20:.0f} MiB (bfloat16); torchtitan state dict "
              f"{state_bytes / 2**20:.0f} MiB (float32)")
        args = {"folder": str(folder), "dcp": str(out), "producer": str(PRODUCER),
                "script": str(options.convert_from_hf.resolve())}
        results: dict[str, list[dict]] = {"ckptshim": [], "convert_from_hf": [], "native": []}
        for _ in range(options.rounds):
            results["ckptshim"].append(step("ckptshim", sys.executable, args))
            results["convert_from_hf"].append(step("convert_from_hf", options.torchtitan_python, args))
            results["native"].append(step("native", sys.executable, args))
    if len({r["digest"] for r in results["ckptshim"] + results["native"]}) != 1:
        print("FAIL: ckptshim's load and the converter's differ")
        return 1
    median = {name: statistics.median(r["seconds"] for r in runs) for name, runs in results.items()}
    for name, runs in results.items():
        rounds = ", ".join(f"{r['seconds']:.2f}" for r in runs)
        peak = max(r["peak"] for r in runs)
        print(f"{name:16s} {median[name]:6.2f} s (rounds {rounds}); peak over before {peak / 2**20:6.0f} MiB "
              f"({peak / state_bytes:.2f} x the float32 state dict)")
    baseline = median["convert_from_hf"] + median["native"]
    print(f"ckptshim / convert_from_hf = {median['ckptshim'] / median['convert_from_hf']:.2f}; "
          f"ckptshim / (convert_from_hf + native load) = {median['ckptshim'] / baseline:.2f}; values equal")
    ok = median["ckptshim"] < median["convert_from_hf"] and \
        max(r["peak"] for r in results["ckptshim"]) <= max(r["peak"] for r in results["native"])
    print("OK" if ok else "MISSED the goal")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
