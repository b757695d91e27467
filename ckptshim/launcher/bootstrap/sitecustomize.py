"""ckptshim's bootstrap ``sitecustomize``: ``ckptshim run`` puts this folder first on PYTHONPATH.

Python imports ``sitecustomize`` at start-up in every interpreter that inherits the environment
(torchrun workers, multiprocessing children, ``python -m ...`` wrappers), so each of them imports
ckptshim, whose hooks then attach when the script imports torch, orbax or flax. The script itself
is not edited.

This module must never break the interpreter it runs in, so every failure is reported on stderr
and start-up goes on. It also runs the ``sitecustomize`` the environment had before (the next
one on ``sys.path`` once this folder is left out), so distributions that rely on theirs keep it.
"""

import os
import sys

_HERE = os.path.dirname(os.path.realpath(__file__))


def _is_bootstrap(entry):
    try:
        return os.path.realpath(entry or os.getcwd()) == _HERE
    except (OSError, ValueError):
        return False


def _chain():
    """Execute the next ``sitecustomize`` on sys.path (not this one, not twice)."""
    import importlib.machinery
    import importlib.util

    search = [entry for entry in sys.path if not _is_bootstrap(entry)]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", search)
    if spec is None or spec.loader is None or spec.origin is None:
        return
    if os.path.dirname(os.path.realpath(spec.origin)) == _HERE:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module  # what `import sitecustomize` would have produced
    spec.loader.exec_module(module)


def _import_ckptshim():
    try:
        import ckptshim  # noqa: F401  (the import installs the hooks)
    except ImportError:
        home = os.environ.get("CKPTSHIM_BOOTSTRAP_HOME")
        if not home:
            raise
        sys.path.append(home)  # after everything else: never shadows what the child has
        import ckptshim  # noqa: F401


def _run():
    try:
        _import_ckptshim()
    except Exception as error:  # never stop the child from starting
        sys.stderr.write(f"ckptshim: could not import ckptshim in this process ({error!r}); "
                         "its checkpoint loads are not shimmed\n")
    try:
        _chain()
    except Exception as error:
        sys.stderr.write(f"ckptshim: the environment's own sitecustomize failed: {error!r}\n")


if not getattr(sys, "_ckptshim_bootstrapped", False):  # imported twice: do the work once
    sys._ckptshim_bootstrapped = True
    _run()
