"""Shared test set-up: keep jax on the CPU; a one-process gloo group for the tests that need one;
local S3 and GCS servers (started on first use, once per session) and a fresh bucket per test.
(pytest puts ``tests/`` on ``sys.path`` for this file, so every test imports the shared helpers
as ``support``.)"""

from __future__ import annotations

import os
import socket

import pytest

from support import object_stores

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# gcsfs reads this once, on import, and Lightning imports gcsfs when pytest collects its tests: set
# here, before any fixture runs, or gcsfs probes every bucket of the local GCS server over gRPC
# with TLS for about a minute (and an Orbax save to gs:// times out meanwhile).
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


def pytest_addoption(parser):
    parser.addoption("--gcs-server", choices=object_stores.SERVERS["gs"], default=object_stores.SERVERS["gs"][0],
                     help="the local GCS server of this run (its clients read the address once per process)")


@pytest.fixture(scope="module")
def process_group():
    """A one-process gloo group (DDP and FSDP need one), for the tests of one module."""
    import torch.distributed as dist

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server on 127.0.0.1, with this process's S3 clients (botocore, s3fs) pointed at it."""
    yield from object_stores.serving("s3")


@pytest.fixture(scope="session")
def gcs_server(request):
    """A GCS server on 127.0.0.1 (``--gcs-server``: the Python emulator or fake-gcs-server), with
    this process's GCS clients (tensorstore, gcsfs) pointed at it."""
    yield from object_stores.serving("gs", request.config.getoption("--gcs-server"))


@pytest.fixture(params=object_stores.SCHEMES)
def bucket(request) -> str:
    """A fresh, empty bucket on each local server in turn: ``s3://...``, then ``gs://...``."""
    server = request.getfixturevalue({"s3": "s3_server", "gs": "gcs_server"}[request.param])
    return server.new_bucket()


@pytest.fixture
def gs_bucket(gcs_server) -> str:
    """A fresh, empty bucket on the local GCS server (Orbax reaches object storage only by gs://)."""
    return gcs_server.new_bucket()
