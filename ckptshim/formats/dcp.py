"""torch.distributed.checkpoint (DCP) directories: a pickled ``.metadata`` beside rank files.

``.metadata`` is a pickle of DCP's metadata dataclasses (a ``FileSystemWriter`` with
``use_collectives=False`` writes one per rank instead, ``__<rank>.metadata``, each describing what
that rank saved; such a folder reads as the union of them, which is what DCP's reader finds).
It is read by :mod:`ckptshim.formats.safe_pickle` with an allow-list taken from torch at run
time: every dataclass and enum ``torch.distributed.checkpoint`` defines in its metadata, planner
and file-system modules (:func:`dcp_types`; Megatron-Core keeps DCP's own ``SavePlan``s in
``Metadata.all_local_plans``), plus what ``torch.load(weights_only=True)`` allows (``torch.Size``,
dtypes, layouts, containers) and path types -- each built here as inert data, so no code from the
checkpoint runs -- and refuses every other global by name. :func:`to_torch` then builds, for
``dcp.load``, the objects ``pickle.load`` would have, running only DCP's and torch's own code on
plain data. Any folder DCP's own reader would unpickle metadata from is recognised here first,
so a ``dcp.load`` hook never hands one to it unread. The default ``FileSystemWriter`` stores each
chunk (a whole tensor, or one rank's block of it) as a complete ``torch.save`` archive at
``(relative_path, offset, length)`` inside a ``__<rank>_<n>.distcp`` file; those archives are
parsed with :mod:`ckptshim.formats.torch_pickle` only when their bytes are wanted. Reads go
through ``pread`` into buffers the caller owns, so every byte is read once and only when needed.

A local folder and a bucket prefix are read the same way, through
:class:`~ckptshim.storage.Location`: the folder listed once (bounded), its metadata read whole
under a size cap (:func:`metadata_limit`) and parsed by the unpickler, each file's size taken
from the listing for completeness, and each chunk's archive read through
:meth:`Location.open <ckptshim.storage.Location.open>` (a local descriptor, or an object's byte ranges).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path, PurePath
from typing import Any

import numpy as np

from ckptshim.errors import CorruptCheckpointError, UnknownFormatError, UnsafeCheckpointError, brief, describe
from ckptshim.formats import located, marker, safe_pickle
from ckptshim.formats.base import Budget, Checkpoint, FileInfo, Piece, metadata_limit, reader, reading, storage_dtype
from ckptshim.formats.torch_globals import ExtraGlobals, Globals, Layout, Size, TensorRef, dtype_of, members
from ckptshim.formats.torch_pickle import read_archive, tensor_view
from ckptshim.inventory import Entry, Inventory, dtype_name, split_key
from ckptshim.storage import Location, ObjectInfo, OpenFile
from ckptshim.storage.problems import KIND_WORDS
from ckptshim.storage.ranged import Window, archive_spans, prefetch

NAME = "torch-dcp"
METADATA_FILE = ".metadata"
#: What ``FileSystemWriter(use_collectives=False)`` writes instead: one metadata file per rank.
RANK_METADATA = re.compile(r"__(\d+)\.metadata")

#: The modules whose dataclasses and enums DCP pickles into ``.metadata``: its metadata classes,
#: its planner's (Megatron-Core keeps each rank's ``SavePlan`` in ``Metadata.all_local_plans``),
#: the file system writer's storage records, and the sharded-tensor ``TensorProperties`` that
#: DCP wrote before torch 2.2. Which classes those are is read off torch at run time.
DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner",
               "torch.distributed.checkpoint.filesystem", "torch.distributed._shard.sharded_tensor.metadata")


class Record:
    """One of DCP's own dataclass objects, kept as inert data: its type (``kind``, the real class,
    never called) and its pickled state, nothing run."""

    kind: type
    state: Any = None

    def __setstate__(self, state: Any) -> None:
        self.state = state


@dataclass(frozen=True)
class Member:
    """One of DCP's own enum members, as its type and value (checked to be one of its members)."""

    kind: type
    value: Any


class PathText(str):
    """A ``pathlib`` path a ``.metadata`` holds (``StorageMeta.checkpoint_id``), as its text."""

    __slots__ = ()


def _path(*parts: str) -> PathText:
    if not all(type(part) is str for part in parts):
        raise safe_pickle.Refused("a pathlib path of other than strings")
    return PathText(PurePath(*parts))


def _enum(kind: type) -> Any:
    """What pickle calls to rebuild a member of the enum ``kind``: ``kind(value)``, by value only."""
    values = {member.value for member in kind}

    def member(value: Any) -> Member:
        if not safe_pickle.key_hashes_cheaply(value) or value not in values:
            raise safe_pickle.Refused(f"{kind.__qualname__}({type(value).__name__}), which is none of its members")
        return Member(kind, value)
    return member


@functools.cache
def dcp_types() -> Mapping[tuple[str, str], Any]:
    """Every dataclass and enum ``torch.distributed.checkpoint`` defines in :data:`DCP_MODULES`,
    by ``(module, qualname)`` as a pickle names it, each as the stand-in the unpickler builds:
    a :class:`Record` subclass for a dataclass, a checked constructor for an enum. Read off torch
    at run time; reading DCP metadata therefore imports torch (without torch it is refused)."""
    found: dict[tuple[str, str], Any] = {}
    for module_name in DCP_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            if module_name.startswith("torch.distributed.checkpoint"):
                raise UnknownFormatError(
                    "reading DCP metadata needs torch: ckptshim allows the classes "
                    f"torch.distributed.checkpoint defines, and asks torch which those are ({error}). "
                    "Install torch (pip install torch).") from None
            continue  # a module a later torch dropped
        for value in vars(module).values():
            if not (isinstance(value, type) and value.__module__ == module_name):
                continue
            key = (module_name, value.__qualname__)
            if issubclass(value, enum.Enum):
                found[key] = _enum(value)
            elif dataclasses.is_dataclass(value):
                found[key] = type(value.__name__, (Record,), {"__module__": __name__, "kind": value})
    return found


#: Globals a ``.metadata`` may name beyond DCP's own classes and torch's ``weights_only``
#: allow-list: the path types ``StorageMeta.checkpoint_id`` may hold, and ``frozenset`` (which
#: a protocol 2 pickle names as a global; ``set`` is on torch's list).
_PLAIN_EXTRA: ExtraGlobals = {
    ("builtins", "frozenset"): members(frozenset),
    **{("pathlib", name): _path for name in ("Path", "PosixPath", "WindowsPath", "PurePath",
                                              "PurePosixPath", "PureWindowsPath")},
}


def _find_class(where: str) -> Any:
    """``find_class`` for ``.metadata``: DCP's own dataclasses and enums (:func:`dcp_types`), then
    what ``torch.load(weights_only=True)`` allows (sizes, dtypes, layouts, containers), and paths."""
    records = dcp_types()
    torch_globals = Globals(where, _PLAIN_EXTRA)

    def find_class(module: str, name: str) -> Any:
        found = records.get((module, name))
        if found is not None:
            return found
        try:
            return torch_globals.find_class(module, name)
        except UnsafeCheckpointError:
            raise UnsafeCheckpointError(
                f"{where} needs {module}.{name} to unpickle, which is neither a dataclass or enum "
                "of torch.distributed.checkpoint nor a global torch.load(weights_only=True) allows, "
                "so ckptshim refuses to run it: the file was not written by torch.distributed.checkpoint "
                "alone, or was altered afterwards. If you trust this file, load it with the hook off "
                "(CKPTSHIM_DISABLE_HOOKS=torch-dcp).") from None
    return find_class


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
    """One tensor as the metadata lists it: its dtype, size, and the blocks it is stored in."""

    dtype: str
    size: tuple[int, ...]
    chunks: tuple[Chunk, ...]

    @cached_property
    def chunk_at(self) -> dict[tuple[int, ...], Chunk]:
        """Each stored block by its offsets (what DCP's ``MetadataIndex`` names it by)."""
        return {chunk.offsets: chunk for chunk in self.chunks}


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
    #: the unpickled records of one metadata file, which :func:`to_torch` builds DCP's own objects
    #: from (``None`` for the union of several ranks' files)
    records: Any = dataclasses.field(default=None, compare=False, repr=False)


def _state(record: Any, kind: str) -> Any:
    if not isinstance(record, Record) or record.kind.__name__ != kind:
        raise TypeError(f"expected {kind}, found {type(record).__name__}")
    return record.state


def _ints(values: Any) -> tuple[int, ...]:
    """Sizes and offsets as DCP writes them: a sequence of integers >= 0 (``torch.Size``)."""
    if not isinstance(values, (tuple, list)) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ValueError(f"{brief(values)} is not a size (integers >= 0)")
    return tuple(values)


def _tensor_meta(record: Record) -> TensorMeta:
    state = _state(record, "TensorStorageMetadata")
    properties = _state(state["properties"], "TensorProperties")
    dtype = dtype_of(properties[0] if isinstance(properties, tuple) else properties["dtype"])
    if dtype is None:
        raise TypeError("the dtype is not a torch dtype")
    chunks = tuple(Chunk(_ints(c["offsets"]), _ints(c["sizes"]))
                   for c in (_state(chunk, "ChunkStorageMetadata") for chunk in state["chunks"]))
    return TensorMeta(dtype, _ints(state["size"]), chunks)


def _text(value: Any, what: str) -> str:
    """A name DCP writes as a string (a key, a file name, the version), or ``TypeError``; never
    ``str()`` of whatever the pickle holds there (see :func:`~ckptshim.errors.brief`)."""
    if type(value) is not str:
        raise TypeError(f"{what} is a {type(value).__name__}, not a string")
    return value


def _path_of(value: Any, fqn: str) -> tuple:
    """A ``planner_data`` entry: the key's path in the nested state dict, names and list indices."""
    if not isinstance(value, (tuple, list)) or not all(
            type(part) is str or (type(part) is int and part.bit_length() <= 64) for part in value):
        raise TypeError(f"planner_data of {brief(fqn)} is {brief(value)}, not a path of names and indices")
    return tuple(value)


def _stored(record: Record) -> Stored:
    state = _state(record, "_StorageInfo")
    file = _text(state["relative_path"], "a storage file name")
    if PurePath(file).name != file or file in ("", ".", ".."):
        raise ValueError(f"storage file {file!r} is not a plain file name inside the checkpoint")
    offset, length = _ints((state["offset"], state["length"]))
    return Stored(file, offset, length, tuple(state.get("transform_descriptors") or ()))


def parse_metadata(root: Any) -> DcpMetadata:
    """Turn the unpickled records into :class:`DcpMetadata`; ``TypeError``/``KeyError``/
    ``ValueError`` when they do not have the shape torch writes."""
    state = _state(root, "Metadata")
    tensors: dict[str, TensorMeta] = {}
    objects: set[str] = set()
    for fqn, record in state["state_dict_metadata"].items():
        if isinstance(record, Record) and record.kind.__name__ == "BytesStorageMetadata":
            objects.add(_text(fqn, "a key"))
        else:
            tensors[_text(fqn, "a key")] = _tensor_meta(record)
    storage: dict[StorageKey, Stored] = {}
    for index, info in (state.get("storage_data") or {}).items():
        index_state = _state(index, "MetadataIndex")
        offset = index_state.get("offset")
        storage[_text(index_state["fqn"], "a key"), None if offset is None else _ints(offset)] = _stored(info)
    planner_data = state.get("planner_data") or {}
    if not isinstance(planner_data, Mapping):
        raise TypeError("planner_data is not a mapping")
    version = state.get("version")
    return DcpMetadata(tensors, frozenset(objects), storage,
                       {(key := _text(k, "a key")): _path_of(v, key) for k, v in planner_data.items()},
                       None if version is None else _text(version, "the version"), root)


def load_metadata(file: Path | Location, array_bytes: int = 0, size: int | None = None) -> DcpMetadata:
    """Read a DCP ``.metadata`` file (or one rank's) with the allow-listed unpickler; its
    object budget is credited with ``array_bytes``, what the checkpoint's rank files hold.
    It is read whole, refused first when larger than :func:`metadata_limit` (``size``: its size,
    where a listing gave it)."""
    where = str(file)
    with reading(file):
        try:
            data = Location.of(file).read_bytes(metadata_limit(array_bytes), size)
        except OSError as error:
            raise CorruptCheckpointError(f"{file}: cannot be read ({error})") from None
        return loads_metadata(data, where, array_bytes)


def loads_metadata(data: bytes, where: str, array_bytes: int = 0) -> DcpMetadata:
    """The DCP metadata pickled in ``data`` (a ``.metadata`` file's bytes, read from ``where``),
    unpickled by the allow-listed unpickler with a budget credited with ``array_bytes``."""
    with reading(where):
        root = safe_pickle.load(data, where, safe_pickle.PICKLE, _find_class(where),
                                budget=Budget(where, array_bytes))
        try:
            return parse_metadata(root)
        except (AttributeError, KeyError, TypeError, ValueError, OverflowError) as error:
            raise CorruptCheckpointError(
                f"{where}: does not hold DCP metadata as torch.distributed.checkpoint writes it "
                f"({describe(error, 200)}). Re-save the checkpoint with dcp.save.") from None


_PLAIN = frozenset({str, int, float, bool, type(None)})


def to_torch(records: Any, where: str) -> Any:
    """The objects ``pickle.load`` would have built from a ``.metadata`` whose records passed the
    allow-list: DCP's own dataclasses (given their state as pickle gives it -- through the class's
    own ``__setstate__``, as ``TensorProperties`` has, else into its ``__dict__``, extra attributes
    such as Megatron-Core's ``all_local_plans`` included) and enum members, ``torch.Size``, dtypes,
    layouts and paths. Only DCP's and torch's own code runs, on plain data; each object is built
    once, however often the pickle refers to it."""
    import torch

    built: dict[int, Any] = {}

    def build(value: Any) -> Any:
        if type(value) in _PLAIN:  # most leaves: names, numbers
            return value
        known = built.get(id(value))
        if known is not None:
            return known
        if isinstance(value, Record):
            kind = value.kind
            made = built[id(value)] = kind.__new__(kind)
            state = build(value.state)
            setstate = getattr(kind, "__setstate__", None)
            if setstate is not None:
                setstate(made, state)
            else:
                attributes, slots = state if isinstance(state, tuple) and len(state) == 2 else (state, None)
                for part in (attributes, slots):
                    if part is not None and not (isinstance(part, dict) and all(type(k) is str for k in part)):
                        raise TypeError(f"{kind.__name__} given a {type(part).__name__} as its state")
                made.__dict__.update(attributes or {})
                made.__dict__.update(slots or {})
            return made
        if isinstance(value, Member):
            return value.kind(value.value)
        if isinstance(value, Size):
            return torch.Size(value)
        if isinstance(value, Layout):
            return getattr(torch, value.removeprefix("torch."))
        if isinstance(value, PathText):
            return Path(value)
        dtype = dtype_of(value)
        if dtype is not None:
            return getattr(torch, dtype)
        if isinstance(value, dict):
            made = built[id(value)] = {}
            made.update((build(k), build(v)) for k, v in value.items())
            return made
        if isinstance(value, list):
            made = built[id(value)] = []
            made.extend(build(item) for item in value)
            return made
        if isinstance(value, (tuple, set, frozenset)):
            return type(value)([build(item) for item in value])
        if isinstance(value, (bytes, bytearray, complex)):
            return value
        raise TypeError(f"a {type(value).__name__}, which DCP metadata does not hold")

    try:
        return build(records)
    except (AttributeError, KeyError, TypeError, ValueError, RuntimeError, RecursionError) as error:
        raise CorruptCheckpointError(
            f"{where}: does not hold DCP metadata as torch.distributed.checkpoint writes it "
            f"({type(error).__name__}: {str(error)[:200]}). Re-save the checkpoint with dcp.save.") from None


def metadata_names(names: Iterable[str]) -> list[str]:
    """Of the names in a checkpoint folder, those of the metadata DCP reads: ``.metadata`` if
    there, else every rank's ``__<rank>.metadata`` (rank order)."""
    names = list(names)
    if METADATA_FILE in names:
        return [METADATA_FILE]
    ranks = sorted((int(match[1]), name) for name in names if (match := RANK_METADATA.fullmatch(name)) is not None)
    return [name for _, name in ranks]


def merge_ranks(parts: Sequence[DcpMetadata], files: Sequence[Path]) -> DcpMetadata:
    """The union of per-rank metadata: what every rank saved, each chunk once.

    A chunk that several ranks saved whole (a replicated tensor: same offsets and sizes) is
    read from the lowest rank's file; a tensor that ranks describe with different dtypes or
    sizes is refused. Chunks that overlap otherwise are left to :func:`_problems`.
    """
    tensors: dict[str, TensorMeta] = {}
    storage: dict[StorageKey, Stored] = {}
    planner_data: dict[str, tuple] = {}
    for part, file in zip(parts, files):
        for fqn, meta in part.tensors.items():
            seen = tensors.get(fqn)
            if seen is None:
                tensors[fqn] = meta
                continue
            if (seen.dtype, seen.size) != (meta.dtype, meta.size):
                raise CorruptCheckpointError(
                    f"{file}: describes {fqn!r} as {meta.dtype}{list(meta.size)}, but a lower rank's "
                    f"metadata as {seen.dtype}{list(seen.size)}; the ranks' files do not belong together.")
            known = set(seen.chunks)
            tensors[fqn] = dataclasses.replace(seen, chunks=seen.chunks + tuple(c for c in meta.chunks if c not in known))
        for key, stored in part.storage.items():
            storage.setdefault(key, stored)
        for fqn, value in part.planner_data.items():
            planner_data.setdefault(fqn, value)
    return DcpMetadata(tensors, frozenset().union(*(p.objects for p in parts)), storage, planner_data,
                       parts[0].version)


# -- reading bytes -----------------------------------------------------------------------------


def read_exact(raw: OpenFile, buffer: memoryview, offset: int, where: str) -> None:
    """Fill ``buffer`` from ``raw`` at ``offset`` (one ``pread`` per call, usually), or refuse."""
    done, total = 0, len(buffer)
    while done < total:
        got = raw.pread(buffer[done:], offset + done)
        if got <= 0:
            raise CorruptCheckpointError(
                f"{where}: needs bytes up to {offset + total} but the file ends at {offset + done}; "
                "it is truncated. Re-copy it from the original.")
        done += got


@dataclass(frozen=True)
class ChunkLayout:
    """Where one chunk's elements lie: its storage starts at byte ``start`` of ``file``, and
    ``ref`` gives the tensor's shape, strides and offset within that storage, in elements."""

    file: Path | Location
    start: int
    ref: TensorRef

    @property
    def itemsize(self) -> int:
        return storage_dtype(self.ref.storage.dtype).itemsize

    @property
    def storage_bytes(self) -> int:
        return self.ref.storage.numel * self.itemsize


def read_layout(raw: OpenFile, file: Path | Location, stored: Stored, chunk: Chunk, dtype: str, where: str) -> ChunkLayout:
    """Parse the ``torch.save`` archive of one chunk (a few hundred bytes of headers) and check
    that it holds what ``.metadata`` promised. A chunk in a form ckptshim does not read itself --
    written through DCP's stream extensions, or an archive that is not one plain tensor -- is an
    ``UnknownFormatError`` (``dcp.load`` hands such chunks to DCP's own reader); a damaged one,
    a ``CorruptCheckpointError``."""
    if stored.transforms:
        raise UnknownFormatError(
            f"{where} was written through DCP stream extensions ({', '.join(stored.transforms)}), "
            "which ckptshim does not decode itself (dcp.load reads it through DCP's own reader). "
            "Re-save it without extensions to inspect or convert it.")
    archive = read_archive(Window(raw, stored.offset, stored.length), where)
    ref = archive.tree
    if archive.problems:
        raise CorruptCheckpointError(
            f"{where}: expected one tensor's torch.save archive, found {'; '.join(archive.problems)}. "
            "The file is damaged or was not written by DCP's FileSystemWriter.")
    if not isinstance(ref, TensorRef):
        raise UnknownFormatError(
            f"{where}: holds a {type(ref).__name__}, not one plain tensor, which ckptshim does not "
            "read itself (dcp.load reads it through DCP's own reader).")
    if ref.shape != chunk.sizes or dtype_name(ref.storage.dtype) != dtype:
        raise CorruptCheckpointError(
            f"{where}: .metadata declares {dtype}{list(chunk.sizes)} but the file holds "
            f"{dtype_name(ref.storage.dtype)}{list(ref.shape)}; the metadata and data do not belong together.")
    begin = archive.offsets.get(ref.storage.key)
    layout = ChunkLayout(file, stored.offset + (begin or 0), ref)
    if begin is None or begin + layout.storage_bytes > stored.length:
        raise CorruptCheckpointError(f"{where}: the tensor's bytes run past its archive; the file is damaged.")
    return layout


def read_chunk(raw: OpenFile, layout: ChunkLayout, where: str) -> np.ndarray:
    """The whole chunk, read once into a new array (a strided view of its storage's bytes)."""
    buffer = np.empty(layout.storage_bytes, np.uint8)
    read_exact(raw, memoryview(buffer), layout.start, where)
    return tensor_view(buffer, layout.ref, where)


# -- the checkpoint ----------------------------------------------------------------------------


def sniff(path: Path) -> bool:
    """A local folder DCP's reader would unpickle metadata from (see :func:`metadata_names`;
    its names alone, nothing stat-ed: a folder of 100,000 per-array entries is sniffed too).
    A bucket prefix is recognised from the listing detection makes anyway."""
    return path.is_dir() and bool(metadata_names(child.name for child in path.iterdir()))


READERS = {"torch": sniff}


class DcpCheckpoint(Checkpoint):
    """A DCP directory. Tensor entries' locations are their flat keys; object entries (pickled
    Python values) are listed as ``uint8`` arrays of their stored length."""

    def __init__(self, path: Path, metadata: DcpMetadata, inventory: Inventory, files, problems,
                 unreadable: frozenset[str] = frozenset(), parts: Mapping[str, DcpMetadata] | None = None) -> None:
        version = f"dcp {metadata.version}" if metadata.version else "dcp (before 1.0.0)"
        super().__init__(path, NAME, version, inventory, tuple(files), tuple(problems))
        self.metadata = metadata
        #: each metadata file read, by name: ``.metadata``, or every rank's ``__<rank>.metadata``
        self.parts = dict(parts) if parts is not None else {METADATA_FILE: metadata}
        self._unreadable = unreadable

    def stored(self, fqn: str, offsets: tuple[int, ...] | None) -> Stored:
        """Where the object ``fqn`` (``offsets=None``) or its chunk at ``offsets`` is stored."""
        found = self.metadata.storage.get((fqn, offsets))
        if found is None:
            raise CorruptCheckpointError(f"{self.path}: .metadata has no storage record for {fqn!r}"
                                         f"{'' if offsets is None else f' at {list(offsets)}'}.")
        return found

    def read(self, entry: Entry) -> np.ndarray:
        fqn = entry.location
        if fqn in self._unreadable:  # its chunks overlap or leave part of it unwritten
            raise CorruptCheckpointError(
                f"{self.path}: {fqn!r} cannot be read: "
                + "; ".join(p for p in self.problems if f": {fqn}: " in p))
        if fqn in self.metadata.objects:
            stored = self.stored(fqn, None)
            out = np.empty(stored.length, np.uint8)
            with Location.of(self.path / stored.file).open() as raw:
                read_exact(raw, memoryview(out), stored.offset, str(self.path / stored.file))
            return out
        meta = self.metadata.tensors[fqn]
        out = None
        for chunk in meta.chunks:
            stored = self.stored(fqn, chunk.offsets)
            where = f"{self.path / stored.file}: {fqn!r} chunk {list(chunk.offsets)}"
            with Location.of(self.path / stored.file).open() as raw:
                prefetch([(raw, archive_spans(stored.offset, stored.length))])  # an object's headers: one request or two
                array = read_chunk(raw, read_layout(raw, self.path / stored.file, stored, chunk, meta.dtype, where), where)
            if chunk.sizes == meta.size:
                return array
            if out is None:  # every element is written below: the chunks tile the tensor exactly
                out = np.empty(meta.size, storage_dtype(meta.dtype))
            out[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))] = array
        if out is None:
            raise CorruptCheckpointError(f"{self.path}: {fqn!r} has no stored chunks")
        return out


def _pieces(metadata: DcpMetadata) -> dict[str, list[Piece]]:
    """Per rank file, what each stored record holds: key, block and byte range, in file order."""
    chunks = {(fqn, c.offsets): c for fqn, meta in metadata.tensors.items() for c in meta.chunks}
    pieces: dict[str, list[Piece]] = {}
    for (fqn, offsets), stored in metadata.storage.items():
        chunk = chunks.get((fqn, offsets))
        block = ("object" if chunk is None else
                 "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(chunk.offsets, chunk.sizes)) + "]")
        pieces.setdefault(stored.file, []).append(Piece(fqn, block, stored.offset, stored.length))
    return {file: sorted(found, key=lambda piece: piece.offset) for file, found in pieces.items()}


#: ``FileSystemWriter``'s rank files: ``__<rank>_<n>.distcp``.
_RANK_FILE = re.compile(r"__(\d+)_\d+\.distcp")


def _writer(file: str) -> str:
    """``rank N`` for a rank file, else the file's own name."""
    match = _RANK_FILE.fullmatch(file)
    return f"rank {match[1]}" if match else file


def _problems(metadata: DcpMetadata) -> dict[str, list[str]]:
    """Where the metadata contradicts itself, by key: chunks without storage, outside their
    tensor, overlapping, or not covering it (then some elements would be read from nowhere)."""
    problems: dict[str, list[str]] = {}
    for fqn, meta in metadata.tensors.items():
        found = []
        for chunk in meta.chunks:
            if (fqn, chunk.offsets) not in metadata.storage:
                found.append(f"chunk at {list(chunk.offsets)} has no storage record")
            if len(chunk.offsets) != len(meta.size) or len(chunk.sizes) != len(meta.size) or any(
                    o + s > n for o, s, n in zip(chunk.offsets, chunk.sizes, meta.size)):
                found.append(f"chunk at {list(chunk.offsets)} lies outside {list(meta.size)}")
        overlap = None if found else _first_overlap(meta.chunks)
        if overlap is not None:
            found.append(f"chunks at {list(overlap[0].offsets)} and {list(overlap[1].offsets)} overlap")
        covered = sum(math.prod(chunk.sizes) for chunk in meta.chunks)
        if covered != math.prod(meta.size):
            found.append(f"its chunks hold {covered} of {math.prod(meta.size)} elements")
        if found:
            problems[fqn] = found
    for fqn in sorted(metadata.objects):
        if (fqn, None) not in metadata.storage:
            problems[fqn] = ["object has no storage record"]
    return problems


def _first_overlap(chunks: Sequence[Chunk]) -> tuple[Chunk, Chunk] | None:
    """Two chunks (each inside the tensor) that share an element, or ``None``.

    A sweep along the axis on which the chunks start at the most different offsets (rows for
    a row-sharded tensor, columns for a column-sharded one): each chunk is compared only with
    those still open along that axis, so a tiling of n chunks takes about n log n steps.
    """
    boxes = [c for c in chunks if 0 not in c.sizes]
    if len(boxes) < 2:
        return None
    if not boxes[0].offsets:  # 0-d: two chunks of one scalar
        return boxes[0], boxes[1]
    axis = max(range(len(boxes[0].offsets)), key=lambda a: len({c.offsets[a] for c in boxes}))
    boxes.sort(key=lambda c: c.offsets[axis])
    open_: list[Chunk] = []
    for box in boxes:
        start = box.offsets[axis]
        open_ = [other for other in open_ if other.offsets[axis] + other.sizes[axis] > start]
        for other in open_:
            if all(a < b + m and b < a + n
                   for a, n, b, m in zip(box.offsets, box.sizes, other.offsets, other.sizes)):
                return other, box
        open_.append(box)
    return None


@reader
def open_checkpoint(path: Path | Location, listed: Sequence[ObjectInfo] | None = None) -> DcpCheckpoint:
    """The DCP folder or bucket prefix ``path``: its ``.metadata``, or the union of its ranks'
    metadata files. One bounded listing (``listed``, where the caller already made it) gives the
    metadata files and every file's size; locally the folder is walked first for links that
    leave it and for anything neither a file nor a folder (which a bucket cannot hold)."""
    root = Location.of(path)
    root.refuse_links_leaving()
    listed_by_name = {info.location.name: info for info in (located.listing(root) if listed is None else listed)}
    sources = metadata_names(listed_by_name)
    if not sources:
        raise _no_metadata(path)
    for name in sources:
        if listed_by_name[name].kind != "file":
            kind = listed_by_name[name].kind
            raise CorruptCheckpointError(
                f"{root / name} is not a file (a {KIND_WORDS.get(kind, kind)}); DCP reads its metadata "
                "from there. Restore the checkpoint's metadata file (re-copy the checkpoint from the original).")
    marker.require_complete(root, listed_by_name)  # a folder ckptshim convert wrote: every object it lists
    array_bytes = sum(info.size for info in listed_by_name.values() if info.kind == "file")
    parts = [load_metadata(root / name, array_bytes, listed_by_name[name].size) for name in sources]

    def info(name: str, size: int, **kw: Any) -> FileInfo:
        found = listed_by_name.get(name)
        return FileInfo(name, None if found is None else found.size, size,
                        kind="file" if found is None else found.kind, **kw)
    return _checkpoint(path, sources, parts, info)


def _no_metadata(path: object) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{path}: no {METADATA_FILE} (nor __<rank>.metadata) in the folder; "
                                  "it is not a DCP checkpoint, or its metadata is missing.")


def _checkpoint(path: Path | Location, sources: list[str], parts: list[DcpMetadata],
                info: Any) -> DcpCheckpoint:
    """The checkpoint whose metadata files ``sources`` held ``parts``; ``info(name, needed,
    pieces=, writer=)`` says what is at each file the metadata names."""
    metadata = parts[0] if len(parts) == 1 else merge_ranks(parts, [path / name for name in sources])
    label = sources[0] if len(sources) == 1 else f"{len(sources)} rank metadata files"
    entries = [Entry(split_key(fqn), meta.size, meta.dtype, fqn) for fqn, meta in metadata.tensors.items()]
    entries += [Entry(split_key(fqn), (metadata.storage[fqn, None].length,), "uint8", fqn)
                for fqn in sorted(metadata.objects) if (fqn, None) in metadata.storage]
    needed: dict[str, int] = {}
    for stored in metadata.storage.values():
        needed[stored.file] = max(needed.get(stored.file, 0), stored.offset + stored.length)
    pieces = _pieces(metadata)
    files = [info(name, size, pieces=tuple(pieces[name]), writer=_writer(name)) for name, size in sorted(needed.items())]
    problems = _problems(metadata)
    shown = [f"{label}: {fqn}: {problem}" for fqn, found in problems.items() for problem in found]
    return DcpCheckpoint(path, metadata, Inventory(entries, str(path)), files, shown, frozenset(problems),
                         dict(zip(sources, parts)))
