"""The errors every store raises alike, each saying what is wrong and what to do next.

Locations are taken as plain objects (only their text is used), so that every module of the
package can raise these without importing another.
"""

from __future__ import annotations

from ckptshim.errors import CorruptCheckpointError, StorageUnreachableError, UnsafeCheckpointError


def truncated(location: object, start: int, end: int, size: int) -> CorruptCheckpointError:
    """A read of bytes ``start..end`` that runs past the end of an object of ``size`` bytes."""
    return CorruptCheckpointError(
        f"{location}: bytes {start}..{end} were asked for, but it holds {size} bytes; it is "
        "truncated, or the metadata that points into it is wrong. Re-copy the checkpoint from "
        "the original.")


def too_many(location: object, limit: int) -> CorruptCheckpointError:
    """A listing of more than ``limit`` entries."""
    return CorruptCheckpointError(
        f"{location} holds more than {limit:,} entries, more than ckptshim lists in one place; no "
        "checkpoint format it reads has that many there. Point it at the checkpoint itself, not "
        "at a folder or prefix that holds many.")


def too_many_names(location: object, count: int, limit: int) -> CorruptCheckpointError:
    """Metadata (a marker, an index) naming more files than one listing of ``location`` returns."""
    return CorruptCheckpointError(
        f"{location}: its metadata names {count:,} files, more than the {limit:,} ckptshim lists in "
        "one place; no checkpoint holds that many. The metadata is damaged or built to exhaust time.")


def too_large(location: object, size: int, limit: int) -> CorruptCheckpointError:
    """A whole-file read of a file larger than its kind can be."""
    return CorruptCheckpointError(
        f"{location} is {size:,} bytes, more than the {limit:,} ckptshim reads of such a file; it "
        "is not what its name says, or it was built to exhaust memory.")


#: How errors name each kind of :attr:`ObjectInfo.kind <ckptshim.storage.location.ObjectInfo.kind>`
#: that is not a regular file, where the short word alone would puzzle ("a fifo").
KIND_WORDS = {"fifo": "named pipe (FIFO)", "device": "device or other special file",
              "special file": "device or other special file"}


def not_regular(location: object, kind: str) -> UnsafeCheckpointError:
    """The refusal of something that is not a regular file (a FIFO, socket, device, folder)."""
    return UnsafeCheckpointError(
        f"{location} is a {KIND_WORDS.get(kind, kind)}, not a regular file; ckptshim reads only "
        "regular files inside a checkpoint (opening a pipe or device can block forever, or read "
        "what no checkpoint holds). Replace it with the file it stands for.")


def outside(location: object, root: object, why: str) -> UnsafeCheckpointError:
    """The refusal of ``location``, named by the checkpoint at ``root``, which lies outside it."""
    return UnsafeCheckpointError(
        f"{location} lies outside the checkpoint {root} ({why}); ckptshim reads only files and "
        "objects the checkpoint contains, locally below its folder and remotely below its bucket "
        "and prefix. Fix the metadata that names it, or copy what it names into the checkpoint.")


def unreachable(location: object, endpoint: str, error: BaseException) -> StorageUnreachableError:
    """The storage at ``endpoint`` answered no request for ``location`` (``error``: the client's
    last, after its own retries)."""
    return StorageUnreachableError(
        f"{location}: the storage at {endpoint} could not be reached ({type(error).__name__}: "
        f"{str(error)[:300]}); nothing was read, and nothing is known about the checkpoint. Check that "
        "the endpoint is up and is the one meant (AWS_ENDPOINT_URL, STORAGE_EMULATOR_HOST, the "
        "client's settings), and the network, then try again.")
