"""Progress bars over bytes, shown only where a person is watching.

``ckptshim convert`` and every hooked load that reads a checkpoint (an Orbax, Flax or T5X
restore ckptshim performs, a ``dcp.load`` through ckptshim's storage reader) show one tqdm bar
on stderr -- never when stderr is not a terminal, never when ``CKPTSHIM_PROGRESS=0``, only on
the first process of a distributed job (torch rank 0, JAX process 0), and for a hooked load
only when it reads at least ``CKPTSHIM_PROGRESS_MIN_BYTES`` (1 GiB unless set), as
``from_pretrained`` shows one for a large download. tqdm is imported only when a bar is shown.

A hooked load opens its bar with :func:`load_bar`; executors report the bytes they have put in
place with :func:`advance`, which costs nothing when no bar is shown.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from typing import Any, Protocol

from ckptshim import config
from ckptshim.log import first_process


class Counter(Protocol):
    def update(self, n: int) -> Any: ...


class _Silent:
    def update(self, n: int) -> None:
        pass


def bar_enabled(enabled: bool | None) -> bool:
    """An explicit choice wins; by default a bar only on a terminal, unless CKPTSHIM_PROGRESS=0."""
    if enabled is not None:
        return enabled
    return config.progress_enabled() and sys.stderr.isatty()


@contextlib.contextmanager
def bar(total_bytes: int, description: str, *, enabled: bool | None = None) -> Iterator[Counter]:
    """A bar over ``total_bytes`` on stderr (when :func:`bar_enabled`), or a counter that shows nothing."""
    if not bar_enabled(enabled):
        yield _Silent()
        return
    from tqdm import tqdm

    with tqdm(total=total_bytes, desc=description, unit="B", unit_scale=True, unit_divisor=1024,
              file=sys.stderr) as shown:
        yield shown


_lock = threading.Lock()
_current: Counter | None = None  # the bar of the hooked load running now, if it shows one


@contextlib.contextmanager
def load_bar(total_bytes: int, description: str) -> Iterator[None]:
    """While the body runs, :func:`advance` moves a bar over the ``total_bytes`` this process's
    load reads -- if it is big enough to show one (see the module docstring). A load started
    inside another one's (a nested restore) counts into the outer bar."""
    global _current
    if _current is not None or total_bytes < config.progress_min_bytes() or not first_process():
        yield
        return
    with bar(total_bytes, description) as shown:
        _current = None if isinstance(shown, _Silent) else shown
        try:
            yield
        finally:
            _current = None


def advance(nbytes: int) -> None:
    """``nbytes`` more of the running load's bytes are in place (from any thread)."""
    shown = _current
    if shown is not None:
        with _lock:
            shown.update(nbytes)
