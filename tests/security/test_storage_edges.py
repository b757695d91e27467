"""Object storage at its edges: names a client would rewrite, URL spellings fsspec does not
know, a server that cannot be reached. Each ends in a clean message of ckptshim's (or the
framework's own call, untouched), never a raw traceback or an "internal error".

Before: ``convert --force`` into a bucket whose destination held an object named with ``//``
(``dst//x.bin``) crashed with a raw ``ValueError``; ``S3://`` (upper case, which fsspec does not
know) ended in ``InternalError``, "a bug in ckptshim"; an unreachable endpoint, after the
client's retries, was reported as a corrupt checkpoint ("Re-copy it from the original").
"""

from __future__ import annotations

import socket
from pathlib import Path

import fsspec
import pytest

torch = pytest.importorskip("torch")

from safetensors.torch import save_file  # noqa: E402

import ckptshim  # noqa: E402,F401  (the hooks)
from ckptshim.cli import main  # noqa: E402
from ckptshim.errors import ShimError  # noqa: E402
from hostile import confined  # noqa: E402
from support.markers import QUIET  # noqa: E402

pytestmark = [QUIET, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def _source(tmp_path: Path) -> Path:
    save_file({"w": torch.arange(4, dtype=torch.float32)}, tmp_path / "model.safetensors")
    return tmp_path / "model.safetensors"


def _objects(url: str) -> dict[str, bytes]:
    fs, path = fsspec.core.url_to_fs(url)
    fs.invalidate_cache()
    return {name[len(path):]: fs.cat_file(name) for name in fs.find(path, withdirs=False)}


def test_convert_force_onto_a_destination_holding_a_double_slash_name_is_refused_cleanly(bucket, tmp_path,
                                                                                          capsys) -> None:
    url = f"{bucket}/dst"
    fs, path = fsspec.core.url_to_fs(url)
    for name, data in {"/dst/a.bin": b"old", "/dst//x.bin": b"odd", "/dst2/y.bin": b"near", "/other": b"o"}.items():
        fs.pipe_file(path.rsplit("/", 1)[0] + name, data)
    before = _objects(bucket)
    assert "/dst//x.bin" in before, sorted(before)  # the server holds the name as written
    assert main(["convert", str(_source(tmp_path)), url, "--to", "dcp", "--force", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "holds an object named" in err and "x.bin" in err and "Traceback" not in err, err
    assert _objects(bucket) == before  # nothing deleted, nothing written


@pytest.mark.parametrize("spelling", ["S3", "GS", "Gs"])
def test_an_upper_case_scheme_is_not_read_as_a_bucket(spelling: str, capsys) -> None:
    """fsspec knows ``s3://`` and ``gs://`` as written; so does ckptshim: ``inspect`` says what
    it reads, and a hook steps aside -- DCP's own call raises its own error, no ckptshim error."""
    url = f"{spelling}://bucket/ckpt"
    assert main(["inspect", url]) == 1
    err = capsys.readouterr().err
    assert f"not {spelling}://" in err and "bug in ckptshim" not in err, err
    import torch.distributed.checkpoint as dcp

    with pytest.raises(Exception) as raised:
        dcp.load({"w": torch.zeros(4)}, checkpoint_id=url, no_dist=True)
    assert not isinstance(raised.value, ShimError), raised.value
    assert "Cannot detect which StorageReader" in str(raised.value)


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize("scheme", ["gs", "s3"])
def test_an_unreachable_endpoint_is_named_and_the_checkpoint_not_blamed(scheme: str) -> None:
    """A closed port on 127.0.0.1 as the endpoint. The clients' retries are kept short with their
    own settings (botocore's ``AWS_MAX_ATTEMPTS``); gcsfs has no setting for its six tries, so its
    back-off sleeps are made instant (its requests and retries are still its own)."""
    port = _closed_port()
    outcome = confined(f"""
        import asyncio, os, sys
        os.environ.update(STORAGE_EMULATOR_HOST="http://127.0.0.1:{port}", AWS_ENDPOINT_URL="http://127.0.0.1:{port}",
                          AWS_MAX_ATTEMPTS="1", AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test")
        import gcsfs.retry

        async def instant(seconds, *args, _sleep=asyncio.sleep, **kwargs):
            await _sleep(0)

        gcsfs.retry.asyncio = type("Instant", (), {{"sleep": staticmethod(instant)}})
        from ckptshim.cli import main
        sys.exit(main(["inspect", "{scheme}://bucket/ckpt"]))
        """, memory_mb=3000, seconds=180)
    assert outcome.returncode == 1, outcome
    last = outcome.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ckptshim: {scheme}://bucket/ckpt: the storage at http://127.0.0.1:{port} could not be "
                           "reached"), last
    assert "corrupt" not in last and "Re-copy" not in last
