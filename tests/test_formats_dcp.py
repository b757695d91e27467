"""The DCP directory format on torch's own fixtures: inventory from ``.metadata`` alone, reads,
completeness, ``ckptshim inspect``, and the allow-listed unpickler (DCP's own classes, read off
torch at run time)."""

from __future__ import annotations

import json
import pickle
import pickletools
from pathlib import Path

import pytest

from ckptshim.cli import main
from ckptshim.errors import CorruptCheckpointError, UnsafeCheckpointError
from ckptshim.formats import dcp
from ckptshim.formats.detect import detect, open_checkpoint
from support.fixtures import FIXTURES, array_sha256, copy_fixture, expected_arrays

DCP = FIXTURES / "torch_dcp_single"
PREFIXES = {"dcp_plain": ("model",), "dcp_compiled": ("model", "_orig_mod"), "dcp_plain_toplevel": ()}


@pytest.mark.parametrize("name", sorted(PREFIXES))
def test_inventory_and_reads_match_manifest(name):
    checkpoint = open_checkpoint(DCP / name)
    expected = expected_arrays("torch_dcp_single")
    assert detect(DCP / name) is dcp and checkpoint.format == "torch-dcp"
    assert checkpoint.version == "dcp 1.0.0" and checkpoint.complete
    assert len(checkpoint.inventory) == len(expected)
    for key, entry in checkpoint.inventory.items():
        assert key[:len(PREFIXES[name])] == PREFIXES[name]
        item = expected[".".join(key[len(PREFIXES[name]):])]
        assert (list(entry.shape), entry.dtype) == (item["shape"], item["dtype"])
        assert array_sha256(checkpoint.read(entry)) == item["sha256"], key


def _copy(tmp_path: Path) -> Path:
    return copy_fixture("torch_dcp_single/dcp_plain", tmp_path)


def test_inspect_lists_chunk_layout_per_rank_file(capsys):
    assert main(["inspect", str(DCP / "dcp_plain"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    (rank_file,) = info["files"]
    assert info["complete"] and info["format"] == "torch-dcp"
    assert rank_file["path"] == "__0_0.distcp" and rank_file["size"] == rank_file["expected_size"] == 446506
    assert rank_file["contents"][0] == "model.pos_emb [0:32, 0:64] bytes 0..9769"
    assert len(rank_file["contents"]) == len(info["entries"]) == 26
    assert info["total_bytes"] == sum(e["bytes"] for e in info["entries"])
    assert main(["inspect", str(DCP / "dcp_plain")]) == 0
    assert "    model.lm_head.weight [0:256, 0:64] bytes 379393..446506" in capsys.readouterr().out


@pytest.mark.parametrize("damage", ["missing", "short"])
def test_missing_or_short_rank_file_is_incomplete(tmp_path, capsys, damage):
    copy = _copy(tmp_path)
    rank_file = copy / "__0_0.distcp"
    if damage == "missing":
        rank_file.unlink()
    else:
        rank_file.write_bytes(rank_file.read_bytes()[:400_000])
    assert main(["inspect", str(copy), "--json"]) == 1
    info = json.loads(capsys.readouterr().out)
    assert info["complete"] is False
    assert info["problems"] == [f"__0_0.distcp: {'missing' if damage == 'missing' else '400000 bytes, but its metadata needs 446506'}"]


def test_forbidden_global_is_refused_by_name(tmp_path):
    copy = _copy(tmp_path)
    data = (copy / ".metadata").read_bytes()
    # opcodes that call os.mkdir(<marker>) and drop the result, spliced in before the metadata
    # object: plain pickle.load would make the folder and still return DCP's Metadata
    marker = tmp_path / "pwned"
    evil = pickletools.optimize(pickle.dumps(_Mkdir(marker), protocol=2))[:-1] + b"0"
    (copy / ".metadata").write_bytes(data[:2] + evil[2:] + data[2:])
    with pytest.raises(UnsafeCheckpointError, match="needs posix.mkdir to unpickle"):
        open_checkpoint(copy)
    assert not marker.exists()


class _Mkdir:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        import os

        return os.mkdir, (str(self.path),)


def test_garbage_metadata_is_corrupt(tmp_path):
    copy = _copy(tmp_path)
    (copy / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": {}}))
    with pytest.raises(CorruptCheckpointError, match="does not hold DCP metadata"):
        open_checkpoint(copy)
    (copy / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(CorruptCheckpointError, match="does not unpickle"):
        open_checkpoint(copy)


@pytest.mark.parametrize("name", sorted(PREFIXES))
def test_metadata_is_what_torchs_own_reader_unpickles(name):
    """The objects ckptshim builds from ``.metadata`` (never running ``pickle.load``) are the
    ones DCP's own ``FileSystemReader`` unpickles, field for field."""
    from torch.distributed.checkpoint import FileSystemReader

    checkpoint = open_checkpoint(DCP / name)
    ours = dcp.to_torch(checkpoint.metadata.records, name)
    theirs = FileSystemReader(DCP / name).read_metadata()
    theirs.storage_meta.load_id = ours.storage_meta.load_id
    assert ours == theirs


def test_metadata_allow_list_is_read_off_torch(tmp_path, monkeypatch):
    """DCP's own dataclasses are enumerated from torch at run time: one that torch's planner module
    defines is inert data (even a class it gained since ckptshim was written); the same class
    from any other module is refused by name, unrun."""
    import dataclasses
    import torch.distributed.checkpoint.planner as planner_module
    from torch.distributed.checkpoint import FileSystemReader

    @dataclasses.dataclass
    class LaterPlan:
        steps: int

    LaterPlan.__module__, LaterPlan.__qualname__ = planner_module.__name__, "LaterPlan"
    monkeypatch.setattr(planner_module, "LaterPlan", LaterPlan, raising=False)
    dcp.dcp_types.cache_clear()
    try:
        copy = _copy(tmp_path)
        metadata = FileSystemReader(copy).read_metadata()
        metadata.later = LaterPlan(steps=3)  # an attribute beside the fields, as Megatron-Core adds its plans
        (copy / ".metadata").write_bytes(pickle.dumps(metadata))
        built = dcp.to_torch(open_checkpoint(copy).metadata.records, str(copy))
        assert built.later == LaterPlan(steps=3) and built == metadata

        LaterPlan.__module__ = __name__  # the very class, not torch's
        monkeypatch.setitem(globals(), "LaterPlan", LaterPlan)
        (copy / ".metadata").write_bytes(pickle.dumps(metadata))
        with pytest.raises(UnsafeCheckpointError, match=rf"needs {__name__}\.LaterPlan to unpickle"):
            open_checkpoint(copy)
    finally:
        dcp.dcp_types.cache_clear()
