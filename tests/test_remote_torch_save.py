"""``torch.save`` files and Hugging Face folders of ``pytorch_model.bin`` weights in a bucket (real
local S3 and GCS servers): the zip directory and the pickle read by byte ranges, with the same
parser and allow-list as locally; tensors by their own ranges. ``inspect``, ``convert`` and
``dcp.load(checkpoint_id=URL)`` answer exactly as for a local copy of the same bytes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from huggingface_hub import save_torch_state_dict
from safetensors.torch import load_file

from ckptshim.conversion import convert
from ckptshim.errors import UnknownFormatError
from ckptshim.formats.detect import open_checkpoint
from support.markers import QUIET
from test_remote_safetensors import assert_inspected_alike, inspected, outcome, same, state, upload

pytestmark = [QUIET]

#: A Hugging Face folder of ``pytorch_model.bin`` weights written by transformers 4.30.2's own
#: ``save_pretrained(safe_serialization=False)`` (transformers 5 writes safetensors only).
TRANSFORMERS_BIN = Path(__file__).parent / "fixtures" / "hf_gptneox_tf4.30.2" / "pytorch_model_bin"


def bin_folder(folder: Path, expected: dict, sharded: bool) -> Path:
    """A Hugging Face folder of ``pytorch_model.bin`` weights, written by the hub's own writer
    (``torch.save`` per shard, and ``pytorch_model.bin.index.json`` where sharded)."""
    folder.mkdir()
    save_torch_state_dict(expected, folder, safe_serialization=False, max_shard_size="3KB" if sharded else "10GB")
    assert (folder / "pytorch_model.bin.index.json").exists() == sharded
    return folder


def converted_alike(url: str, local: Path, tmp_path: Path) -> dict:
    """``convert`` of the URL and of the local copy to safetensors give the same bytes."""
    convert(url, tmp_path / "remote.safetensors", to="safetensors", progress=False)
    convert(local, tmp_path / "local.safetensors", to="safetensors", progress=False)
    assert (tmp_path / "remote.safetensors").read_bytes() == (tmp_path / "local.safetensors").read_bytes()
    return load_file(tmp_path / "remote.safetensors")


def test_a_torch_save_file_in_a_bucket(bucket, tmp_path, capsys):
    expected = state()
    local = tmp_path / "model.pt"
    torch.save(expected, local)
    url = f"{bucket}/run/model.pt"
    upload(local, url)
    assert assert_inspected_alike(capsys, url, local)["format"] == "torch-pickle"
    assert same(converted_alike(url, local, tmp_path), expected)


def test_any_name_is_recognised_by_its_bytes(bucket, tmp_path):
    """Lightning's ``.ckpt``, a ``.pth``, a name without suffix: a ``torch.save`` archive is one by
    its first bytes, remotely as locally."""
    local = tmp_path / "last.ckpt"
    torch.save({"state_dict": state(), "epoch": 3}, local)
    upload(local, f"{bucket}/lightning/last.ckpt")
    remote = open_checkpoint(f"{bucket}/lightning/last.ckpt")
    assert remote.format == "torch-pickle" and set(remote.inventory) == set(open_checkpoint(local).inventory)


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_a_hugging_face_folder_of_bin_weights_in_a_bucket(bucket, tmp_path, capsys, sharded):
    expected = state()
    local = bin_folder(tmp_path / "model", expected, sharded)
    url = f"{bucket}/models/tiny"
    upload(local, url)
    assert assert_inspected_alike(capsys, url, local)["format"] == "hf-dir"
    assert same(converted_alike(url, local, tmp_path), expected)


def test_a_folder_transformers_saved_with_bin_weights(bucket, tmp_path, capsys):
    url = f"{bucket}/models/gptneox"
    upload(TRANSFORMERS_BIN, url)
    assert assert_inspected_alike(capsys, url, TRANSFORMERS_BIN)["version"] == "pytorch_model.bin"
    converted_alike(url, TRANSFORMERS_BIN, tmp_path)


def test_tied_and_strided_tensors_read_as_locally(bucket, tmp_path):
    """Tensors that share a storage (tied weights, a transposed view, a slice from an offset)
    are not dense runs of their own bytes: each is read from its storage, as locally; an empty
    tensor and a scalar read as locally too."""
    base = torch.randn(8, 6)
    saved = {"embed": base, "head": base, "transposed": base.t(), "rows": base[2:5], "column": base[:, 1],
             "empty": torch.zeros(0, 3), "scalar": torch.tensor(2.5, dtype=torch.float64)}
    local = tmp_path / "views.pt"
    torch.save(saved, local)
    upload(local, f"{bucket}/views.pt")
    remote, here = open_checkpoint(f"{bucket}/views.pt"), open_checkpoint(local)
    for entry in here.inventory.values():
        assert (remote.read(remote.inventory[entry.key]) == here.read(entry)).all(), entry.key
    assert same(converted_alike(f"{bucket}/views.pt", local, tmp_path),
                {key: value.contiguous() for key, value in saved.items()})


@pytest.mark.parametrize("layout", ["file", "hf-sharded"])
def test_dcp_load_of_torch_save_weights_at_a_url(bucket, tmp_path, layout):
    """``dcp.load(checkpoint_id=URL)`` of what DCP cannot read (no ``.metadata``), into a
    ``torch.compile``d model's state dict: read through ckptshim by byte ranges, bit for bit
    what the same load from the local copy gives."""
    import torch.distributed.checkpoint as dcp

    expected = state()
    if layout == "file":
        local = tmp_path / "model.pt"
        torch.save(expected, local)
        url = f"{bucket}/weights/model.pt"
    else:
        local = bin_folder(tmp_path / "model", expected, sharded=True)
        url = f"{bucket}/weights/tiny"
    upload(local, url)
    loaded = {}
    for where in (url, str(local)):
        into = {f"_orig_mod.{k}": torch.zeros_like(v) for k, v in expected.items()}
        dcp.load(into, checkpoint_id=where, no_dist=True)
        loaded[where] = {k.removeprefix("_orig_mod."): v for k, v in into.items()}
    assert same(loaded[url], expected) and same(loaded[str(local)], expected)


def test_the_archive_is_opened_in_few_round_trips(bucket, tmp_path, monkeypatch):
    """The ends of the archive in one batch, the pickle and every storage's local header in at
    most one more: never a request per tensor."""
    from ckptshim.storage import ranged

    expected = {f"layers.{i}.weight": torch.randn(64, 64) for i in range(40)}  # 640 KiB: past both ends
    local = tmp_path / "model.pt"
    torch.save(expected, local)
    upload(local, f"{bucket}/big.pt")
    batches: list[int] = []
    real = ranged.read_ranges

    def recorded(ranges, buffers=None):
        batches.append(len(ranges))
        return real(ranges, buffers)

    monkeypatch.setattr(ranged, "read_ranges", recorded)
    checkpoint = open_checkpoint(f"{bucket}/big.pt")
    assert checkpoint.complete and len(checkpoint.inventory) == 40
    assert len(batches) <= 2, batches


def _damaged(raw: bytes, damage: str) -> bytes:
    directory = raw.index(b"PK\x01\x02")  # data.pkl's entry, first in the central directory
    if damage == "truncated":
        return raw[:len(raw) // 2]
    if damage == "directory offset past the end":  # in the zip64 record torch writes, which zipfile reads
        end = raw.rindex(b"PK\x06\x06") + 48
        return raw[:end] + (len(raw) * 2).to_bytes(8, "little") + raw[end + 8:]
    if damage == "member compressed":
        return raw[:directory + 10] + b"\x08\x00" + raw[directory + 12:]
    assert damage == "directory entry garbled"
    return raw[:directory] + b"XXXX" + raw[directory + 4:]


@pytest.mark.parametrize("damage", ["truncated", "directory offset past the end", "member compressed",
                                    "directory entry garbled"])
def test_a_damaged_archive_is_refused_as_locally(bucket, tmp_path, damage):
    local = tmp_path / "model.pt"
    torch.save(state(), local)
    local.write_bytes(_damaged(local.read_bytes(), damage))
    upload(local, f"{bucket}/m.pt")
    remote = outcome(f"{bucket}/m.pt")
    assert remote == outcome(str(local)) and remote != "complete"


def test_a_missing_shard_is_reported_as_locally(bucket, tmp_path, capsys):
    local = bin_folder(tmp_path / "model", state(), sharded=True)
    next(local.glob("pytorch_model-00001-*.bin")).unlink()
    upload(local, f"{bucket}/models/tiny")
    code, remote = inspected(capsys, f"{bucket}/models/tiny")
    local_code, here = inspected(capsys, str(local))
    assert code == local_code == 1 and not remote["complete"]
    assert remote["problems"] == here["problems"]
    assert [f for f in remote["files"] if f["size"] is None] == [f for f in here["files"] if f["size"] is None] != []


def test_a_legacy_torch_save_file_says_to_download_it(bucket, tmp_path):
    """A pre-1.6 ``torch.save`` file (a bare pickle, its storages after it with no directory) is
    not read by ranges; the refusal says what to do."""
    local = tmp_path / "old.pt"
    torch.save(state(), local, _use_new_zipfile_serialization=False)
    upload(local, f"{bucket}/old.pt")
    with pytest.raises(UnknownFormatError, match="legacy format.*Download it.*re-save it"):
        open_checkpoint(f"{bucket}/old.pt")


def test_a_legacy_file_at_a_url_is_dcps_own_to_load(bucket, tmp_path):
    """``dcp.load`` of a legacy file at a URL is DCP's own call, with ckptshim's note saying why."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    local = tmp_path / "old.pt"
    torch.save(state(), local, _use_new_zipfile_serialization=False)
    upload(local, f"{bucket}/old.pt")
    into = {k: torch.zeros_like(v) for k, v in state().items()}
    with pytest.raises(CheckpointException) as raised:  # DCP's own: it finds no .metadata
        dcp.load(into, checkpoint_id=f"{bucket}/old.pt", no_dist=True)
    assert any("legacy format" in note for note in getattr(raised.value, "__notes__", ())), raised.value


def test_a_shard_of_another_kind_in_the_folder_is_not_read(bucket, tmp_path):
    """Weights chosen as ``from_pretrained`` chooses them: a ``model.safetensors`` beside the
    ``.bin`` wins, remotely as locally."""
    from safetensors.torch import save_file

    local = bin_folder(tmp_path / "model", state(), sharded=False)
    other = {k: torch.zeros_like(v) for k, v in state().items()}
    save_file(other, local / "model.safetensors")
    upload(local, f"{bucket}/both")
    assert open_checkpoint(f"{bucket}/both").version == open_checkpoint(local).version == "model.safetensors"



def test_a_local_legacy_file_is_named_as_such(tmp_path):
    """Locally too, a legacy ``torch.save`` file is named for what it is (not taken for an empty
    msgpack map, which its first byte also is), with what to do."""
    local = tmp_path / "old.pt"
    torch.save(state(), local, _use_new_zipfile_serialization=False)
    with pytest.raises(UnknownFormatError, match="legacy format.*re-save it") as refused:
        open_checkpoint(local)
    assert "Download" not in str(refused.value)
