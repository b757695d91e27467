"""A ~1 GiB Hugging Face Llama-style folder into a scanned MaxText target: ckptshim's restore of
the folder itself vs MaxText's converter plus Orbax's restore of its output.

The folder (bfloat16 ``model.safetensors`` and ``config.json``: hidden 2048, 16 heads of 128,
8 KV heads, MLP 5632, vocabulary 32000, 8 layers; seeded random values) is written once. Cases,
each in fresh subprocesses:

- ``to_maxtext`` (once; needs ``--maxtext-python``, a Python 3.12 venv with MaxText 0.2.5 as in
  ``tests/fixtures/hf_to_maxtext/produce.py``): ``maxtext.checkpoint_conversion.to_maxtext.main``
  on the folder, scanned, bfloat16, its model table pointed at the folder's config, its
  ``LazyTensor``\\ s all loaded (the conversion work), then the tree saved by Orbax's
  ``StandardCheckpointer`` (MaxText 0.2.5's own save needs a newer Orbax than that venv has).
  Without ``--maxtext-python`` the MaxText checkpoint is written by ckptshim's restore plus an
  Orbax save, and only the native restore of that pre-converted checkpoint is compared;
- ``native``: ckptshim disabled, ``StandardCheckpointer.restore`` of that MaxText checkpoint;
- ``shimmed``: ``StandardCheckpointer.restore(hf_folder, scanned target)`` through ckptshim.

Reported: median wall time, and peak RSS over the process baseline (``ru_maxrss`` at the end
minus RSS before the work, imports done), also as a multiple of the model's bytes. Every case's
arrays are checksummed and must agree. The machine is shared: figures move between runs.

Run: ``python bench/bench_hf_maxtext.py [--rounds 3] [--dir /tmp] [--maxtext-python /tmp/mtvenv/bin/python]``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
          "intermediate_size": 5632, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
          "num_hidden_layers": 8, "vocab_size": 32000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
          "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}, "tie_word_embeddings": False,
          "hidden_act": "silu", "dtype": "bfloat16"}
CASES = ("native", "shimmed")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _write(root: Path) -> None:
    """The Hugging Face folder, tensor by tensor (never the whole model in memory twice)."""
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    c = CONFIG
    e, i, v, d = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["head_dim"]
    shapes = {"model.embed_tokens.weight": (v, e), "model.norm.weight": (e,), "lm_head.weight": (v, e)}
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes.update({p + "input_layernorm.weight": (e,), p + "post_attention_layernorm.weight": (e,),
                       p + "self_attn.q_proj.weight": (c["num_attention_heads"] * d, e),
                       p + "self_attn.k_proj.weight": (c["num_key_value_heads"] * d, e),
                       p + "self_attn.v_proj.weight": (c["num_key_value_heads"] * d, e),
                       p + "self_attn.o_proj.weight": (e, c["num_attention_heads"] * d),
                       p + "mlp.gate_proj.weight": (i, e), p + "mlp.up_proj.weight": (i, e),
                       p + "mlp.down_proj.weight": (e, i)})
    rng = np.random.default_rng(0)
    tensors = {name: (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)
               for name, shape in shapes.items()}
    (root / "hf").mkdir()
    save_file(tensors, str(root / "hf" / "model.safetensors"), metadata={"format": "pt"})
    (root / "hf" / "config.json").write_text(json.dumps(CONFIG))


def _target(params_shapes: dict):
    import jax
    import ml_dtypes

    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(tuple(s), ml_dtypes.bfloat16, sharding=device),
                                  params_shapes, is_leaf=lambda s: isinstance(s, list))


def _shapes() -> dict:
    """MaxText's scanned Llama params, ``{"params": {"params": ...}}`` (shapes only)."""
    c = CONFIG
    e, i, v, d, n = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["head_dim"], c["num_hidden_layers"]
    h, kv = c["num_attention_heads"], c["num_key_value_heads"]
    layers = {"pre_self_attention_layer_norm": {"scale": [e, n]}, "post_self_attention_layer_norm": {"scale": [e, n]},
              "self_attention": {"query": {"kernel": [e, n, h, d]}, "key": {"kernel": [e, n, kv, d]},
                                 "value": {"kernel": [e, n, kv, d]}, "out": {"kernel": [h, n, d, e]}},
              "mlp": {"wi_0": {"kernel": [e, n, i]}, "wi_1": {"kernel": [e, n, i]}, "wo": {"kernel": [i, n, e]}}}
    return {"params": {"params": {"token_embedder": {"embedding": [v, e]},
                                  "decoder": {"decoder_norm": {"scale": [e]}, "logits_dense": {"kernel": [e, v]},
                                              "layers": layers}}}}


def _checksum(tree) -> list[float]:
    import jax
    import numpy as np

    return [float(np.asarray(leaf, dtype=np.float64).sum()) for leaf in jax.tree_util.tree_leaves(tree)]


def _measure(root: Path, case: str) -> dict:
    """One restore in this (fresh) process."""
    if case == "native":
        os.environ["CKPTSHIM_DISABLE"] = "1"
    import ckptshim  # noqa: F401
    import jax
    import orbax.checkpoint as ocp

    target = _target(_shapes())
    checkpointer = ocp.StandardCheckpointer()
    baseline = _rss_bytes()
    start = time.perf_counter()
    restored = checkpointer.restore(root / ("maxtext" if case == "native" else "hf"), target)
    jax.block_until_ready(restored)
    elapsed = time.perf_counter() - start
    leaves = jax.tree_util.tree_leaves(restored)
    return {"case": case, "seconds": elapsed, "peak_over_baseline": _peak() - baseline,
            "restored_bytes": sum(leaf.nbytes for leaf in leaves), "checksum": _checksum(restored)}


def _to_maxtext(root: Path) -> dict:
    """MaxText's converter on the folder (run by the MaxText venv's Python), then an Orbax save."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    import transformers

    jax.config.update("jax_platforms", "cpu")
    from maxtext.checkpoint_conversion import to_maxtext
    from maxtext.checkpoint_conversion.utils import hf_model_configs

    captured = {}
    to_maxtext.save_weights_to_checkpoint = lambda output, tree, *a, **k: captured.update(tree=tree)
    hf_model_configs.HF_MODEL_CONFIGS["llama3.1-8b"] = transformers.LlamaConfig.from_pretrained(root / "hf")
    c = CONFIG
    overrides = [f"base_emb_dim={c['hidden_size']}", f"base_num_query_heads={c['num_attention_heads']}",
                 f"base_num_kv_heads={c['num_key_value_heads']}", f"head_dim={c['head_dim']}",
                 f"base_mlp_dim={c['intermediate_size']}", f"base_num_decoder_layers={c['num_hidden_layers']}",
                 f"vocab_size={c['vocab_size']}"]
    baseline = _rss_bytes()
    start = time.perf_counter()
    to_maxtext.main(["to_maxtext", "model_name=llama3.1-8b", f"base_output_directory={root / 'unused'}",
                     "run_name=bench", "scan_layers=true", "hardware=cpu", "skip_jax_distributed_system=true",
                     "override_model_config=true", *overrides],
                    lazy_load_tensors=True, hf_model_path=str(root / "hf"), save_dtype="bfloat16",
                    simulated_cpu_devices_count=1)
    tree = jax.tree_util.tree_map(np.asarray, captured.pop("tree"))  # the LazyTensors' conversion work
    converted = time.perf_counter() - start
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(root / "maxtext", {"params": tree})
        checkpointer.wait_until_finished()
    return {"case": "to_maxtext", "seconds": time.perf_counter() - start, "convert_seconds": converted,
            "peak_over_baseline": _peak() - baseline, "checksum": _checksum({"params": tree})}


def _preconvert(root: Path) -> dict:
    """Without MaxText: the MaxText checkpoint written by ckptshim's restore and an Orbax save."""
    import ckptshim  # noqa: F401
    import orbax.checkpoint as ocp

    restored = ocp.StandardCheckpointer().restore(root / "hf", _target(_shapes()))
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(root / "maxtext", restored)
        checkpointer.wait_until_finished()
    return {"case": "preconverted", "checksum": _checksum(restored)}


def _run(python: str, *args: str) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([python, __file__, *args], check=True, env=env, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where to write the checkpoints")
    parser.add_argument("--maxtext-python", default=None, help="Python of a venv with MaxText 0.2.5")
    parser.add_argument("--step", nargs=2, metavar=("STEP", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.step:
        step, root = args.step[0], Path(args.step[1])
        steps = {"write": _write, "to_maxtext": _to_maxtext, "preconvert": _preconvert}
        print(json.dumps(steps[step](root) if step in steps else _measure(root, step)))
        return

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        subprocess.run([sys.executable, __file__, "--step", "write", tmp], check=True)
        model_bytes = (Path(tmp) / "hf" / "model.safetensors").stat().st_size
        if args.maxtext_python:
            converter = _run(args.maxtext_python, "--step", "to_maxtext", tmp)
        else:
            converter = _run(sys.executable, "--step", "preconvert", tmp)
        runs: dict[str, list[dict]] = {case: [] for case in CASES}
        for round_ in range(args.rounds):
            for case in CASES[round_ % 2:] + CASES[:round_ % 2]:
                runs[case].append(_run(sys.executable, "--step", case, tmp))
    checksums = {json.dumps(run["checksum"]) for case in CASES for run in runs[case]} | {json.dumps(converter["checksum"])}
    assert len(checksums) == 1, "the cases restored different values"
    report = {"model_GiB": round(model_bytes / 2**30, 3), "rounds": args.rounds}
    if "seconds" in converter:
        report["to_maxtext"] = {"seconds": round(converter["seconds"], 2),
                                "convert_seconds": round(converter["convert_seconds"], 2),
                                "peak_over_baseline_GiB": round(converter["peak_over_baseline"] / 2**30, 3),
                                "peak_over_model": round(converter["peak_over_baseline"] / model_bytes, 3)}
    for case in CASES:
        seconds = [run["seconds"] for run in runs[case]]
        peak = statistics.median(run["peak_over_baseline"] for run in runs[case])
        report[case] = {"seconds": round(statistics.median(seconds), 3),
                        "range": [round(min(seconds), 3), round(max(seconds), 3)],
                        "peak_over_baseline_GiB": round(peak / 2**30, 3), "peak_over_model": round(peak / model_bytes, 3)}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
