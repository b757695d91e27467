"""DCP with ckptshim across processes: two and four gloo/CPU ranks under torchrun, then one process.

One ``torchrun --nproc_per_node=2`` launch (tests/dcp_worker.py) runs every multi-process case:
FSDP2 and tensor-parallel models, compiled, load a checkpoint saved on one rank, each rank's
local shard checked against its slice; bad input fails on both ranks with ckptshim's error and
changes nothing on either; and a plain FSDP2 model is saved on two ranks, which the tests below
read back in one process. A second launch, ``torchrun --nproc_per_node=4``
(tests/dcp_four_ranks_worker.py), loads that 2-rank checkpoint into FSDP2 x tensor-parallel
models on a 2 x 2 mesh (compiled, stacked, through ``set_model_state_dict``), each shard exact.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

from ckptshim.formats.detect import open_checkpoint  # noqa: E402
from support.fixtures import array_sha256, expected_arrays  # noqa: E402
from support.markers import QUIET  # noqa: E402
from support.processes import environment, worker  # noqa: E402
from test_dcp import assert_manifest, build, module_from, reference, stacked_twin  # noqa: E402

pytestmark = QUIET


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("two_ranks")
    env = {k: v for k, v in environment().items() if not k.startswith("CKPTSHIM_")}
    try:
        run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                              "--nproc_per_node=2", worker("dcp_worker.py"), str(out)],
                             capture_output=True, text=True, timeout=240, env=env, check=False)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"the two ranks hung: {error.stdout}{error.stderr}")
    assert run.returncode == 0, run.stdout + run.stderr
    return out


@pytest.fixture(scope="module")
def four_ranks(two_ranks, tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("four_ranks")
    env = {k: v for k, v in environment().items() if not k.startswith("CKPTSHIM_")}
    try:
        run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                              "--nproc_per_node=4", worker("dcp_four_ranks_worker.py"), str(out),
                              str(two_ranks / "fsdp2_plain")],
                             capture_output=True, text=True, timeout=300, env=env, check=False)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"the four ranks hung: {error.stdout}{error.stderr}")
    assert run.returncode == 0, run.stdout + run.stderr
    return [json.loads((out / f"four_rank{rank}.json").read_text()) for rank in range(4)]


@pytest.mark.parametrize("case", ["case_compiled_2d", "case_stacked_2d", "case_set_model_state_dict_2d",
                                  "case_missing_rank_file"])
def test_two_rank_checkpoint_into_a_2x2_mesh_on_four_ranks(four_ranks, case):
    failed = {rank: results[case] for rank, results in enumerate(four_ranks) if results[case] != "ok"}
    assert not failed, "\n".join(f"rank {rank}:\n{text}" for rank, text in failed.items())


@pytest.mark.parametrize("rank", [0, 1])
def test_every_case_passes_on_every_rank(two_ranks, rank):
    results = json.loads((two_ranks / f"rank{rank}.json").read_text())
    assert set(results) >= {"case_fsdp2_compiled", "case_tensor_parallel_compiled",
                            "case_missing_file_of_one_rank", "case_truncated_file",
                            "case_tampered_metadata", "case_shape_mismatch", "case_zero3_into_fsdp2",
                            "case_megatron_tp2_pp2_into_fsdp2"}
    failed = {case: text for case, text in results.items() if text != "ok"}
    assert not failed, "\n".join(f"{case}:\n{text}" for case, text in failed.items())


def test_missing_rank_file_fails_both_ranks_quickly_with_one_message(two_ranks):
    """A file only rank 1 reads is gone: both ranks raise within seconds (no rank waits for the
    other until the process group's timeout), and both report the same refusal naming it."""
    reports = [json.loads((two_ranks / f"missing_rank1_rank{rank}.json").read_text()) for rank in (0, 1)]
    assert all(report["seconds"] < 20 for report in reports), reports
    assert reports[0]["messages"] == reports[1]["messages"], reports
    assert any("__1_0.distcp" in message and "missing" in message for message in reports[0]["messages"]), reports


def test_two_rank_checkpoint_into_one_compiled_process(two_ranks):
    state_dict = torch.compile(build(seed=4)).state_dict()
    dcp.load({"model": state_dict}, checkpoint_id=two_ranks / "fsdp2_plain")
    assert_manifest(state_dict)


def test_two_rank_checkpoint_into_stacked_layers(two_ranks):
    state_dict = module_from(stacked_twin(reference())).state_dict()
    dcp.load(state_dict, checkpoint_id=two_ranks / "fsdp2_plain")
    ref = reference()
    for key, value in state_dict.items():
        layers = [ref[f"layers.{i}.{key[7:]}"] for i in range(2)] if key.startswith("layers.") else None
        assert torch.equal(value, torch.stack(layers) if layers else ref[key]), key


def test_inspect_two_rank_checkpoint(two_ranks):
    checkpoint = open_checkpoint(two_ranks / "fsdp2_plain")
    assert checkpoint.format == "torch-dcp" and checkpoint.complete
    assert [f.path for f in checkpoint.files] == ["__0_0.distcp", "__1_0.distcp"]
    assert all(f.size == f.expected_size for f in checkpoint.files)
    first, second = (" ".join(f.contents) for f in checkpoint.files)
    assert "model.lm_head.weight [0:128, 0:64]" in first and "model.lm_head.weight [128:256, 0:64]" in second
    expected = expected_arrays("torch_dcp_single")
    for key, entry in checkpoint.inventory.items():
        assert array_sha256(checkpoint.read(entry)) == expected[".".join(key[1:])]["sha256"], key


def test_inspect_names_the_rank_a_missing_file_costs(two_ranks, tmp_path, capsys):
    from ckptshim.cli import main

    copy = tmp_path / "fsdp2_plain"
    shutil.copytree(two_ranks / "fsdp2_plain", copy)
    (copy / "__1_0.distcp").unlink()
    assert main(["inspect", str(copy), "--json"]) == 1
    writers = {w["writer"]: w for w in json.loads(capsys.readouterr().out)["writers"]}
    assert set(writers) == {"rank 0", "rank 1"} and not writers["rank 0"]["gaps"]
    (gap,) = writers["rank 1"]["gaps"]
    assert writers["rank 1"]["bytes_present"] == 0 and writers["rank 0"]["bytes_present"] > 0
    assert any(cost.startswith("model.lm_head.weight [128:256, 0:64] bytes ") for cost in gap["costs"])
