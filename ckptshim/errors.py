"""The one exception family ckptshim raises.

``ShimError`` derives from both ``RuntimeError`` (what ``torch.nn.Module.load_state_dict`` raises)
and ``ValueError`` (what Orbax and JAX raise for tree mismatches), so code that already catches
the framework's own error keeps working. A hook whose framework raises some other type wraps the
error with :func:`as_framework_error`, which builds a subclass of both.
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


class AmbiguousNameError(PlanError):
    """Names that could each be the one wanted: two keys that mean one name once wrapper
    components are removed (or claim one layer), or one key whose exact name and whose name
    without wrapper components lead to different targets. Nothing is guessed.

    Refused also where the framework alone would load by exact names (a non-strict load): which
    reading that load takes is right or wrong by luck, and no name tells which.
    """


class InternalError(ShimError):
    """A bug inside ckptshim, where falling back to the framework's own loader is not safe.

    Raised by hooks whose framework call could run code from the checkpoint (DCP's and
    DeepSpeed's loaders unpickle it without limits); the message names how to bypass ckptshim
    deliberately, and the original exception is its ``__cause__``.
    """


_framework_error_types: dict[tuple[type, type], type[ShimError]] = {}


def _framework_error_type(kind: type[ShimError], base: type[BaseException]) -> type[ShimError]:
    cls = _framework_error_types.get((kind, base))
    if cls is None:
        cls = type(f"{kind.__name__}[{base.__name__}]", (kind, base), {"__module__": __name__})
        _framework_error_types[kind, base] = cls
    return cls


def as_framework_error(error: ShimError, base: type[BaseException]) -> ShimError:
    """Return ``error`` re-typed as a subclass of both its own class and ``base``.

    ``base`` is the exception type the patched framework function documents, so callers that
    catch it also catch ckptshim's refusal. The message and cause are preserved.
    """
    if isinstance(error, base):
        return error
    try:
        cls = _framework_error_type(type(error), base)
        wrapped = cls(*error.args)
    except TypeError:  # a base with an incompatible layout or constructor: keep ours
        return error
    wrapped.__cause__ = error.__cause__
    return wrapped
