"""One process of a Hugging Face Trainer run under DeepSpeed on CPU (gloo): train and checkpoint, or resume.

Usage: ``python tests/workers/hf_trainer_deepspeed_worker.py JOBS.json RANK WORLD_SIZE PORT``
(with ``tests/`` on ``PYTHONPATH``; ``DS_ACCELERATOR=cpu``). ``JOBS.json`` lists ``{"stage",
"output_dir", "resume"}``; for each, ``Trainer(model, args=TrainingArguments(deepspeed=config),
train_dataset=...)`` of a one-layer GPT-2 with odd sizes under ZeRO ``stage``, a global batch of
6 sequences whatever the world size (``6 // WORLD_SIZE`` per process), taken in order. Accelerate
finds no accelerator's backend on a CPU, so the Trainer uses a ``PartialState`` configured here
(``accelerator_config={"use_configured_state": True}``) on the gloo group:

- ``resume`` null: ``trainer.train()`` for 2 steps, checkpointing at step 2 (``output_dir/checkpoint-2``);
- ``resume`` a checkpoint: ``trainer.train(resume_from_checkpoint=resume)`` up to step 5, saving nothing.

It prints one ``RESULT`` JSON line: per job, the losses the Trainer logged (each step's, gathered
over the processes), the global step, and whether ckptshim re-cut the ZeRO partitions.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

RANK, WORLD_SIZE, PORT = sys.argv[2:5]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=PORT, RANK=RANK, WORLD_SIZE=WORLD_SIZE, LOCAL_RANK=RANK,
                  LOCAL_WORLD_SIZE=WORLD_SIZE, ACCELERATE_USE_DEEPSPEED="true")

import ckptshim  # noqa: E402,F401
import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

from support.deepspeed_cpu import init_distributed_on_gloo  # noqa: E402

GLOBAL_BATCH = 6


class Recut(logging.Handler):
    """Counts ckptshim's INFO line of a re-cut ZeRO load."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += "re-cut for" in record.getMessage()


def dataset() -> list[dict]:
    """24 sequences of 8 tokens (vocabulary 11), each its own labels."""
    return [{"input_ids": (ids := torch.tensor([(seq * 5 + i * 3) % 11 for i in range(8)])), "labels": ids}
            for seq in range(24)]


def config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto", "gradient_clipping": "auto", "steps_per_print": 1000,
        "optimizer": {"type": "Adam", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto"}},
        "zero_optimization": {"stage": stage},
    }


def run(job: dict, recut: Recut) -> dict:
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()  # each job's Trainer its own Accelerator (and DeepSpeed plugin)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=11, n_positions=8, n_embd=6, n_layer=1, n_head=2,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                       bos_token_id=None, eos_token_id=None))
    args = TrainingArguments(
        output_dir=job["output_dir"], deepspeed=config(job["stage"]), max_steps=2 if job["resume"] is None else 5,
        per_device_train_batch_size=GLOBAL_BATCH // int(WORLD_SIZE), learning_rate=0.05, warmup_steps=10,
        logging_steps=1,
        save_steps=2, save_strategy="steps" if job["resume"] is None else "no", report_to=[], seed=0, data_seed=0,
        train_sampling_strategy="sequential", dataloader_num_workers=0, disable_tqdm=True,
        accelerator_config={"use_configured_state": True})
    trainer = Trainer(model=model, args=args, train_dataset=dataset())
    before = recut.count
    trainer.train(resume_from_checkpoint=job["resume"])
    losses = {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}
    return {"losses": losses, "global_step": trainer.state.global_step, "recut": recut.count > before}


def main() -> None:
    from accelerate import PartialState

    jobs = json.loads(Path(sys.argv[1]).read_text())
    init_distributed_on_gloo(verbose=False)
    PartialState(backend="gloo")  # DeepSpeed's (ACCELERATE_USE_DEEPSPEED) on the gloo group: the Trainer's state
    recut = Recut()
    logging.getLogger("ckptshim").addHandler(recut)
    logging.getLogger("ckptshim").setLevel(logging.INFO)
    print("RESULT " + json.dumps([run(job, recut) for job in jobs]))


if __name__ == "__main__":
    main()
