"""Shared test set-up: make ``tests/`` importable (for ``manifest``) and keep jax on the CPU."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
