"""safetensors files and Hugging Face folders in a bucket (real local S3 and GCS servers): ``inspect``
and ``convert`` read them by byte ranges -- the header with the same validation as locally, each
tensor by its own range -- and answer exactly as for a local copy of the same bytes."""

from __future__ import annotations

import json
from pathlib import Path

import fsspec
import pytest
import torch
from huggingface_hub import save_torch_state_dict
from safetensors.torch import load_file, save_file

from ckptshim import cli
from ckptshim.conversion import convert
from ckptshim.errors import CorruptCheckpointError
from ckptshim.formats.detect import open_checkpoint
from support.markers import QUIET

pytestmark = [QUIET]


def state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"model.embed.weight": torch.randn(64, 16), "model.layers.0.mlp.weight": torch.randn(32, 16),
            "model.layers.0.norm.weight": torch.randn(16).to(torch.bfloat16),
            "model.layers.1.mlp.weight": torch.randn(32, 16).to(torch.float16), "lm_head.steps": torch.arange(5)}


def upload(local: Path, url: str) -> None:
    fs, path = fsspec.core.url_to_fs(url)
    if local.is_dir():
        for file in sorted(f for f in local.iterdir() if f.is_file()):
            fs.put_file(str(file), f"{path}/{file.name}")
    else:
        fs.put_file(str(local), path)
    fs.invalidate_cache()


def inspected(capsys, where: str) -> tuple[int, dict]:
    code = cli.main(["inspect", "--json", where])
    return code, json.loads(capsys.readouterr().out)


def same(got: dict, expected: dict) -> bool:
    return got.keys() == expected.keys() and all(
        got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in expected.items())


def assert_inspected_alike(capsys, url: str, local: Path) -> dict:
    code, remote = inspected(capsys, url)
    local_code, here = inspected(capsys, str(local))
    assert code == local_code == 0
    assert remote["path"] == url and remote["format"] == here["format"] and remote["complete"]
    for field in ("entries", "total_bytes", "writers", "problems", "version"):
        assert remote[field] == here[field], field
    assert [(Path(f["path"]).name, f["size"]) for f in remote["files"]] == \
        [(Path(f["path"]).name, f["size"]) for f in here["files"]]
    return remote


def test_a_safetensors_file_in_a_bucket(bucket, tmp_path, capsys):
    expected = state()
    local = tmp_path / "model.safetensors"
    save_file(expected, local, metadata={"format": "pt"})
    url = f"{bucket}/run/model.safetensors"
    upload(local, url)
    assert assert_inspected_alike(capsys, url, local)["format"] == "safetensors"
    convert(url, tmp_path / "back.safetensors", to="safetensors", progress=False)
    assert same(load_file(tmp_path / "back.safetensors"), expected)


def test_a_slice_of_a_remote_tensor_is_read_by_its_range(bucket, tmp_path):
    import numpy as np

    expected = state()
    local = tmp_path / "model.safetensors"
    save_file(expected, local)
    upload(local, f"{bucket}/m.safetensors")
    checkpoint = open_checkpoint(f"{bucket}/m.safetensors")
    entry = checkpoint.inventory[("model", "embed", "weight")]
    out = np.empty((10, 16), np.float32)
    checkpoint.read_into(entry, (slice(20, 30), slice(None)), out)
    assert np.array_equal(out, expected["model.embed.weight"][20:30].numpy())


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_a_hugging_face_folder_in_a_bucket(bucket, tmp_path, capsys, sharded):
    expected = state()
    local = tmp_path / "model"
    local.mkdir()
    save_torch_state_dict(expected, local, max_shard_size="3KB" if sharded else "10GB")
    (local / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    assert (local / "model.safetensors.index.json").exists() == sharded
    url = f"{bucket}/models/tiny"
    upload(local, url)
    remote = assert_inspected_alike(capsys, url, local)
    assert remote["format"] == "hf-dir"
    convert(url, tmp_path / "out.safetensors", to="safetensors", progress=False)
    assert same(load_file(tmp_path / "out.safetensors"), expected)


def test_a_missing_shard_is_reported_as_locally(bucket, tmp_path, capsys):
    local = tmp_path / "model"
    local.mkdir()
    save_torch_state_dict(state(), local, max_shard_size="3KB")
    (local / "model-00002-of-00003.safetensors").unlink()
    url = f"{bucket}/models/tiny"
    upload(local, url)
    code, remote = inspected(capsys, url)
    local_code, here = inspected(capsys, str(local))
    assert code == local_code == 1 and not remote["complete"]
    assert remote["problems"] == here["problems"]
    assert [f for f in remote["files"] if f["size"] is None] == [f for f in here["files"] if f["size"] is None]


def outcome(where: str) -> str:
    """What opening ``where`` says: the refusal, or the problems found, with the name left out."""
    try:
        checkpoint = open_checkpoint(where)
    except CorruptCheckpointError as error:
        return str(error).replace(where, "FILE")
    return "; ".join(checkpoint.all_problems()).replace(where, "FILE") or "complete"


@pytest.mark.parametrize("damage", ["truncated", "header past the end", "header not json", "bytes owned by none"])
def test_a_damaged_file_is_refused_as_locally(bucket, tmp_path, damage):
    local = tmp_path / "model.safetensors"
    save_file(state(), local)
    raw = local.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    raw = {"truncated": raw[:-100], "header past the end": (10**7).to_bytes(8, "little") + raw[8:],
           "header not json": raw[:8] + b"{" * length + raw[8 + length:],
           "bytes owned by none": raw + b"\0" * 8}[damage]
    local.write_bytes(raw)
    upload(local, f"{bucket}/m.safetensors")
    assert outcome(f"{bucket}/m.safetensors") == outcome(str(local))


@pytest.mark.parametrize("layout", ["file", "hf-sharded"])
def test_dcp_load_of_safetensors_at_a_url(bucket, tmp_path, layout):
    """``dcp.load(checkpoint_id=URL)`` of what DCP cannot read at all (its own ``FsspecReader``
    finds no ``.metadata``): read through ckptshim by byte ranges, into a ``torch.compile``d-style
    wrapped state dict, bit for bit; the same load from the local copy gives the same tensors."""
    import torch.distributed.checkpoint as dcp

    expected = state()
    local = tmp_path / "model"
    local.mkdir()
    if layout == "file":
        local = local / "model.safetensors"
        save_file(expected, local)
        url = f"{bucket}/weights/model.safetensors"
    else:
        save_torch_state_dict(expected, local, max_shard_size="3KB")
        url = f"{bucket}/weights/tiny"
    upload(local, url)
    loaded = {f"_orig_mod.{k}": torch.zeros_like(v) for k, v in expected.items()}
    dcp.load(loaded, checkpoint_id=url, no_dist=True)
    assert same({k.removeprefix("_orig_mod."): v for k, v in loaded.items()}, expected)


def test_plan_of_a_remote_folder_like_a_local_checkpoint(bucket, tmp_path, capsys):
    expected = state()
    local = tmp_path / "model"
    local.mkdir()
    save_torch_state_dict(expected, local, max_shard_size="3KB")
    upload(local, f"{bucket}/tiny")
    wrapped = tmp_path / "wrapped.safetensors"
    save_file({f"module.{k}": v for k, v in expected.items()}, wrapped)
    code = cli.main(["plan", "--json", f"{bucket}/tiny", "--like", str(wrapped)])
    plan = json.loads(capsys.readouterr().out)
    assert code == 0 and plan["complete"] and any("module." in line for line in plan["lines"])


def test_an_index_naming_a_shard_outside_the_prefix_is_refused(bucket, tmp_path):
    local = tmp_path / "model"
    local.mkdir()
    save_torch_state_dict(state(), local, max_shard_size="3KB")
    index = json.loads((local / "model.safetensors.index.json").read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = "../elsewhere/model.safetensors"
    (local / "model.safetensors.index.json").write_text(json.dumps(index))
    upload(local, f"{bucket}/tiny")
    with pytest.raises(CorruptCheckpointError, match="lies outside the directory"):
        open_checkpoint(f"{bucket}/tiny")


def test_shards_in_a_subfolder_are_read(bucket, tmp_path):
    expected = state()
    local = tmp_path / "model"
    local.mkdir()
    save_torch_state_dict(expected, local, max_shard_size="3KB")
    index = json.loads((local / "model.safetensors.index.json").read_text())
    index["weight_map"] = {key: f"weights/{name}" for key, name in index["weight_map"].items()}
    (local / "model.safetensors.index.json").write_text(json.dumps(index))
    (local / "weights").mkdir()
    for shard in set(index["weight_map"].values()):
        (local / shard.removeprefix("weights/")).rename(local / shard)
    upload(local, f"{bucket}/tiny")
    upload(local / "weights", f"{bucket}/tiny/weights")
    checkpoint = open_checkpoint(f"{bucket}/tiny")
    assert checkpoint.complete
    convert(f"{bucket}/tiny", tmp_path / "out.safetensors", to="safetensors", progress=False)
    assert same(load_file(tmp_path / "out.safetensors"), expected)


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "torch.save"])
def test_remote_tensors_are_read_a_window_at_a_time(bucket, tmp_path, monkeypatch, safe):
    """A load hands the format many blocks at once (a window of ``read_ahead_bytes``), and the
    format fetches a window's tensors by one batch of byte ranges -- never a tensor per round
    trip, never more than the window: the batches are recorded at ckptshim's own storage call,
    the bytes come from the real server, and the values are the local load's. The same for
    shards written by ``torch.save`` (``pytorch_model-*.bin``)."""
    import torch.distributed.checkpoint as dcp
    from ckptshim.formats import base
    from ckptshim.storage import objects

    expected = {f"layers.{i}.weight": torch.randn(32, 16, generator=torch.Generator().manual_seed(i))
                for i in range(12)}  # 2 KiB each
    local = tmp_path / "model"
    local.mkdir()
    save_torch_state_dict(expected, local, safe_serialization=safe, max_shard_size="10KB")
    url = f"{bucket}/windows"
    upload(local, url)
    batches: list[int] = []
    real = base.read_ranges

    def recorded(ranges, buffers=None):
        batches.append(sum(r.length for r in ranges))
        return real(ranges, buffers)

    monkeypatch.setattr(base, "read_ranges", recorded)
    monkeypatch.setattr(objects, "READ_AHEAD_BYTES", 5 * 2048)
    loaded = {key: torch.zeros_like(value) for key, value in expected.items()}
    dcp.load(loaded, checkpoint_id=url, no_dist=True)
    assert same(loaded, expected)
    assert sum(batches) == 12 * 2048 and max(batches) <= 5 * 2048 and len(batches) < 12, batches
    assert len(batches) == 3  # windows span shards: one batch each
    batches.clear()
    convert(url, tmp_path / "out.safetensors", to="safetensors", progress=False)
    assert same(load_file(tmp_path / "out.safetensors"), expected)
    assert sum(batches) == 12 * 2048 and max(batches) <= 5 * 2048 and len(batches) < 12, batches


def test_blocks_read_together_are_the_local_reads(bucket, tmp_path):
    """``read_blocks`` of a remote file, mixing what goes straight into its buffer (rows of a
    tensor, a whole one) with what does not (a column range, a cast, a transposed buffer, an
    empty block), fills every buffer as the same blocks read one by one from the local copy."""
    import numpy as np

    expected = state()
    local = tmp_path / "model.safetensors"
    save_file(expected, local)
    url = f"{bucket}/mixed/model.safetensors"
    upload(local, url)
    requests = [("model.embed.weight", (slice(8, 24), slice(0, 16)), np.float32, False),
                ("model.embed.weight", (slice(0, 64), slice(3, 9)), np.float32, False),
                ("model.layers.0.mlp.weight", (slice(0, 32), slice(0, 16)), np.float64, False),
                ("model.layers.0.mlp.weight", (slice(0, 32), slice(0, 16)), np.float32, True),
                ("model.layers.0.norm.weight", (slice(0, 16),), np.uint16, False),
                ("model.layers.1.mlp.weight", (slice(5, 5), slice(0, 16)), np.float16, False),
                ("lm_head.steps", (slice(1, 4),), np.int64, False)]

    def filled(where: str) -> list:
        checkpoint = open_checkpoint(where)
        blocks = []
        for name, index, dtype, transposed in requests:
            entry = checkpoint.inventory[tuple(name.split("."))]
            shape = tuple(len(range(*part.indices(n))) for part, n in zip(index, entry.shape))
            out = np.zeros(shape[::-1], dtype).T if transposed else np.zeros(shape, dtype)
            blocks.append((entry, index, out))
        checkpoint.read_blocks(blocks)
        return [out for _, _, out in blocks]

    remote, here = filled(url), filled(str(local))
    assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(remote, here))
    assert np.array_equal(here[0], expected["model.embed.weight"][8:24].numpy())
