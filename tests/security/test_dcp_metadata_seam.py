"""DCP's own readers read ``.metadata`` through ckptshim's allow-list on every load, not only where
ckptshim reads the checkpoint itself.

Where ckptshim steps aside from a ``dcp.load`` -- a URL it does not read (``s3a://``,
``simplecache::s3://``, ``s3:///``), a reader the caller built -- torch's ``FileSystemReader`` or
``FsspecReader`` reads the checkpoint. Without ckptshim, its ``read_metadata`` is a plain
``pickle.load``, and a hostile ``.metadata`` runs code (each case shows it does); with ckptshim,
no code runs, and a benign checkpoint loads bit for bit as without it. Against the real local S3
server.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import fsspec
import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

import ckptshim  # noqa: E402
from torch.distributed.checkpoint import CheckpointException, FileSystemReader  # noqa: E402
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")

#: URLs of one ``s3://BUCKET/KEY`` that fsspec reads and ckptshim does not: DCP's own load runs.
SPELLINGS = {"s3a": "s3a://{bucket}/{key}", "simplecache": "simplecache::s3://{bucket}/{key}",
             "empty host": "s3:///{bucket}/{key}"}


class Payload:
    """Unpickled, makes a folder: proof that a pickle ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


def _state() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.arange(4, dtype=torch.bfloat16)}


def _load(state: dict, *, hooked: bool, **where) -> BaseException | None:
    (ckptshim.install if hooked else ckptshim.uninstall)()
    try:
        dcp.load(state, **where)
    except BaseException as error:  # noqa: BLE001 - CheckpointException is a BaseException
        return error
    finally:
        ckptshim.install()
    return None


def _refusals(error: BaseException | None) -> str:
    assert isinstance(error, CheckpointException), error
    return "\n".join(str(failure) for failure, _trace in error.failures.values())


@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_hostile_metadata_runs_no_code_however_the_url_is_spelled(s3_server, tmp_path, spelling):
    url = f"{s3_server.new_bucket()}/dcp/hostile"
    dcp.save(_state(), checkpoint_id=url)
    fs, path = fsspec.core.url_to_fs(url)
    bucket, _, key = path.partition("/")
    spelled = SPELLINGS[spelling].format(bucket=bucket, key=key)
    for hooked in (False, True):
        marker = tmp_path / f"ran-{hooked}"
        fs.pipe(f"{path}/.metadata", pickle.dumps(Payload(marker)))
        error = _load({key: torch.zeros_like(value) for key, value in _state().items()},
                      hooked=hooked, checkpoint_id=spelled)
        assert error is not None
        assert marker.exists() is not hooked, f"hooked={hooked}: {error}"
    assert "posix.mkdir" in _refusals(error)


@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_a_load_ckptshim_steps_aside_from_reads_its_metadata_as_torch_does(s3_server, spelling):
    url = f"{s3_server.new_bucket()}/dcp/benign"
    expected = _state()
    dcp.save(expected, checkpoint_id=url)
    _, path = fsspec.core.url_to_fs(url)
    bucket, _, key = path.partition("/")
    spelled = SPELLINGS[spelling].format(bucket=bucket, key=key)
    loaded = []
    for hooked in (False, True):
        target = {key: torch.zeros_like(value) for key, value in expected.items()}
        assert _load(target, hooked=hooked, checkpoint_id=spelled) is None
        loaded.append(target)
    for got in loaded:
        assert all(torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)) for k, v in expected.items())


@pytest.mark.parametrize("reader", [FsspecReader, type("OwnReader", (FileSystemReader,), {})])
def test_a_reader_the_caller_built_reads_hostile_local_metadata_safely(tmp_path, reader):
    """The caller's reader runs untouched but for its metadata read: a plain ``pickle.load``
    inherited from torch's ``FileSystemReader`` is ckptshim's allow-listed read."""
    folder = tmp_path / "ckpt"
    dcp.save(_state(), checkpoint_id=folder)
    for hooked in (False, True):
        marker = tmp_path / f"ran-{hooked}"
        (folder / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
        error = _load({key: torch.zeros_like(value) for key, value in _state().items()},
                      hooked=hooked, storage_reader=reader(str(folder)))
        assert error is not None
        assert marker.exists() is not hooked, f"hooked={hooked}: {error}"
    assert "posix.mkdir" in _refusals(error)
