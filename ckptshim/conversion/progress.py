"""What a conversion reports as it writes: a bar over bytes written, and the caller's callback.

Every writer calls :meth:`Progress.written` once per array, when that array's bytes are on
their way to disk (not when it is queued), so the bar and ``on_array`` move array by array
whatever the target format. The bar is :func:`ckptshim.progress.bar`: on stderr, only on a
terminal, never when ``CKPTSHIM_PROGRESS=0``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from ckptshim import progress
from ckptshim.inventory import Entry, join_key


class Progress:
    """Counts arrays as they are written: advances the bar by their bytes, calls ``on_array``."""

    def __init__(self, shown: progress.Counter, sep: str, on_array: Callable[[str], None] | None) -> None:
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
    """Yield a :class:`Progress` whose bar (when shown) spans ``total_bytes``."""
    with progress.bar(total_bytes, description, enabled=enabled) as shown:
        yield Progress(shown, sep, on_array)
