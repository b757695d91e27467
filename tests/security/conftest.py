"""The attack suite's shared set-up: this folder importable (``hostile``), hooks on."""

from __future__ import annotations

