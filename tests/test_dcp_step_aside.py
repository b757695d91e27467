"""``dcp.load`` with ckptshim keeps every DCP feature torch has: torch's reader machinery stays the
reference for data, and where ckptshim has nothing to add the load is DCP's own.

- Chunks written through DCP's stream extensions (``ZStandard``; a transform of the caller's own,
  registered in the ``ExtensionRegistry`` they pass) are read by torch's ``FileSystemReader``
  itself, and still through ckptshim's key mapping where names differ; a plain chunk is read by
  ckptshim, straight into its destination. Objects stored through a transform must still pass
  ``torch.load(weights_only=True)`` before anything is written.
- A Megatron-Core style ``.metadata`` -- DCP's own ``SavePlan``s kept in
  ``Metadata.all_local_plans`` by a ``DefaultSavePlanner`` subclass, as Megatron-Core's does -- is
  DCP's own data: inspected, and loaded as without ckptshim.
- A checkpoint in object storage, a missing folder: DCP's own call and error.

Every checkpoint is written by DCP's own ``dcp.save``; every load is compared with the same
load without ckptshim, bit for bit.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from typing import IO

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension, ZStandard
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from ckptshim.errors import UnsafeCheckpointError
from ckptshim.formats.detect import open_checkpoint
from support.fixtures import fixture_module
from support.markers import QUIET
from support.native import natively, raised, same_error

pytestmark = QUIET
build = fixture_module("torch_dcp_single/dcp_tiny_model.py").build


class Xor(StreamTransformExtension):
    """A transform of the caller's own: every byte XORed with a key (stands in for encryption)."""

    KEY = 0x5A

    @staticmethod
    def registry_name() -> str:
        return "test.xor"

    @staticmethod
    def from_descriptor(version: str) -> Xor:
        return Xor()

    def get_descriptor(self) -> str:
        return f"{self.registry_name()}/1"

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        return _XorStream(output, writing=True)

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        return _XorStream(input, writing=False)


class _XorStream(io.RawIOBase):
    def __init__(self, inner: IO[bytes], writing: bool) -> None:
        super().__init__()
        self.inner, self.writing = inner, writing

    def readable(self) -> bool:
        return not self.writing

    def writable(self) -> bool:
        return self.writing

    def readinto(self, buffer) -> int:
        data = self.inner.read(len(buffer))
        buffer[:len(data)] = bytes(b ^ Xor.KEY for b in data)
        return len(data)

    def write(self, data) -> int:
        self.inner.write(bytes(b ^ Xor.KEY for b in bytes(data)))
        return len(data)

    def flush(self) -> None:
        self.inner.flush()


def saved(state: dict) -> dict:
    """The tiny model's state and a stored object, as a training script saves them."""
    return {"model": state, "step": 7}


def values(state: dict) -> dict:
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state["model"].items()} | {"step": state["step"]}


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key].view(torch.uint8) if a[key].dtype.is_floating_point else a[key],
                               b[key].view(torch.uint8) if b[key].dtype.is_floating_point else b[key]), key
        else:
            assert a[key] == b[key], key


def fresh(seed: int = 5) -> dict:
    return {"model": build(seed=seed).state_dict(), "step": 0}


def torch_reads(monkeypatch) -> list[int]:
    """Count the read items torch's own ``FileSystemReader.read_data`` reads."""
    counted: list[int] = []
    original = FileSystemReader.read_data

    def read_data(self, plan, planner):
        counted.append(len(plan.items))
        return original(self, plan, planner)
    monkeypatch.setattr(FileSystemReader, "read_data", read_data)
    return counted


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict:
    """The tiny model saved plainly, with ZStandard, with the caller's own Xor transform, and by
    a planner that keeps every rank's plan in the metadata (Megatron-Core's way)."""
    root = tmp_path_factory.mktemp("dcp_features")
    state = saved(build(seed=1).state_dict())
    registry = ExtensionRegistry()
    registry.register(Xor)

    class KeepPlans(DefaultSavePlanner):
        def create_global_plan(self, all_plans):
            plans, metadata = super().create_global_plan(all_plans)
            metadata.all_local_plans = all_plans
            return plans, metadata

    dcp.save(state, storage_writer=FileSystemWriter(root / "plain"))
    dcp.save(state, storage_writer=FileSystemWriter(root / "zstd", _extensions=[ZStandard()]))
    dcp.save(state, storage_writer=FileSystemWriter(root / "xor", _extensions=[Xor()]))
    dcp.save(state, checkpoint_id=root / "megatron", planner=KeepPlans())
    return {"root": root, "state": values(state), "registry": registry}


def load(folder, registry=None, state=None) -> dict:
    target = state if state is not None else fresh()
    reader = FileSystemReader(folder, _extension_registry=registry) if registry is not None else None
    if reader is None:
        dcp.load(target, checkpoint_id=folder)
    else:
        dcp.load(target, storage_reader=reader)
    return target


@pytest.mark.parametrize("name", ["zstd", "xor"])
def test_stream_extensions_are_read_by_torchs_own_reader(written, name, monkeypatch):
    registry = written["registry"] if name == "xor" else None
    native = natively(lambda: values(load(written["root"] / name, registry)))
    assert_same(native, written["state"])
    reads = torch_reads(monkeypatch)
    assert_same(values(load(written["root"] / name, registry)), native)
    assert sum(reads) == len(native) - 1  # every tensor through torch's reader; the object checked by ckptshim


def test_plain_chunks_are_read_by_ckptshim(written, monkeypatch):
    reads = torch_reads(monkeypatch)
    assert_same(values(load(written["root"] / "plain")), written["state"])
    assert reads == []


@pytest.mark.parametrize("name", ["zstd", "xor"])
def test_stream_extensions_with_ckptshims_key_mapping(written, name):
    """Names that differ (a compiled model) are mapped by ckptshim; the bytes still come through
    the caller's extensions, by torch's reader."""
    registry = written["registry"] if name == "xor" else None
    compiled = {"model": torch.compile(build(seed=5)).state_dict(), "step": 0}
    load(written["root"] / name, registry, compiled)
    renamed = {k.removeprefix("_orig_mod."): v for k, v in compiled["model"].items()} | {"step": compiled["step"]}
    assert_same(renamed, written["state"])


def test_custom_transform_without_its_registry_is_dcps_own_error(written):
    error = same_error(raised(lambda: load(written["root"] / "xor")),
                       raised(lambda: natively(lambda: load(written["root"] / "xor"))))
    assert "test.xor" in str(error)


class Payload:
    """An object DCP stores with ``torch.save`` and its default planner unpickles without limits."""

    ran = False

    def __setstate__(self, state) -> None:
        Payload.ran = True


def test_object_stored_through_a_transform_must_still_pass_weights_only(tmp_path):
    folder = tmp_path / "payload"
    natively(lambda: dcp.save({"model": build(seed=1).state_dict(), "extra": Payload()},
                              storage_writer=FileSystemWriter(folder, _extensions=[ZStandard()])))
    target = {"model": build(seed=5).state_dict(), "extra": None}
    before = {k: v.clone() for k, v in target["model"].items()}
    with pytest.raises(CheckpointException) as error:
        dcp.load(target, checkpoint_id=folder)
    (failure, _trace), = error.value.failures.values()
    assert isinstance(failure, UnsafeCheckpointError) and "Payload" in str(failure)
    assert not Payload.ran and all(torch.equal(v, before[k]) for k, v in target["model"].items())


def test_megatron_style_metadata_with_all_local_plans(written):
    """DCP's own ``SavePlan``s (write items, chunk and tensor properties, ``torch.Size``s, enum
    members, the file system writer's storage prefix) are inert data ckptshim reads as torch does."""
    folder = written["root"] / "megatron"
    metadata = natively(lambda: FileSystemReader(folder).read_metadata())
    assert metadata.all_local_plans[0].items  # the plans really are there
    checkpoint = open_checkpoint(folder)
    assert checkpoint.complete and len(checkpoint.inventory) == len(written["state"])
    native = natively(lambda: values(load(folder)))
    assert_same(values(load(folder)), native)
    assert_same(native, written["state"])
    compiled = {"model": torch.compile(build(seed=5)).state_dict(), "step": 0}
    load(folder, state=compiled)  # through ckptshim's key mapping too
    assert_same({k.removeprefix("_orig_mod."): v for k, v in compiled["model"].items()} | {"step": 7},
                written["state"])


def test_megatron_style_metadata_inspects(written):
    run = subprocess.run([sys.executable, "-m", "ckptshim", "inspect", "--json", str(written["root"] / "megatron")],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["format"] == "torch-dcp"


@pytest.mark.parametrize("where", ["s3://ckptshim-test-bucket/step_1", "gs://ckptshim-test-bucket/step_1"])
def test_object_storage_is_dcps_own_call(where):
    same_error(raised(lambda: dcp.load(fresh(), checkpoint_id=where)),
               raised(lambda: natively(lambda: dcp.load(fresh(), checkpoint_id=where))))


def test_missing_folder_is_dcps_own_error(tmp_path):
    where = tmp_path / "never_saved"
    error = same_error(raised(lambda: dcp.load(fresh(), checkpoint_id=where)),
                       raised(lambda: natively(lambda: dcp.load(fresh(), checkpoint_id=where))))
    assert "No such file or directory" in str(error)


def test_rank_metadata_without_collectives_is_read_as_dcp_reads_it(tmp_path):
    """``dcp.save(use_collectives=False)`` writes ``__0.metadata``; DCP reads it after
    ``.metadata`` is not found, and so does ckptshim (torch's own error for the first try)."""
    folder = tmp_path / "no_collectives"
    state = saved(build(seed=2).state_dict())
    natively(lambda: dcp.save(state, checkpoint_id=folder, no_dist=True, use_collectives=False))
    assert (folder / "__0.metadata").is_file() and not (folder / ".metadata").exists()
    assert_same(values(load(folder)), values(state))
    compiled = {"model": torch.compile(build(seed=5)).state_dict(), "step": 0}
    load(folder, state=compiled)
    assert_same({k.removeprefix("_orig_mod."): v for k, v in compiled["model"].items()} | {"step": 7}, values(state))


def test_dcps_own_planner_errors_are_dcps(tmp_path, written):
    """A key the checkpoint lacks, in a strict load, with nothing to rename: DCP's own error."""
    target = fresh()
    target["model"]["extra.weight"] = torch.zeros(2)
    error = same_error(raised(lambda: load(written["root"] / "plain", state=target)),
                       raised(lambda: natively(lambda: load(written["root"] / "plain", state=target))))
    assert "Missing key in checkpoint state_dict: model.extra.weight" in str(error)


def test_a_dcp_folder_beside_megatrons_latest_iteration_file_is_read_as_dcp_reads_it(tmp_path):
    """A folder with DCP metadata of its own is what DCP reads, whatever else lies in it: a
    ``latest_checkpointed_iteration.txt`` there (Megatron-LM's save-root marker) sends ckptshim to
    no iteration folder."""
    folder = tmp_path / "with_latest"
    state = saved(build(seed=2).state_dict())
    natively(lambda: dcp.save(state, checkpoint_id=folder, no_dist=True))
    (folder / "latest_checkpointed_iteration.txt").write_text("1000")
    assert_same(values(load(folder)), values(natively(lambda: load(folder))))
    assert_same(values(load(folder)), values(state))
