"""Shared test set-up: keep jax on the CPU. (pytest puts ``tests/`` on ``sys.path`` for this file,
so every test imports the shared helpers as ``support``.)"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
