"""Writing a destination in a bucket all at once: a temporary prefix, copied into place, then a marker.

Object stores cannot rename, so the local guarantee (:mod:`ckptshim.conversion.atomic`: a
temporary sibling renamed into place) is kept this way:

1. the writer writes under a temporary prefix beside DST, ``.<name>.ckptshim-tmp-<token>``,
   through the framework's own fsspec client (s3fs, gcsfs); nobody reads that name;
2. when everything is written, each object is copied into place by the server (no byte comes
   back to this machine; several copies in flight at once), and for a folder :data:`MARKER` is written last: a JSON list of the
   objects and their sizes. A folder without it is not (yet, or no longer) a finished
   conversion. A single object (``model.safetensors``) needs none: an object store publishes an
   object only once its upload or copy is complete;
3. the temporary prefix is removed, on success and on failure alike.

A failure while writing leaves nothing under DST's name (an existing DST, with ``force``, is
untouched until everything is written). A failure while copying into place removes what was
copied, so DST's name holds nothing rather than a part; with ``force`` the old DST was removed
just before, so it is gone too (the local exchange has no such window; an object store offers
no way to close it). Without ``force``, any object at DST's name, or below it, is refused, checked
before writing and again just before copying; a convert racing another for the same DST between
that check and the copies is not excluded (object stores have no exclusive create that fsspec
exposes for every server).
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Iterator
from typing import IO, Any

from ckptshim.conversion.atomic import TEMP_TAG, DestinationError, DestinationExistsError
from ckptshim.formats.marker import MARKER
from ckptshim.storage import Location
from ckptshim.storage.objects import MAX_PARALLEL_READS, filesystem, fsspec_path


def open_for_writing(location: Location) -> IO[bytes]:
    """A binary file to write the object at ``location`` through the scheme's fsspec client (a
    multipart or resumable upload: the object appears only when the file is closed)."""
    return filesystem(location.scheme).open(fsspec_path(location), "wb")


class BucketFolder:
    """The temporary prefix a writer writes into (see :class:`ckptshim.conversion.Folder`): each
    object an upload through the scheme's fsspec client, which appears only once complete."""

    def __init__(self, location: Location) -> None:
        self.location = location

    @contextlib.contextmanager
    def create(self, name: str) -> Iterator[IO[bytes]]:
        with open_for_writing(self.location / name) as out:
            yield out

    def dcp_writer(self) -> Any:
        """torch's ``FsspecWriter`` (what ``dcp.save(checkpoint_id=URL)`` uses), one file per rank."""
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        # sync_files would os.sync() the whole machine: there is no local file to flush
        return FsspecWriter(str(self.location), single_file_per_rank=True, thread_count=1, sync_files=False)


def _objects(fs: Any, location: Location) -> dict[str, int]:
    """Every object at ``location`` itself or below it, by name relative to it (``""`` for the
    object itself), with its size."""
    found: dict[str, int] = {}
    path = fsspec_path(location)
    fs.invalidate_cache(path)
    with contextlib.suppress(FileNotFoundError):
        info = fs.info(path)
        if info.get("type") != "directory":
            found[""] = int(info.get("size") or 0)
    with contextlib.suppress(FileNotFoundError):
        for name, info in fs.find(path, detail=True, withdirs=False).items():
            name = name.rstrip("/")
            if name.startswith(path + "/"):
                found[name[len(path) + 1:]] = int(info.get("size") or 0)
    return found


def _remove(fs: Any, location: Location, names: Iterator[str] | list[str]) -> None:
    """Remove the objects ``names`` (as :func:`_objects` gives them) at or below ``location``;
    nothing at all when one has a name a client could rewrite into another object's
    (``dst//x.bin``: an empty part), which is refused, naming it."""
    paths = [fsspec_path(_below(location, name)) if name else fsspec_path(location) for name in names]
    if paths:
        fs.rm(paths)


def _below(location: Location, name: str) -> Location:
    try:
        return location / name
    except ValueError:
        raise DestinationError(
            f"{location} holds an object named {fsspec_path(location)}/{name!r:.200} (a '.', '..' or empty "
            "name part, which HTTP clients rewrite into another object's name); ckptshim deletes nothing "
            "it cannot name exactly. Remove that object with your storage's own tools, or convert to "
            "another destination.") from None


def _refuse_existing(fs: Any, destination: Location) -> None:
    if _objects(fs, destination):
        raise DestinationExistsError(f"{destination} already exists; pass --force to replace it")


@contextlib.contextmanager
def bucket_destination(destination: Location, *, force: bool = False) -> Iterator[Location]:
    """Yield an empty temporary prefix beside ``destination``; on success what was written there
    becomes ``destination`` (the one object named like it, else a folder of everything), as
    the module docstring describes."""
    fs = filesystem(destination.scheme)
    if not destination.key:
        raise DestinationError(f"{destination} is a whole bucket; convert to a prefix in it "
                               f"({destination}/NAME)")
    if not force:
        _refuse_existing(fs, destination)
    tmp = destination.parent / f".{destination.name}{TEMP_TAG}{uuid.uuid4().hex}"
    try:
        try:
            yield tmp
            written = _objects(fs, tmp)
            if not force:
                _refuse_existing(fs, destination)
            _into_place(fs, tmp, written, destination)
        except MemoryError:
            raise DestinationError(f"not enough memory to write {destination}: an array of the "
                                   "checkpoint is larger than this machine can allocate") from None
        except OSError as error:
            raise DestinationError(f"writing {destination} failed ({type(error).__name__}: {error}). "
                                   f"Nothing was left at {destination}; check the bucket's permissions "
                                   "and the client's settings, and convert again.") from None
    finally:
        with contextlib.suppress(OSError):
            _remove(fs, tmp, list(_objects(fs, tmp)))


def _into_place(fs: Any, tmp: Location, written: dict[str, int], destination: Location) -> None:
    """Copy ``written`` (the objects below ``tmp``) to ``destination``, marker last; on any
    failure remove what reached ``destination``'s name."""
    single = list(written) == [destination.name]
    old = _objects(fs, destination)
    try:
        _remove(fs, destination, list(old))
        if single:
            fs.copy(fsspec_path(tmp / destination.name), fsspec_path(destination))
            return
        names = sorted(written)  # copied by the server, at most MAX_PARALLEL_READS at once
        fs.copy([fsspec_path(tmp / name) for name in names], [fsspec_path(destination / name) for name in names],
                batch_size=MAX_PARALLEL_READS)
        marker = {"written_by": "ckptshim convert", "objects": dict(sorted(written.items()))}
        fs.pipe_file(fsspec_path(destination / MARKER), json.dumps(marker, indent=1).encode())
    except BaseException:
        with contextlib.suppress(OSError):
            _remove(fs, destination, list(_objects(fs, destination)))
        raise
