"""One data-parallel rank of DeepSpeed's real engine on CPU (gloo): train and save, or load and step.

Usage: ``python tests/workers/deepspeed_engine_worker.py JOBS.json RANK WORLD_SIZE PORT`` (with
``tests/`` on ``PYTHONPATH``; ``DS_ACCELERATOR=cpu``). ``JOBS.json`` lists ``{"mode", "stage",
"dtype", "dir", "out"}``, optionally with ``"frozen": true`` (the embedding frozen, as a frozen
embedding or a LoRA base is) and ``"sub_group_size"`` (ZeRO-3's); for each, a fresh engine of a
tiny model with odd sizes (every flat partition pads) under ZeRO ``stage``, Adam (torch's) and a
WarmupLR scheduler:

- ``save``: two training steps, then ``engine.save_checkpoint(dir, client_state={"epoch": 3})``;
- ``load``: ``engine.load_checkpoint(dir)``;

then, after the record below, ``steps_after`` (1 unless the job says) more training steps, every
rank on rank 0's batch: a resume's losses compare with the saving run's own.

Either way it writes ``out/<rank>.npz``: this rank's flat fp32 partitions and Adam moments as the
optimizer holds them (``fp32/<group>``, ``exp_avg/<group>``...), and on every rank each trainable
parameter's full fp32 master and moments as DeepSpeed's own ``safe_get_full_fp32_param`` /
``safe_get_full_optimizer_state`` gather them (``full/<state>/<name>``), each parameter's
training-dtype weight (``full/module/<name>``, gathered under ZeRO-3) and, under ZeRO-3, this
rank's own elements of each frozen parameter (``frozen/<name>``: its ``ds_tensor`` without the
padding). It prints one ``RESULT``
JSON line per job: what ``load_checkpoint`` returned or raised, the engine's step and learning
rate, Adam's ``step``, whether DeepSpeed's own ``_load_zero_checkpoint`` ran, how many bytes of
tensors ckptshim read from the saved files, and the losses of the steps after the load.
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


class TinyMoE(Tiny):
    """Tiny with a DeepSpeed MoE layer of two 13->13 experts (expert parallel size 1) after ``proj``."""

    def __init__(self) -> None:
        from deepspeed.moe.layer import MoE

        super().__init__()
        self.moe = MoE(hidden_size=13, expert=nn.Linear(13, 13), num_experts=2, ep_size=1, k=1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden, _, _ = self.moe(self.proj(self.embed(ids)))
        return self.out(torch.tanh(self.norm(hidden)))


def engine_for(job: dict) -> DeepSpeedEngine:
    """The job's engine. Besides ``stage`` and ``dtype`` (``fp32``, ``bf16``, ``fp16``: dynamic
    loss scaling from 2**16, growing every 2 steps without overflow), a job may ask
    for ``frozen`` (the embedding), ``sub_group_size`` (ZeRO-3), ``offload`` (the optimizer on
    the CPU, torch's Adam kept), ``accumulation`` (gradient accumulation steps), ``moe``,
    ``groups`` (two param groups: the matrices with weight decay 0.1, the rest without),
    ``universal`` (``checkpoint.load_universal``) or another ``seed`` for the initial weights."""
    torch.manual_seed(job.get("seed", 0))
    model = TinyMoE() if job.get("moe") else Tiny()
    model.embed.requires_grad_(not job.get("frozen"))
    parameters = list(model.parameters())
    if job.get("groups"):
        parameters = [{"params": [p for p in parameters if p.dim() > 1], "weight_decay": 0.1},
                      {"params": [p for p in parameters if p.dim() <= 1], "weight_decay": 0.0}]
    world, accumulation = int(WORLD_SIZE), job.get("accumulation", 1)
    zero = {"stage": job["stage"], **({"sub_group_size": job["sub_group_size"]} if "sub_group_size" in job else {})}
    if job.get("offload"):
        zero["offload_optimizer"] = {"device": "cpu"}
    config = {
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": accumulation,
        "train_batch_size": world * accumulation, "steps_per_print": 1000, "zero_force_ds_cpu_optimizer": False,
        "optimizer": {"type": "Adam", "params": {"lr": 0.05, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.05,
                                                      "warmup_num_steps": 10}},
        "zero_optimization": zero,
        "bf16": {"enabled": job["dtype"] == "bf16"},
        "fp16": {"enabled": job["dtype"] == "fp16", "initial_scale_power": 16, "loss_scale_window": 2},
        "checkpoint": {"load_universal": bool(job.get("universal"))},
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=parameters, config=config)
    return engine


def train_step(engine: DeepSpeedEngine, step: int, rank: int) -> float:
    """One optimizer step (its micro-batches under gradient accumulation) on batches of
    ``rank``'s (the steps after a load take rank 0's on every rank, so that their losses compare
    across world sizes); the first micro-batch's loss."""
    losses = []
    for micro in range(engine.gradient_accumulation_steps()):
        ids = torch.tensor([[(rank * 5 + step * 3 + micro * 7 + i) % 11 for i in range(6)]])
        loss = nn.functional.cross_entropy(engine(ids).float().reshape(-1, 11), ids.reshape(-1))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses[0]


def flat_groups(engine: DeepSpeedEngine) -> list[torch.Tensor]:
    optimizer = engine.optimizer
    if engine.zero_optimization_stage() == 3:
        return list(optimizer.fp32_partitioned_groups_flat)
    return list(optimizer.single_partition_of_fp32_groups)


def record(engine: DeepSpeedEngine, out: Path) -> dict:
    arrays: dict[str, np.ndarray] = {}
    for index, flat in enumerate(flat_groups(engine)):
        arrays[f"fp32/{index}"] = flat.detach().numpy().copy()
        state = engine.optimizer.optimizer.state[flat]
        for moment in MOMENTS:
            arrays[f"{moment}/{index}"] = state[moment].detach().numpy().copy()
    if engine.zero_optimization_stage() < 3:  # ZeRO-1/2 link the moments to the parameters at the first step
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    for name, param in engine.module.named_parameters():
        if not param.requires_grad or engine.has_moe_layers:  # no linked moments in MoE's expert groups
            continue
        arrays[f"full/fp32/{name}"] = safe_get_full_fp32_param(param).detach().numpy().copy()
        for moment in MOMENTS:
            arrays[f"full/{moment}/{name}"] = safe_get_full_optimizer_state(param, moment).detach().numpy().copy()
    zero3 = engine.zero_optimization_stage() == 3
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=zero3):
        for name, param in engine.module.named_parameters():  # the training-dtype weights, whole
            arrays[f"full/module/{name}"] = param.detach().float().numpy().copy()
    names = []
    if zero3:  # each parameter's piece per rank, in partition order (the sub-groups one after another)
        params = [p for group in engine.optimizer.fp16_groups for p in group]
        arrays["layout"] = np.array([[p.ds_numel, p.partition_numel()] for p in params])
        names = [engine.optimizer.param_names[p] for p in params]
        for name, param in engine.module.named_parameters():
            if not param.requires_grad:  # this rank's elements of it, without the padding
                valid = max(0, min(param.ds_numel - int(RANK) * param.partition_numel(), param.partition_numel()))
                arrays[f"frozen/{name}"] = param.ds_tensor[:valid].detach().float().numpy().copy()
    out.mkdir(parents=True, exist_ok=True)
    np.savez(out / f"{RANK}.npz", **arrays)
    scaler = {key: value for key, value in vars(engine.optimizer.loss_scaler).items()
              if type(value) in (bool, int, float)}
    return {"adam_step": adam_steps(engine), "global_steps": engine.global_steps, "lr": engine.get_lr()[0],
            "scheduler": engine.lr_scheduler.state_dict(), "names": names, "sub_groups": len(flat_groups(engine)),
            "loss_scaler": scaler, "overflow": bool(engine.optimizer.overflow), "skipped_steps": engine.skipped_steps,
            "micro_steps": engine.micro_steps, "param_groups": hyperparameters(engine)}


def hyperparameters(engine: DeepSpeedEngine) -> list[dict]:
    """The torch optimizer's param groups, without their parameters."""
    return [{key: value for key, value in group.items() if key != "params"}
            for group in engine.optimizer.optimizer.param_groups]


def adam_steps(engine: DeepSpeedEngine) -> list[float]:
    """Adam's ``step`` of each flat group (sub-group)."""
    return [float(engine.optimizer.optimizer.state[flat].get("step", 0)) for flat in flat_groups(engine)]


def run(job: dict, native_zero_loads: list, read: list) -> dict:
    loaded = {}
    try:
        engine = engine_for(job)
        if job["mode"] == "save":
            for step in range(2):
                train_step(engine, step, int(RANK))
            engine.save_checkpoint(job["dir"], client_state={"epoch": 3})
        else:
            before, read[0] = len(native_zero_loads), 0
            path, client = engine.load_checkpoint(job["dir"])
            loaded = {"load_path": path, "client_state": client, "bytes_read": read[0],
                      "native_zero_load": len(native_zero_loads) > before}
    except Exception as error:  # noqa: BLE001 -- the test asserts on it
        return {"error": type(error).__name__, "message": str(error), "notes": list(getattr(error, "__notes__", []))}
    result = {**record(engine, Path(job["out"])), **loaded}
    result["losses_after"] = [train_step(engine, 2 + step, 0) for step in range(job.get("steps_after", 1))]
    result["adam_step_after"] = adam_steps(engine)
    return result


def count_reads(read: list) -> None:
    """Count the bytes of tensors each resume reads from the saved files (``read[0]``): ckptshim
    reads a partition's elements with one ``pread`` per tensor they span (``Flat.copy``)."""
    from ckptshim.formats import deepspeed_zero

    own = deepspeed_zero.read_exact

    def counted(raw, buffer, offset, where):
        read[0] += len(buffer)
        return own(raw, buffer, offset, where)
    deepspeed_zero.read_exact = counted


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
