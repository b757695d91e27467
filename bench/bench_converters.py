"""Meta's original Llama layout and a Megatron-Core ``GPTModel`` checkpoint (~1 GiB each,
bfloat16) into ``LlamaForCausalLM``'s state dict: ckptshim's ``dcp.load`` of the folder against
what a user runs without it -- the family's own converter, then a load of what it wrote.

Both checkpoints are written by the fixtures' own producers (``tests/fixtures/meta_llama`` and
``tests/fixtures/megatron_llama``: ``produce.py``'s tensors and save paths, at larger widths), each
in its throwaway virtualenv as its docstring sets it up: ``--meta-python`` (transformers 4.46.3,
llama-models 0.3.0), ``--bridge-python`` (megatron-core 0.16.1, megatron-bridge 0.3.1,
transformers 4.57.6). Each step runs in a fresh subprocess:

- ``ckptshim``: ``dcp.load(LlamaForCausalLM state dict, checkpoint_id=folder)`` (for Megatron, the
  save root);
- Meta, ``convert``: transformers 4.46.3's ``convert_llama_weights_to_hf.write_model`` (the last
  release that ships it);
- Megatron: the producer writes a Hugging Face ``LlamaForCausalLM`` (``write_hf``) and Bridge
  imports it at TP 1 (``import_worker``), untimed. ``convert``: Megatron-Bridge's own
  ``AutoBridge.from_hf_pretrained(hf).export_ckpt(save_root, out)`` (the converter users run; it
  needs the original Hugging Face folder);
- ``load``: ``load_state_dict`` of what the converter wrote (every ``*.safetensors`` in the folder,
  ``load_file``), hooks off. For both families the bench checks that ckptshim's load and this one
  are equal bit for bit (a hash of every tensor's bytes).

Each prints its wall time and its peak resident memory (``VmHWM``, reset to the resident size
just before the step: what is counted is what the step adds; the loads' state dict is allocated
and touched before). Run: ``python bench/bench_converters.py --meta-python /tmp/meta33/bin/python
--bridge-python /tmp/bridge44/venv/bin/python [--mib 1024] [--rounds 3] [--family meta|megatron|both]``.
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
import os, pathlib, socket
sys.path[:0] = [ARGS["producer"]]
import produce
produce.HERE = pathlib.Path(ARGS["root"]).parent; produce.HF = pathlib.Path(ARGS["hf_source"])
produce.HF_CONFIG.update(ARGS["hf_config"])
produce.HERE.mkdir(parents=True)
with socket.socket() as free:
    free.bind(("127.0.0.1", 0)); port = free.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
produce.write_hf()
produce.import_worker(1)
print(json.dumps({}))
""",
    "convert_megatron": COMMON + """
import shutil
sys.path[:0] = [ARGS["producer"]]
import produce
torch, AutoBridge = produce.cpu_bridge()
shutil.rmtree(ARGS["hf"], ignore_errors=True)
base = reset_peak(); start = time.perf_counter()
AutoBridge.from_hf_pretrained(ARGS["hf_source"]).export_ckpt(ARGS["root"], ARGS["hf"], show_progress=False)
print(json.dumps({"seconds": time.perf_counter() - start, "peak": (status_kib("VmHWM") - base) * 1024}))
""",
    "load": COMMON + TARGET + """
from pathlib import Path
from safetensors.torch import load_file
files = sorted(Path(ARGS["hf"]).glob("*.safetensors"))
model, state = target(ARGS["hf_config"]); base = reset_peak(); start = time.perf_counter()
model.load_state_dict({key: value for file in files for key, value in load_file(file).items()})
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


def compare(family: str, convert: tuple[str, str], args: dict, checkpoint: str, rounds: int) -> None:
    """``rounds`` of ckptshim's load, the converter (``convert``: its step and its Python), and the
    load of what it wrote; the two loads must be equal bit for bit."""
    runs: dict[str, list[dict]] = {"ckptshim": [], "convert": [], "load": []}
    for _ in range(rounds):
        runs["ckptshim"].append(step("ckptshim", sys.executable, {**args, "checkpoint": checkpoint}))
        runs["convert"].append(step(*convert, args))
        runs["load"].append(step("load", sys.executable, args))
    if {r["digest"] for r in runs["ckptshim"] + runs["load"]} != {runs["load"][0]["digest"]}:
        raise SystemExit(f"{family}: ckptshim's load and the converter's differ")
    for name, found in runs.items():
        print(f"{family:8} {name:9} {statistics.median(r['seconds'] for r in found):7.2f} s (best "
              f"{min(r['seconds'] for r in found):.2f}), peak +{max(r['peak'] for r in found) / 2**20:.0f} MiB")
    print(f"load average: {os.getloadavg()[0]:.1f}; the two loads equal bit for bit")


def directory_gib(folder: str) -> float:
    return sum(path.stat().st_size for path in Path(folder).rglob("*") if path.is_file()) / 2**30


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--meta-python", help="Meta's producer venv (see the module docstring)")
    parser.add_argument("--bridge-python", help="Megatron-Bridge's producer venv (see the module docstring)")
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--family", choices=("meta", "megatron", "both"), default="both")
    options = parser.parse_args()
    families = ("meta", "megatron") if options.family == "both" else (options.family,)
    pythons = {"meta": ("--meta-python", options.meta_python), "megatron": ("--bridge-python", options.bridge_python)}
    missing = [flag for family, (flag, python) in pythons.items() if family in families and not python]
    if missing:
        parser.error(f"--family {options.family} needs {' and '.join(missing)}")
    per_layer = (2 * DIM * DIM + 2 * DIM * DIM * KV_HEADS // HEADS + 3 * DIM * FFN) * 2
    layers = max(1, (options.mib * 2**20 - 2 * VOCAB * DIM * 2) // per_layer)
    hf_config = {"hidden_size": DIM, "intermediate_size": FFN, "num_hidden_layers": layers,
                 "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": DIM // HEADS,
                 "vocab_size": VOCAB, "tie_word_embeddings": False}
    print(f"{layers} layers; load average {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory(prefix="bench-converters-") as tmp:
        if "meta" in families:
            args = {"producer": str(FIXTURES / "meta_llama"), "meta": f"{tmp}/meta", "hf": f"{tmp}/hf_meta",
                    "params": {"dim": DIM, "n_layers": layers, "n_heads": HEADS, "n_kv_heads": KV_HEADS,
                               "vocab_size": VOCAB, "multiple_of": MULTIPLE_OF},
                    "ffn": FFN, "vocab": VOCAB, "hf_config": hf_config}
            os.mkdir(args["meta"])
            print(f"Meta: {step('write', options.meta_python, args)['bytes'] / 2**30:.2f} GiB")
            compare("Meta", ("convert", options.meta_python), args, args["meta"], options.rounds)
        if "megatron" in families:
            args = {"producer": str(FIXTURES / "megatron_llama"), "hf_source": f"{tmp}/hf_source",
                    "root": f"{tmp}/megatron/tp1", "hf": f"{tmp}/hf_megatron", "hf_config": hf_config}
            step("write_megatron", options.bridge_python, args)
            print(f"Megatron: save root {directory_gib(args['root']):.2f} GiB")
            compare("Megatron", ("convert_megatron", options.bridge_python), args, args["root"], options.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
