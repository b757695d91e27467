"""``torch.save`` files (the zip format torch has written since 1.6), read without running code.

The pickle in ``<archive>/data.pkl`` is interpreted by :mod:`ckptshim.formats.safe_pickle` in
the dialect ``torch.load(weights_only=True)`` reads, with the globals it allows in this process
(:mod:`ckptshim.formats.torch_globals`: containers, ``OrderedDict``, tensor rebuild functions,
storage types, dtypes, and what torch's safe-globals registry holds, such as torchao's float8
weight subclass) built as inert stand-ins, so no tensor bytes are read and no code from the
file runs; torch is not even imported. Any other global is refused, naming it. Only after the whole pickle has been interpreted (so that no
``BUILD`` can change a record once it was checked) are the stand-ins turned into
:class:`TensorRef` records, and every record checked against the zip member that holds its
storage, as torch checks them. Tensor bytes are then read-only views of a memory map of the
(uncompressed) zip member that holds each storage.

A local file and an object in a bucket are read the same way, through
:meth:`Location.open <ckptshim.storage.Location.open>` and a
:class:`~ckptshim.storage.ranged.Window` onto it: the file's first :data:`HEAD_BYTES` and last
:data:`TAIL_BYTES` (the pickle, and the zip directory) asked for ahead in one parallel batch (an
object fetches them; a local file, with the page cache behind it, needs nothing fetched), then,
where those did not hold them, the pickle and the local headers of the storages it names
(:func:`_prefetch`). Every member is checked against the file's size, and nothing outside it is
read. A whole tensor is a view of the file's bytes (:meth:`~ckptshim.storage.OpenFile.view`:
locally of a memory map, nothing copied; remotely exactly its bytes, fetched); a block of one
is its byte range (:meth:`TorchPickleCheckpoint.byte_range`, batched by ``read_blocks``). A
pre-1.6 ``torch.save`` file (a bare pickle, not a zip) is not read: :func:`refuse_legacy`.
"""

from __future__ import annotations

import io
import os
import struct
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterable, Mapping, Sequence
from typing import BinaryIO

import numpy as np

from ckptshim.errors import CorruptCheckpointError, ShimError, UnknownFormatError
from ckptshim.formats import located, safe_pickle
from ckptshim.formats.base import Budget, Checkpoint, FileInfo, check_view, contiguous, reader, reading, storage_dtype
from ckptshim.formats.torch_globals import ExtraGlobals, Globals, Storage, StorageRef, Tensor, TensorRef
from ckptshim.inventory import Entry, Inventory, dtype_name, flatten
from ckptshim.storage import ByteRange, Location, OpenFile
from ckptshim.storage.ranged import Window, archive_spans, prefetch

NAME = "torch-pickle"
#: Nesting deeper than any state dict (an optimizer's is four levels deep); deeper pickles cost
#: time quadratic in their depth to flatten, and could hold a container that holds itself.
MAX_DEPTH = 128


#: How much of a remote file's start and end one round trip fetches: the pickle of a state dict
#: of a few hundred tensors, and a zip directory of a few thousand members; a larger one takes
#: one more request.
HEAD_BYTES = 64 << 10
TAIL_BYTES = 256 << 10
#: A zip local header before its name (torch.save's names are short; its padding ``extra``
#: field is under 64 bytes): what a member's bytes are fetched with, so they start in the span.
_LOCAL_HEADER = 30
_LOCAL_SLACK = 256
#: A first local header with the longest name zip allows: all :func:`sniff` ever reads.
_FIRST_HEADER = _LOCAL_HEADER + 0xFFFF
#: What a pre-1.6 ``torch.save`` file starts with: pickle protocol 2, then torch's magic number.
_LEGACY_MAGIC = b"\x80\x02\x8a\x0a" + (0x1950A86A20F9469CFC6C).to_bytes(10, "little")


def _opens_with_pickle(head: bytes) -> bool:
    """Whether ``head`` (a file's first bytes: its first local header and name) is a zip archive
    whose first member is ``<archive>/data.pkl`` -- what torch.save writes first."""
    if len(head) < _LOCAL_HEADER or head[:4] != b"PK\x03\x04":
        return False
    (name_length,) = struct.unpack("<H", head[26:28])
    return head[_LOCAL_HEADER:_LOCAL_HEADER + name_length].endswith(b"/data.pkl")


def sniff(path: Path | Location) -> bool:
    """A ``torch.save`` zip archive (whatever its name: ``model.pt``, ``pytorch_model.bin``,
    Lightning's ``.ckpt``), judged from the first local header alone, so a truncated file (its
    central directory gone) is still recognised, and then reported as truncated rather than as
    an unknown format. A legacy one is refused (:func:`refuse_legacy`)."""
    head = located.head(path, _FIRST_HEADER)
    refuse_legacy(path, head)
    return _opens_with_pickle(head)


def refuse_legacy(where: Path | Location, head: bytes) -> None:
    """An :class:`UnknownFormatError` saying what to do when ``head`` starts a ``torch.save``
    file of the legacy format (torch < 1.6: a bare pickle, its storages after it with no
    directory), which ckptshim does not read: no directory says where its storages lie (so no
    bucket can serve it by ranges either), and nothing else should mistake it for its own format
    (its first byte is also an empty msgpack map)."""
    if not head.startswith(_LEGACY_MAGIC):
        return
    remote = Location.of(where).is_remote  # what to tell the user only: the reading is the same
    raise UnknownFormatError(
        f"{where} is a torch.save file in the legacy format (torch < 1.6, not a zip archive), which "
        f"ckptshim does not read{' from object storage' if remote else ''}. "
        + ("Download it (gcloud storage cp, aws s3 cp), load the copy" if remote else "Load it")
        + " with torch.load(..., weights_only=True) and re-save it with a current torch.save.")


READERS = {"torch": sniff}


class TorchPickleCheckpoint(Checkpoint):
    """One ``torch.save`` archive; entry locations are ``(file, TensorRef)``. Its bytes are read
    through the file opened at its location (:meth:`~ckptshim.storage.Location.open`), on the
    first read; ``size``: the file's, where known (a listing, a stat), else taken then."""

    def __init__(self, path: Path | Location, inventory: Inventory, files, offsets: dict[str, int],
                 size: int | None = None) -> None:
        super().__init__(path, NAME, "zip", inventory, tuple(files))
        self._offsets = offsets
        self._location = Location.of(path)
        self._size = size if size is not None or not self.files else self.files[0].size
        self._file: OpenFile | None = None

    def _opened(self) -> OpenFile:
        if self._file is None:
            self._file = self._location.open()
        return self._file

    def _storage(self, entry: Entry) -> tuple[TensorRef, int]:
        """``entry``'s tensor record and where its storage starts, checked against the file."""
        ref: TensorRef = entry.location[1]
        start = self._offsets.get(ref.storage.key)
        if start is None:
            raise CorruptCheckpointError(f"{self.path}: storage {ref.storage.key} is missing from the archive")
        if self._size is None:
            self._size = self._location.stat().size
        check_view(Entry(entry.key, (ref.storage.numel,), ref.storage.dtype), start, start + ref.storage.nbytes,
                   self._size, str(self.path))
        return ref, start

    def read(self, entry: Entry) -> np.ndarray:
        """The tensor, a read-only view of the file's bytes: exactly its own where it is dense in
        its storage, else a strided view of its storage's."""
        ref, start = self._storage(entry)
        dense = _dense(ref)
        if dense is not None:
            data = self._opened().view(start + dense.start, dense.stop - dense.start)
            return np.frombuffer(data, storage_dtype(ref.storage.dtype)).reshape(ref.shape)
        data = self._opened().view(start, ref.storage.nbytes)
        return tensor_view(np.frombuffer(data, np.uint8), ref, f"{self.path}: {'.'.join(entry.key)!r}")

    def check_entry(self, entry: Entry) -> None:
        """The entry's storage checked against the file's size; nothing is read."""
        self._storage(entry)

    def byte_range(self, entry: Entry, index: tuple, out: np.ndarray) -> ByteRange | None:
        """Where the tensor is dense in its storage, ``entry[index]`` one run of it and ``out`` a
        C-contiguous buffer of the stored dtype (what ``dcp.load`` and ``convert`` ask for): that
        run's byte range, for :meth:`read_blocks` to read with the others in one batch."""
        ref, start = self._storage(entry)
        dense, span = _dense(ref), contiguous(entry.shape, index)
        stored = storage_dtype(ref.storage.dtype)
        if dense is None or span is None or out.dtype != stored or not out.flags.c_contiguous:
            return None
        first, count = span
        return ByteRange(self._location, start + dense.start + first * stored.itemsize, count * stored.itemsize)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _dense(ref: TensorRef) -> slice | None:
    """The bytes of ``ref``'s storage that hold the tensor, in C order and nothing else between
    (its strides are row-major for its shape); ``None`` for any other view."""
    expected, strides = 1, []
    for n in reversed(ref.shape):
        strides.append(expected)
        expected *= n
    if any(n > 1 and s != want for n, s, want in zip(ref.shape, ref.stride, reversed(strides))):
        return None
    itemsize = storage_dtype(ref.storage.dtype).itemsize
    return slice(ref.offset * itemsize, (ref.offset + expected) * itemsize)


def tensor_view(storage_bytes: np.ndarray, ref: TensorRef, where: str) -> np.ndarray:
    """The tensor ``ref`` describes, as a read-only strided view of its storage's bytes (which
    must be the whole storage: the view never reaches past them)."""
    storage = storage_bytes.view(storage_dtype(ref.storage.dtype))
    if ref.extent > len(storage) or min(ref.stride, default=0) < 0:
        raise CorruptCheckpointError(f"{where} reaches past its storage")
    if not ref.shape:
        return storage[ref.offset:ref.offset + 1].reshape(())
    return np.lib.stride_tricks.as_strided(
        storage[ref.offset:], shape=ref.shape,
        strides=tuple(s * storage.itemsize for s in ref.stride), writeable=False)


@dataclass(frozen=True)
class Archive:
    """A parsed ``torch.save`` archive: its object tree (tensors as :class:`TensorRef`, every one
    inside its storage), where each storage's bytes start (from the start of the file object it
    was read from; each holds exactly its storage), and any problems found on the way."""

    tree: object
    offsets: dict[str, int]
    problems: tuple[str, ...]


#: What :mod:`zipfile` raises on a damaged archive: bad or inconsistent headers, names that are
#: not UTF-8, unknown versions or compression methods, "encrypted" flags, offsets past the end.
_ZIP_ERRORS = (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError,
               RuntimeError, NotImplementedError, struct.error, zlib.error, OverflowError)


def read_archive(raw: BinaryIO, where: str, extra: ExtraGlobals | None = None) -> Archive:
    """Parse the ``torch.save`` zip in the seekable ``raw`` (a file, or a window onto one: DCP
    stores each chunk as one such archive inside a larger file) without running its code.

    ``extra`` widens the allow-list for this one read only (DeepSpeed's ``mp_rank`` files hold
    numpy RNG state): each allowed global maps to an inert stand-in that builds data."""
    with reading(where):
        try:
            return _read_archive(raw, where, extra)
        except ShimError:
            raise
        except _ZIP_ERRORS as error:
            raise CorruptCheckpointError(f"{where}: not a readable torch.save zip archive "
                                         f"({type(error).__name__}: {error}); the file may be truncated "
                                         "or damaged. Re-copy it from the original.") from None


def _read_archive(raw: BinaryIO, where: str, extra: ExtraGlobals | None) -> Archive:
    size = raw.seek(0, io.SEEK_END)
    with zipfile.ZipFile(raw) as archive:
        members = _members(archive, where)
        if not members:
            raise CorruptCheckpointError(f"{where}: an empty zip archive is not a torch.save file")
        prefix = archive.infolist()[0].filename.split("/", 1)[0] + "/"  # as torch's reader finds it
        if prefix + "data.pkl" not in members:
            raise CorruptCheckpointError(
                f"{where}: zip archive without {prefix}data.pkl (torch reads the folder of its "
                "first member) is not a torch.save file")
        stored = {name[len(prefix) + 5:]: info for name, info in members.items()
                  if name.startswith(prefix + "data/")}
        _prefetch(raw, [members[prefix + name] for name in ("data.pkl", "byteorder") if prefix + name in members],
                  (), size)
        byteorder = _stored_member(archive, members[prefix + "byteorder"], size, where) \
            if prefix + "byteorder" in members else b"little"
        data = _stored_member(archive, members[prefix + "data.pkl"], size, where)
        names = Globals(where, extra)
        budget = Budget(f"{where}: data.pkl", sum(info.file_size for info in stored.values()))
        stand_ins = safe_pickle.load(data, f"{where}: data.pkl", safe_pickle.TORCH, names.find_class,
                                     names.persistent_load, budget)
        tree, tensors = _settle(stand_ins, len(data), where)
        offsets, problems = _storage_offsets(raw, names.storages, stored, size, where)
    for tensor in tensors:
        if tensor.extent > tensor.storage.numel or min(tensor.stride, default=0) < 0:
            raise CorruptCheckpointError(
                f"{where}: a tensor {list(tensor.shape)} with strides {list(tensor.stride)} from element "
                f"{tensor.offset} reaches past its storage of {tensor.storage.numel}; torch refuses it too.")
    text = byteorder.decode("ascii", "replace")
    if text != "little":
        problems.append(f"stored {text!r:.40}-endian; ckptshim reads little-endian torch files only")
    return Archive(tree, offsets, tuple(problems))


def _prefetch(raw: BinaryIO, whole: Iterable[zipfile.ZipInfo], headers: Iterable[zipfile.ZipInfo],
              size: int) -> None:
    """Ask for ahead, in one parallel batch, what the parse reads next, piece by piece (through a
    :class:`Window`; an object fetches it, a local file needs nothing fetched): the ``whole`` members (the pickle,
    with their local headers) and the local header of each of ``headers`` (the storages the
    pickle named, whose data starts after it). A member the directory says runs past the
    archive's ``size`` is left for the parse to refuse, unfetched."""
    if isinstance(raw, Window):
        raw.prefetch([(info.header_offset, _LOCAL_HEADER + _LOCAL_SLACK + info.compress_size) for info in whole
                      if info.header_offset + info.compress_size <= size]
                     + [(info.header_offset, _LOCAL_HEADER) for info in headers])


def _members(archive: zipfile.ZipFile, where: str) -> dict[str, zipfile.ZipInfo]:
    """Members by name; a name twice is refused (torch reads the first, ``zipfile`` the last)."""
    members: dict[str, zipfile.ZipInfo] = {}
    for info in archive.infolist():
        if info.filename in members:
            raise CorruptCheckpointError(
                f"{where}: the zip archive holds {info.filename!r:.200} twice; which one is meant "
                "would be a guess (torch reads the first, Python's zipfile the last). The file was "
                "altered after torch.save wrote it.")
        members[info.filename] = info
    return members


def _stored_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, size: int, where: str) -> bytes:
    """A small member's bytes, refused unless stored uncompressed (as torch.save stores every
    member) and within the file: a compressed member could inflate to any size in memory."""
    if info.compress_type != zipfile.ZIP_STORED or info.header_offset + info.compress_size > size:
        raise CorruptCheckpointError(
            f"{where}: {info.filename} is compressed or runs past the end of the file ({info.compress_size} "
            f"bytes at {info.header_offset} of {size}); torch.save stores it uncompressed. The file "
            "is damaged or was not written by torch.save.")
    return archive.read(info)


def _settle(root: object, budget: int, where: str) -> tuple[object, list[TensorRef]]:
    """The unpickled stand-ins as plain data -- dicts, lists, tuples, :class:`TensorRef` -- and
    every tensor record in it, or a refusal.

    A pickle can make a container hold itself, refer to one container from many places (so
    that a walk takes exponential time), or nest so deeply that flattening it takes time
    quadratic in its depth. ``torch.save`` writes each container of a state dict once, with at
    least one opcode byte per node, a few levels deep; so a walk longer than the pickle has
    bytes, or deeper than :data:`MAX_DEPTH`, is refused.
    """
    tensors: list[TensorRef] = []
    visited = 0

    def settle(node: object, depth: int) -> object:
        nonlocal visited
        visited += 1
        if visited > budget or depth > MAX_DEPTH:
            raise CorruptCheckpointError(
                f"{where}: data.pkl's objects nest deeper than {MAX_DEPTH} levels, refer to "
                f"themselves, or refer to each other more often than a state dict does (over "
                f"{budget} nodes from {budget} bytes); refusing to walk it. The file was not written "
                "by torch.save of a state dict.")
        kind = type(node)
        if kind is Tensor:
            tensors.append(node.ref)
            return node.ref
        if kind is Storage:
            return node.ref
        if isinstance(node, dict):  # a dict, an OrderedDict, a stand-in that is a dict of its state
            return {key: settle(value, depth + 1) for key, value in dict.items(node)}
        if kind is list:
            return [settle(value, depth + 1) for value in node]
        if kind is tuple:
            return tuple(settle(value, depth + 1) for value in node)
        return node

    return settle(root, 0), tensors


def _storage_offsets(raw: BinaryIO, storages: Mapping[str, StorageRef], members: Mapping[str, zipfile.ZipInfo],
                     size: int, where: str) -> tuple[dict[str, int], list[str]]:
    """Where each storage's bytes start in ``raw``, once its ``data/<key>`` member is as torch
    requires: stored, exactly ``numel x itemsize`` bytes long, inside the file. A missing member
    is a problem (the file is incomplete); a member of another size is refused, as torch does."""
    _prefetch(raw, (), (members[key] for key in storages if key in members), size)
    offsets, problems = {}, []
    for key, storage in storages.items():
        info = members.get(key)
        if info is None:
            problems.append(f"storage {key} is missing")
            continue
        if info.compress_type != zipfile.ZIP_STORED or info.file_size != storage.nbytes:
            raise CorruptCheckpointError(
                f"{where}: {info.filename} holds {info.file_size} bytes"
                f"{'' if info.compress_type == zipfile.ZIP_STORED else ' compressed'}, but its storage "
                f"record declares {storage.numel} x {storage.dtype} ({storage.nbytes} bytes); torch "
                "refuses the file too. It was altered after torch.save wrote it.")
        raw.seek(info.header_offset)
        local = raw.read(30)
        if len(local) < 30 or local[:4] != b"PK\x03\x04":
            problems.append(f"{info.filename}: local zip header is damaged")
            continue
        name_len, extra_len = struct.unpack("<HH", local[26:30])
        start = info.header_offset + 30 + name_len + extra_len
        if start + storage.nbytes > size:
            problems.append(f"{info.filename}: needs bytes up to {start + storage.nbytes} but the file "
                            f"has {size}; it is truncated")
        offsets[key] = start
    return offsets, problems


def flat_tree(tree: object, where: str) -> dict[tuple[str, ...], object]:
    """:func:`~ckptshim.inventory.flatten` of an unpickled tree; keys that spell one path
    (``{1: a, "1": b}``, which torch.save of a state dict never writes) make the file corrupt."""
    try:
        return flatten(tree)
    except ValueError as error:
        raise CorruptCheckpointError(f"{where}: {error}; a state dict names each tensor once. "
                                     "The file is damaged or was not written by torch.save.") from None


@reader
def open_checkpoint(path: Location | os.PathLike[str], size: int | None = None) -> TorchPickleCheckpoint:
    """The ``torch.save`` file at ``path`` (``size`` its size when a listing gave it)."""
    return open_files([(path, size)])[0]


def open_files(files: Sequence[tuple[Location | os.PathLike[str], int | None]]) -> list[TorchPickleCheckpoint]:
    """Each ``(file, size)`` opened as a ``torch.save`` archive (``size``: where a listing gave
    it), parsed by :func:`read_archive` through a :class:`Window` onto it; the first and last
    bytes of all of them (their pickles and zip directories) asked for ahead in one batch. Each
    checkpoint's ``path`` is the file as given."""
    opened: list[tuple[Location | os.PathLike[str], OpenFile, int]] = []
    try:
        for given, size in files:
            where = Location.of(given)
            try:
                file = where.open()
            except OSError as error:
                raise CorruptCheckpointError(f"{where}: cannot be read ({error})") from None
            opened.append((given, file, where.stat().size if size is None else size))
        prefetch([(file, archive_spans(0, size, HEAD_BYTES, TAIL_BYTES)) for _, file, size in opened])
        out = []
        for given, file, size in opened:
            with reading(given, "opening it"):
                archive = read_archive(Window(file, 0, size), str(given))
            entries, expected = _entries(given, archive)
            out.append(_opened(given, entries, FileInfo(str(given), size, expected), archive, size))
        return out
    finally:
        for _, file, _ in opened:
            file.close()


def _entries(path: Location | os.PathLike[str], archive: Archive) -> tuple[list[Entry], int]:
    """One entry per tensor of ``archive`` (its key split at dots, as torch's state dicts spell
    it), and the bytes of the file its storages need."""
    entries, expected = [], 0
    for path_parts, leaf in flat_tree(archive.tree, str(path)).items():
        if isinstance(leaf, TensorRef):
            key = tuple(part for component in path_parts for part in component.split("."))
            entries.append(Entry(key, leaf.shape, dtype_name(leaf.storage.dtype), (str(path), leaf)))
            start = archive.offsets.get(leaf.storage.key)
            if start is not None:
                expected = max(expected, start + leaf.storage.nbytes)
    return entries, expected


def _opened(path: Location | os.PathLike[str], entries: list[Entry], info: FileInfo, archive: Archive,
            size: int | None = None) -> TorchPickleCheckpoint:
    checkpoint = TorchPickleCheckpoint(path, Inventory(entries, str(path)), [info], archive.offsets, size)
    checkpoint.problems = archive.problems
    return checkpoint
