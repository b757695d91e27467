"""What a conversion reports as it writes: a bar over bytes written, and the caller's callback.

Every writer calls :meth:`Progress.written` once per array, when that array's bytes are on
their way to disk (not when it is queued), so the bar and ``on_array`` move array by array
whatever the target format. The bar goes to stderr and is shown only on a terminal, and never
when ``CKPTSHIM_PROGRESS=0``; tqdm is imported only when a bar is shown.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

from ckptshim import config
from ckptshim.inventory import Entry, join_key


class _Silent:
    def update(self, n: int) -> None:
        pass


def bar_enabled(enabled: bool | None) -> bool:
    """An explicit choice wins; by default a bar only on a terminal, unless CKPTSHIM_PROGRESS=0."""
    if enabled is not None:
        return enabled
    return config.progress_enabled() and sys.stderr.isatty()


class Progress:
    """Counts arrays as they are written: advances the bar by their bytes, calls ``on_array``."""

    def __init__(self, shown: Any, sep: str, on_array: Callable[[str], None] | None) -> None:
        self._shown = shown
        self._sep = sep
        self._on_array = on_array

    def written(self, entry: Entry) -> None:
        self._shown.update(entry.nbytes)
        if self._on_array is not None:
            self._on_array(join_key(entry.key, self._sep))


@contextlib.contextmanager
def tracking(total_bytes: int, description: str, sep: str, *, enabled: bool | None = None,
             on_array: Callable[[str], None] | None = None) -> Iterator[Progress]:
    """Yield a :class:`Progress` whose bar (when :func:`bar_enabled`) spans ``total_bytes``."""
    if not bar_enabled(enabled):
        yield Progress(_Silent(), sep, on_array)
        return
    from tqdm import tqdm

    with tqdm(total=total_bytes, desc=description, unit="B", unit_scale=True, unit_divisor=1024,
              file=sys.stderr) as shown:
        yield Progress(shown, sep, on_array)
