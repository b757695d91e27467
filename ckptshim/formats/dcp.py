"""torch.distributed.checkpoint (DCP) directories: a pickled ``.metadata`` beside rank files.

``.metadata`` is a pickle of DCP's metadata dataclasses. It is read by an allow-listed unpickler
that knows only those classes, ``torch.Size``, torch dtypes and layouts, a few containers and
path types -- each built here as inert data, so neither torch nor any code from the checkpoint
runs -- and refuses every other global by name. The default ``FileSystemWriter`` stores each
chunk (a whole tensor, or one rank's block of it) as a complete ``torch.save`` archive at
``(relative_path, offset, length)`` inside a ``__<rank>_<n>.distcp`` file; those archives are
parsed with :mod:`ckptshim.formats.torch_pickle` only when their bytes are wanted. Reads go
through ``pread`` into buffers the caller owns, so every byte is read once and only when needed.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any, BinaryIO

import numpy as np

from ckptshim.errors import CorruptCheckpointError, UnknownFormatError, UnsafeCheckpointError
from ckptshim.formats.base import Checkpoint, file_info, storage_dtype
from ckptshim.formats.torch_pickle import TensorRef, read_archive, tensor_view
from ckptshim.inventory import DTYPE_SIZES, Entry, Inventory, dtype_name, split_key

NAME = "torch-dcp"
METADATA_FILE = ".metadata"

_DCP = "torch.distributed.checkpoint.metadata"
_SHARD = "torch.distributed._shard.sharded_tensor.metadata"  # TensorProperties before torch 2.2


class _Record:
    """An allow-listed DCP metadata object kept as inert data: its pickled state, nothing run."""

    state: Any = None

    def __setstate__(self, state: Any) -> None:
        self.state = state


#: The dataclasses DCP pickles into ``.metadata`` (torch 2.0 to 2.13), rebuilt as records.
_RECORD_TYPES: dict[tuple[str, str], type[_Record]] = {
    (module, name): type(name, (_Record,), {"__module__": __name__})
    for module, name in (
        (_DCP, "Metadata"), (_DCP, "TensorStorageMetadata"), (_DCP, "BytesStorageMetadata"),
        (_DCP, "ChunkStorageMetadata"), (_DCP, "TensorProperties"), (_DCP, "MetadataIndex"),
        (_DCP, "StorageMeta"), (_SHARD, "TensorProperties"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    )
}


def _path(*parts: str) -> str:
    return str(PurePath(*parts))


#: Callables the pickle may apply (REDUCE), each replaced by an inert equivalent.
_CALLS: dict[tuple[str, str], Any] = {
    ("torch", "Size"): lambda dims=(): tuple(int(d) for d in dims),
    ("torch.serialization", "_get_layout"): str,
    (_DCP, "_MEM_FORMAT_ENCODING"): int,
    (_SHARD, "MEM_FORMAT_ENCODING"): int,
    ("collections", "OrderedDict"): dict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    **{("pathlib", name): _path for name in ("Path", "PosixPath", "WindowsPath", "PurePath",
                                              "PurePosixPath", "PureWindowsPath")},
}


#: torch dtypes (torch 2.13) that ckptshim has no name for: refused as unreadable, not as unsafe.
_UNREAD_DTYPES = frozenset(
    {"bit", "bits16", "bits1x8", "bits2x4", "bits4x2", "bits8", "chalf", "complex32",
     "float4_e2m1fn_x2", "float8_e8m0fnu", "qint32", "qint8", "quint2x4", "quint4x2", "quint8"}
    | {f"{kind}{bits}" for kind in ("int", "uint") for bits in range(1, 8)})


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: BinaryIO, where: str) -> None:
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        found = _RECORD_TYPES.get((module, name)) or _CALLS.get((module, name))
        if found is not None:
            return found
        if module == "torch":
            try:
                return dtype_name(name)  # torch.float32 -> "float32"
            except ValueError:
                if name in _UNREAD_DTYPES:
                    raise UnknownFormatError(
                        f"{self.where} describes tensors of dtype torch.{name}, which ckptshim does "
                        "not read yet. Load this checkpoint with the hook off "
                        "(CKPTSHIM_DISABLE_HOOKS=torch-dcp).") from None
        raise UnsafeCheckpointError(
            f"{self.where} needs {module}.{name} to unpickle, but DCP metadata holds only "
            "torch.distributed.checkpoint's metadata classes, sizes and dtypes, so ckptshim refuses "
            "to run it: the file was not written by torch.distributed.checkpoint or was altered "
            "afterwards. Re-save the checkpoint with dcp.save; if you trust this file, load it "
            "with the hook off (CKPTSHIM_DISABLE_HOOKS=torch-dcp).")


@dataclass(frozen=True)
class Chunk:
    """One stored block of a tensor: where it starts in the whole tensor and how big it is."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class Stored:
    """Where one chunk's (or one object's) ``torch.save`` archive lies: file and byte range."""

    file: str
    offset: int
    length: int
    transforms: tuple[str, ...] = ()


@dataclass(frozen=True)
class TensorMeta:
    dtype: str
    size: tuple[int, ...]
    chunks: tuple[Chunk, ...]


#: A storage key as DCP's ``MetadataIndex``: the flat key and the chunk's offsets (None for objects).
StorageKey = tuple[str, "tuple[int, ...] | None"]


@dataclass(frozen=True)
class DcpMetadata:
    """What ``.metadata`` says, as plain data.

    ``objects`` are the non-tensor values (``BytesStorageMetadata``: torch.save'd Python
    objects such as optimizer hyper-parameters). ``planner_data`` maps each flat key to its path
    in the nested state dict that was saved (``"model.w"`` -> ``("model", "w")``).
    """

    tensors: Mapping[str, TensorMeta]
    objects: frozenset[str]
    storage: Mapping[StorageKey, Stored]
    planner_data: Mapping[str, tuple]
    version: str | None


def _state(record: Any, kind: str) -> Any:
    if not isinstance(record, _Record) or type(record).__name__ != kind:
        raise TypeError(f"expected {kind}, found {type(record).__name__}")
    return record.state


def _ints(values: Any) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


def _tensor_meta(record: _Record) -> TensorMeta:
    state = _state(record, "TensorStorageMetadata")
    properties = _state(state["properties"], "TensorProperties")
    dtype = properties[0] if isinstance(properties, tuple) else properties["dtype"]
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:  # a torch.<dtype> global's name
        raise TypeError(f"dtype {dtype if isinstance(dtype, str) else type(dtype).__name__!r:.60} "
                        "is not a torch dtype")
    chunks = tuple(Chunk(_ints(c["offsets"]), _ints(c["sizes"]))
                   for c in (_state(chunk, "ChunkStorageMetadata") for chunk in state["chunks"]))
    return TensorMeta(dtype, _ints(state["size"]), chunks)


def _stored(record: _Record) -> Stored:
    state = _state(record, "_StorageInfo")
    file = str(state["relative_path"])
    if PurePath(file).name != file or file in ("", ".", ".."):
        raise ValueError(f"storage file {file!r} is not a plain file name inside the checkpoint")
    return Stored(file, int(state["offset"]), int(state["length"]),
                  tuple(state.get("transform_descriptors") or ()))


def parse_metadata(root: Any) -> DcpMetadata:
    """Turn the unpickled records into :class:`DcpMetadata`; ``TypeError``/``KeyError``/
    ``ValueError`` when they do not have the shape torch writes."""
    state = _state(root, "Metadata")
    tensors: dict[str, TensorMeta] = {}
    objects: set[str] = set()
    for fqn, record in state["state_dict_metadata"].items():
        if isinstance(record, _Record) and type(record).__name__ == "BytesStorageMetadata":
            objects.add(str(fqn))
        else:
            tensors[str(fqn)] = _tensor_meta(record)
    storage: dict[StorageKey, Stored] = {}
    for index, info in (state.get("storage_data") or {}).items():
        index_state = _state(index, "MetadataIndex")
        offset = index_state.get("offset")
        storage[str(index_state["fqn"]), None if offset is None else _ints(offset)] = _stored(info)
    planner_data = state.get("planner_data") or {}
    if not isinstance(planner_data, Mapping):
        raise TypeError("planner_data is not a mapping")
    return DcpMetadata(tensors, frozenset(objects), storage,
                       {str(k): tuple(v) for k, v in planner_data.items()}, state.get("version"))


def load_metadata(file: Path) -> DcpMetadata:
    """Read a DCP ``.metadata`` file through the allow-listed unpickler."""
    try:
        with open(file, "rb") as raw:
            root = _MetadataUnpickler(raw, str(file)).load()
    except (UnsafeCheckpointError, UnknownFormatError):
        raise
    except OSError as error:
        raise CorruptCheckpointError(f"{file}: cannot be read ({error})") from None
    except Exception as error:
        raise CorruptCheckpointError(f"{file}: does not unpickle ({type(error).__name__}: {error}); "
                                     "the file is damaged. Re-copy it from the original.") from None
    try:
        return parse_metadata(root)
    except (AttributeError, KeyError, TypeError, ValueError) as error:
        raise CorruptCheckpointError(
            f"{file}: does not hold DCP metadata as torch.distributed.checkpoint writes it "
            f"({type(error).__name__}: {error}). Re-save the checkpoint with dcp.save.") from None


# -- reading bytes -----------------------------------------------------------------------------


def read_exact(raw: BinaryIO, buffer: memoryview, offset: int, where: str) -> None:
    """Fill ``buffer`` from ``raw`` at ``offset`` (one ``pread`` per call, usually), or refuse."""
    done, total, fd = 0, len(buffer), raw.fileno()
    while done < total:
        got = os.preadv(fd, [buffer[done:]], offset + done)
        if got <= 0:
            raise CorruptCheckpointError(
                f"{where}: needs bytes up to {offset + total} but the file ends at {offset + done}; "
                "it is truncated. Re-copy it from the original.")
        done += got


class _Window(io.RawIOBase):
    """A read-only, seekable view of ``length`` bytes of ``raw`` from ``start`` (one archive)."""

    def __init__(self, raw: BinaryIO, start: int, length: int) -> None:
        super().__init__()
        self._raw, self._start, self._length, self._pos = raw, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer) -> int:
        count = max(0, min(len(buffer), self._length - self._pos))
        got = os.preadv(self._raw.fileno(), [memoryview(buffer)[:count]], self._start + self._pos) if count else 0
        self._pos += got
        return got


@dataclass(frozen=True)
class ChunkLayout:
    """Where one chunk's elements lie: its storage starts at byte ``start`` of ``file``, and
    ``ref`` gives the tensor's shape, strides and offset within that storage, in elements."""

    file: Path
    start: int
    ref: TensorRef

    @property
    def itemsize(self) -> int:
        return storage_dtype(self.ref.storage.dtype).itemsize

    @property
    def storage_bytes(self) -> int:
        return self.ref.storage.numel * self.itemsize


def read_layout(raw: BinaryIO, file: Path, stored: Stored, chunk: Chunk, dtype: str, where: str) -> ChunkLayout:
    """Parse the ``torch.save`` archive of one chunk (a few hundred bytes of headers) and check
    that it holds what ``.metadata`` promised."""
    if stored.transforms:
        raise UnknownFormatError(
            f"{where} was written through DCP stream extensions ({', '.join(stored.transforms)}), "
            "which ckptshim does not decode. Load it with the hook off "
            "(CKPTSHIM_DISABLE_HOOKS=torch-dcp) or re-save it without extensions.")
    archive = read_archive(_Window(raw, stored.offset, stored.length), where)
    ref = archive.tree
    if archive.problems or not isinstance(ref, TensorRef):
        raise CorruptCheckpointError(
            f"{where}: expected one tensor's torch.save archive, found "
            f"{'; '.join(archive.problems) or type(ref).__name__}. The file is damaged or was not "
            "written by DCP's FileSystemWriter with its default torch.save serialization.")
    if ref.shape != chunk.sizes or dtype_name(ref.storage.dtype) != dtype:
        raise CorruptCheckpointError(
            f"{where}: .metadata declares {dtype}{list(chunk.sizes)} but the file holds "
            f"{dtype_name(ref.storage.dtype)}{list(ref.shape)}; the metadata and data do not belong together.")
    begin = archive.offsets.get(ref.storage.key)
    layout = ChunkLayout(file, stored.offset + (begin or 0), ref)
    if begin is None or begin + layout.storage_bytes > stored.length:
        raise CorruptCheckpointError(f"{where}: the tensor's bytes run past its archive; the file is damaged.")
    return layout


def read_chunk(raw: BinaryIO, layout: ChunkLayout, where: str) -> np.ndarray:
    """The whole chunk, read once into a new array (a strided view of its storage's bytes)."""
    buffer = np.empty(layout.storage_bytes, np.uint8)
    read_exact(raw, memoryview(buffer), layout.start, where)
    return tensor_view(buffer, layout.ref, where)


# -- the checkpoint ----------------------------------------------------------------------------


def sniff(path: Path) -> bool:
    return path.is_dir() and (path / METADATA_FILE).is_file()


READERS = {"torch": sniff}


class DcpCheckpoint(Checkpoint):
    """A DCP directory. Tensor entries' locations are their flat keys; object entries (pickled
    Python values) are listed as ``uint8`` arrays of their stored length."""

    def __init__(self, path: Path, metadata: DcpMetadata, inventory: Inventory, files, problems) -> None:
        version = f"dcp {metadata.version}" if metadata.version else "dcp (before 1.0.0)"
        super().__init__(path, NAME, version, inventory, tuple(files), tuple(problems))
        self.metadata = metadata

    def stored(self, fqn: str, offsets: tuple[int, ...] | None) -> Stored:
        """Where the object ``fqn`` (``offsets=None``) or its chunk at ``offsets`` is stored."""
        found = self.metadata.storage.get((fqn, offsets))
        if found is None:
            raise CorruptCheckpointError(f"{self.path}: .metadata has no storage record for {fqn!r}"
                                         f"{'' if offsets is None else f' at {list(offsets)}'}.")
        return found

    def read(self, entry: Entry) -> np.ndarray:
        fqn = entry.location
        if fqn in self.metadata.objects:
            stored = self.stored(fqn, None)
            out = np.empty(stored.length, np.uint8)
            with open(self.path / stored.file, "rb") as raw:
                read_exact(raw, memoryview(out), stored.offset, str(self.path / stored.file))
            return out
        meta = self.metadata.tensors[fqn]
        out = None
        for chunk in meta.chunks:
            stored = self.stored(fqn, chunk.offsets)
            where = f"{self.path / stored.file}: {fqn!r} chunk {list(chunk.offsets)}"
            with open(self.path / stored.file, "rb") as raw:
                array = read_chunk(raw, read_layout(raw, self.path / stored.file, stored, chunk, meta.dtype, where), where)
            if chunk.sizes == meta.size:
                return array
            if out is None:
                out = np.empty(meta.size, storage_dtype(meta.dtype))
            out[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))] = array
        if out is None:
            raise CorruptCheckpointError(f"{self.path}: {fqn!r} has no stored chunks")
        return out


def _contents(metadata: DcpMetadata) -> dict[str, list[str]]:
    """Per rank file, one line per stored record: key, block and byte range, in file order."""
    lines: dict[str, list[tuple[int, str]]] = {}
    for (fqn, offsets), stored in metadata.storage.items():
        meta = metadata.tensors.get(fqn)
        chunk = next((c for c in meta.chunks if c.offsets == offsets), None) if meta else None
        block = ("object" if chunk is None else
                 "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(chunk.offsets, chunk.sizes)) + "]")
        lines.setdefault(stored.file, []).append(
            (stored.offset, f"{fqn} {block} bytes {stored.offset}..{stored.offset + stored.length}"))
    return {file: [text for _, text in sorted(found)] for file, found in lines.items()}


def _problems(metadata: DcpMetadata) -> list[str]:
    """Where ``.metadata`` contradicts itself (each line names it: the fault is in that file)."""
    problems = []
    for fqn, meta in metadata.tensors.items():
        covered = 0
        for chunk in meta.chunks:
            if (fqn, chunk.offsets) not in metadata.storage:
                problems.append(f"{fqn}: chunk at {list(chunk.offsets)} has no storage record")
            if len(chunk.offsets) != len(meta.size) or any(
                    o < 0 or o + s > n for o, s, n in zip(chunk.offsets, chunk.sizes, meta.size)):
                problems.append(f"{fqn}: chunk at {list(chunk.offsets)} lies outside {list(meta.size)}")
            covered += math.prod(chunk.sizes)
        if covered != math.prod(meta.size):
            problems.append(f"{fqn}: its chunks hold {covered} of {math.prod(meta.size)} elements")
    problems += [f"{fqn}: object has no storage record" for fqn in sorted(metadata.objects)
                 if (fqn, None) not in metadata.storage]
    return [f"{METADATA_FILE}: {problem}" for problem in problems]


def open_checkpoint(path: Path) -> DcpCheckpoint:
    metadata = load_metadata(path / METADATA_FILE)
    entries = [Entry(split_key(fqn), meta.size, meta.dtype, fqn) for fqn, meta in metadata.tensors.items()]
    entries += [Entry(split_key(fqn), (metadata.storage[fqn, None].length,), "uint8", fqn)
                for fqn in sorted(metadata.objects) if (fqn, None) in metadata.storage]
    needed: dict[str, int] = {}
    for stored in metadata.storage.values():
        needed[stored.file] = max(needed.get(stored.file, 0), stored.offset + stored.length)
    contents = _contents(metadata)
    files = [dataclasses.replace(file_info(path / name, size, root=path), contents=tuple(contents[name]))
             for name, size in sorted(needed.items())]
    return DcpCheckpoint(path, metadata, Inventory(entries, str(path)), files, _problems(metadata))
