"""The one exception family ckptshim raises.

``ShimError`` derives from both ``RuntimeError`` (what ``torch.nn.Module.load_state_dict`` raises)
and ``ValueError`` (what Orbax and JAX raise for tree mismatches), so code that already catches
the framework's own error keeps working.
"""

from __future__ import annotations


class ShimError(RuntimeError, ValueError):
    """A checkpoint that ckptshim refuses: unsafe, corrupt, incompatible or ambiguous.

    The message always says what was expected, what was found, and what to do next.
    """


class UnsafeCheckpointError(ShimError):
    """Loading would need to run code from the checkpoint (e.g. unpickle a forbidden global)."""


class CorruptCheckpointError(ShimError):
    """A file is missing, truncated or does not parse as its format says it should."""


class UnknownFormatError(ShimError):
    """No supported format recognises the path."""


class PlanError(ShimError):
    """The source cannot be mapped onto the target without guessing or losing data."""


class NoPlan(PlanError):
    """ckptshim has no plan that makes this checkpoint fit this target (names, shapes or dtypes
    that no rule mends). The load is the framework's to carry out or refuse: a hook that meets
    this error runs the framework's own call untouched, and where that call raises, this error's
    text goes onto the framework's exception as a note (see :func:`ckptshim.hooks.seam.step_aside`).
    Raised as such only where no framework call stands behind (``ckptshim plan``, ``convert``).
    """


#: How a diagnosis note begins, so that a reader of the traceback knows whose words follow.
NOTE_PREFIX = "ckptshim: "


def add_diagnosis(error: BaseException, diagnosis: object) -> None:
    """Put what ckptshim knows about a failed load onto the framework's own exception (PEP 678),
    once: the exception itself, its type and its text stay the framework's.

    Defined here, below every layer, because the framework's error is met where its own code runs
    inside ckptshim's (a DCP planner wrapping the caller's) as well as at a hook's seam."""
    note = f"{NOTE_PREFIX}{diagnosis}"
    if note not in getattr(error, "__notes__", ()):
        error.add_note(note)


class AmbiguousNameError(PlanError):
    """Names that could each be the one wanted: two keys that mean one name once wrapper
    components are removed (or claim one layer), or one key whose exact name and whose name
    without wrapper components lead to different targets. Nothing is guessed.

    Refused also where the framework alone would load by exact names (a non-strict load): which
    reading that load takes is right or wrong by luck, and no name tells which.
    """


class PeerError(ShimError):
    """Another process of a multi-process load refused or failed it (or never reported back);
    raised on every process, so that none goes on alone (see ``ckptshim.loading.agreement``)."""


class InternalError(ShimError):
    """A bug inside ckptshim, where falling back to the framework's own loader is not safe.

    Raised by hooks whose framework call could run code from the checkpoint (DCP's and
    DeepSpeed's loaders unpickle it without limits); the message names how to bypass ckptshim
    deliberately, and the original exception is its ``__cause__``.
    """



#: The documentation site (pyproject.toml's ``Documentation`` URL): errors and help point here,
#: never at the repository's ``docs/`` folder, which a pip install does not have.
DOCS_URL = "https://ckptshim.readthedocs.io/en/latest/"


def docs_page(page: str, section: str = "") -> str:
    """The address of a page of the documentation site (``docs/<page>.md`` in the repository)."""
    return f"{DOCS_URL}{page}/" + (f"#{section}" if section else "")
