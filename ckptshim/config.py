"""The environment switches, read when asked (so tests and launchers can change them).

``CKPTSHIM_DISABLE=1`` turns everything off; ``CKPTSHIM_DISABLE_HOOKS=orbax,t5x`` turns off
single hooks; ``CKPTSHIM_STRICT=1`` turns every guess into an error; ``CKPTSHIM_LOG=info|debug``
prints the summary (or the whole plan) of every load on stderr; ``CKPTSHIM_RNG_FROM_TARGET=1``
opts in to keeping the target's own rng state where the checkpoint's does not fit (see
:mod:`ckptshim.rules.profiles.maxtext`); ``CKPTSHIM_PROGRESS=0`` hides progress bars even on a
terminal (for logs captured through a pseudo-terminal, e.g. ``script`` or CI runners);
``CKPTSHIM_PROGRESS_MIN_BYTES`` is how much a hooked load must read before it shows one;
``CKPTSHIM_AGREEMENT_TIMEOUT`` is how long the processes of a multi-process JAX load wait for
each other's outcome (see :mod:`ckptshim.loading.agreement`).
"""

from __future__ import annotations

import os

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def disabled() -> bool:
    return os.environ.get("CKPTSHIM_DISABLE", "").strip().lower() in _TRUE


def disabled_hooks() -> frozenset[str]:
    raw = os.environ.get("CKPTSHIM_DISABLE_HOOKS", "")
    return frozenset(name.strip() for name in raw.split(",") if name.strip())


def strict() -> bool:
    return os.environ.get("CKPTSHIM_STRICT", "").strip().lower() in _TRUE


def rng_from_target() -> bool:
    return os.environ.get("CKPTSHIM_RNG_FROM_TARGET", "").strip().lower() in _TRUE


def progress_enabled() -> bool:
    """False only when ``CKPTSHIM_PROGRESS`` says no; a bar still needs a terminal to show."""
    return os.environ.get("CKPTSHIM_PROGRESS", "").strip().lower() not in _FALSE


#: What ``CKPTSHIM_LOG`` may say, from the most said to the least (besides off: unset, 0, off, none).
LOG_LEVELS = ("debug", "info", "warning")
_LOG_OFF = {"", "0", "off", "none"}


def log_level() -> str | None:
    """One of :data:`LOG_LEVELS` (any case), or ``None`` when ``CKPTSHIM_LOG`` is unset or off.

    Raises ``ValueError`` naming the valid values for any other: a typo must not turn logging on
    (or off) by a guess. :func:`ckptshim.log.configure_from_env` turns it into a warning, so
    that a wrong value never breaks ``import ckptshim``.
    """
    raw = os.environ.get("CKPTSHIM_LOG", "").strip().lower()
    if raw in _LOG_OFF:
        return None
    if raw not in LOG_LEVELS:
        raise ValueError(f"CKPTSHIM_LOG={raw[:40]!r} is not a level ckptshim knows; use "
                         f"{', '.join(LOG_LEVELS)}, or 0/off for none. ckptshim adds no log output.")
    return raw


#: A hooked load reading fewer bytes than this shows no progress bar (1 GiB).
PROGRESS_MIN_BYTES = 2**30
#: Seconds the processes of a multi-process load wait for each other's outcome.
AGREEMENT_TIMEOUT = 300.0


def progress_min_bytes() -> int:
    """``CKPTSHIM_PROGRESS_MIN_BYTES`` (an integer number of bytes), else :data:`PROGRESS_MIN_BYTES`."""
    return int(_number("CKPTSHIM_PROGRESS_MIN_BYTES", PROGRESS_MIN_BYTES, int))


def agreement_timeout() -> float:
    """``CKPTSHIM_AGREEMENT_TIMEOUT`` (seconds), else :data:`AGREEMENT_TIMEOUT`."""
    return _number("CKPTSHIM_AGREEMENT_TIMEOUT", AGREEMENT_TIMEOUT, float)


def _number(name: str, default: float, kind: type) -> float:
    raw = os.environ.get(name, "").strip()
    try:
        value = kind(raw) if raw else default
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number; unset it or give one (default "
                         f"{default})") from None
    return max(value, 0)
