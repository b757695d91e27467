"""ZeRO-3 at another world size with a frozen parameter and sub-groups, in DeepSpeed's real engine.

The checkpoints are written by ``engine.save_checkpoint`` (``tests/workers/deepspeed_engine_worker.py``,
CPU, gloo) of the tiny model with its embedding frozen -- as a frozen embedding or a LoRA base
is -- and a ``sub_group_size`` of 10 elements: one rank's partition buckets the trainable
parameters into 6 sub-groups, two or three ranks' into 4. DeepSpeed alone fails on both: its
``load_module_state_dict`` copies the saved ``ceil(numel / N)`` frozen pieces into ``ds_tensor``
pieces cut for M, and its optimizer has another number of flat groups.

After the load each rank must hold the saved state re-cut for M ranks, bit for bit: the fp32
partition and Adam moments of every sub-group, Adam's ``step``, its own elements of the frozen
embedding (as the saving ranks held them), every parameter whole. Each rank must have read
exactly the bytes of its own elements. The next two training steps (every rank on one batch)
must give the saving run's own losses (the first bit for bit; the second as far as averaging
the same gradient over another number of ranks rounds).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from support.processes import run_ranks
from support.zero_partitions import AVERAGING, assert_recut, own_elements, records

pytest.importorskip("deepspeed")

WORKER = "deepspeed_engine_worker.py"
ENV = {"DS_ACCELERATOR": "cpu"}
DTYPES = ("fp32", "bf16")
JOB = {"stage": 3, "frozen": True, "sub_group_size": 10, "steps_after": 2}
FROZEN = "embed.weight"
RESUMES = ((2, 1), (2, 3), (1, 2), (3, 2))


def _jobs(mode: str, source: Path, out: Path) -> list[dict]:
    return [{**JOB, "mode": mode, "dtype": dtype, "dir": str(source / dtype), "out": str(out / dtype)}
            for dtype in DTYPES]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], tuple[Path, list[list[dict]]]]:
    """World size -> (its save dirs' folder, each saving rank's record per dtype), saved once
    per module when a test first asks for it."""
    done: dict[int, tuple[Path, list[list[dict]]]] = {}

    def at(world: int) -> tuple[Path, list[list[dict]]]:
        if world not in done:
            root = tmp_path_factory.mktemp(f"zero3_saved_by_{world}")
            done[world] = (root, run_ranks(WORKER, _jobs("save", root, root / "saved"), world, root, ENV))
        return done[world]
    return at


@pytest.mark.parametrize(("saved_world", "world"), RESUMES, ids=[f"{n}to{m}" for n, m in RESUMES])
def test_zero3_with_frozen_parameters_and_sub_groups_resumes(saved: Callable, tmp_path: Path, saved_world: int,
                                                             world: int) -> None:
    root, recorded = saved(saved_world)
    results = run_ranks(WORKER, _jobs("load", root, tmp_path), world, tmp_path, ENV)
    for index, dtype in enumerate(DTYPES):
        at_save = recorded[0][index]
        before, after = records(root / "saved" / dtype, saved_world), records(tmp_path / dtype, world)
        if {saved_world, world} == {1, 2}:  # the sub-groups are not the checkpoint's
            assert (at_save["sub_groups"], results[0][index]["sub_groups"]) == \
                ((6, 4) if saved_world == 1 else (4, 6))
        held = np.concatenate([rank[f"frozen/{FROZEN}"] for rank in before])  # the saving ranks' pieces
        assert held.tobytes() == before[0][f"full/module/{FROZEN}"].reshape(-1).tobytes()
        for rank, (result, partitions) in enumerate(zip(results, after)):
            result = result[index]
            assert "error" not in result, result
            assert result["native_zero_load"] is False
            assert result["global_steps"] == 2 and result["scheduler"] == at_save["scheduler"]
            assert set(result["adam_step"]) == set(at_save["adam_step"]) == {2.0}
            for key in before[0].files:
                if key.startswith("full/"):
                    assert partitions[key].tobytes() == before[0][key].tobytes(), (dtype, key)
            piece = -(-held.size // world)
            assert partitions[f"frozen/{FROZEN}"].tobytes() == held[rank * piece:(rank + 1) * piece].tobytes()
            trainable = sum(own_elements(numel, part, rank) for numel, part in partitions["layout"])
            frozen_bytes = own_elements(held.size, piece, rank) * (2 if dtype == "bf16" else 4)
            assert result["bytes_read"] == 3 * 4 * trainable + frozen_bytes  # its own elements, nothing else
            assert result["losses_after"][0] == at_save["losses_after"][0]
            assert result["losses_after"][1] == pytest.approx(at_save["losses_after"][1], rel=AVERAGING[dtype])
        assert_recut(before, after, 3, result["names"])
