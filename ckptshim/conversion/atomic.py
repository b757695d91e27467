"""Writing a destination all at once: a temporary sibling, renamed into place on success.

The temporary folder is named after DST and the writing process's id, so a later run can tell
a dead writer's leftovers (its process is gone) from a live concurrent one's, and removes them.

The final rename never replaces anything it did not check. Without ``force`` it is an
exclusive rename (``renameat2(RENAME_NOREPLACE)``): when two converts race for one DST, one
wins and the other fails, saying so. With ``force`` the existing DST -- whatever the name is:
a folder, a file, or a symlink, which is replaced as a link, never followed -- is exchanged
atomically with the new one (``RENAME_EXCHANGE``), and put back if what came out is not what
was checked. Where the system has no ``renameat2`` (not Linux, or a file system without it) an
exclusive lock file beside DST serialises the check and the rename instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from ckptshim.errors import ShimError

#: What names a temporary folder (or bucket prefix) of a convert in progress, after DST's name.
TEMP_TAG = ".ckptshim-tmp-"
_NOREPLACE, _EXCHANGE = 1, 2  # renameat2 flags (linux/fs.h)
_AT_FDCWD = -100


class LocalFolder:
    """The temporary folder a writer writes into (see :class:`ckptshim.conversion.Folder`): each
    file flushed to the disk (``fsync``) before it counts as written."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @contextlib.contextmanager
    def create(self, name: str) -> Iterator[BinaryIO]:
        with open(self.path / name, "wb") as out:
            yield out
            out.flush()
            os.fsync(out.fileno())

    def dcp_writer(self) -> Any:
        """torch's ``FileSystemWriter`` (what ``dcp.save`` to a local folder uses), one file per rank."""
        import torch.distributed.checkpoint as dcp

        return dcp.FileSystemWriter(str(self.path), single_file_per_rank=True, thread_count=1)


class DestinationExistsError(ShimError):
    """DST exists and ``--force`` was not given, or another process created it meanwhile."""


class DestinationError(ShimError):
    """DST cannot be written: a read-only or full file system, a missing parent, no memory."""


def temp_name(destination: Path, pid: int) -> Path:
    return destination.with_name(f".{destination.name}{TEMP_TAG}{pid}")


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
    for candidate in destination.parent.glob(f".{destination.name}{TEMP_TAG}*"):
        pid = candidate.name.rsplit(TEMP_TAG, 1)[1].split(".")[0]
        if pid.isdigit() and int(pid) != os.getpid() and _alive(int(pid)):
            continue
        _remove(candidate)
        removed.append(candidate)
    return removed


def _remove(path: Path) -> None:
    """Remove ``path`` itself: a folder's contents, or a file or link (never a link's target)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink(missing_ok=True)


def _identity(path: Path) -> tuple[int, ...] | None:
    """What is at ``path`` itself (a link is not followed), or ``None`` for nothing: its inode,
    and its modification time and size (an inode number can be reused by a new file)."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return None
    return info.st_dev, info.st_ino, info.st_mtime_ns, info.st_size


def _present(path: Path) -> bool:
    return _identity(path) is not None


@contextlib.contextmanager
def atomic_destination(destination: Path, *, force: bool = False) -> Iterator[Path]:
    """Yield an empty temporary folder; on success it (or the one entry in it) becomes DST.

    A writer that leaves exactly one file or folder named like DST in the temporary folder (a
    ``model.safetensors`` file; an Orbax checkpoint, which Orbax insists on creating itself)
    has that entry renamed to DST. An existing DST is replaced only with ``force``, and only
    after the new one is complete (see the module docstring). An ``OSError`` or ``MemoryError``
    while writing is a :class:`DestinationError` naming DST; the temporary folder is removed.
    """
    if not destination.parent.is_dir():
        raise DestinationError(f"{destination.parent} does not exist; create it first")
    clean_stale(destination)
    checked = _identity(destination)
    if checked is not None and not force:
        raise DestinationExistsError(f"{destination} already exists; pass --force to replace it")
    tmp = temp_name(destination, os.getpid())
    try:
        tmp.mkdir()
    except OSError as error:
        raise DestinationError(f"cannot write next to {destination} ({error.strerror}): "
                               f"{destination.parent} must be a writable folder") from None
    try:
        try:
            yield tmp
        except MemoryError:
            raise DestinationError(f"not enough memory to write {destination}: an array of the "
                                   "checkpoint is larger than this machine can allocate") from None
        except OSError as error:
            raise DestinationError(_write_failure(destination, error)) from None
        single = tmp / destination.name
        produced = single if single.exists() and len(list(tmp.iterdir())) == 1 else tmp
        _move_into_place(produced, destination, checked)
    finally:
        _remove(tmp)


def _write_failure(destination: Path, error: OSError) -> str:
    reason = {errno.ENOSPC: "the file system is full", errno.EDQUOT: "the disk quota is used up",
              errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied"}
    return (f"writing {destination} failed: {reason.get(error.errno, error.strerror or str(error))} "
            f"({error}). Nothing was written to {destination}; free space or choose another "
            "destination and convert again.")


def _move_into_place(produced: Path, destination: Path, checked: tuple[int, ...] | None) -> None:
    """Rename ``produced`` to ``destination``, replacing only ``checked`` (what was there)."""
    try:
        if checked is None:
            _rename(produced, destination, _NOREPLACE)
        else:
            _rename(produced, destination, _EXCHANGE)
            if _identity(produced) != checked:  # what came out is not what was checked
                _rename(produced, destination, _EXCHANGE)
                raise DestinationExistsError(
                    f"{destination} was replaced by another process while this convert ran; "
                    "its files are left as they are and nothing was written. Convert again.")
            _remove(produced)
    except FileExistsError:
        raise DestinationExistsError(
            f"{destination} was created by another process while this convert ran; nothing was "
            "replaced. Remove it (or pass --force) and convert again.") from None
    except OSError as error:
        raise DestinationError(_write_failure(destination, error)) from None


def _rename(source: Path, destination: Path, flags: int) -> None:
    """``renameat2(source, destination, flags)``; an exclusive lock file where there is none."""
    if _renameat2(source, destination, flags):
        return
    lock = destination.with_name(f".{destination.name}.ckptshim-lock")
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        raise FileExistsError(errno.EEXIST, "another convert holds the lock (remove it if no "
                              "convert is running)", str(lock)) from None
    try:
        if flags == _NOREPLACE:
            if _present(destination):
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(destination))
            os.rename(source, destination)
        else:  # exchange: move the old aside, the new in, the old to where the new was
            aside = source.with_name(source.name + ".old")
            os.rename(destination, aside)
            os.rename(source, destination)
            os.rename(aside, source)
    finally:
        os.close(fd)
        os.unlink(lock)


def _renameat2(source: Path, destination: Path, flags: int) -> bool:
    """Whether ``renameat2`` did the rename (``False``: the system or file system lacks it)."""
    function = getattr(_libc(), "renameat2", None)
    if function is None:
        return False
    if function(_AT_FDCWD, os.fsencode(source), _AT_FDCWD, os.fsencode(destination), flags) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(destination))


_LIBC: ctypes.CDLL | None = None


def _libc() -> ctypes.CDLL:
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
    return _LIBC
