"""Cold reads: dropping a checkpoint's pages from the page cache, reading its files raw, and the
bytes a process read (``/proc/self/io``). Used by the multi-process worker and the benchmarks."""

from __future__ import annotations

import os
import time
from pathlib import Path

#: The raw read's request size (a large sequential read, as ``cat`` or ``dd bs=8M`` would make).
READ_SIZE = 8 << 20


def files_under(folder: Path) -> list[Path]:
    """Every regular file under ``folder``, in sorted order."""
    return sorted(path for path in folder.rglob("*") if path.is_file() and not path.is_symlink())


def drop_cache(folder: Path) -> None:
    """Ask the kernel to drop the cached pages of every file under ``folder`` (clean pages go;
    a file still being written back keeps its dirty ones, so write, then ``sync``, then drop)."""
    for path in files_under(folder):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_read(folder: Path) -> tuple[int, float]:
    """Read every file under ``folder`` sequentially, ``READ_SIZE`` at a time, into one buffer:
    the bytes read and the seconds it took."""
    buffer = memoryview(bytearray(READ_SIZE))
    total = 0
    start = time.perf_counter()
    for path in files_under(folder):
        fd = os.open(path, os.O_RDONLY)
        try:
            while count := os.readv(fd, [buffer]):
                total += count
        finally:
            os.close(fd)
    return total, time.perf_counter() - start


def io_counters() -> dict[str, int]:
    """This process's I/O counters: ``rchar`` (bytes asked of read calls), ``read_bytes`` (bytes
    fetched from the device), ..."""
    with open("/proc/self/io") as f:
        return {name: int(value) for name, value in (line.split(": ") for line in f)}
