"""A progress bar over bytes written, shown only on a terminal (tqdm, imported when shown)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any


class _Silent:
    def update(self, n: int) -> None:
        pass


@contextlib.contextmanager
def bar(total: int, description: str, enabled: bool | None = None) -> Iterator[Any]:
    """Yield an object with ``update(nbytes)``; a tqdm bar when ``enabled`` (default: stderr is a TTY)."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        yield _Silent()
        return
    from tqdm import tqdm

    with tqdm(total=total, desc=description, unit="B", unit_scale=True, unit_divisor=1024,
              file=sys.stderr) as shown:
        yield shown
