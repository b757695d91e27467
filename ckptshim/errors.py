"""The one exception family ckptshim raises.

``ShimError`` derives from both ``RuntimeError`` (what ``torch.nn.Module.load_state_dict`` raises)
and ``ValueError`` (what Orbax and JAX raise for tree mismatches), so code that already catches
the framework's own error keeps working.

Messages are bounded like everything else built from a checkpoint: a value from a file is shown
with :func:`brief` (never ``str()`` of it: a list nested and shared many ways prints as gigabytes),
an exception out of a parser with :func:`describe`, and a message longer than
:data:`MAX_MESSAGE` characters (a 20 MB key named in it) keeps its beginning and its end.
"""

from __future__ import annotations

#: The most characters a :class:`ShimError`'s message keeps; beyond, its middle is left out.
MAX_MESSAGE = 16_384


class ShimError(RuntimeError, ValueError):
    """A checkpoint that ckptshim refuses: unsafe, corrupt, incompatible or ambiguous.

    The message always says what was expected, what was found, and what to do next.
    """

    def __init__(self, *args: object) -> None:
        if len(args) == 1 and isinstance(args[0], str) and len(args[0]) > MAX_MESSAGE:
            text, keep = args[0], MAX_MESSAGE // 2
            args = (f"{text[:keep]} [... {len(text) - 2 * keep:,} characters left out ...] {text[-keep:]}",)
        super().__init__(*args)


class UnsafeCheckpointError(ShimError):
    """Loading would need to run code from the checkpoint (e.g. unpickle a forbidden global)."""


class CorruptCheckpointError(ShimError):
    """A file is missing, truncated or does not parse as its format says it should."""


class UnknownFormatError(ShimError):
    """No supported format recognises the path."""


class PlanError(ShimError):
    """The source cannot be mapped onto the target without guessing or losing data."""


class MetadataConflict(PlanError):
    """The checkpoint's model description and the target's disagree on what decides the layout
    (head counts of the same shapes): whatever the key names, a load would compute garbage."""


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


class StorageUnreachableError(NoPlan):
    """The object storage that holds a checkpoint could not be reached (a connection refused or
    timed out after the client's own retries): nothing is known about the checkpoint itself. No
    plan, then: a hook leaves the load to the framework, whose own error gets this as a note;
    ``inspect``/``plan``/``convert`` say it as it is."""


class InternalError(ShimError):
    """A bug inside ckptshim, where falling back to the framework's own loader is not safe.

    Raised by hooks whose framework call could run code from the checkpoint (DCP's and
    DeepSpeed's loaders unpickle it without limits); the message names how to bypass ckptshim
    deliberately, and the original exception is its ``__cause__``.
    """



#: The documentation site, once it is published (then also pyproject.toml's ``Documentation``
#: URL): the one switch. Until a host serves the pages, it is ``None`` and every pointer names
#: ``ckptshim docs PAGE``, which prints the page from the copy shipped inside the package -- never
#: the repository's ``docs/`` folder, which a pip install does not have.
DOCS_URL: str | None = None


def docs_page(page: str, section: str = "") -> str:
    """Where a message sends the user for a page of the documentation (``docs/<page>.md`` in the
    repository): the command that prints it, or its address once :data:`DOCS_URL` is set."""
    if DOCS_URL is None:
        return f"`ckptshim docs {page}`" + (f" (section {section.replace('-', ' ')!r})" if section else "")
    return f"{DOCS_URL}{page}/" + (f"#{section}" if section else "")


# -- values from a checkpoint in messages ---------------------------------------------------------

#: Containers :func:`brief` shows nested at most this deep.
_BRIEF_DEPTH = 6


def brief(value: object, limit: int = 80) -> str:
    """``repr(value)`` cut to about ``limit`` characters, built in time proportional to ``limit``.

    A value read from a checkpoint (a pickle can share one list many ways, so that its ``repr``
    is exponentially long) is shown only this way: strings and bytes sliced before they are
    quoted, containers item by item until the limit, integers over 64 bits by their size, any
    other object by its type's name (its own ``repr`` never runs).
    """
    pieces: list[str] = []
    left = limit

    def emit(text: str) -> None:
        nonlocal left
        pieces.append(text[:max(left, 0)])
        left -= len(text)

    def show(item: object, depth: int) -> None:
        if left <= 0:
            return
        if isinstance(item, (str, bytes)):
            emit(repr(item[:left]))
        elif item is None or isinstance(item, (bool, float)):
            emit(repr(item))
        elif isinstance(item, int):
            emit(repr(item) if item.bit_length() <= 64 else f"<int of {item.bit_length()} bits>")
        elif isinstance(item, (list, tuple, set, frozenset, dict)):
            opener, closer = "()" if isinstance(item, tuple) else "[]" if isinstance(item, list) else "{}"
            emit(opener)
            if depth >= _BRIEF_DEPTH and item:
                emit("...")
            else:
                for index, part in enumerate(item.items() if isinstance(item, dict) else item):
                    if left <= 0:
                        break
                    if index:
                        emit(", ")
                    if isinstance(item, dict):
                        show(part[0], depth + 1)
                        emit(": ")
                        part = part[1]
                    show(part, depth + 1)
            emit(closer)
        else:
            emit(f"<{type(item).__name__}>")

    show(value, 0)
    text = "".join(pieces)
    return text if left >= 0 else text + "..."


def describe(error: BaseException, limit: int = 300) -> str:
    """``"TypeError: ..."`` for an exception out of a parser, at most about ``limit`` characters
    of its message: ``str(error)`` where its arguments are plain text and numbers (the text is
    as long as they are), else its arguments through :func:`brief`."""
    args = error.args
    plain = all(isinstance(arg, (str, bytes, float, bool, type(None))) or (
        isinstance(arg, int) and arg.bit_length() <= 64) for arg in args)
    text = str(error)[:limit] if plain else ", ".join(brief(arg, limit // max(len(args), 1)) for arg in args)
    return f"{type(error).__name__}: {text}"
