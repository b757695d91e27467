"""Shared plumbing for hook modules: patch a function, step aside, and keep a bug from breaking a load.

A hook's shimmed path ends in one of four ways:

- it succeeds: ckptshim carried out a load the framework could not;
- it has no plan (:class:`~ckptshim.errors.NoPlan`): the framework's own call runs untouched
  (:func:`step_aside`), and if that raises, ckptshim's diagnosis rides on the framework's own
  exception as a note -- never in its place;
- it refuses (any other :class:`~ckptshim.errors.ShimError`: unsafe, corrupt, ambiguous input
  ckptshim vouched for), which is final;
- it hits an unexpected exception (a bug in ckptshim). What that leads to depends on the seam
  (:class:`Seam`): where the framework's own call cannot run code from the checkpoint
  (``load_state_dict`` of tensors, Orbax, Flax and T5X restores) it runs instead, with a
  warning; where it can (DCP's and DeepSpeed's loaders unpickle without limits), the bug is
  raised as an :class:`~ckptshim.errors.InternalError` naming the switch that turns the hook off.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, NoReturn

from ckptshim.errors import InternalError, NoPlan, ShimError, add_diagnosis, describe
from ckptshim.keytext import shown_error, shown_lines
from ckptshim.log import logger

__all__ = ["Patches", "Seam", "bind", "framework_call", "guarded", "internal_error", "step_aside"]


@dataclass(frozen=True)
class Seam:
    """One patched framework call.

    ``name`` is the hook's name in ``CKPTSHIM_DISABLE_HOOKS``; ``call`` names the call in
    messages; ``falls_back`` says whether the original call is safe to run for a checkpoint
    ckptshim failed on (it reads no pickles, or only ``weights_only`` ones).
    """

    name: str
    call: str
    falls_back: bool


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


def bind(function: Callable[..., Any], args: tuple, kwargs: dict) -> dict[str, Any] | None:
    """The call's arguments by ``function``'s parameter names, defaults filled in; ``None`` when
    they do not fit its signature (a bad call: the hook then lets the framework report it).

    Every hook reads its caller's arguments this way, against the signature of the very function
    it patched, so a framework release that adds a parameter changes nothing here.
    """
    try:
        bound = inspect.signature(function).bind(*args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return dict(bound.arguments)


class FrameworkRaised(Exception):
    """The framework's own loader, called from inside a hook (a load ckptshim leaves to it, or
    the part of one it cannot do), raised ``error``. That is the caller's error, exactly as
    without ckptshim: :func:`guarded` re-raises ``error`` itself, never reports it as a bug in
    ckptshim nor runs the framework's load a second time."""

    def __init__(self, error: Exception) -> None:
        super().__init__(error)
        self.error = error


def framework_call(call: Callable[..., Any]) -> Callable[..., Any]:
    """``call`` (the framework's own loader) as a hook runs it inside :func:`guarded`: what it
    raises comes out of ``guarded`` unchanged (see :class:`FrameworkRaised`)."""
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return call(*args, **kwargs)
        except Exception as error:
            raise FrameworkRaised(error) from None
    return run


def step_aside(original: Callable[[], Any], diagnosis: object) -> Any:
    """Run the framework's own call for a load ckptshim has no plan for, as without ckptshim:
    its return value stands; what it raises is raised unchanged, with ``diagnosis`` as a note.
    A coroutine seam's call returns an awaitable, whose error gets the note when it is awaited."""
    try:
        result = original()
    except BaseException as error:
        add_diagnosis(error, diagnosis)
        raise
    return _noting(result, diagnosis) if inspect.isawaitable(result) else result


async def _noting(awaitable: Any, diagnosis: object) -> Any:
    try:
        return await awaitable
    except BaseException as error:
        add_diagnosis(error, shown_lines(str(diagnosis)))
        raise


def guarded(seam: Seam, shimmed: Callable[[], Any], original: Callable[[], Any], where: object = None) -> Any:
    """Run ``shimmed()``. Where ckptshim has no plan (:class:`~ckptshim.errors.NoPlan`), the
    framework's ``original()`` runs instead (:func:`step_aside`); another ShimError propagates,
    and so does what the framework's own loader raised inside ``shimmed`` (:func:`framework_call`).
    Any other exception is a bug in ckptshim: the seam either falls back to ``original()`` or
    raises :func:`internal_error` (``where`` names the checkpoint).

    The framework's own exceptions are raised outside every ``except`` clause, so they carry no
    ckptshim exception as their context: the traceback a user sees is the framework's."""
    try:
        return shimmed()
    except NoPlan as no_plan:
        then = partial(step_aside, original, no_plan)
    except ShimError as refused:
        shown_error(refused)  # its message names what the checkpoint holds
        raise
    except FrameworkRaised as raised:
        then = partial(_raise, raised.error)
    except Exception as bug:
        if not seam.falls_back:
            raise internal_error(seam, bug, where) from bug
        logger.warning("internal error in the %s hook; falling back to the framework's own "
                       "loader. Please report this with the traceback below.", seam.call, exc_info=True)
        then = original
    return then()


def _raise(error: BaseException) -> NoReturn:
    raise error


def internal_error(seam: Seam, error: BaseException, where: object = None) -> InternalError:
    """The error for a bug in ckptshim at a seam that must not fall back to the framework."""
    return InternalError(
        f"ckptshim's {seam.call} hook failed{f' on {where}' if where is not None else ''} with an "
        f"internal error ({describe(error)}); this is a bug in ckptshim, please report "
        "it with this traceback. ckptshim does not hand the checkpoint to the framework's own loader "
        "instead: that loader would unpickle it without limits. If you trust the checkpoint, load it "
        f"with the hook off: CKPTSHIM_DISABLE_HOOKS={seam.name}.")
