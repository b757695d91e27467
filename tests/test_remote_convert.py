"""``ckptshim convert SRC URL``: written to a real local S3 or GCS server under a temporary prefix,
copied into place, a folder marked complete last; read back by the frameworks' own remote readers
(torch's ``FsspecReader``, safetensors over fsspec) bit for bit. A failure while writing leaves no
object under DST's name, and an existing DST is refused without ``--force``."""

from __future__ import annotations

import json
from pathlib import Path

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from safetensors.torch import load as load_safetensors
from safetensors.torch import save_file
from torch import nn

from ckptshim import cli
from ckptshim.conversion import ConvertError, convert
from ckptshim.conversion.atomic import DestinationError, DestinationExistsError
from ckptshim.conversion.bucket import MARKER
from ckptshim.storage.objects import filesystem
from support.markers import QUIET

pytestmark = [QUIET, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    return {k: v.detach().clone() for k, v in model.state_dict().items()} | {
        "extra.half": torch.randn(3, 5).to(torch.bfloat16), "extra.steps": torch.arange(7)}


def local_dcp(tmp_path: Path) -> tuple[Path, dict]:
    expected = state()
    dcp.save(expected, checkpoint_id=tmp_path / "src")
    return tmp_path / "src", expected


def objects_below(url: str) -> list[str]:
    fs, path = fsspec.core.url_to_fs(url)
    fs.invalidate_cache()
    found = fs.find(path, withdirs=False)
    return sorted(name[len(path):] for name in found if name == path or name.startswith(path + "/"))


def same(got: dict, expected: dict) -> bool:
    return got.keys() == expected.keys() and all(
        got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in expected.items())


def test_convert_to_safetensors_in_a_bucket_reads_back_bit_exact(bucket, tmp_path, capsys):
    source, expected = local_dcp(tmp_path)
    url = f"{bucket}/out/model.safetensors"
    assert cli.main(["convert", str(source), url, "--to", "safetensors", "--no-progress"]) == 0
    assert f"wrote {url}" in capsys.readouterr().out
    fs, path = fsspec.core.url_to_fs(url)
    assert same(load_safetensors(fs.cat_file(path)), expected)
    assert objects_below(f"{bucket}/out") == ["/model.safetensors"]  # no temporary prefix left


def test_convert_to_dcp_in_a_bucket_reads_back_with_fsspec_reader(bucket, tmp_path):
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    source, expected = local_dcp(tmp_path)
    url = f"{bucket}/out/step_1"
    convert(source, url, to="dcp", progress=False)
    loaded = {k: torch.zeros_like(v) for k, v in expected.items()}
    dcp.load(loaded, storage_reader=FsspecReader(url), no_dist=True)
    assert same(loaded, expected)
    listed = objects_below(url)
    assert f"/{MARKER}" in listed and "/.metadata" in listed
    fs, path = fsspec.core.url_to_fs(f"{url}/{MARKER}")
    marker = json.loads(fs.cat_file(path))
    assert sorted(f"/{name}" for name in marker["objects"]) == [name for name in listed if name != f"/{MARKER}"]
    assert objects_below(f"{bucket}/out") == [f"/step_1{name}" for name in listed]


def test_convert_from_a_bucket_to_a_bucket(bucket, tmp_path):
    source, expected = local_dcp(tmp_path)
    convert(source, f"{bucket}/a", to="dcp", progress=False)
    convert(f"{bucket}/a", f"{bucket}/b.safetensors", to="safetensors", progress=False)
    fs, path = fsspec.core.url_to_fs(f"{bucket}/b.safetensors")
    assert same(load_safetensors(fs.cat_file(path)), expected)
    with pytest.raises(ConvertError, match="overlaps the source"):
        convert(f"{bucket}/a", f"{bucket}/a/inner", to="dcp", progress=False)


@pytest.mark.parametrize("to, name", [("dcp", "step_1"), ("safetensors", "model.safetensors")])
def test_a_failure_while_writing_leaves_nothing_under_the_name(bucket, tmp_path, to, name):
    source, _ = local_dcp(tmp_path)
    written = []

    def fail_after_one(key: str) -> None:
        written.append(key)
        raise RuntimeError("stopped after the first array")

    # DCP's saver wraps the writer's exception in its CheckpointException, a BaseException
    with pytest.raises(BaseException, match="stopped after the first array"):
        convert(source, f"{bucket}/out/{name}", to=to, progress=False, on_array=fail_after_one)
    assert written  # the writer had begun
    assert objects_below(f"{bucket}/out") == []  # neither DST nor the temporary prefix


def test_a_failure_while_copying_into_place_removes_what_was_copied(bucket, tmp_path, monkeypatch):
    source, _ = local_dcp(tmp_path)
    fs = filesystem(bucket.partition(":")[0])  # the client instance convert writes through
    copies = []
    real_copy = fs._cp_file

    async def copy_then_fail(path1, path2, **kwargs):  # one server-side copy of one object
        if copies:
            raise OSError("connection reset (injected)")
        copies.append(path2)
        return await real_copy(path1, path2, **kwargs)

    monkeypatch.setattr(fs, "_cp_file", copy_then_fail)
    with pytest.raises(DestinationError, match="Nothing was left at"):
        convert(source, f"{bucket}/out/step_1", to="dcp", progress=False)
    assert copies  # one object had reached the final name
    assert objects_below(f"{bucket}/out") == []


def test_an_existing_destination_needs_force(bucket, tmp_path):
    source, expected = local_dcp(tmp_path)
    url = f"{bucket}/out/model.safetensors"
    fs, path = fsspec.core.url_to_fs(url)
    fs.pipe_file(path, b"someone else's object")
    with pytest.raises(DestinationExistsError, match="pass --force"):
        convert(source, url, to="safetensors", progress=False)
    assert fs.cat_file(path) == b"someone else's object"
    assert objects_below(f"{bucket}/out") == ["/model.safetensors"]
    convert(source, url, to="safetensors", force=True, progress=False)
    assert same(load_safetensors(fs.cat_file(path)), expected)


def test_force_replaces_a_folder_entirely(bucket, tmp_path):
    source, expected = local_dcp(tmp_path)
    url = f"{bucket}/out/ckpt"
    fs, path = fsspec.core.url_to_fs(url)
    fs.pipe_file(f"{path}/stale.distcp", b"old")
    with pytest.raises(DestinationExistsError):
        convert(source, url, to="dcp", progress=False)
    convert(source, url, to="dcp", force=True, progress=False)
    assert "/stale.distcp" not in objects_below(url)


def test_orbax_to_a_bucket_is_refused_before_reading(bucket, tmp_path):
    file = tmp_path / "m.safetensors"
    save_file(state(), file)
    with pytest.raises(ConvertError, match="not orbax"):
        convert(file, f"{bucket}/out", to="orbax", progress=False)
    assert objects_below(f"{bucket}/out") == []


@pytest.mark.parametrize("to, objects", [("dcp", None), ("safetensors", "model.safetensors")])
def test_a_converted_folder_missing_an_object_its_marker_lists_is_incomplete(bucket, tmp_path, capsys, to, objects):
    """A reader of a folder that ``convert`` wrote to a bucket checks its marker: complete as
    written; with an object the marker lists gone (a DCP rank file), or replaced by one of
    another size, an
    incomplete checkpoint naming the object (``inspect`` and ``dcp.load`` alike), the destination
    untouched."""
    source, expected = local_dcp(tmp_path)
    url = f"{bucket}/out/converted"
    convert(source, url, to=to, progress=False)
    loaded = {k: torch.zeros_like(v) for k, v in expected.items()}
    dcp.load(loaded, checkpoint_id=url, no_dist=True)
    assert same(loaded, expected)
    fs, path = fsspec.core.url_to_fs(url)
    marker = json.loads(fs.cat_file(f"{path}/{MARKER}"))
    victim = objects or next(name for name in sorted(marker["objects"]) if name.endswith(".distcp"))
    data = fs.cat_file(f"{path}/{victim}")
    damages = [(lambda: fs.pipe_file(f"{path}/{victim}", data + b"\0" * 8), f"{len(data) + 8:,} bytes, but {MARKER} says")]
    if to == "dcp":  # a folder that lost its only weights object is no checkpoint at all (inspect says so)
        damages.insert(0, (lambda: fs.rm_file(f"{path}/{victim}"), "missing"))
    for damage, words in damages:
        damage()
        fs.invalidate_cache()
        assert cli.main(["inspect", url]) != 0
        assert f"{victim}: {words}" in capsys.readouterr().err
        untouched = {k: torch.zeros_like(v) for k, v in expected.items()}
        with pytest.raises(CheckpointException, match=rf"is incomplete(.|\n)*{victim}: {words}"):
            dcp.load(untouched, checkpoint_id=url, no_dist=True)
        assert all(not v.any() for v in untouched.values())
