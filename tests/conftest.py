"""Shared test set-up: keep jax on the CPU; a one-process gloo group for the tests that need one.
(pytest puts ``tests/`` on ``sys.path`` for this file, so every test imports the shared helpers
as ``support``.)"""

from __future__ import annotations

import os
import socket

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")


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
