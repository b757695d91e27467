"""A Hugging Face folder of safetensors shards at ``s3://``/``gs://`` (local servers): ckptshim's
parallel byte-range reads against "download, then load".

One folder of a plain per-layer model (``layers.N.weight``, 2048 x 2048: 16 MiB each in float32,
8 MiB in bfloat16 with ``--dtype bfloat16``; ``--mib`` in all, plus a small bias per layer) is
written by ``huggingface_hub``'s ``save_torch_state_dict`` (shards of ``--shard-mib``; ``--weights bin``: ``torch.save`` shards,
``pytorch_model-*.bin``) locally, then uploaded to a bucket on each local server of the test
suite. Each case runs in a fresh subprocess, rounds interleaved:

- ``shimmed``: ``dcp.load(model.state_dict(), checkpoint_id=URL)`` with ``import ckptshim``: the
  shards' headers by byte ranges, then the tensors a window at a time, their ranges fetched in
  parallel straight into the parameters (DCP's own ``FsspecReader`` cannot read the folder);
- ``remapped``: the same load into ``torch.compile(model)``'s state dict (every key gains
  ``_orig_mod.``, which ckptshim maps back);
- ``download``: what a user does without ckptshim: fsspec ``get`` of the folder to a local one,
  then ``safetensors.torch.load_file`` (or ``torch.load(weights_only=True, mmap=True)``) of each
  shard and ``model.load_state_dict`` (hooks uninstalled);
- ``convert``: ``ckptshim convert URL out.safetensors --to safetensors`` (the CLI's ``main`` in
  process), to a local file: read ahead a window at a time, each tensor written as it comes.

Time is the step alone (the libraries imported, the fsspec client built and the model allocated
before it; ckptshim's own modules for the load are imported on its first call, inside), median
over rounds;
every case's tensors are checked bit for bit. Target: shimmed and remapped < download.
Run: ``python bench/bench_remote_safetensors.py [--mib 256] [--dtype float32|bfloat16] [--rounds 5] [--schemes s3 gs]
[--server emulator|fake-gcs] [--weights bin]``.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import remote_rounds

CASES = ("shimmed", "remapped", "download", "convert")
def worker(case: str, url: str, layers: int, dtype: str) -> dict:
    """One case in this process; one JSON line on stdout."""
    warnings.simplefilter("ignore")
    import ckptshim
    import fsspec
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    if case == "download":
        ckptshim.uninstall()
    fs, path = fsspec.core.url_to_fs(url)  # the client imported and built, for every case alike
    want = remote_rounds.layered_state(layers, dtype)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(torch.nn.Linear(remote_rounds.WIDTH, remote_rounds.WIDTH, device="meta",
                                                       dtype=getattr(torch, dtype)) for _ in range(layers))
    model.to_empty(device="cpu")
    target = (torch.compile(model) if case == "remapped" else model).state_dict()
    prefix = "_orig_mod." if case == "remapped" else ""
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        if case in ("shimmed", "remapped"):
            dcp.load(target, checkpoint_id=url, no_dist=True)
        elif case == "download":
            fs.get(path + "/", folder + "/", recursive=True)
            for shard in sorted(Path(folder).glob("*.safetensors")):
                model.load_state_dict(load_file(shard), strict=False)
            for shard in sorted(Path(folder).glob("*.bin")):
                model.load_state_dict(torch.load(shard, weights_only=True, mmap=True), strict=False)
        else:
            from ckptshim import cli

            cli.main(["convert", url, f"{folder}/out.safetensors", "--to", "safetensors", "--no-progress"])
        seconds = time.perf_counter() - start
        if case == "convert":
            target = load_file(f"{folder}/out.safetensors")
    assert all(torch.equal(target[prefix + key], value) for key, value in want.items()), "not bit-exact"
    return {"case": case, "seconds": seconds}


def main() -> int:
    parser = remote_rounds.arguments(__doc__, CASES, rounds=5)
    parser.add_argument("--shard-mib", type=int, default=64, help="shard size (default 64)")
    parser.add_argument("--weights", choices=("safetensors", "bin"), default="safetensors",
                        help="shards written as safetensors (default) or by torch.save")
    args = parser.parse_args()
    if remote_rounds.worked(args, worker):
        return 0
    layers = remote_rounds.layers_of(args.mib, args.dtype)

    def write(bucket: str, env: dict[str, str]) -> str:
        subprocess.run([sys.executable, "-c", _SAVE, bucket + "/model", str(layers), args.dtype, str(args.shard_mib),
                        args.weights, str(Path(__file__).resolve())], env=env, check=True)
        return f"{remote_rounds.described(layers, args.dtype)} in {args.weights} shards of {args.shard_mib} MiB"

    def argv(case: str, bucket: str) -> list[str]:
        return [sys.executable, __file__, "--case", case, "--url", bucket + "/model", "--mib", str(args.mib),
                "--dtype", args.dtype]

    passed = True
    for scheme in args.schemes:
        found = remote_rounds.medians(scheme, write, argv, args.cases, args.rounds, args.server)
        passed &= remote_rounds.ratio(scheme, found, "shimmed", "download", 1.0, strict=True)
        passed &= remote_rounds.ratio(scheme, found, "remapped", "download", 1.0, strict=True)
        remote_rounds.ratio(scheme, found, "convert", "download", 1.0, strict=True)
    return 0 if passed else 1


_SAVE = """
import sys, tempfile, warnings
warnings.simplefilter("ignore")
import os
sys.path.insert(0, os.path.dirname(sys.argv[-1]))  # the bench folder
import remote_rounds
import fsspec
from pathlib import Path
from huggingface_hub import save_torch_state_dict
with tempfile.TemporaryDirectory() as local:
    save_torch_state_dict(remote_rounds.layered_state(int(sys.argv[2]), sys.argv[3]), local,
                          max_shard_size=f"{sys.argv[4]}MB", safe_serialization=sys.argv[5] == "safetensors")
    fs, path = fsspec.core.url_to_fs(sys.argv[1])
    fs.put([str(f) for f in sorted(Path(local).iterdir())], path + "/")
"""

if __name__ == "__main__":
    sys.exit(main())
