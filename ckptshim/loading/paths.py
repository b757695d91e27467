"""Which locations ckptshim reads itself: local paths, and where a loader says so, object storage.

Frameworks open ``gs://bucket/ckpt`` or ``s3://...`` through their own file systems (Orbax and
Flax through ``etils.epath``, T5X through ``tf.io.gfile``). ``pathlib.Path`` would collapse such a
URL into the local path ``gs:/bucket/ckpt``, which names something else entirely; so a location
with a scheme is never turned into a path here: :func:`local_path` leaves it to the framework,
:func:`item_location` keeps an ``s3://``/``gs://`` URL a :class:`~ckptshim.storage.Location` for
the loaders that read object storage.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from ckptshim.storage import Location, UnsupportedLocation

#: ``scheme://`` at the start of a location (RFC 3986 scheme syntax).
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def local_path(location: Any) -> Path | None:
    """``location`` (a string or path object, ``etils.epath`` paths included) as a local
    :class:`~pathlib.Path`; ``None`` for a URL of any scheme, or for something that names no
    path at all."""
    try:
        text = os.fspath(location)
    except TypeError:
        return None
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    return None if _URL.match(text) else Path(text)


def item_location(location: Any) -> Path | Location | None:
    """``location`` as a local :class:`~pathlib.Path` or, for an ``s3://``/``gs://`` URL, a
    :class:`~ckptshim.storage.Location`; ``None`` for a URL of another scheme (the framework's to
    read) or something that names no path."""
    if isinstance(location, Location):
        return location if location.is_remote else location.path
    path = local_path(location)
    if path is not None:
        return path
    try:
        return Location.of(os.fsdecode(os.fspath(location)))
    except (TypeError, ValueError, UnsupportedLocation):
        return None
