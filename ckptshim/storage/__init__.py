"""Where checkpoints are: one :class:`Location` type for local paths and object storage.

Formats name their files with locations and read them through it; local paths go to the file
system (regular files only, never blocking), ``s3://`` and ``gs://`` to the fsspec clients the
frameworks use (s3fs, gcsfs), and tensorstore reads arrays from :meth:`Location.kvstore_spec`.
Importing this package imports neither fsspec nor tensorstore, torch nor jax.
"""

from ckptshim.storage import local, objects, snapshot
from ckptshim.storage.location import (DEFAULT_LIST_LIMIT, REMOTE_SCHEMES, ByteRange, Location, ObjectInfo,
                                       OpenFile, Store, UnsupportedLocation, read_ranges, register_store)

register_store("", lambda kind: local.LocalFiles())
for _scheme in objects.CLIENTS:
    register_store(_scheme, objects.FsspecObjects)

__all__ = ["DEFAULT_LIST_LIMIT", "REMOTE_SCHEMES", "ByteRange", "Location", "ObjectInfo", "OpenFile", "Store",
           "UnsupportedLocation", "read_ranges", "register_store"]
