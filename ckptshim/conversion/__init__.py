"""``ckptshim convert SRC DST --to {safetensors,dcp,orbax}``: rewrite a checkpoint in another format.

The arrays stream one at a time from SRC (usually straight from a memory map) into a temporary
sibling of DST, which is renamed into place only when everything is written (in a bucket,
copied into place and marked complete: :mod:`ckptshim.conversion.bucket`); SRC is opened once
and only ever read. A convert that dies leaves no DST, and the next convert to the same DST
removes the dead one's temporary folder. With ``like``, the arrays are first mapped onto another
checkpoint's layout (or a ``module:function``'s) by the same plan a load would use, every op
kind included (renames, stacking, transposes, fused arrays split or joined), run by the files
executor (:mod:`ckptshim.execute.arrays`).

The package is not called ``convert`` so that it never shadows the lazy ``ckptshim.convert``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, ContextManager, Protocol

from ckptshim import extras
from ckptshim.conversion.atomic import LocalFolder, atomic_destination
from ckptshim.conversion.bucket import BucketFolder, bucket_destination
from ckptshim.conversion.progress import tracking
from ckptshim.errors import ShimError
from ckptshim.execute.arrays import PlannedArrays
from ckptshim.formats.detect import location, open_checkpoint
from ckptshim.loading.files import plan_onto, plan_onto_model
from ckptshim.planner import Plan
from ckptshim.storage import Location

#: Output format -> module ``ckptshim.conversion.<format>_writer`` with
#: ``write(arrays, folder: Folder, destination_name, progress) -> None`` and ``NEEDS``, the modules it
#: imports to write (checked before anything is opened: a missing one names its extra).
WRITERS = ("safetensors", "dcp", "orbax")
#: The output formats written to object storage (Orbax writes gs:// through tensorstore, which
#: a temporary prefix copied into place does not suit yet).
BUCKET_WRITERS = ("safetensors", "dcp")


class ConvertError(ShimError):
    """The conversion cannot be done as asked (nothing has been written to DST)."""


class Folder(Protocol):
    """Where a writer writes: a temporary folder or bucket prefix that becomes DST only once
    everything is written (:func:`_writing`). A writer asks it for what it writes and never
    where it is."""

    def create(self, name: str) -> ContextManager[IO[bytes]]:
        """A new file ``name`` in it, written whole: written once the ``with`` ends."""

    def dcp_writer(self) -> Any:
        """The storage writer ``dcp.save`` itself uses there (one file per rank)."""


def convert(source: str | Path | Location, destination: str | Path | Location, to: str,
            like: str | Path | None = None, *, force: bool = False, progress: bool | None = None,
            on_array: Callable[[str], None] | None = None) -> Path | Location:
    """Write ``source``'s arrays (in ``like``'s layout, if given) to ``destination`` as ``to``.

    ``progress=None`` shows a bar (bytes, array by array, on stderr) only when stderr is a
    terminal and ``CKPTSHIM_PROGRESS`` is not ``0``. ``on_array`` is called after each array
    is written, with its key. Returns the destination: a path, or for an ``s3://``/``gs://``
    destination its :class:`~ckptshim.storage.Location` (written as
    :mod:`ckptshim.conversion.bucket` describes).
    """
    if to not in WRITERS:
        raise ConvertError(f"cannot convert to {to!r}; choose one of {', '.join(WRITERS)}")
    # the source is opened as named (a format checks the components it gives meaning to, such as
    # a hub cache's snapshots/ and blobs/); resolved only to compare it with the destination
    given, target = location(source), location(destination)
    if target.is_remote and to not in BUCKET_WRITERS:
        raise ConvertError(f"{destination}: ckptshim writes {' and '.join(BUCKET_WRITERS)} to object "
                           f"storage, not {to}; convert to a local folder, then copy it up "
                           "(gcloud storage cp -r, aws s3 cp --recursive)")
    if not target.is_remote:  # DST itself is never resolved: a link there is what --force replaces
        target = Location.of(target.path.parent.resolve() / target.name)
    if target.inside(given) or given.inside(target):  # a bucket never overlaps a local folder
        raise ConvertError(f"{target} overlaps the source {given}; write somewhere else")
    from importlib import import_module

    writer = import_module(f"ckptshim.conversion.{to}_writer")
    extras.require(writer.NEEDS, f"convert --to {to}")
    place = _writing(target, force)
    checkpoint = open_checkpoint(given)
    try:
        checkpoint.require_complete()
        plan = plan_onto_model(checkpoint) if like is None else _plan_onto(checkpoint, like)
        if plan is not None:
            plan.require_complete(checkpoint.key_sep, allow_missing=False, allow_unexpected=True)
        arrays = PlannedArrays(checkpoint, plan, checkpoint.key_sep)
        with place as folder, tracking(arrays.total_bytes, target.name, arrays.sep, enabled=progress,
                                       on_array=on_array) as reporting:
            writer.write(arrays, folder, target.name, reporting)
    finally:
        checkpoint.close()
    return target if target.is_remote else target.path


@contextlib.contextmanager
def _writing(target: Location, force: bool) -> Iterator[Folder]:
    """The temporary folder the writer fills, which then becomes ``target``: locally a sibling
    renamed into place (:mod:`ckptshim.conversion.atomic`), in a bucket a prefix copied into
    place and marked complete (:mod:`ckptshim.conversion.bucket`). The one place that asks
    which kind of storage DST is in."""
    if target.is_remote:
        with bucket_destination(target, force=force) as prefix:
            yield BucketFolder(prefix)
    else:
        with atomic_destination(target.path, force=force) as tmp:
            yield LocalFolder(tmp)


def _plan_onto(checkpoint, like: str | Path) -> Plan:
    """The plan onto ``like``'s layout, each array in the dtype the source stores it in (convert
    copies bytes exactly and never casts: a torchtitan float32 checkpoint ``--like`` a bfloat16
    Hugging Face folder is written in float32, which ``from_pretrained`` casts on load)."""
    return plan_onto(checkpoint, like, stored_dtypes=True)
