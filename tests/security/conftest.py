"""The attack suite's shared set-up: this folder importable (``hostile``), hooks on."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
