"""``dcp.load`` from ``s3://`` and ``gs://`` (local servers): ckptshim's remote reader against DCP's own.

One DCP checkpoint of a plain per-layer model (``layers.N.weight``, 2048 x 2048: 16 MiB each in
float32, 8 MiB in bfloat16 with ``--dtype bfloat16``; ``--mib`` in all, plus as many small bias
vectors) is written with ``dcp.save`` to a bucket on each local server of the test suite
(moto's S3 server, the GCS emulator of ``tests/support/gcs_emulator.py``). Each case then runs in a fresh subprocess, rounds interleaved:

- ``native``: DCP's own remote load (hooks uninstalled, its ``FsspecReader``) into the plain
  model: the framework's remote restore of the same bytes;
- ``matching``: the same load with the hooks on (nothing to remap: ckptshim reads the metadata,
  torch's ``FsspecReader`` the chunks);
- ``shimmed``: the load into ``torch.compile(model)`` (every key remapped), read by ckptshim's
  remote reader (byte ranges in parallel, straight into the parameters);
- ``download``: what a user does without a remote reader: fetch the checkpoint to a local folder
  with fsspec (``get``), then ``dcp.load`` it there into the compiled model through ckptshim.

Time is per process (one load call each, after the imports and the fsspec client built),
median over rounds. Targets:
shimmed/native and matching/native <= 1.1; shimmed < download. Every load is checked bit-exactly.
The servers are single processes on this machine: the figures measure the clients' request
handling as much as the bytes, so compare ratios within one run only, and say the load average.
Run: ``python bench/bench_remote_dcp.py [--mib 256] [--dtype float32|bfloat16] [--rounds 3] [--schemes s3 gs]
[--server emulator|fake-gcs]``.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import remote_rounds

CASES = ("native", "matching", "shimmed", "download")
def worker(case: str, url: str, layers: int, dtype: str) -> dict:
    """One case in this process; one JSON line on stdout."""
    warnings.simplefilter("ignore")
    import ckptshim
    import fsspec
    import torch
    import torch.distributed.checkpoint as dcp

    if case == "native":
        ckptshim.uninstall()
    fs, path = fsspec.core.url_to_fs(url)  # the client imported and built, for every case alike
    want = remote_rounds.layered_state(layers, dtype)
    prefix = "" if case in ("native", "matching") else "_orig_mod."
    target = {prefix + key: torch.zeros_like(value) for key, value in want.items()}
    start = time.perf_counter()
    if case == "download":
        with tempfile.TemporaryDirectory() as folder:
            fs.get(path + "/", folder + "/", recursive=True)
            dcp.load(target, checkpoint_id=folder)
    else:
        dcp.load(target, checkpoint_id=url)
    seconds = time.perf_counter() - start
    assert all(torch.equal(target[prefix + key], value) for key, value in want.items()), "not bit-exact"
    return {"case": case, "seconds": seconds}


def main() -> int:
    parser = remote_rounds.arguments(__doc__, CASES, rounds=3)
    args = parser.parse_args()
    if remote_rounds.worked(args, worker):
        return 0
    layers = remote_rounds.layers_of(args.mib, args.dtype)

    def write(bucket: str, env: dict[str, str]) -> str:
        subprocess.run([sys.executable, "-c", _SAVE, bucket + "/checkpoint", str(layers), args.dtype,
                        str(Path(__file__).resolve())], env=env, check=True)
        return remote_rounds.described(layers, args.dtype)

    def argv(case: str, bucket: str) -> list[str]:
        return [sys.executable, __file__, "--case", case, "--url", bucket + "/checkpoint", "--mib", str(args.mib),
                "--dtype", args.dtype]

    passed = True
    for scheme in args.schemes:
        found = remote_rounds.medians(scheme, write, argv, args.cases, args.rounds, args.server)
        passed &= remote_rounds.ratio(scheme, found, "matching", "native", 1.1)
        passed &= remote_rounds.ratio(scheme, found, "shimmed", "native", 1.1)
        passed &= remote_rounds.ratio(scheme, found, "shimmed", "download", 1.0, strict=True)
    return 0 if passed else 1


_SAVE = """
import sys, warnings
warnings.simplefilter("ignore")
import os
sys.path.insert(0, os.path.dirname(sys.argv[-1]))  # the bench folder
import remote_rounds
import torch.distributed.checkpoint as dcp
dcp.save(remote_rounds.layered_state(int(sys.argv[2]), sys.argv[3]), checkpoint_id=sys.argv[1])
"""

if __name__ == "__main__":
    sys.exit(main())
