"""Megatron-Core and Meta Llama checkpoints read from ``gs://`` and ``s3://`` exactly as from a disk.

The real fixtures (``tests/fixtures/megatron_llama``: Bridge's torch_dist and Megatron-Core
0.12's zarr saves, each an iteration folder and its save root; ``tests/fixtures/meta_llama``:
``consolidated.NN.pth`` beside ``params.json``) are uploaded as ``gcloud storage cp -r`` copies
them, to the real local servers, and read by the same calls as locally: ``dcp.load`` of the
model's state dict, ``ckptshim convert ... --like``, ``ckptshim inspect``. Values are compared bit
for bit with Bridge's export (and the converter's), refusals with the local refusal's words.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from ckptshim.cli import main
from support.markers import QUIET
from test_decoder_hub import (FIXTURE, MEGATRON, assert_same, bridge_export, converted, llama,
                              megatron_llama)

pytestmark = [QUIET, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def upload(folder: Path, url: str) -> str:
    """Every file below ``folder`` to the prefix ``url``, as the plain objects a copy makes."""
    import fsspec

    fs, _ = fsspec.core.url_to_fs(url)
    fs.pipe({f"{url}/{file.relative_to(folder).as_posix()}": file.read_bytes()
             for file in folder.rglob("*") if file.is_file()})
    fs.invalidate_cache()
    return url


@pytest.mark.parametrize("where", ["tp1/iter_0000000", "tp2"])
def test_dcp_load_of_a_megatron_checkpoint_from_a_bucket(bucket, where):
    root = where.split("/")[0]
    url = upload(MEGATRON / root, f"{bucket}/{root}")
    state_dict = megatron_llama().state_dict()
    dcp.load(state_dict, checkpoint_id=f"{bucket}/{where}")
    assert_same(state_dict, bridge_export(int(root[2])))


def inspected(where: str, capsys) -> str:
    """``ckptshim inspect``'s output for ``where``, the location itself written ``CKPT``."""
    assert main(["inspect", where]) == 0
    return capsys.readouterr().out.replace(where, "CKPT")


def test_convert_a_megatron_checkpoint_in_a_bucket_like_a_hugging_face_folder(bucket, tmp_path):
    url = upload(MEGATRON / "tp2", f"{bucket}/tp2")
    out = tmp_path / "model.safetensors"
    assert main(["convert", f"{url}/iter_0000000", str(out), "--to", "safetensors", "--like",
                 str(MEGATRON / "hf_tp1")]) == 0
    assert_same(load_file(out), bridge_export(2))


def test_inspect_of_a_megatron_save_root_in_a_bucket_is_the_local_inspect(bucket, capsys):
    url = upload(MEGATRON / "tp2", f"{bucket}/tp2")
    remote = inspected(url, capsys)
    assert remote.startswith("CKPT/iter_0000000: torch-dcp")
    assert "Megatron-Core wrote it, 8 heads (num_attention_heads) in 2 key/value groups" in remote
    assert remote == inspected(str(MEGATRON / "tp2"), capsys)
