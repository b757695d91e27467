"""Writing a destination all at once: a temporary sibling, renamed into place on success.

The temporary folder is named after DST and the writing process's id, so a later run can tell
a dead writer's leftovers (its process is gone) from a live concurrent one's, and removes them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from ckptshim.errors import ShimError

_TAG = ".ckptshim-tmp-"


class DestinationExistsError(ShimError):
    """DST exists and ``--force`` was not given."""


def temp_name(destination: Path, pid: int) -> Path:
    return destination.with_name(f".{destination.name}{_TAG}{pid}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale(destination: Path) -> list[Path]:
    """Remove temporary siblings of ``destination`` left by writers that no longer run."""
    removed = []
    for candidate in destination.parent.glob(f".{destination.name}{_TAG}*"):
        pid = candidate.name.rsplit(_TAG, 1)[1].split(".")[0]
        if pid.isdigit() and int(pid) != os.getpid() and _alive(int(pid)):
            continue
        shutil.rmtree(candidate, ignore_errors=True) if candidate.is_dir() else candidate.unlink(missing_ok=True)
        removed.append(candidate)
    return removed


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


@contextlib.contextmanager
def atomic_destination(destination: Path, *, force: bool = False) -> Iterator[Path]:
    """Yield an empty temporary folder; on success it (or the one entry in it) becomes DST.

    A writer that leaves exactly one file or folder named like DST in the temporary folder (a
    ``model.safetensors`` file; an Orbax checkpoint, which Orbax insists on creating itself)
    has that entry renamed to DST. An existing DST is replaced only with
    ``force``, and only after the new one is complete.
    """
    if not destination.parent.is_dir():
        raise ShimError(f"{destination.parent} does not exist; create it first")
    clean_stale(destination)
    if (destination.exists() or destination.is_symlink()) and not force:
        raise DestinationExistsError(f"{destination} already exists; pass --force to replace it")
    tmp = temp_name(destination, os.getpid())
    tmp.mkdir()
    try:
        yield tmp
        single = tmp / destination.name
        produced = single if single.exists() and len(list(tmp.iterdir())) == 1 else tmp
        old = None
        if destination.exists() or destination.is_symlink():
            old = temp_name(destination, os.getpid()).with_name(
                f".{destination.name}{_TAG}{os.getpid()}.old")
            os.replace(destination, old)
        os.replace(produced, destination)
        if old is not None:
            _remove(old)
    finally:
        if tmp.exists():
            _remove(tmp)
