"""ZeRO resumes at another world size under the engine options training runs use, in DeepSpeed's
real engine on CPU: the optimizer offloaded to the CPU (ZeRO-2 and 3), gradient accumulation,
fp16 with its dynamic loss scaler, and MoE layers.

One module-scoped run saves every variant at 2 ranks (``tests/workers/deepspeed_engine_worker.py``)
and one resumes them all at 3; each test reads its variant's records. A resume must hold the saved
state re-cut for 3 ranks, bit for bit, read only its own elements, and continue with the saving
run's own losses (the first bit for bit, the second as ``AVERAGING`` says); where ckptshim
cannot re-cut (MoE), DeepSpeed's own error is raised with ckptshim's reason as a note.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from support.processes import run_ranks
from support.zero_partitions import AVERAGING, STATES, assert_recut, records

pytest.importorskip("deepspeed")

WORKER = "deepspeed_engine_worker.py"
ENV = {"DS_ACCELERATOR": "cpu"}
SAVED_WORLD, WORLD = 2, 3
VARIANTS = {
    "offload_zero2": {"stage": 2, "dtype": "fp32", "offload": True},
    "offload_zero3": {"stage": 3, "dtype": "fp32", "offload": True},
    "accumulation_zero2": {"stage": 2, "dtype": "fp32", "accumulation": 2},
    "accumulation_zero3": {"stage": 3, "dtype": "bf16", "accumulation": 2},
    "fp16_zero2": {"stage": 2, "dtype": "fp16"},
    "fp16_zero3": {"stage": 3, "dtype": "fp16"},
    "moe_zero2": {"stage": 2, "dtype": "fp32", "moe": True},
}
FP16_REFUSED = "Type fp16 is not supported on your device."


def _jobs(mode: str, source: Path, out: Path) -> list[dict]:
    return [{**job, "mode": mode, "steps_after": 2, "dir": str(source / name), "out": str(out / name)}
            for name, job in VARIANTS.items()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[list[dict], list[dict], Path]]:
    """Variant -> (each saving rank's record, each resuming rank's record, the folder of both)."""
    root = tmp_path_factory.mktemp("configs")
    saved = run_ranks(WORKER, _jobs("save", root, root / "saved"), SAVED_WORLD, root / "save", ENV)
    loaded = run_ranks(WORKER, _jobs("load", root, root / "loaded"), WORLD, root / "load", ENV)
    return {name: ([rank[index] for rank in saved], [rank[index] for rank in loaded], root)
            for index, name in enumerate(VARIANTS)}


def _assert_resumed(runs: dict, name: str) -> tuple[dict, list[dict]]:
    """The resume of variant ``name`` holds the saved state re-cut, bit for bit, read only its own
    elements, and continues with the saving run's losses."""
    saved, loaded, root = runs[name]
    assert "error" not in saved[0], saved[0]
    before, after = records(root / "saved" / name, SAVED_WORLD), records(root / "loaded" / name, WORLD)
    for rank, (result, partitions) in enumerate(zip(loaded, after)):
        assert "error" not in result, result
        assert result["native_zero_load"] is False
        assert result["global_steps"] == saved[0]["global_steps"] == 2
        assert set(result["adam_step"]) == set(saved[0]["adam_step"])
        assert result["scheduler"] == saved[0]["scheduler"] and result["client_state"]["epoch"] == 3
        held = sum(len(part) for state in STATES for key, part in partitions.items() if key.startswith(f"{state}/"))
        assert 0 < result["bytes_read"] <= 4 * held, rank  # its own partition's elements, no more
        assert result["losses_after"][0] == saved[0]["losses_after"][0]
        assert result["losses_after"][1] == pytest.approx(saved[0]["losses_after"][1],
                                                          rel=AVERAGING[VARIANTS[name]["dtype"]])
    assert_recut(before, after, VARIANTS[name]["stage"], loaded[0]["names"])
    return saved[0], loaded


@pytest.mark.parametrize("stage", [2, 3])
def test_offloaded_optimizer_resumes(runs: dict, stage: int) -> None:
    """``offload_optimizer: {device: cpu}``: the fp32 partitions and moments live on the CPU
    (torch's Adam, ``zero_force_ds_cpu_optimizer: false``: DeepSpeedCPUAdam is a JIT-built op)."""
    _assert_resumed(runs, f"offload_zero{stage}")


@pytest.mark.parametrize("stage", [2, 3])
def test_gradient_accumulation_resumes(runs: dict, stage: int) -> None:
    """Two micro-batches per step (ZeRO-3 in bf16): the engine's counters are per optimizer step."""
    saved, loaded = _assert_resumed(runs, f"accumulation_zero{stage}")
    assert saved["micro_steps"] == 4 and all(result["micro_steps"] == 0 for result in loaded)  # DeepSpeed saves none


@pytest.mark.parametrize("stage", [2, 3])
def test_fp16_dynamic_loss_scaler_survives_the_recut(runs: dict, stage: int) -> None:
    """Dynamic loss scaling (from 2**16, growing every 2 steps): the scale, its growth tracker
    (``cur_iter``, ``last_overflow_iter``...), the overflow flag and the skipped steps come back
    as saved. DeepSpeed's CPU accelerator refuses fp16 where the CPU lacks
    oneDNN's fp16 support (``torch.ops.mkldnn._is_mkldnn_fp16_supported()``): there the test
    shows DeepSpeed's own refusal and stops."""
    import torch

    saved, loaded, _ = runs[f"fp16_zero{stage}"]
    if "error" in saved[0]:
        assert not torch.ops.mkldnn._is_mkldnn_fp16_supported()
        assert (saved[0]["error"], saved[0]["message"]) == ("ValueError", FP16_REFUSED)
        assert all((result["error"], result["message"]) == ("ValueError", FP16_REFUSED) for result in loaded)
        pytest.skip(f"DeepSpeed on this CPU: ValueError: {FP16_REFUSED} (deepspeed.initialize, fp16 enabled)")
    _, loaded = _assert_resumed(runs, f"fp16_zero{stage}")
    assert saved[0]["loss_scaler"]["cur_iter"] == 2  # the scaler moved
    for result in loaded:
        assert result["loss_scaler"] == saved[0]["loss_scaler"]
        assert (result["overflow"], result["skipped_steps"]) == (saved[0]["overflow"], saved[0]["skipped_steps"])


def test_moe_layers_get_deepspeeds_own_error_with_a_note(runs: dict) -> None:
    """An engine with MoE layers (expert parameters in their own groups and files): ckptshim does
    not re-cut, so DeepSpeed's own load runs and refuses; ckptshim's reason is a note on it."""
    saved, loaded, _ = runs["moe_zero2"]
    assert "error" not in saved[0], saved[0]
    for result in loaded:
        assert result["error"] == "ZeRORuntimeException"
        assert result["message"].startswith("The checkpoint being loaded used a DP world size of 2 but the "
                                            "current world size is 3.")
        assert any("MoE layers" in note for note in result["notes"]), result["notes"]
