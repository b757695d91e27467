"""``torch.save`` files (the zip format torch has written since 1.6), read without running code.

The pickle in ``<archive>/data.pkl`` is interpreted by an allow-listed unpickler that knows only
what ``weights_only=True`` allows for plain state dicts: containers, ``OrderedDict``, tensor
rebuild functions and storage types -- built here as inert placeholders, so no tensor bytes are
read and torch is not imported. Any other global is refused, naming it. Tensor bytes are then
read-only views of a memory map of the (uncompressed) zip member that holds each storage.
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable, Mapping
from typing import Any, BinaryIO

import numpy as np

from ckptshim.errors import CorruptCheckpointError, ShimError, UnsafeCheckpointError
from ckptshim.formats.base import Checkpoint, check_view, file_info, storage_dtype
from ckptshim.inventory import Entry, Inventory, dtype_name, flatten

NAME = "torch-pickle"

_STORAGE_DTYPES = {
    "FloatStorage": "float32", "DoubleStorage": "float64", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32",
    "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool",
    "ComplexFloatStorage": "complex64", "ComplexDoubleStorage": "complex128",
    "Float8_e4m3fnStorage": "float8_e4m3fn", "Float8_e5m2Storage": "float8_e5m2",
}


@dataclass(frozen=True)
class StorageRef:
    """One storage record of the archive: the ``data/<key>`` member, its dtype and length."""

    key: str
    dtype: str
    numel: int


@dataclass(frozen=True)
class TensorRef:
    """A tensor as the pickle describes it: a strided window (in elements) onto a storage."""

    storage: StorageRef
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


class _StorageType:
    def __init__(self, name: str) -> None:
        self.dtype = _STORAGE_DTYPES[name]


def _rebuild_tensor(storage, storage_offset, size, stride, *_ignored) -> TensorRef:
    """A :class:`TensorRef`, once its arguments are what ``torch.save`` writes: a storage record,
    a non-negative offset, and sizes and strides as equally long tuples of ints (sizes >= 0)."""
    if not (isinstance(storage, StorageRef) and _is_int(storage_offset) and storage_offset >= 0
            and isinstance(size, tuple) and isinstance(stride, tuple) and len(size) == len(stride)
            and all(_is_int(n) and n >= 0 for n in size) and all(_is_int(s) for s in stride)):
        raise ValueError("a tensor record that is not (storage, offset, sizes, strides): "
                         f"({', '.join(type(a).__name__ for a in (storage, storage_offset, size, stride))})")
    return TensorRef(storage, storage_offset, size, stride)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _rebuild_parameter(data, *_ignored):
    return data


_ALLOWED = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
}


#: Extra globals a caller allows for one read: ``(module, name)`` -> the inert stand-in to
#: build instead (a function or class that makes plain data, never the real global).
ExtraGlobals = Mapping[tuple[str, str], Callable[..., Any]]


class _SafeUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, where: str, extra: ExtraGlobals | None = None) -> None:
        super().__init__(io.BytesIO(data))
        self.where = where
        self.extra = extra or {}

    def find_class(self, module: str, name: str):
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(name)
        found = _ALLOWED.get((module, name)) or self.extra.get((module, name))
        if found is None:
            raise UnsafeCheckpointError(_unsafe_message(self.where, f"{module}.{name}"))
        return found

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType)):
            raise CorruptCheckpointError(f"{self.where}: unexpected storage record (a {type(pid).__name__})")
        _, storage_type, key, _location, numel = pid
        if not (_is_int(numel) and numel >= 0):
            raise CorruptCheckpointError(f"{self.where}: storage record whose element count is not a "
                                         f"size ({numel if _is_int(numel) else type(numel).__name__})")
        return StorageRef(str(key), storage_type.dtype, numel)


def _unsafe_message(where: str, first: str) -> str:
    names = [first]
    try:  # torch, when installed, can list every unsafe global at once
        import torch.serialization

        names = sorted(set(torch.serialization.get_unsafe_globals_in_checkpoint(where))) or names
    except Exception:  # torch missing or the file unreadable by it: the first global is enough
        pass
    return (f"{where} needs {', '.join(names)} to unpickle, which torch.load(weights_only=True) "
            "does not allow and ckptshim will not run. If you trust this file, load it yourself "
            "with torch.load(..., weights_only=False), re-save its state dict with torch.save, "
            "and load that.")


def sniff(path: Path) -> bool:
    """A zip archive whose first member is ``<archive>/data.pkl`` -- what torch.save writes first.

    Judged from the first local header alone, so a truncated file (its central directory gone)
    is still recognised, and then reported as truncated rather than as an unknown format.
    """
    if not path.is_file():
        return False
    with io.open(path, "rb") as f:
        header = f.read(30)
        if len(header) < 30 or header[:4] != b"PK\x03\x04":
            return False
        (name_length,) = struct.unpack("<H", header[26:28])
        return f.read(name_length).endswith(b"/data.pkl")


READERS = {"torch": sniff}


class TorchPickleCheckpoint(Checkpoint):
    def __init__(self, path: Path, inventory: Inventory, files, offsets: dict[str, int]) -> None:
        super().__init__(path, NAME, "zip", inventory, tuple(files))
        self._offsets = offsets
        self._map: np.memmap | None = None

    def read(self, entry: Entry) -> np.ndarray:
        ref: TensorRef = entry.location[1]
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        start = self._offsets.get(ref.storage.key)
        if start is None:
            raise CorruptCheckpointError(f"{self.path}: storage {ref.storage.key} is missing from the archive")
        nbytes = ref.storage.numel * storage_dtype(ref.storage.dtype).itemsize
        check_view(Entry(entry.key, (ref.storage.numel,), ref.storage.dtype), start, start + nbytes,
                   len(self._map), str(self.path))
        return tensor_view(self._map[start:start + nbytes], ref, f"{self.path}: {'.'.join(entry.key)!r}")

    def close(self) -> None:
        self._map = None


def tensor_view(storage_bytes: np.ndarray, ref: TensorRef, where: str) -> np.ndarray:
    """The tensor ``ref`` describes, as a read-only strided view of its storage's bytes."""
    storage = storage_bytes.view(storage_dtype(ref.storage.dtype))
    extent = ref.offset + 1 + sum((n - 1) * s for n, s in zip(ref.shape, ref.stride))
    if min(ref.shape, default=1) > 0 and (extent > ref.storage.numel or min(ref.stride, default=0) < 0):
        raise CorruptCheckpointError(f"{where} reaches past its storage")
    if not ref.shape:
        return storage[ref.offset:ref.offset + 1].reshape(())
    return np.lib.stride_tricks.as_strided(
        storage[ref.offset:], shape=ref.shape,
        strides=tuple(s * storage.itemsize for s in ref.stride), writeable=False)


@dataclass(frozen=True)
class Archive:
    """A parsed ``torch.save`` archive: its object tree (tensors as :class:`TensorRef`), where
    each storage's bytes start (from the start of the file object it was read from), and any
    problems found on the way."""

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
        names = archive.namelist()
        pkl = next((n for n in names if n.endswith("/data.pkl")), None)
        if pkl is None:
            raise CorruptCheckpointError(f"{where}: zip archive without data.pkl is not a torch.save file")
        prefix = pkl[: -len("data.pkl")]
        byteorder = _stored_member(archive, prefix + "byteorder", size, where) if prefix + "byteorder" in names else b"little"
        data = _stored_member(archive, pkl, size, where)
        try:
            tree = _SafeUnpickler(data, where, extra).load()
            byteorder = byteorder.decode()
        except ShimError:
            raise
        except Exception as error:
            raise CorruptCheckpointError(f"{where}: data.pkl does not unpickle ({type(error).__name__}: {error})") from None
        _check_tree(tree, len(data), where)
        offsets, problems = _member_offsets(raw, archive, prefix)
    if byteorder != "little":
        problems.append(f"stored {byteorder!r:.40}-endian; ckptshim reads little-endian torch files only")
    return Archive(tree, offsets, tuple(problems))


def _stored_member(archive: zipfile.ZipFile, name: str, size: int, where: str) -> bytes:
    """A small member's bytes, refused unless stored uncompressed (as torch.save stores every
    member) and within the file: a compressed member could inflate to any size in memory."""
    info = archive.getinfo(name)
    if info.compress_type != zipfile.ZIP_STORED or info.header_offset + info.compress_size > size:
        raise CorruptCheckpointError(
            f"{where}: {name} is compressed or runs past the end of the file ({info.compress_size} "
            f"bytes at {info.header_offset} of {size}); torch.save stores it uncompressed. The file "
            "is damaged or was not written by torch.save.")
    return archive.read(info)


def _check_tree(tree: object, budget: int, where: str) -> None:
    """Refuse an object graph that is not a tree of at most ``budget`` nodes.

    A pickle can make a container hold itself, or refer to one container from many places, so
    that walking the tree (as :func:`~ckptshim.inventory.flatten` does) never ends or takes
    exponential time. ``torch.save`` writes each container of a state dict once, with at least
    one opcode byte per node, so a walk longer than the pickle has bytes is such a graph.
    """
    stack, visited = [tree], 0
    while stack:
        node = stack.pop()
        visited += 1
        if visited > budget:
            raise CorruptCheckpointError(
                f"{where}: data.pkl's objects refer to themselves or to each other more often than "
                f"a state dict does (over {budget} nodes from {budget} bytes); refusing to walk it. "
                "The file was not written by torch.save of a state dict.")
        if isinstance(node, Mapping):
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)


def _member_offsets(raw: BinaryIO, archive: zipfile.ZipFile, prefix: str) -> tuple[dict[str, int], list[str]]:
    """Where each uncompressed ``data/<key>`` member's bytes start in ``raw``."""
    offsets, problems = {}, []
    for info in archive.infolist():
        if not info.filename.startswith(prefix + "data/"):
            continue
        key = info.filename[len(prefix) + 5:]
        if info.compress_type != zipfile.ZIP_STORED:
            problems.append(f"{info.filename}: compressed members are not a torch.save layout")
            continue
        raw.seek(info.header_offset)
        local = raw.read(30)
        if len(local) < 30 or local[:4] != b"PK\x03\x04":
            problems.append(f"{info.filename}: local zip header is damaged")
            continue
        name_len, extra_len = struct.unpack("<HH", local[26:30])
        offsets[key] = info.header_offset + 30 + name_len + extra_len
    return offsets, problems


def flat_tree(tree: object, where: str) -> dict[tuple[str, ...], object]:
    """:func:`~ckptshim.inventory.flatten` of an unpickled tree; keys that spell one path
    (``{1: a, "1": b}``, which torch.save of a state dict never writes) make the file corrupt."""
    try:
        return flatten(tree)
    except ValueError as error:
        raise CorruptCheckpointError(f"{where}: {error}; a state dict names each tensor once. "
                                     "The file is damaged or was not written by torch.save.") from None


def open_checkpoint(path: Path) -> TorchPickleCheckpoint:
    try:
        with open(path, "rb") as raw:
            archive = read_archive(raw, str(path))
    except OSError as error:
        raise CorruptCheckpointError(f"{path}: cannot be read ({error})") from None
    problems = list(archive.problems)
    entries, expected = [], 0
    for path_parts, leaf in flat_tree(archive.tree, str(path)).items():
        if isinstance(leaf, TensorRef):
            key = tuple(part for component in path_parts for part in component.split("."))
            entries.append(Entry(key, leaf.shape, dtype_name(leaf.storage.dtype), (str(path), leaf)))
            start = archive.offsets.get(leaf.storage.key)
            if start is None:
                problems.append(f"storage {leaf.storage.key} for {'.'.join(key)} is missing")
            else:
                expected = max(expected, start + leaf.storage.numel * storage_dtype(leaf.storage.dtype).itemsize)
    checkpoint = TorchPickleCheckpoint(path, Inventory(entries, str(path)),
                                       [file_info(path, expected)], archive.offsets)
    checkpoint.problems = tuple(problems)
    return checkpoint
