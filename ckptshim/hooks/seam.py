"""Shared plumbing for hook modules: patch a function, and keep a bug from breaking a load.

A hook's shimmed path either succeeds, raises a :class:`~ckptshim.errors.ShimError` (a
refusal, which is final), or hits an unexpected exception (a bug in ckptshim), in which case
the original function runs instead and a warning says so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ckptshim.errors import ShimError
from ckptshim.log import logger


class Patches:
    """Replaces attributes with wrapt wrappers and puts the originals back; idempotent."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any | None]] = []

    @property
    def active(self) -> bool:
        return bool(self._saved)

    def wrap(self, owner: Any, attribute: str, wrapper: Callable[..., Any]) -> None:
        import wrapt

        own = attribute in vars(owner)
        # the raw attribute (a classmethod stays unbound), from the class that defines it
        defining = next((k for k in getattr(owner, "__mro__", (owner,)) if attribute in vars(k)), None)
        original = vars(defining)[attribute] if defining is not None else getattr(owner, attribute)
        self._saved.append((owner, attribute, original if own else None))
        setattr(owner, attribute, wrapt.FunctionWrapper(original, wrapper))

    def restore(self) -> None:
        while self._saved:
            owner, attribute, original = self._saved.pop()
            if original is None:  # it was inherited: uncover the base class's attribute again
                delattr(owner, attribute)
            else:
                setattr(owner, attribute, original)


def guarded(hook: str, shimmed: Callable[[], Any], original: Callable[[], Any]) -> Any:
    """Run ``shimmed()``; a ShimError propagates, any other exception falls back to ``original()``."""
    try:
        return shimmed()
    except ShimError:
        raise
    except Exception:
        logger.warning("internal error in the %s hook; falling back to the framework's own "
                       "loader. Please report this with the traceback below.", hook, exc_info=True)
        return original()
