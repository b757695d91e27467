"""``dcp.load(..., checkpoint_id="s3://..."/"gs://...")`` through ckptshim's remote reader, against
the real local servers (moto's S3 server and the GCS emulator).

Where ckptshim remaps keys (a plain DCP checkpoint into a ``torch.compile``d model), it reads the
checkpoint itself: ``.metadata`` under a size cap through its safe unpickler (DCP's pickling
metadata read never runs), chunks by the byte ranges the metadata declares. Each case is checked
bit for bit against the same checkpoint downloaded and loaded from a local copy.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader

import ckptshim
from ckptshim.errors import CorruptCheckpointError, UnsafeCheckpointError
from ckptshim.execute import dcp_storage
from ckptshim.storage import objects
from ckptshim.formats import base as formats_base
from support.markers import QUIET

pytestmark = [QUIET, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def build(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8), nn.LayerNorm(8))


def saved(url: str) -> dict[str, torch.Tensor]:
    """A plain model's state dict, saved by DCP itself to ``url``."""
    state = build(seed=0).state_dict()
    dcp.save(state, checkpoint_id=url)
    return state


def download(url: str, into: Path) -> Path:
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    into.mkdir()
    for name in fs.ls(path, detail=False):
        fs.get(name, str(into / name.rsplit("/", 1)[1]))
    return into


def compiled_state() -> dict[str, torch.Tensor]:
    """What a ``torch.compile``d copy of the model asks for: every key under ``_orig_mod.``."""
    return {key: torch.zeros_like(value) for key, value in torch.compile(build(seed=1)).state_dict().items()}


def assert_bit_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key in want:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key].view(torch.uint8), want[key].view(torch.uint8)), key


def never_pickled(monkeypatch) -> None:
    """DCP's own metadata read (``pickle.load``) fails the test if it ever runs."""
    def refuse(*args, **kwargs):
        raise AssertionError("DCP's pickling read_metadata ran")
    monkeypatch.setattr(FileSystemReader, "read_metadata", refuse)


def test_plain_checkpoint_into_compiled_model(bucket, tmp_path, monkeypatch):
    url = f"{bucket}/dcp/plain"
    state = saved(url)
    target = compiled_state()
    ckptshim.uninstall()
    try:
        with pytest.raises(CheckpointException, match="Missing key in checkpoint state_dict: _orig_mod"):
            dcp.load(compiled_state(), checkpoint_id=url)
    finally:
        ckptshim.install()
    never_pickled(monkeypatch)
    dcp.load(target, checkpoint_id=url)
    local = compiled_state()
    dcp.load(local, checkpoint_id=download(url, tmp_path / "copy"))
    assert_bit_exact(target, local)
    assert_bit_exact(target, {f"_orig_mod.{key}": value for key, value in state.items()})


def test_chunks_staged_and_batched(bucket, monkeypatch):
    """A destination that is not the stored bytes (a transposed view) goes through a staging
    buffer; headers and reads in batches of one chunk each."""
    url = f"{bucket}/dcp/staged"
    state = {"w": torch.arange(24, dtype=torch.float32).reshape(4, 6), "b": torch.arange(6, dtype=torch.bfloat16),
             "step": torch.tensor(3)}
    dcp.save(state, checkpoint_id=url)
    monkeypatch.setattr(dcp_storage, "HEADER_BATCH", 1)
    monkeypatch.setattr(objects, "READ_AHEAD_BYTES", 1)
    never_pickled(monkeypatch)
    base = torch.zeros(6, 4)
    target = {"_orig_mod.w": base.t(), "_orig_mod.b": torch.zeros(6, dtype=torch.bfloat16),
              "_orig_mod.step": torch.tensor(0)}
    dcp.load(target, checkpoint_id=url)
    assert torch.equal(base.t(), state["w"]) and torch.equal(target["_orig_mod.b"], state["b"])
    assert int(target["_orig_mod.step"]) == 3


def test_names_that_fit_read_chunks_through_torch(bucket, monkeypatch):
    """Nothing to remap: the metadata is still read by ckptshim (never pickled), the chunks by
    torch's own FsspecReader data path."""
    url = f"{bucket}/dcp/fits"
    state = saved(url)
    never_pickled(monkeypatch)
    read_by_torch = []
    native_read = FileSystemReader.read_data
    monkeypatch.setattr(FileSystemReader, "read_data",
                        lambda self, plan, planner: read_by_torch.append(len(plan.items)) or native_read(self, plan, planner))
    target = {key: torch.zeros_like(value) for key, value in state.items()}
    dcp.load(target, checkpoint_id=url)
    assert_bit_exact(target, state)
    assert read_by_torch == [len(state)]


class Payload:
    """Unpickled, makes a folder: proof that a pickle ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


def test_hostile_metadata_refused_unread_by_pickle(bucket, tmp_path):
    import fsspec

    url = f"{bucket}/dcp/hostile"
    state = saved(url)
    marker = tmp_path / "ran"
    fs, path = fsspec.core.url_to_fs(url)
    fs.pipe(f"{path}/.metadata", pickle.dumps(Payload(marker)))
    target = {key: torch.zeros_like(value) for key, value in state.items()}
    with pytest.raises(CheckpointException) as raised:
        dcp.load(target, checkpoint_id=url)
    (error, _trace), = raised.value.failures.values()
    assert isinstance(error, UnsafeCheckpointError) and "posix.mkdir" in str(error), error
    assert not marker.exists()


def test_metadata_larger_than_the_cap_is_not_fetched(bucket, monkeypatch):
    url = f"{bucket}/dcp/capped"
    saved(url)
    monkeypatch.setattr(formats_base, "ALLOWANCE_BYTES", 64)  # what metadata_limit allows beyond the arrays
    with pytest.raises(CheckpointException) as raised:
        dcp.load(compiled_state(), checkpoint_id=url)
    (error, _trace), = raised.value.failures.values()
    assert isinstance(error, CorruptCheckpointError) and ".metadata is" in str(error) and "more than the" in str(error), error


@pytest.mark.parametrize("remap", [True, False], ids=["remapped", "names-match"])
def test_truncated_chunk_file_refused_before_any_write(bucket, remap):
    """Whoever reads the chunks (ckptshim where it remaps, torch's own reader where the names
    match), every file is checked against ``.metadata`` before any byte is written."""
    import fsspec

    url = f"{bucket}/dcp/truncated"
    state = saved(url)
    fs, path = fsspec.core.url_to_fs(url)
    data_file = next(name for name in fs.ls(path, detail=False) if name.endswith(".distcp"))
    fs.pipe(data_file, fs.cat_file(data_file)[:-100])
    target = compiled_state() if remap else {key: torch.zeros_like(value) for key, value in state.items()}
    with pytest.raises(CheckpointException) as raised:
        dcp.load(target, checkpoint_id=url)
    (error, _trace), = raised.value.failures.values()
    assert isinstance(error, CorruptCheckpointError) and "bytes, but its metadata needs" in str(error), error
    assert all(not value.any() for value in target.values())


def test_caller_reader_keeps_working(bucket):
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    url = f"{bucket}/dcp/own_reader"
    state = saved(url)
    target = compiled_state()
    dcp.load(target, storage_reader=FsspecReader(url))
    assert_bit_exact(target, {f"_orig_mod.{key}": value for key, value in state.items()})


def test_url_ckptshim_cannot_read_is_dcps(bucket):
    """Nothing below the prefix: DCP's own load runs, and its own error stands."""
    def failures(error: CheckpointException) -> list[str]:
        return [f"{type(e).__name__}: {e}" for e, _trace in error.failures.values()]

    with pytest.raises(CheckpointException) as native:
        ckptshim.uninstall()
        try:
            dcp.load(compiled_state(), checkpoint_id=f"{bucket}/dcp/nothing")
        finally:
            ckptshim.install()
    with pytest.raises(CheckpointException) as shimmed:
        dcp.load(compiled_state(), checkpoint_id=f"{bucket}/dcp/nothing")
    assert failures(shimmed.value) == failures(native.value)
    assert any("holds no .metadata" in note or "does not read it" in note for note in shimmed.value.__notes__)


def test_two_ranks_each_read_only_their_own_file_from_the_bucket(s3_server, tmp_path):
    """Two gloo ranks save an FSDP2 model to S3 with DCP's own writer (one data file per rank),
    then load it into a compiled FSDP2 model: ckptshim remaps and reads from the bucket, each
    rank exactly its own shards. A rank reads no byte of the other rank's file beyond the values
    every rank holds whole (which DCP's save wrote once, into one rank's file)."""
    import json
    import subprocess
    import sys

    from support.processes import environment, worker

    url = f"{s3_server.new_bucket()}/fsdp2"
    env = {k: v for k, v in environment().items() if not k.startswith("CKPTSHIM_")}
    try:
        run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                              worker("remote_dcp_worker.py"), url, str(tmp_path)],
                             capture_output=True, text=True, timeout=300, env=env, check=False)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"the two ranks hung: {error.stdout}{error.stderr}")
    assert run.returncode == 0, run.stdout + run.stderr
    for rank in range(2):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert results == {"case_save_then_load_compiled": "ok"}, results
        found = json.loads((tmp_path / f"reads{rank}.json").read_text())
        foreign = [(name, start, start + length) for name, length, start in found["reads"]
                   if name.endswith(".distcp") and name != f"__{rank}_0.distcp"]
        assert all(any(name == file and first <= start and end <= last for file, first, last in found["whole"])
                   for name, start, end in foreign), (foreign, found["whole"])
        assert any(name == f"__{rank}_0.distcp" for name, _, _ in found["reads"])
