"""The marker of a folder that ``ckptshim convert`` wrote to a bucket, checked by its readers.

Object stores cannot rename a folder into place, so ``convert`` copies each object to the
destination's name and writes :data:`MARKER` last: the name and size of every object of the
conversion (:mod:`ckptshim.conversion.bucket`). A reader that finds the marker checks it, so a
folder whose copies were interrupted, or lost an object since, is an incomplete checkpoint that
names what is missing -- not a load of whatever happens to be there. A folder without a marker
is not one ckptshim wrote (or not one it finished); the format's own checks apply as always.
"""

from __future__ import annotations

from collections.abc import Mapping

from ckptshim.errors import CorruptCheckpointError
from ckptshim.formats.base import strict_json
from ckptshim.keytext import shown
from ckptshim.storage import Location, ObjectInfo

#: The object ``convert`` writes last inside a destination folder, once every other one is in place.
MARKER = "ckptshim-complete.json"
#: The most a marker may hold: a line per object of a checkpoint (a real one is a few KiB).
MAX_MARKER_BYTES = 16 * 2**20


def require_complete(root: Location, listed: Mapping[str, ObjectInfo]) -> None:
    """Refuse the folder ``root`` (its first level ``listed`` by name) when its marker names an
    object that is missing or of another size (see :func:`problems`)."""
    found = problems(root, listed)
    if found:
        raise CorruptCheckpointError(f"{root} is incomplete: {MARKER}, which ckptshim convert wrote last, lists "
                                     "objects it does not hold as listed:\n  " + "\n  ".join(found))


def problems(root: Location, listed: Mapping[str, ObjectInfo]) -> list[str]:
    """What the marker in ``root`` (a bucket prefix whose first level ``listed`` maps by name)
    says is missing or of another size; nothing when there is no marker. A marker that is not
    one ``convert`` writes is refused, naming it."""
    found = listed.get(MARKER)
    if found is None:
        return []
    where = root / MARKER
    try:
        marker = strict_json(where.read_bytes(MAX_MARKER_BYTES, found.size))
        objects = marker["objects"] if isinstance(marker, dict) else None
        if not isinstance(objects, dict) or not all(isinstance(size, int) and not isinstance(size, bool)
                                                     for size in objects.values()):
            raise ValueError("no 'objects' map of names to sizes")
    except (ValueError, KeyError) as error:
        raise CorruptCheckpointError(f"{where}: not the marker ckptshim convert writes ({error}); remove it "
                                     "if the folder was written another way, or convert again.") from None
    present = listed if all("/" not in name for name in objects) else root.files_named(objects)
    out = []
    for name, size in sorted(objects.items()):
        there = present.get(name)
        if there is None or there.kind != "file":
            out.append(f"{shown(name)}: missing ({size:,} bytes when {MARKER} was written); the convert that wrote "
                       f"{root} did not finish, or the object was removed since. Convert again.")
        elif there.size != size:
            out.append(f"{shown(name)}: {there.size:,} bytes, but {MARKER} says {size:,}; the object was replaced "
                       "since the convert. Convert again.")
    return out

