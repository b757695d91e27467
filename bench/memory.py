"""A process's memory as the benchmarks measure it: ``/proc/self/status`` fields, and the
high-water mark reset to the resident size before a measured step.

(``ru_maxrss`` would not do: Linux carries it over ``exec`` from the parent, which usually wrote
the checkpoint.) The benchmarks run as scripts, so this module is imported from ``bench/``.
"""

from __future__ import annotations

from pathlib import Path


def status_kib(field: str) -> int:
    """A ``/proc/self/status`` field in KiB (``VmRSS``, ``VmHWM``, ``RssFile``, ...)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def reset_peak() -> int:
    """Reset the high-water mark (``VmHWM``) to the resident size now, and return that size in KiB."""
    Path("/proc/self/clear_refs").write_text("5")
    return status_kib("VmRSS")
