"""Where DeepSpeed's own way to another world size -- ``ds_to_universal`` then ``load_universal``
-- restores another state than the one saved, and ckptshim's re-cut restores the saved one.

One ZeRO-3 checkpoint of 2 ranks (``tests/workers/deepspeed_engine_worker.py``): the embedding
frozen, two param groups (weight decay 0.1 on the matrices, 0.0 on the rest) and
``sub_group_size`` 10, so that one rank holds 6 sub-groups. DeepSpeed's converter
(``python -m deepspeed.checkpoint.ds_to_universal``) writes its universal checkpoint; a
one-rank engine built from another seed (so that a parameter left unrestored shows) resumes
once from the universal checkpoint and once, with ckptshim, from the original; each then takes
two steps. docs/deepspeed.md quotes the DeepSpeed lines behind each difference.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from support.processes import environment, run_ranks
from support.zero_partitions import records

pytest.importorskip("deepspeed")

WORKER = "deepspeed_engine_worker.py"
ENV = {"DS_ACCELERATOR": "cpu"}
JOB = {"stage": 3, "dtype": "fp32", "frozen": True, "groups": True, "sub_group_size": 10, "steps_after": 2}
FROZEN = "embed.weight"


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict, dict, Path]:
    """(the saving rank 0's record, ckptshim's resume's, the universal route's, their folder)."""
    root = tmp_path_factory.mktemp("universal")
    save = root / "ckpt"
    saved = run_ranks(WORKER, [{**JOB, "mode": "save", "dir": str(save), "out": str(root / "saved")}], 2,
                      root / "save", ENV)[0][0]
    tag = (save / "latest").read_text().strip()
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                    str(save / tag), "--output_folder", str(save / f"{tag}_universal"), "--num_extract_workers",
                    "1", "--num_merge_workers", "1"], check=True, capture_output=True, timeout=600,
                   env=environment(ENV))  # it writes ``latest_universal`` beside ``latest``
    loads = [{**JOB, "mode": "load", "seed": 1, "dir": str(save), "out": str(root / "ckptshim")},
             {**JOB, "mode": "load", "seed": 1, "universal": True, "dir": str(save), "out": str(root / "universal")}]
    ours, universal = run_ranks(WORKER, loads, 1, root / "load", ENV)[0]
    return saved, ours, universal, root


def test_universal_route_leaves_frozen_parameters_unrestored(resumed: tuple) -> None:
    """``DeepSpeedEngine._load_checkpoint`` calls ``load_module_state_dict`` -- the only step that
    copies ``frozen_param_fragments`` -- only when not loading a universal checkpoint."""
    _, ours, universal, root = resumed
    assert "error" not in ours and "error" not in universal, (ours, universal)
    whole = records(root / "saved", 1)[0][f"full/module/{FROZEN}"]  # saving rank 0's record
    assert records(root / "ckptshim", 1)[0][f"full/module/{FROZEN}"].tobytes() == whole.tobytes()
    left = records(root / "universal", 1)[0][f"full/module/{FROZEN}"]
    assert not np.array_equal(left, whole)  # the new engine's own initial values (seed 1)


def test_universal_route_gives_every_zero3_param_group_group_0s_hyperparameters(resumed: tuple) -> None:
    """``DeepSpeedZeroOptimizer_Stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3`` sets
    every param group's hyperparameters from ``param_groups[0]``."""
    saved, ours, universal, _ = resumed
    assert [group["weight_decay"] for group in saved["param_groups"]] == [0.1, 0.0]
    assert ours["param_groups"] == saved["param_groups"]
    assert [group["weight_decay"] for group in universal["param_groups"]] == [0.1, 0.1]


def test_universal_route_shares_one_zero3_step_across_sub_groups(resumed: tuple) -> None:
    """The same function puts one ``step`` tensor (``state[0]['step']``) into every sub-group's
    state; torch's Adam advances it in place at each sub-group's step, so after two steps every
    sub-group's ``step`` has advanced two times per sub-group."""
    saved, ours, universal, _ = resumed
    sub_groups = ours["sub_groups"]
    assert sub_groups == universal["sub_groups"] == 6 and saved["sub_groups"] == 4
    assert ours["adam_step_after"] == [4.0] * sub_groups  # 2 saved steps, 2 more
    assert universal["adam_step_after"] == [2.0 + 2 * sub_groups] * sub_groups
