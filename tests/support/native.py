"""The framework's own call, with ckptshim's hooks off, and what a step-aside must leave of it.

Where ckptshim has no plan, the framework's own call runs untouched (docs/how-it-works.md, "Step
aside"): the error it raises is the framework's -- its type and text -- with what ckptshim knows
added as a note (PEP 678). These helpers run a call both ways and compare what came out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ckptshim
from ckptshim.errors import NOTE_PREFIX


def natively(call: Callable[[], Any]) -> Any:
    """``call()`` with every ckptshim hook off."""
    ckptshim.uninstall()
    try:
        return call()
    finally:
        ckptshim.install()


def raised(call: Callable[[], Any]) -> BaseException:
    """What ``call()`` raises (DCP's ``CheckpointException`` is a ``BaseException``)."""
    try:
        call()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as error:  # noqa: BLE001 - every outcome is compared
        return error
    raise AssertionError(f"{call} did not raise")


def failure(error: BaseException) -> BaseException:
    """The error itself, or the one error DCP's ``CheckpointException`` carries from its rank."""
    failures = getattr(error, "failures", None)
    if failures:
        (inner, _trace), = failures.values()
        return inner
    return error


def diagnosis(error: BaseException) -> str:
    """ckptshim's notes on a framework error, joined (empty when it added none)."""
    return "\n".join(note for note in getattr(error, "__notes__", ()) if note.startswith(NOTE_PREFIX))


def same_error(shimmed: BaseException, native: BaseException) -> BaseException:
    """Assert that ``shimmed`` is the framework's own error as ``native`` is (type and text, each
    DCP rank's failure compared the same way); the shimmed one, for further checks."""
    ours, theirs = failure(shimmed), failure(native)
    assert type(ours) is type(theirs) and str(ours) == str(theirs), (
        f"with ckptshim: {type(ours).__name__}: {ours}\nwithout: {type(theirs).__name__}: {theirs}")
    assert type(shimmed) is type(native)
    return ours


@dataclass
class Outcome:
    """What one call did: its return value, or what it raised."""

    result: Any = None
    error: BaseException | None = None


def outcome(call: Callable[[], Any]) -> Outcome:
    try:
        return Outcome(result=call())
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as error:  # noqa: BLE001 - every outcome is compared
        return Outcome(error=error)


def without_and_with(call: Callable[[], Any]) -> tuple[Outcome, Outcome]:
    """``call()`` with every hook off (the framework alone), then with ckptshim's hooks on."""
    return natively(lambda: outcome(call)), outcome(call)


def same_failure(native: Outcome, shimmed: Outcome) -> str:
    """Assert that the call failed with ckptshim as it fails without it (:func:`same_error`), and
    return ckptshim's notes on the failure ('' when it added none)."""
    assert native.error is not None, f"the framework alone returned {native.result!r}"
    assert shimmed.error is not None, f"with ckptshim the call returned {shimmed.result!r}, natively {native.error!r}"
    same_error(shimmed.error, native.error)
    assert diagnosis(native.error) == ""
    return diagnosis(shimmed.error)
