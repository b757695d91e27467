"""Run a callback right after a module finishes importing (or now, if it already has).

This is the mechanism wrapt's post-import hooks provide; ckptshim carries its own few lines
because importing wrapt costs 25-80 ms (it pulls in ``inspect``, ``asyncio`` and
``importlib.metadata``), while ``import ckptshim`` must stay under 10 ms. wrapt is still used,
lazily, for the function wrappers themselves once a framework is imported.
"""

from __future__ import annotations

import _thread
import sys

# ``import ckptshim`` runs this module: it imports nothing beyond builtins (not even typing).
_lock = _thread.RLock()
_pending: dict[str, list] = {}


def when_imported(name: str, callback) -> None:
    """Call ``callback(module)`` once ``name`` is imported; immediately if it already is."""
    with _lock:
        module = sys.modules.get(name)
        if module is None:
            _pending.setdefault(name, []).append(callback)
            if not any(isinstance(f, _Finder) for f in sys.meta_path):
                sys.meta_path.insert(0, _Finder())
            return
    callback(module)


def _fire(module) -> None:
    with _lock:
        callbacks = _pending.pop(module.__name__, [])
    for callback in callbacks:
        callback(module)


class _Finder:
    """A meta-path finder that asks the others, then wraps the loader of watched modules."""

    def __init__(self) -> None:
        self._busy: set[tuple[int, str]] = set()  # (thread, module) lookups in progress

    def find_spec(self, fullname, path=None, target=None):
        token = (_thread.get_ident(), fullname)
        if fullname not in _pending or token in self._busy:
            return None
        self._busy.add(token)
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._busy.discard(token)
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _NotifyingLoader(spec.loader)
        return spec


class _NotifyingLoader:
    """Delegates to the real loader; after the module executes, restores it and fires callbacks."""

    def __init__(self, loader) -> None:
        self._loader = loader

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        _fire(module)
