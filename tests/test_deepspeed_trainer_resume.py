"""The Hugging Face Trainer's own resume under DeepSpeed ZeRO at another number of processes.

``Trainer(model, args=TrainingArguments(deepspeed=config)).train(resume_from_checkpoint=dir)``
calls ``DeepSpeedEngine.load_checkpoint`` (``deepspeed_load_checkpoint``), which refuses a ZeRO
checkpoint of another data-parallel size. Here a one-layer GPT-2 is trained for 2 steps and
checkpointed by the Trainer at 2 processes (CPU, gloo; ``tests/workers/hf_trainer_deepspeed_worker.py``),
then resumed up to step 5 at 2 processes (DeepSpeed's own load) and at 3 (ckptshim's re-cut),
with the same global batch of 6 sequences taken in order. The losses the Trainer logs after the
resume at 3 must be those of the resume at 2: equal up to the rounding of a sum over 2 or 3
processes (the per-process losses and gradients are averaged in another order).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from support.processes import run_ranks

pytest.importorskip("deepspeed")
pytest.importorskip("accelerate")

WORKER = "hf_trainer_deepspeed_worker.py"
ENV = {"DS_ACCELERATOR": "cpu"}
STAGES = (2, 3)
SAVED_WORLD, WORLD = 2, 3


@pytest.fixture(scope="module")
def resumes(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[list[dict]]]:
    """World size -> each process's result per ZeRO stage, resuming the checkpoints of 2 processes."""
    root = tmp_path_factory.mktemp("trainer")
    run_ranks(WORKER, [{"stage": stage, "output_dir": str(root / f"zero{stage}"), "resume": None} for stage in STAGES],
              SAVED_WORLD, root / "save", ENV, timeout=600)
    return {world: run_ranks(WORKER, [{"stage": stage, "output_dir": str(root / f"resumed{world}_zero{stage}"),
                                       "resume": str(root / f"zero{stage}" / "checkpoint-2")} for stage in STAGES],
                             world, root / f"resume{world}", ENV, timeout=600)
            for world in (SAVED_WORLD, WORLD)}


@pytest.mark.parametrize("stage", STAGES)
def test_trainer_resumes_at_another_number_of_processes(resumes: dict, stage: int) -> None:
    index = STAGES.index(stage)
    same, other = resumes[SAVED_WORLD], resumes[WORLD]
    assert all(rank[index]["recut"] is False for rank in same)  # DeepSpeed's own load
    assert all(rank[index]["recut"] is True for rank in other)
    expected = _after_resume(same[0][index]["losses"])
    assert sorted(expected) == [3, 4, 5] and same[0][index]["global_step"] == 5
    for rank in other:
        assert rank[index]["global_step"] == 5
        assert _after_resume(rank[index]["losses"]) == pytest.approx(expected, rel=1e-6)


def _after_resume(losses: dict[str, float]) -> dict[int, float]:
    """The losses logged after the resume at step 2 (the log history goes on from the checkpoint's)."""
    return {int(step): loss for step, loss in losses.items() if int(step) > 2}
