"""Megatron-Core and Meta Llama checkpoints read from ``gs://`` and ``s3://`` exactly as from a disk.

The real fixtures (``tests/fixtures/megatron_llama``: Bridge's torch_dist and Megatron-Core
0.12's zarr saves, each an iteration folder and its save root; ``tests/fixtures/meta_llama``:
``consolidated.NN.pth`` beside ``params.json``) are uploaded as ``gcloud storage cp -r`` copies
them, to the real local servers, and read by the same calls as locally: ``dcp.load`` of the
model's state dict, ``ckptshim convert ... --like``, ``ckptshim inspect``. Values are compared bit
for bit with Bridge's export (and the converter's), refusals with the local refusal's words.
"""

from __future__ import annotations

from collections.abc import Callable
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


def local_copy(source: Path, into: Path, names: tuple[str, ...] | None = None) -> Path:
    """A writable copy of the folder ``source`` (only its files ``names``, where given)."""
    for file in source.rglob("*"):
        if file.is_file() and (names is None or file.name in names):
            (into / file.relative_to(source)).parent.mkdir(parents=True, exist_ok=True)
            (into / file.relative_to(source)).write_bytes(file.read_bytes())
    return into


def refused_alike(model: Callable[[], torch.nn.Module], local: Path, url: str, match: str) -> None:
    """``dcp.load`` of the local copy and of the bucket's each refused (``match``), the model
    untouched, with the same exception and words."""
    refusals = []
    for where in (str(local), url):
        target = model()
        before = {key: value.clone() for key, value in target.state_dict().items()}
        with pytest.raises(BaseException, match=match) as error:
            dcp.load(target.state_dict(), checkpoint_id=where)
        assert all(torch.equal(before[key], value) for key, value in target.state_dict().items())
        refusals.append((type(error.value), str(error.value).replace(where, "CKPT")))
    assert refusals[1] == refusals[0]


@pytest.mark.parametrize("where", ["tp1/iter_0000000", "tp2", "zarr_tp1/iter_0000000", "zarr_tp2"])
def test_dcp_load_of_a_megatron_checkpoint_from_a_bucket(bucket, where):
    """torch_dist or zarr, the iteration folder or the save root: Bridge's export, bit for bit
    (the zarr saves' float32 norms cast back as Bridge casts them)."""
    root = where.split("/")[0]
    url = upload(MEGATRON / root, f"{bucket}/{root}")
    state_dict = megatron_llama().state_dict()
    dcp.load(state_dict, checkpoint_id=f"{bucket}/{where}")
    assert_same(state_dict, bridge_export(int(root.removeprefix("zarr_")[2])))


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


@pytest.mark.parametrize("root, fmt", [("tp2", "torch-dcp"), ("zarr_tp2", "megatron-core-zarr")])
def test_inspect_of_a_megatron_save_root_in_a_bucket_is_the_local_inspect(bucket, capsys, root, fmt):
    url = upload(MEGATRON / root, f"{bucket}/{root}")
    remote = inspected(url, capsys)
    assert remote.startswith(f"CKPT/iter_0000000: {fmt}")
    assert "Megatron-Core wrote it, 8 heads (num_attention_heads) in 2 key/value groups" in remote
    assert remote == inspected(str(MEGATRON / root), capsys)


def test_convert_a_zarr_checkpoint_in_a_bucket_as_locally(bucket, tmp_path):
    """``convert`` copies each array as stored: the same bytes as from the local folder."""
    url = upload(MEGATRON / "zarr_tp2", f"{bucket}/zarr_tp2")
    outs = [tmp_path / "local.safetensors", tmp_path / "remote.safetensors"]
    for where, out in zip((str(MEGATRON / "zarr_tp2" / "iter_0000000"), f"{url}/iter_0000000"), outs):
        assert main(["convert", where, str(out), "--to", "safetensors", "--like", str(MEGATRON / "hf_tp1")]) == 0
    assert outs[1].read_bytes() == outs[0].read_bytes()
    assert_same({key: value.to(torch.bfloat16) for key, value in load_file(outs[1]).items()}, bridge_export(2))


def test_a_zarr_chunk_missing_from_a_bucket_is_refused_as_locally(bucket, tmp_path):
    local = local_copy(MEGATRON / "zarr_tp1" / "iter_0000000", tmp_path / "iter")
    (local / "decoder.layers.self_attention.linear_qkv.weight" / "0.0.0").unlink()
    refused_alike(megatron_llama, local, upload(local, f"{bucket}/iter"), r"linear_qkv\.weight/0\.0\.0")


# -- Meta's consolidated.NN.pth beside params.json -----------------------------------------------


@pytest.mark.parametrize("mp", ["mp1", "mp2"])
def test_dcp_load_of_a_meta_folder_from_a_bucket(bucket, mp):
    url = upload(FIXTURE / mp, f"{bucket}/{mp}")
    state_dict = llama().state_dict()
    dcp.load(state_dict, checkpoint_id=url)
    assert_same(state_dict, converted(mp))


def test_convert_and_inspect_a_meta_folder_in_a_bucket(bucket, tmp_path, capsys):
    url = upload(FIXTURE / "mp2", f"{bucket}/mp2")
    out = tmp_path / "model.safetensors"
    assert main(["convert", url, str(out), "--to", "safetensors", "--like", str(FIXTURE / "hf_mp1")]) == 0
    assert_same(load_file(out), converted("mp2"))
    capsys.readouterr()
    remote = inspected(url, capsys)
    assert "meta-llama (version model parallel 2, 8 heads in 2 key/value groups (params.json))" in remote
    assert remote == inspected(str(FIXTURE / "mp2"), capsys)


def test_a_meta_folder_in_a_bucket_missing_a_rank_is_refused_as_locally(bucket, tmp_path, capsys):
    local = local_copy(FIXTURE / "mp2", tmp_path / "mp2", ("params.json", "consolidated.00.pth"))
    url = upload(local, f"{bucket}/mp2")
    main(["inspect", url])
    assert "consolidated.01.pth is missing" in capsys.readouterr().out
    refused_alike(llama, local, url, r"consolidated\.01\.pth is missing")


def test_a_near_miss_head_count_is_refused_from_a_bucket_as_locally(bucket, tmp_path, capsys):
    """4 heads of 8 in 1 group against params.json's 8 heads of 4 in 2 groups: the same shapes."""
    import json

    like = local_copy(FIXTURE / "hf_mp1", tmp_path / "like")
    config = json.loads((like / "config.json").read_text())
    config.update(num_attention_heads=4, num_key_value_heads=1, head_dim=8)
    (like / "config.json").write_text(json.dumps(config))
    url = upload(FIXTURE / "mp1", f"{bucket}/mp1")
    said = []
    for where in (str(FIXTURE / "mp1"), url):
        out = tmp_path / "out.safetensors"
        assert main(["convert", where, str(out), "--to", "safetensors", "--like", str(like)]) != 0
        assert not out.exists()
        said.append(capsys.readouterr().err.replace(where, "CKPT"))
    assert "params.json (the checkpoint's) says 8 heads (n_heads) in 2 key/value groups (n_kv_heads)" in said[0]
    assert said[1] == said[0]


# -- torchtune's checkpointer output ---------------------------------------------------------------

TORCHTUNE = Path(__file__).parent / "fixtures" / "torchtune_0.6.1"


@pytest.mark.parametrize("folder", ["llama3/torchtune", "llama3/meta", "qwen2/torchtune"])
def test_dcp_load_of_a_torchtune_folder_from_a_bucket(bucket, folder, capsys):
    """Its ``.bin`` read as a ``torch.save`` object, its ``config.json`` naming the family and the
    head counts: torchtune's own converter's values, bit for bit; ``inspect`` as locally."""
    from test_torchtune_litgpt import hf_model, tune_to_hf

    local = TORCHTUNE / folder / "epoch_0"
    url = upload(local, f"{bucket}/{folder}")
    state_dict = hf_model(local).state_dict()
    dcp.load(state_dict, checkpoint_id=url)
    assert_same(state_dict, tune_to_hf(folder.split("/")[0]))
    remote = inspected(url, capsys)
    assert "torchtune" in remote and remote == inspected(str(local), capsys)


# -- the trust boundary, in a bucket as on a disk --------------------------------------------------


@pytest.mark.parametrize("damage", ["zarray-too-large", "params-too-large", "chunk-too-long"])
def test_damaged_metadata_is_refused_in_a_bucket_as_on_a_disk(bucket, tmp_path, capsys, damage):
    """A metadata file larger than its format's cap is refused before it is read (a bucket's
    listing gives its size); a chunk file longer than a chunk is a problem ``inspect`` names."""
    if damage == "params-too-large":
        local = local_copy(FIXTURE / "mp1", tmp_path / "ckpt")
        (local / "params.json").write_text('{"dim": 32' + " " * (1 << 20) + "}")
    else:
        local = local_copy(MEGATRON / "zarr_tp1" / "iter_0000000", tmp_path / "ckpt")
        array = local / "decoder.final_layernorm.weight"
        if damage == "zarray-too-large":
            (array / ".zarray").write_text((array / ".zarray").read_text() + " " * (1 << 20))
        else:
            (array / "0").write_bytes((array / "0").read_bytes() + b"\0" * 4)
    url = upload(local, f"{bucket}/ckpt")
    said = []
    for where in (str(local), url):
        code = main(["inspect", where])
        captured = capsys.readouterr()
        said.append((code, (captured.out + captured.err).replace(where, "CKPT")))
    if damage == "chunk-too-long":
        assert "decoder.final_layernorm.weight/0: 132 bytes, more than the 128 of one chunk" in said[0][1]
    else:
        assert said[0][0] != 0 and "bytes, more than the" in said[0][1], said[0]
    assert said[1] == said[0]


@pytest.mark.parametrize("root", ["tp1", "zarr_tp1"])
def test_plan_of_a_megatron_save_root_in_a_bucket_is_the_local_plan(bucket, capsys, root):
    url = upload(MEGATRON / root, f"{bucket}/{root}")
    planned = []
    for where in (str(MEGATRON / root), url):
        code = main(["plan", where, "--like", str(MEGATRON / "hf_tp1")])
        planned.append((code, capsys.readouterr().out.replace(where, "CKPT")))
    assert "split by query group (2 × [4 q, 1 k, 1 v])" in planned[0][1]
    assert planned[1] == planned[0]
