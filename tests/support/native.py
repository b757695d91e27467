"""One call made without ckptshim's hooks and with them, and what ckptshim added to a framework's
own exception (its PEP 678 notes; see ``ckptshim/hooks/seam.py``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ckptshim
from ckptshim.hooks.seam import NOTE_PREFIX


@dataclass
class Outcome:
    """What one call did: its return value, or what it raised."""

    result: Any = None
    error: BaseException | None = None


def outcome(call: Callable[[], Any]) -> Outcome:
    try:
        return Outcome(result=call())
    except Exception as error:  # noqa: BLE001 - every outcome is compared
        return Outcome(error=error)


def without_and_with(call: Callable[[], Any]) -> tuple[Outcome, Outcome]:
    """``call()`` with every hook off (the framework alone), then with ckptshim's hooks on."""
    ckptshim.uninstall()
    try:
        native = outcome(call)
    finally:
        ckptshim.install()
    return native, outcome(call)


def diagnosis(error: BaseException) -> str:
    """ckptshim's notes on ``error``, without their prefix, one per line ('' if it added none)."""
    return "\n".join(note[len(NOTE_PREFIX):] for note in getattr(error, "__notes__", ())
                     if note.startswith(NOTE_PREFIX))


def same_failure(native: Outcome, shimmed: Outcome) -> str:
    """Assert that the call failed with ckptshim as it fails without it -- the framework's own
    exception, same type, same text, not one of ckptshim's -- and return ckptshim's note on it."""
    assert native.error is not None, f"the framework alone returned {native.result!r}"
    assert shimmed.error is not None, f"with ckptshim the call returned {shimmed.result!r}, natively {native.error!r}"
    assert type(shimmed.error) is type(native.error) and str(shimmed.error) == str(native.error), \
        f"with ckptshim: {shimmed.error!r}; the framework alone: {native.error!r}"
    assert diagnosis(native.error) == ""
    return diagnosis(shimmed.error)
