"""Runs in a subprocess (DeepSpeed sets up torch.distributed): real ``PipelineModule.load_state_dir``.

Usage: ``python tests/workers/deepspeed_worker.py JOBS.json [RANK WORLD_SIZE PORT]`` (with ``tests/``
on ``PYTHONPATH``: it builds the layers with ``test_neox``'s own code), a list of ``{"source",
"tokens", "out", "options"}``: for each, builds GPT-NeoX's pipeline layers as a real DeepSpeed
``PipelineModule`` (one stage, gloo, tensor-parallel over WORLD_SIZE processes), loads ``source``
through ``load_state_dir(strict=True)`` and saves to ``out`` the logits of NeoX's forward on
``tokens`` (.npy) at degree 1, or this rank's layer tensors (.npz, ``"<index>|<name>"``) at a
higher degree. Prints one JSON line: per job, whether ckptshim built the layers' state dicts
(``shimmed``) or DeepSpeed loaded natively, or the error.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

RANK, WORLD_SIZE, PORT = (sys.argv[2:5] if len(sys.argv) > 2 else ("0", "1", "29517"))
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=PORT, RANK=RANK, WORLD_SIZE=WORLD_SIZE, LOCAL_RANK=RANK)

import ckptshim  # noqa: E402,F401
import ckptshim.loading.deepspeed as shim  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from deepspeed.pipe import PipelineModule  # noqa: E402
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine  # noqa: E402
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology  # noqa: E402

from support.deepspeed_cpu import init_distributed_on_gloo  # noqa: E402
from test_neox import NeoXSequential, Stateless, neox_layers  # noqa: E402


def _load(job: dict, calls: list) -> dict:
    degree = int(WORLD_SIZE)
    layers = neox_layers(tp=degree, **job["options"])
    functions = [(lambda x: x) if isinstance(layer, Stateless) else layer for layer in layers.values()]
    topology = PipeModelDataParallelTopology(num_pp=1, num_mp=degree, num_dp=1)
    module = PipelineModule(layers=functions, topology=topology, partition_method="uniform")
    before = len(calls)
    try:
        module.load_state_dir(job["source"], checkpoint_engine=TorchCheckpointEngine(), strict=True)
    except ckptshim.ShimError as error:
        return {"error": str(error)}
    if degree > 1:
        np.savez(job["out"], **{f"{index}|{name}": value.numpy() for index, layer in layers.items()
                                for name, value in layer.state_dict().items()})
        return {"shimmed": len(calls) > before}
    model = NeoXSequential(**job["options"]).eval()
    for index, layer in layers.items():
        model.sequential[index].load_state_dict(layer.state_dict())
    with torch.no_grad():
        np.save(job["out"], model(torch.from_numpy(np.load(job["tokens"]))).numpy())
    return {"shimmed": len(calls) > before}


def main() -> None:
    jobs = json.loads(Path(sys.argv[1]).read_text())
    init_distributed_on_gloo(verbose=False)
    calls: list = []
    real = shim.layer_state_dicts
    shim.layer_state_dicts = lambda *a, **k: calls.append(1) or real(*a, **k)
    patched = type(vars(PipelineModule)["load_state_dir"]).__name__ == "FunctionWrapper"
    print("RESULT " + json.dumps({"patched": patched, "jobs": [_load(job, calls) for job in jobs]}))


if __name__ == "__main__":
    main()
