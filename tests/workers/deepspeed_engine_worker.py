"""One data-parallel rank of DeepSpeed's real engine on CPU (gloo): train and save, or load and step.

Usage: ``python tests/workers/deepspeed_engine_worker.py JOBS.json RANK WORLD_SIZE PORT`` (with
``tests/`` on ``PYTHONPATH``; ``DS_ACCELERATOR=cpu``). ``JOBS.json`` lists ``{"mode", "stage",
"dtype", "dir", "out"}``; for each, a fresh engine of a tiny model with odd sizes (every flat
partition pads) under ZeRO ``stage``, Adam (torch's) and a WarmupLR scheduler:

- ``save``: two training steps, then ``engine.save_checkpoint(dir, client_state={"epoch": 3})``;
- ``load``: ``engine.load_checkpoint(dir)``, then one more training step.

Either way it writes ``out/<rank>.npz``: this rank's flat fp32 partitions and Adam moments as the
optimizer holds them (``fp32/<group>``, ``exp_avg/<group>``...), and on every rank each trainable
parameter's full fp32 master and moments as DeepSpeed's own ``safe_get_full_fp32_param`` /
``safe_get_full_optimizer_state`` gather them (``full/<state>/<name>``) and its training-dtype
weight (``full/module/<name>``, gathered under ZeRO-3). It prints one ``RESULT``
JSON line per job: what ``load_checkpoint`` returned or raised, the engine's step and learning
rate, Adam's ``step``, whether DeepSpeed's own ``_load_zero_checkpoint`` ran, how many elements
ckptshim read from the saved partitions, and the loss of the step after the load.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

RANK, WORLD_SIZE, PORT = sys.argv[2:5]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=PORT, RANK=RANK, WORLD_SIZE=WORLD_SIZE, LOCAL_RANK=RANK)

import ckptshim  # noqa: E402,F401
import deepspeed  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from deepspeed.runtime.engine import DeepSpeedEngine  # noqa: E402
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state  # noqa: E402
from torch import nn  # noqa: E402

from support.deepspeed_cpu import init_distributed_on_gloo  # noqa: E402

MOMENTS = ("exp_avg", "exp_avg_sq")


class Tiny(nn.Module):
    """361 trainable elements in odd sizes: 11x7 embedding, 7->13, a 13-wide norm, 13->11."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 7)
        self.proj = nn.Linear(7, 13)
        self.norm = nn.LayerNorm(13)
        self.out = nn.Linear(13, 11)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.norm(self.proj(self.embed(ids)))))


def engine_for(job: dict) -> DeepSpeedEngine:
    torch.manual_seed(0)
    model = Tiny()
    world = int(WORLD_SIZE)
    config = {
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": world,
        "steps_per_print": 1000,
        "optimizer": {"type": "Adam", "params": {"lr": 0.05, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.05,
                                                      "warmup_num_steps": 10}},
        "zero_optimization": {"stage": job["stage"]},
        "bf16": {"enabled": job["dtype"] == "bf16"},
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def train_step(engine: DeepSpeedEngine, step: int) -> float:
    ids = torch.tensor([[(int(RANK) * 5 + step * 3 + i) % 11 for i in range(6)]])
    loss = nn.functional.cross_entropy(engine(ids).float().reshape(-1, 11), ids.reshape(-1))
    engine.backward(loss)
    engine.step()
    return loss.item()


def flat_groups(engine: DeepSpeedEngine) -> list[torch.Tensor]:
    optimizer = engine.optimizer
    if engine.zero_optimization_stage() == 3:
        return list(optimizer.fp32_partitioned_groups_flat)
    return list(optimizer.single_partition_of_fp32_groups)


def record(engine: DeepSpeedEngine, out: Path) -> dict:
    arrays: dict[str, np.ndarray] = {}
    steps = []
    for index, flat in enumerate(flat_groups(engine)):
        arrays[f"fp32/{index}"] = flat.detach().numpy().copy()
        state = engine.optimizer.optimizer.state[flat]
        for moment in MOMENTS:
            arrays[f"{moment}/{index}"] = state[moment].detach().numpy().copy()
        steps.append(float(state["step"]))
    if engine.zero_optimization_stage() < 3:  # ZeRO-1/2 link the moments to the parameters at the first step
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    for name, param in engine.module.named_parameters():
        arrays[f"full/fp32/{name}"] = safe_get_full_fp32_param(param).detach().numpy().copy()
        for moment in MOMENTS:
            arrays[f"full/{moment}/{name}"] = safe_get_full_optimizer_state(param, moment).detach().numpy().copy()
    zero3 = engine.zero_optimization_stage() == 3
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=zero3):
        for name, param in engine.module.named_parameters():  # the training-dtype weights, whole
            arrays[f"full/module/{name}"] = param.detach().float().numpy().copy()
    if zero3:  # each parameter's piece per rank, in partition order
        arrays["layout"] = np.array([[p.ds_numel, p.partition_numel()] for p in engine.optimizer.fp16_groups[0]])
        names = [engine.optimizer.param_names[p] for p in engine.optimizer.fp16_groups[0]]
    else:
        names = []
    out.mkdir(parents=True, exist_ok=True)
    np.savez(out / f"{RANK}.npz", **arrays)
    return {"adam_step": steps, "global_steps": engine.global_steps, "lr": engine.get_lr()[0],
            "scheduler": engine.lr_scheduler.state_dict(), "names": names}


def run(job: dict, native_zero_loads: list, read: list) -> dict:
    engine = engine_for(job)
    if job["mode"] == "save":
        for step in range(2):
            train_step(engine, step)
        engine.save_checkpoint(job["dir"], client_state={"epoch": 3})
        return record(engine, Path(job["out"]))
    before, read[0] = len(native_zero_loads), 0
    try:
        path, client = engine.load_checkpoint(job["dir"])
    except Exception as error:  # noqa: BLE001 -- the test asserts on it
        return {"error": type(error).__name__, "message": str(error),
                "notes": list(getattr(error, "__notes__", []))}
    result = record(engine, Path(job["out"]))
    result.update(load_path=path, client_state=client, native_zero_load=len(native_zero_loads) > before,
                  elements_read=read[0],
                  loss_after=train_step(engine, 2))
    return result


def count_reads(read: list) -> None:
    """Count the elements each resume reads from the saved partitions (``read[0]``)."""
    from ckptshim.formats.deepspeed_zero import ZeroCheckpoint

    own = ZeroCheckpoint.read_elements

    def counted(self, name, state, start, stop):
        read[0] += stop - start
        return own(self, name, state, start, stop)
    ZeroCheckpoint.read_elements = counted


def main() -> None:
    jobs = json.loads(Path(sys.argv[1]).read_text())
    init_distributed_on_gloo(verbose=False)
    read = [0]
    count_reads(read)
    native_zero_loads: list = []
    own = DeepSpeedEngine._load_zero_checkpoint  # DeepSpeed's own ZeRO step, spied on at the class
    DeepSpeedEngine._load_zero_checkpoint = lambda *a, **k: native_zero_loads.append(1) or own(*a, **k)
    print("RESULT " + json.dumps([run(job, native_zero_loads, read) for job in jobs], default=str))


if __name__ == "__main__":
    main()
