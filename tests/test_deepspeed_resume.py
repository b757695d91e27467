"""A ZeRO checkpoint of N data-parallel ranks resumes in DeepSpeed's real engine at M ranks.

Every checkpoint here is written by ``engine.save_checkpoint`` of DeepSpeed's real engine on CPU
(gloo, one process per rank: ``tests/workers/deepspeed_engine_worker.py``), after two Adam
steps of a tiny model with odd sizes, and loaded by ``engine.load_checkpoint`` in a fresh
engine of another world size. After the load every rank's flat fp32 partition and Adam moments
must be the saved ones re-cut for M ranks, bit for bit, and a further step must run.
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from support.processes import run_ranks
from support.zero_partitions import STATES, assert_recut, records

pytest.importorskip("deepspeed")

WORKER = "deepspeed_engine_worker.py"
ENV = {"DS_ACCELERATOR": "cpu"}
#: (ZeRO stage, training dtype) of the checkpoints saved by 2 ranks.
FROM_TWO = ((1, "fp32"), (2, "fp32"), (3, "fp32"), (2, "bf16"), (3, "bf16"))
#: ... and by 1 rank.
FROM_ONE = ((1, "fp32"), (2, "fp32"), (3, "fp32"))


def _name(stage: int, dtype: str) -> str:
    return f"zero{stage}_{dtype}"


def _save(root: Path, world: int, variants: tuple) -> dict:
    jobs = [{"mode": "save", "stage": stage, "dtype": dtype, "dir": str(root / _name(stage, dtype)),
             "out": str(root / "saved" / _name(stage, dtype))} for stage, dtype in variants]
    results = run_ranks(WORKER, jobs, world, root, ENV)
    return {_name(stage, dtype): results[0][index] for index, (stage, dtype) in enumerate(variants)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[Path, dict]]:
    """World size -> (folder of its save dirs, what the saving ranks recorded per variant)."""
    out = {}
    for world, variants in ((2, FROM_TWO), (1, FROM_ONE)):
        root = tmp_path_factory.mktemp(f"saved_by_{world}")
        out[world] = (root, _save(root, world, variants))
    return out


def _load(source: Path, target: Path, world: int, variants: tuple) -> list[list[dict]]:
    jobs = [{"mode": "load", "stage": stage, "dtype": dtype, "dir": str(source / _name(stage, dtype)),
             "out": str(target / _name(stage, dtype))} for stage, dtype in variants]
    return run_ranks(WORKER, jobs, world, target, ENV)


def _check(saved: dict, saved_world: int, target: Path, world: int, variants: tuple, results: list,
           native: bool = False) -> None:
    root, recorded = saved[saved_world]
    for index, (stage, dtype) in enumerate(variants):
        name = _name(stage, dtype)
        at_save = recorded[name]
        for rank_results in results:
            result = rank_results[index]
            assert "error" not in result, result
            assert result["native_zero_load"] is native
            assert result["client_state"]["epoch"] == 3
            assert result["global_steps"] == at_save["global_steps"] == 2
            assert result["adam_step"] == at_save["adam_step"]
            assert result["scheduler"] == at_save["scheduler"] and result["lr"] == at_save["lr"]
            assert all(math.isfinite(loss) for loss in result["losses_after"])
        for rank, partitions in enumerate(records(target / name, world)):  # each rank read only its partition
            held = sum(len(partitions[key]) for key in partitions.files if key.startswith("fp32/"))
            assert results[rank][index]["bytes_read"] <= 4 * len(STATES) * held if not native else \
                results[rank][index]["bytes_read"] == 0
        assert_recut(records(root / "saved" / name, saved_world), records(target / name, world), stage,
                     results[0][index]["names"])


def test_saved_masters_are_deepspeeds_own_fp32_state_dict(saved: dict) -> None:
    """The reference the resumes are held to: what the saving engine gathered is what
    DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint`` assembles from the files."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    root, recorded = saved[2]
    for stage, dtype in FROM_TWO:
        name = _name(stage, dtype)
        reference = np.load(root / "saved" / name / "0.npz")
        state = get_fp32_state_dict_from_zero_checkpoint(str(root / name))
        for key, value in state.items():
            assert value.detach().numpy().tobytes() == reference[f"full/fp32/{key}"].tobytes(), (name, key)


def test_two_ranks_resume_on_one(saved: dict, tmp_path: Path) -> None:
    _check(saved, 2, tmp_path, 1, FROM_TWO, _load(saved[2][0], tmp_path, 1, FROM_TWO))


def test_two_ranks_resume_on_three(saved: dict, tmp_path: Path) -> None:
    """361 elements: the padding of every partition changes (ZeRO-3: each parameter's piece)."""
    _check(saved, 2, tmp_path, 3, FROM_TWO, _load(saved[2][0], tmp_path, 3, FROM_TWO))


def test_one_rank_resumes_on_two(saved: dict, tmp_path: Path) -> None:
    _check(saved, 1, tmp_path, 2, FROM_ONE, _load(saved[1][0], tmp_path, 2, FROM_ONE))


def test_same_world_size_runs_deepspeeds_own_load(saved: dict, tmp_path: Path) -> None:
    variants = ((2, "fp32"), (3, "fp32"))
    _check(saved, 2, tmp_path, 2, variants, _load(saved[2][0], tmp_path, 2, variants), native=True)


def test_a_resume_ckptshim_cannot_recut_is_deepspeeds_own_error_with_a_note(saved: dict, tmp_path: Path) -> None:
    """A ZeRO-1 checkpoint into a ZeRO-2 engine of another world size: no exact re-cut, so
    DeepSpeed's own load runs and raises its own error, ckptshim's reason added as a note."""
    root = tmp_path / "source"
    shutil.copytree(saved[2][0] / "zero1_fp32", root / "zero2_fp32")
    result = _load(root, tmp_path, 1, ((2, "fp32"),))[0][0]
    assert result["error"] == "ZeRORuntimeException"
    assert result["message"].startswith("The checkpoint being loaded used a DP world size of 2 but the current "
                                        "world size is 1.")
    assert any("same ZeRO stage" in note for note in result["notes"]), result["notes"]
    heading = next(line for line in (Path(__file__).parents[1] / "docs" / "deepspeed.md").read_text().splitlines()
                   if line.startswith("## `ZeRORuntimeException: "))
    assert heading == f"## `{result['error']}: {result['message']}`"  # the page quotes DeepSpeed's own error


class _Mkdir:
    """Pickles as a call of ``os.mkdir(path)``: what an attacker's rank file would run."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (os.mkdir, (self.path,))


def test_unsafe_rank_file_is_refused_before_deepspeed_reads_it(saved: dict, tmp_path: Path) -> None:
    import torch

    source = tmp_path / "source"
    shutil.copytree(saved[2][0] / "zero2_fp32", source / "zero2_fp32")
    marker = tmp_path / "pwned"
    victim = source / "zero2_fp32" / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    state = torch.load(victim, weights_only=False)
    state["payload"] = _Mkdir(str(marker))
    torch.save(state, victim)
    for world in (1, 2):  # at another world size, and at the saved one (DeepSpeed's own load)
        results = _load(source, tmp_path / f"at{world}", world, ((2, "fp32"),))
        for rank_results in results:
            assert rank_results[0]["error"] == "UnsafeCheckpointError", rank_results[0]
            assert "posix.mkdir" in rank_results[0]["message"] or "os.mkdir" in rank_results[0]["message"]
        assert not marker.exists()
