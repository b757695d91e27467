"""Which hooks exist, and attaching them lazily when their framework is imported.

Each hook is a module under ``ckptshim.hooks`` with idempotent ``install()`` and
``uninstall()``. The registry never imports a framework: it waits for the user's own import,
checks the framework's version against the hook's supported range, and only then imports the
hook module. Whatever goes wrong in there is logged; the user's ``import torch`` never fails
because of ckptshim.

``import ckptshim`` runs this module, so it imports only builtins; ``logging`` and
``importlib.metadata`` are imported when a framework shows up.
"""

from __future__ import annotations

import _thread
import sys

from ckptshim import config
from ckptshim.hooks.post_import import when_imported

TYPE_CHECKING = False  # type checkers take it as True; importing typing would cost ~4 ms
if TYPE_CHECKING:
    from collections.abc import Iterable


class HookSpec:
    """One seam: the module whose import triggers it, where its code lives, what it supports.

    ``supported`` is a half-open version range ``[low, high)`` of ``distribution``, compared
    on release numbers only (``2.13.0+cpu`` counts as ``2.13.0``). A plain class rather than a
    dataclass because ``dataclasses`` alone would double the cost of ``import ckptshim``.
    """

    __slots__ = ("name", "trigger", "integration", "distribution", "supported")

    def __init__(self, name: str, trigger: str, integration: str, distribution: str,
                 supported: tuple[str, str]) -> None:
        self.name, self.trigger, self.integration = name, trigger, integration
        self.distribution, self.supported = distribution, supported

    def __repr__(self) -> str:
        return f"HookSpec({self.name!r}, on import {self.trigger!r})"


#: Every hook ckptshim ships, in the order they attach.
HOOKS: tuple[HookSpec, ...] = (
    HookSpec("torch", "torch", "ckptshim.hooks.torch_module", "torch", ("2.4", "3")),
    HookSpec("torch-dcp", "torch.distributed.checkpoint", "ckptshim.hooks.torch_dcp", "torch", ("2.4", "3")),
    HookSpec("orbax", "orbax.checkpoint", "ckptshim.hooks.orbax", "orbax-checkpoint", ("0.11", "1")),
    HookSpec("orbax-v1", "orbax.checkpoint.experimental.v1", "ckptshim.hooks.orbax_v1", "orbax-checkpoint",
             ("0.12", "1")),
    HookSpec("flax", "flax.training.checkpoints", "ckptshim.hooks.flax", "flax", ("0.10", "1")),
    HookSpec("deepspeed", "deepspeed", "ckptshim.hooks.deepspeed", "deepspeed", ("0.14", "1")),
    HookSpec("t5x", "t5x.checkpoints", "ckptshim.hooks.t5x", "t5x", ("0", "1")),
)

_lock = _thread.RLock()
_wanted: set[str] = set()
_watching: set[str] = set()
_installed: dict[str, object] = {}
_states: dict[str, str] = {}


def install(names: Iterable[str] | None = None, specs: tuple[HookSpec, ...] | None = None) -> None:
    """Attach the named hooks, each when its framework is imported (at once if it already is).

    ``import ckptshim`` calls this with no arguments; call it again after [`uninstall`][ckptshim.uninstall].
    Imports no framework itself. Hooks switched off by ``CKPTSHIM_DISABLE`` or
    ``CKPTSHIM_DISABLE_HOOKS`` stay off; a hook whose framework version is outside its supported
    range is not attached (``ckptshim doctor`` says why). Idempotent.

    Args:
        names: Hook names to attach (``"torch"``, ``"torch-dcp"``, ``"orbax"``, ``"flax"``,
            ``"t5x"``, ``"deepspeed"``); ``None`` for all.
        specs: The hooks to choose from (tests give their own; by default every hook ckptshim has).
    """
    specs = HOOKS if specs is None else specs
    if config.disabled():
        for spec in specs:
            _states[spec.name] = "disabled by CKPTSHIM_DISABLE"
        return
    off = config.disabled_hooks()
    for spec in specs:
        if names is not None and spec.name not in names:
            continue
        if spec.name in off:
            _states[spec.name] = "disabled by CKPTSHIM_DISABLE_HOOKS"
            continue
        with _lock:
            _wanted.add(spec.name)
            if spec.name not in _installed:
                _states[spec.name] = f"waiting for `import {spec.trigger}`"
            if spec.trigger in sys.modules:
                watch = False
            else:  # one pending callback per hook, re-armed after it fires
                watch = spec.name not in _watching
                _watching.add(spec.name)
        if watch:
            when_imported(spec.trigger, lambda _module, spec=spec: _fire(spec))
        elif spec.trigger in sys.modules:
            _attach(spec)


def uninstall(names: Iterable[str] | None = None) -> None:
    """Detach the named hooks; the frameworks' own functions are put back as they were.

    A hook not yet attached (its framework not imported) will not attach later. Idempotent.

    Args:
        names: Hook names to detach (as for [`install`][ckptshim.install]); ``None`` for all.
    """
    with _lock:
        for name in list(_wanted if names is None else names):
            _wanted.discard(name)
            module = _installed.pop(name, None)
            if module is not None:
                module.uninstall()
            if name in _states:
                _states[name] = "uninstalled"


def states() -> dict[str, str]:
    """Hook name -> what it is doing (for ``ckptshim doctor``)."""
    return dict(_states)


def _fire(spec: HookSpec) -> None:
    with _lock:
        _watching.discard(spec.name)
    _attach(spec)


def _attach(spec: HookSpec) -> None:
    with _lock:
        if spec.name not in _wanted or spec.name in _installed:
            return
        from ckptshim.log import logger

        try:
            found = installed_version(spec.distribution)
            if found is not None and not supports_version(found, spec.supported):
                _states[spec.name] = (f"not attached: {spec.distribution} {found} is outside the "
                                      f"supported range >={spec.supported[0]},<{spec.supported[1]}")
                logger.warning("%s hook %s", spec.name, _states[spec.name])
                return
            from importlib import import_module

            module = import_module(spec.integration)
            module.install()
        except Exception:  # a bug in ckptshim must never break the user's import
            _states[spec.name] = "failed to attach (see log)"
            logger.warning("could not attach the %s hook; %s loads are not shimmed",
                           spec.name, spec.trigger, exc_info=True)
            return
        _installed[spec.name] = module
        _states[spec.name] = f"active ({spec.distribution} {found or 'unknown version'})"


def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution`` from package metadata (nothing is imported)."""
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _release(version: str) -> tuple[int, ...]:
    """``"2.13.0+cpu"`` -> ``(2, 13, 0)``; ``"0.4.26rc1"`` -> ``(0, 4, 26)``."""
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        digits = ""
        for char in piece:
            if not char.isdigit():
                break
            digits += char
        parts.append(int(digits or 0))
    return tuple(parts)


def supports_version(version: str, supported: tuple[str, str]) -> bool:
    """Whether ``version`` lies in the half-open release range ``[low, high)``."""
    return _release(supported[0]) <= _release(version) < _release(supported[1])
