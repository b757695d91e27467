"""``ckptshim inspect``, ``plan`` and ``convert`` given an ``s3://`` or ``gs://`` URL (real local
servers): the same answers as for a local copy of the same checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch import nn

from ckptshim import cli
from support.markers import QUIET

pytestmark = [QUIET, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def build(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def run(capsys, *argv: str) -> tuple[int, str]:
    code = cli.main(list(argv))
    return code, capsys.readouterr().out


def saved_remote_and_local(bucket: str, tmp_path: Path) -> tuple[str, Path, dict]:
    state = build(seed=0).state_dict()
    url, local = f"{bucket}/ckpt/step_1", tmp_path / "step_1"
    dcp.save(state, checkpoint_id=url)
    dcp.save(state, checkpoint_id=local)
    return url, local, state


def test_inspect_url_as_local(bucket, tmp_path, capsys):
    url, local, _ = saved_remote_and_local(bucket, tmp_path)
    code, remote_out = run(capsys, "inspect", "--json", url)
    assert code == 0
    _, local_out = run(capsys, "inspect", "--json", str(local))
    remote_info, local_info = json.loads(remote_out), json.loads(local_out)
    assert remote_info["path"] == url and remote_info["format"] == "torch-dcp" and remote_info["complete"]
    for field in ("entries", "total_bytes", "files", "writers", "problems", "version"):
        assert remote_info[field] == local_info[field], field


def test_inspect_url_reports_a_missing_file(bucket, tmp_path, capsys):
    import fsspec

    url, _, _ = saved_remote_and_local(bucket, tmp_path)
    fs, path = fsspec.core.url_to_fs(url)
    fs.rm(next(name for name in fs.ls(path, detail=False) if name.endswith(".distcp")))
    code, out = run(capsys, "inspect", url)
    assert code == 1 and "INCOMPLETE" in out and "__0_0.distcp: missing" in out


def test_plan_url_like_a_compiled_model(bucket, tmp_path, capsys):
    url, _, _ = saved_remote_and_local(bucket, tmp_path)
    compiled = tmp_path / "compiled"
    dcp.save(torch.compile(build(seed=1)).state_dict(), checkpoint_id=compiled)
    code, out = run(capsys, "plan", "--json", url, "--like", str(compiled))
    assert code == 0
    plan = json.loads(out)
    assert plan["complete"] and any("_orig_mod." in line for line in plan["lines"])


def test_convert_url_to_local_safetensors_bit_exact(bucket, tmp_path, capsys):
    url, _, state = saved_remote_and_local(bucket, tmp_path)
    out_file = tmp_path / "model.safetensors"
    code, _ = run(capsys, "convert", url, str(out_file), "--to", "safetensors", "--no-progress")
    assert code == 0
    written = load_file(out_file)
    assert written.keys() == state.keys()
    assert all(torch.equal(written[k], v) and written[k].dtype == v.dtype for k, v in state.items())


def test_a_prefix_without_a_checkpoint_says_so(bucket, capsys):
    import fsspec

    fs, path = fsspec.core.url_to_fs(f"{bucket}/other/x.bin")
    fs.pipe(path, b"not a checkpoint")
    code = cli.main(["inspect", f"{bucket}/other"])
    err = capsys.readouterr().err
    assert code == 1 and "is not a checkpoint ckptshim reads from object storage" in err
