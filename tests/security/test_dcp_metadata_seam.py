"""DCP's own readers read ``.metadata`` through ckptshim's allow-list on every load, not only where
ckptshim reads the checkpoint itself.

Where ckptshim steps aside from a ``dcp.load`` -- a URL it does not read (``s3a://``,
``simplecache::s3://``, ``s3:///``), a bucket whose policy denies listing it, a reader the caller
built -- torch's ``FileSystemReader`` or ``FsspecReader`` reads the checkpoint. Without ckptshim, its ``read_metadata`` is a plain
``pickle.load``, and a hostile ``.metadata`` runs code (each case shows it does); with ckptshim,
no code runs, and a benign checkpoint loads bit for bit as without it. Against the real local S3
server (for the denied listing, a moto server that enforces IAM policies).
"""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
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


# -- a bucket whose policy allows reading objects and denies listing them --------------------------


@dataclass(frozen=True)
class PolicedS3:
    """A moto S3 server that enforces IAM policies, with bucket ``BUCKET`` and two users: one
    allowed everything on it (who writes the checkpoints), and one allowed ``s3:GetObject`` and
    denied ``s3:ListBucket``, the usual policy of a public bucket (who loads them)."""

    endpoint: str
    keys: dict[str, tuple[str, str]]

    BUCKET = "public"

    @contextmanager
    def as_user(self, user: str, monkeypatch) -> Iterator[fsspec.AbstractFileSystem]:
        """fsspec's s3 client (the one DCP and ckptshim use) signed as ``user``, then forgotten."""
        key, secret = self.keys[user]
        with monkeypatch.context() as patch:
            for name, value in {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": key,
                                "AWS_SECRET_ACCESS_KEY": secret, "AWS_DEFAULT_REGION": "us-east-1",
                                "AWS_EC2_METADATA_DISABLED": "true"}.items():
                patch.setenv(name, value)
            fsspec.get_filesystem_class("s3").clear_instance_cache()
            try:
                yield fsspec.filesystem("s3")
            finally:
                fsspec.get_filesystem_class("s3").clear_instance_cache()


@pytest.fixture(scope="module")
def policed_s3() -> Iterator[PolicedS3]:
    """moto's server in a thread of this process, its IAM enforcement (``INITIAL_NO_AUTH_ACTION_COUNT``,
    for every request once the users are made) on for this module only."""
    boto3 = pytest.importorskip("boto3")
    from moto import settings
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    root = {"endpoint_url": endpoint, "aws_access_key_id": "testing", "aws_secret_access_key": "testing",
            "region_name": "us-east-1"}
    boto3.client("s3", **root).create_bucket(Bucket=PolicedS3.BUCKET)
    iam = boto3.client("iam", **root)
    bucket, objects = f"arn:aws:s3:::{PolicedS3.BUCKET}", f"arn:aws:s3:::{PolicedS3.BUCKET}/*"
    policies = {
        "writer": [{"Effect": "Allow", "Action": "s3:*", "Resource": [bucket, objects]}],
        "reader": [{"Effect": "Allow", "Action": "s3:GetObject", "Resource": objects},
                   {"Effect": "Deny", "Action": "s3:ListBucket", "Resource": bucket}],
    }
    keys = {}
    for user, statements in policies.items():
        iam.create_user(UserName=user)
        iam.put_user_policy(UserName=user, PolicyName=f"{user}-only",
                            PolicyDocument=json.dumps({"Version": "2012-10-17", "Statement": statements}))
        made = iam.create_access_key(UserName=user)["AccessKey"]
        keys[user] = (made["AccessKeyId"], made["SecretAccessKey"])
    before = settings.INITIAL_NO_AUTH_ACTION_COUNT
    settings.INITIAL_NO_AUTH_ACTION_COUNT = 0  # from now on every request is signed and checked
    try:
        yield PolicedS3(endpoint, keys)
    finally:
        settings.INITIAL_NO_AUTH_ACTION_COUNT = before
        server.stop()


def test_hostile_metadata_runs_no_code_where_listing_the_bucket_is_denied(policed_s3, tmp_path, monkeypatch):
    """Case 4 of issue 31 with the policy itself: the loader may read every object but list none.
    DCP's own reader needs no listing (it opens ``.metadata`` and the rank files by name), so a
    benign checkpoint loads, with and without ckptshim, bit for bit; a hostile ``.metadata`` runs
    code without ckptshim and nothing with it."""
    url = f"s3://{PolicedS3.BUCKET}/dcp/{tmp_path.name}"
    expected = _state()
    with policed_s3.as_user("writer", monkeypatch):
        dcp.save(expected, checkpoint_id=url)
    with policed_s3.as_user("reader", monkeypatch) as fs:
        with pytest.raises(PermissionError):
            fs.ls(url)
        assert fs.cat_file(f"{url}/.metadata")[:1] == b"\x80"  # a pickle, readable by name
        for hooked in (False, True):
            target = {key: torch.zeros_like(value) for key, value in expected.items()}
            assert _load(target, hooked=hooked, checkpoint_id=url) is None, f"hooked={hooked}"
            assert all(torch.equal(target[k].view(torch.uint8), v.view(torch.uint8)) for k, v in expected.items())

    for hooked in (False, True):
        marker = tmp_path / f"ran-{hooked}"
        with policed_s3.as_user("writer", monkeypatch) as fs:
            fs.pipe(f"{url}/.metadata", pickle.dumps(Payload(marker)))
        with policed_s3.as_user("reader", monkeypatch):
            error = _load({key: torch.zeros_like(value) for key, value in expected.items()},
                          hooked=hooked, checkpoint_id=url)
        assert error is not None
        assert marker.exists() is not hooked, f"hooked={hooked}: {error}"
    assert "posix.mkdir" in _refusals(error)
