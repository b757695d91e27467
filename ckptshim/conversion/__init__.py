"""``ckptshim convert SRC DST --to {safetensors,dcp,orbax}``: rewrite a checkpoint in another format.

The arrays stream one at a time from SRC (usually straight from a memory map) into a temporary
sibling of DST, which is renamed into place only when everything is written; SRC is only ever
read. A convert that dies leaves no DST, and the next convert to the same DST removes the dead
one's temporary folder. With ``like``, the arrays are first mapped onto another checkpoint's
layout by the same plan a load would use (renames, stacking and unstacking layers).

The package is not called ``convert`` so that it never shadows the lazy ``ckptshim.convert``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ckptshim.conversion.arrays import planned_arrays
from ckptshim.conversion.atomic import atomic_destination
from ckptshim.conversion.progress import tracking
from ckptshim.errors import ShimError

#: Output format -> module ``ckptshim.conversion.<format>_writer`` with
#: ``write(arrays, folder, destination_name, progress) -> None``.
WRITERS = ("safetensors", "dcp", "orbax")


class ConvertError(ShimError):
    """The conversion cannot be done as asked (nothing has been written to DST)."""


def convert(source: str | Path, destination: str | Path, to: str, like: str | Path | None = None,
            *, force: bool = False, progress: bool | None = None,
            on_array: Callable[[str], None] | None = None) -> Path:
    """Write ``source``'s arrays (in ``like``'s layout, if given) to ``destination`` as ``to``.

    ``progress=None`` shows a bar (bytes, array by array, on stderr) only when stderr is a
    terminal and ``CKPTSHIM_PROGRESS`` is not ``0``. ``on_array`` is called after each array
    is written, with its key. Returns the destination path.
    """
    if to not in WRITERS:
        raise ConvertError(f"cannot convert to {to!r}; choose one of {', '.join(WRITERS)}")
    source, destination = Path(source).resolve(), Path(destination).resolve()
    if destination == source or source in destination.parents or destination in source.parents:
        raise ConvertError(f"{destination} overlaps the source {source}; write somewhere else")
    from importlib import import_module

    writer = import_module(f"ckptshim.conversion.{to}_writer")
    with planned_arrays(source, like) as arrays, atomic_destination(destination, force=force) as tmp, \
            tracking(arrays.total_bytes, destination.name, arrays.sep, enabled=progress,
                     on_array=on_array) as reporting:
        writer.write(arrays, tmp, destination.name, reporting)
    return destination
