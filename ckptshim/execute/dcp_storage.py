"""DCP storage readers over ckptshim's formats: DCP directories, and checkpoints DCP cannot read.

:class:`DcpReader` is DCP's own ``FileSystemReader`` with two of its parts replaced. It reads
``.metadata`` through ckptshim's allow-listed unpickler (never ``pickle.load``) and hands DCP
the very objects ``pickle.load`` would have built; it checks every file, chunk header and stored
Python object a load needs before the first byte is written (objects must pass torch's
``weights_only`` unpickler: DCP's default planner would unpickle them without limits); and it
reads each stored chunk that it reads exactly as torch would (a plain ``torch.save`` archive of
one tensor) once: straight into the destination with one ``pread`` when the block is contiguous
on both sides and the destination is host memory, else once into a buffer from which every
destination that needs a slice of it is filled (device memory through the bounded staging
buffer). A destination's bytes are those of the plain tensor behind it -- a DTensor's shard, a
float8 training weight's high-precision tensor (:mod:`ckptshim.execute.destinations`). (The
stock reader deserialises a whole chunk again for every read item that touches it.) Every other
chunk -- written through DCP's stream extensions (``ZStandard``, a custom transform), or a tensor
type ckptshim does not read -- is read by ``FileSystemReader.read_data`` itself: torch's reader
stays the reference for data.

:class:`FormatReader` lets ``dcp.load`` read a ``torch.save`` file, a safetensors file or a
Hugging Face directory, each tensor being one chunk; each read goes straight into its
destination through the format's ``read_blocks`` (one ``pread`` of exactly the rows a rank's shard
needs, for a local safetensors file; for one in a bucket, a window of blocks' byte ranges at a
time, in parallel).

:class:`DcpReader` reads a local folder and a bucket prefix the same way, through
:class:`~ckptshim.storage.Location`: the metadata read whole under a size cap, chunk headers
fetched in batches, and chunk bytes read as the byte ranges the metadata declares, a window of
the store's ``read_ahead_bytes`` at a time (from a bucket, in parallel), straight into the
destinations. :class:`RemoteDcpReader` is it over DCP's own ``FsspecReader`` file system, for
whatever torch reads itself; where the planner remaps nothing, every tensor chunk is read by
torch's own ``FsspecReader`` data path, as without ckptshim.

A checkpoint that ckptshim refuses does not raise inside ``read_metadata`` -- DCP would turn
that into an ``AssertionError`` string -- but comes back as metadata carrying a
:class:`Refusal`, which :class:`~ckptshim.execute.dcp_planner.RemappingLoadPlanner` raises
as it is, so the caller's ``CheckpointException`` holds ckptshim's own error on every rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import pickle
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ckptshim import progress
from ckptshim.errors import CorruptCheckpointError, ShimError, UnknownFormatError, UnsafeCheckpointError
from ckptshim.execute import destinations
from ckptshim.formats import dcp
from ckptshim.formats.base import Checkpoint, Format, metadata_limit, storage_dtype, windows
from ckptshim.inventory import Entry, dtype_name, join_key, split_key
from ckptshim.keytext import shown_error
from ckptshim.log import logger
from ckptshim.storage import ByteRange, Location, ObjectInfo, OpenFile, UnsupportedLocation, read_ranges
from ckptshim.storage.ranged import archive_spans, prefetch
from ckptshim.targets.tensors import values_of


@dataclass(frozen=True)
class Refusal:
    """Stands in for ``storage_data`` when the reader refused the checkpoint."""

    error: ShimError


def _refused(error: ShimError) -> Metadata:
    return Metadata(state_dict_metadata={}, storage_data=Refusal(shown_error(error)))


def _tensor_md(dtype: str, size: tuple[int, ...], chunks: Iterable[tuple[tuple[int, ...], tuple[int, ...]]]) -> TensorStorageMetadata:
    return TensorStorageMetadata(TensorProperties(dtype=getattr(torch, dtype)), torch.Size(size),
                                 [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks])


def _done() -> Future:
    future: Future = Future()
    future.set_result(None)
    return future


def _destination_shape(planner: LoadPlanner, item: ReadItem) -> tuple[int, ...]:
    """The shape of ``item``'s destination: its lengths, or, where ckptshim's planner reads a
    reordered block as one strided copy, them split row-major into the block's factors
    (:meth:`~ckptshim.execute.dcp_planner.RemappingLoadPlanner.destination_shape`)."""
    shape = getattr(planner, "destination_shape", None)
    return tuple(item.lengths) if shape is None else shape(item)


def _split(destination: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """``block`` (a read item's block, of its lengths) in ``destination``'s shape: its axes split
    row-major (a strided copy's destination), else as it is."""
    return block if block.shape == destination.shape else block.view(destination.shape)


def _resolve(planner: LoadPlanner, items: Iterable[ReadItem]) -> list[tuple[ReadItem, torch.Tensor]]:
    """Every item's destination, checked before anything is written."""
    resolved = []
    for item in items:
        destination, shape = planner.resolve_tensor(item).detach(), _destination_shape(planner, item)
        if tuple(destination.shape) != shape:
            raise CorruptCheckpointError(
                f"read of {item.storage_index.fqn!r} at {list(item.storage_offsets)} needs a "
                f"{list(shape)} destination but the planner gave {list(destination.shape)}; "
                "the planner and the checkpoint disagree.")
        resolved.append((item, destination))
    return resolved


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _block(item: ReadItem) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(item.storage_offsets, item.lengths))


def read_metadata_safely(reader: FileSystemReader, rank: int | None = None) -> Metadata:
    """``FileSystemReader.read_metadata`` (``FsspecReader``'s too) without ``pickle.load``: the
    same file, opened through the reader's own file system (torch's path semantics and errors:
    one named object, no listing), unpickled by ckptshim's allow-listed unpickler into the very
    objects ``pickle.load`` would build. What torch's reader reads when ckptshim reads nothing
    else of the checkpoint (a load it steps aside from, a reader the caller built): a hostile
    ``.metadata`` is refused there too, and no code in it runs. A file larger than
    :func:`~ckptshim.formats.base.metadata_limit` allows is refused unread beyond that."""
    path = reader._get_metadata_path(rank)
    limit = metadata_limit(0)
    with reader.fs.create_stream(path, "rb") as stream:
        data = stream.read(limit + 1)
    where = str(path)
    if len(data) > limit:
        raise CorruptCheckpointError(f"{where} is more than the {limit:,} bytes ckptshim reads of DCP metadata "
                                     "whose checkpoint it has not listed; it is damaged or hostile.")
    metadata = dcp.to_torch(dcp.loads_metadata(data, where).records, where)
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = reader.load_id
    return metadata


class DcpReader(FileSystemReader):
    """DCP's own ``FileSystemReader``, with two of its parts ckptshim's (see the module docstring):
    ``read_metadata`` reads the metadata through ckptshim's allow-list (never ``pickle.load``),
    and every chunk ckptshim reads exactly as torch would -- a plain ``torch.save`` archive of
    one tensor, without stream transforms -- is read by ckptshim, checked before the first write
    and straight into its destination. Everything else (chunks written through DCP's stream
    extensions such as ``ZStandard`` or a custom transform, tensor types ckptshim does not read)
    goes to ``FileSystemReader.read_data`` itself, with the caller's extension registry.

    Like torch's, it reads ``.metadata``, or the rank's own ``__<rank>.metadata`` when DCP asks
    for it (a checkpoint saved without collectives), and a metadata file that is not there fails
    with torch's own ``OSError`` (DCP then tries the rank's file)."""

    def __init__(self, path: str | os.PathLike, _extension_registry: Any = None,
                 listed: list[ObjectInfo] | None = None) -> None:
        super().__init__(path, _extension_registry)
        self._checkpoint: dcp.DcpCheckpoint | None = None
        self._layouts: dict[MetadataIndex, dcp.ChunkLayout] = {}
        self._objects: dict[MetadataIndex, bytes] = {}
        self._by_torch: set[MetadataIndex] = set()
        self._listed = (Location.of(path), listed)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        super().reset(checkpoint_id)
        self._checkpoint, self._layouts, self._objects, self._by_torch = None, {}, {}, set()

    @property
    def location(self) -> Location:
        """Where the checkpoint is: the folder or prefix torch's file system reads (``self.path``)."""
        return Location.of(self.path)

    def _file(self, name: str) -> Location:
        """Where the checkpoint's file ``name`` is."""
        return self.location / name

    def _open_checkpoint(self) -> dcp.DcpCheckpoint:
        """The checkpoint at :attr:`location`, opened from the listing whoever chose this reader
        made (``listed``, used once, for that same location), else listed here."""
        (listed_at, listed), self._listed = self._listed, (None, None)
        return dcp.open_checkpoint(self.location, listed if listed_at == self.location else None)

    @property
    def checkpoint(self) -> dcp.DcpCheckpoint | None:
        """The checkpoint :meth:`read_metadata` opened (``None`` before), for the load's planner."""
        return self._checkpoint

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = dcp.METADATA_FILE if rank is None else f"__{rank}{dcp.METADATA_FILE}"
        with self.fs.create_stream(self.fs.concat_path(self.path, name), "rb"):  # torch's own error when it is not there
            pass
        try:
            self._checkpoint = self._open_checkpoint()
            if self._checkpoint.problems:
                raise CorruptCheckpointError(f"{self.path}: the checkpoint's metadata contradicts itself:\n  "
                                             + "\n  ".join(self._checkpoint.problems)
                                             + "\nRe-save the checkpoint; ckptshim will not load part of a tensor.")
            part = self._checkpoint.parts.get(name)
            if part is None:  # .metadata appeared beside rank files after they were listed
                raise CorruptCheckpointError(f"{self._file(name)}: changed while it was being read; load it again.")
            metadata = dcp.to_torch(part.records, str(self._file(name)))
        except ShimError as error:
            return _refused(error)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Check every file, chunk header and object this rank will read, before any rank writes."""
        self._check_all(plan.items, chunks_by_torch=not self._reads_chunks())
        return plan

    def _stored(self, item: ReadItem) -> dcp.Stored:
        index = item.storage_index
        return self._checkpoint.stored(index.fqn, None if index.offset is None else tuple(index.offset))

    def _check_all(self, items: Iterable[ReadItem], chunks_by_torch: bool = False) -> None:
        """Every file the items read present and as long as ``.metadata`` says, whoever reads
        it; chunk archives as ``.metadata`` says (or left to torch's reader: see the class
        docstring; every tensor chunk, with ``chunks_by_torch``), objects safe to unpickle (kept
        for :meth:`read_data`); whatever is wrong raises here, before any rank writes a byte."""
        assert self._checkpoint is not None, "read_metadata runs first"
        by_file: dict[str, list[ReadItem]] = {}
        needed: set[str] = set()
        seen: set[MetadataIndex] = set()
        for item in items:
            index = item.storage_index
            if index in seen or index in self._layouts or index in self._objects or index in self._by_torch:
                continue
            seen.add(index)
            file = self._stored(item).file
            needed.add(file)
            if chunks_by_torch and item.type != LoadItemType.BYTE_IO:
                self._by_torch.add(index)
                continue
            by_file.setdefault(file, []).append(item)
        files = {f.path: f for f in self._checkpoint.files}
        for name in sorted(needed):
            problem = files[name].problem
            if problem is not None:
                raise CorruptCheckpointError(
                    f"{self.path}: {problem}. Restore the file (or re-copy the checkpoint) before loading it.")
        for name, file_items in sorted(by_file.items()):
            path = self._file(name)
            for batch in range(0, len(file_items), HEADER_BATCH):
                with path.open() as raw:  # what an object's batch fetched ahead is dropped with it
                    self._check_file(raw, path, file_items[batch:batch + HEADER_BATCH])

    def _check_file(self, raw: OpenFile, path: Location, file_items: list[ReadItem]) -> None:
        """:meth:`_check_all` for some items of one file (an object's headers fetched first,
        together: :func:`~ckptshim.storage.ranged.prefetch`)."""
        prefetch([(raw, [span for item in file_items if not (stored := self._stored(item)).transforms
                         for span in archive_spans(stored.offset, stored.length)])])
        for item in file_items:
            index = item.storage_index
            where = f"{path}: {index.fqn!r}"
            stored = self._stored(item)
            if item.type == LoadItemType.BYTE_IO:
                self._objects[index] = _safe_object(self._object_bytes(raw, item, stored, where), where)
                continue
            meta = self._checkpoint.metadata.tensors[index.fqn]
            chunk = meta.chunk_at[tuple(index.offset)]
            if stored.transforms:
                self._by_torch.add(index)
                continue
            try:
                self._layouts[index] = dcp.read_layout(raw, path, stored, chunk, meta.dtype,
                                                       f"{where} chunk {list(chunk.offsets)}")
            except UnknownFormatError:  # a form torch reads and ckptshim does not
                self._by_torch.add(index)

    def _object_bytes(self, raw, item: ReadItem, stored: dcp.Stored, where: str) -> bytes:
        """A stored object's bytes, decoded by the caller's stream extensions (torch's own
        machinery) where it was written through them; never more than :data:`OBJECT_LIMIT`."""
        if not stored.transforms:
            data = bytearray(stored.length)
            dcp.read_exact(raw, memoryview(data), stored.offset, where)
            return bytes(data)
        stream = self.transforms.transform_load_stream(item, stored.transforms,
                                                       dcp.Window(raw, stored.offset, stored.length))
        data = stream.read(OBJECT_LIMIT + 1)
        if len(data) > OBJECT_LIMIT:
            raise CorruptCheckpointError(f"{where}: the stored object decodes to more than {OBJECT_LIMIT} "
                                         "bytes; ckptshim will not hold it. The file is damaged or hostile.")
        return data

    def _reads_chunks(self) -> bool:
        """Whether ckptshim reads the tensor chunks itself (else torch's reader does), as known
        once DCP has planned."""
        return True

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        self._check_all(plan.items, chunks_by_torch=not self._reads_chunks())
        tensor_items = [item for item in plan.items
                        if item.type != LoadItemType.BYTE_IO and item.storage_index not in self._by_torch]
        by_chunk: dict[MetadataIndex, list[tuple[ReadItem, torch.Tensor]]] = {}
        for item, destination in _resolve(planner, tensor_items):
            by_chunk.setdefault(item.storage_index, []).append((item, destination))
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(self._objects[item.storage_index]))
        order = sorted(by_chunk, key=lambda index: (self._layouts[index].file, self._layouts[index].start))
        size = {index: sum(_nbytes(d) for _, d in by_chunk[index]) for index in order}
        with progress.load_bar(sum(size.values()), "ckptshim: dcp.load"):
            for file in dict.fromkeys(self._layouts[index].file for index in order):
                chunks = [index for index in order if self._layouts[index].file == file]
                self._copy_file(file, [(index, self._layouts[index], by_chunk[index]) for index in chunks])
                progress.advance(sum(size[index] for index in chunks))
        for index in order:
            for item, destination in by_chunk[index]:
                planner.commit_tensor(item, destination)
        by_torch = [item for item in plan.items if item.storage_index in self._by_torch]
        if by_torch:
            super().read_data(dataclasses.replace(plan, items=by_torch), _BlockShaped(planner)).wait()
        return _done()


    def _copy_file(self, file: Location,
                   chunks: list[tuple[MetadataIndex, dcp.ChunkLayout, list[tuple[ReadItem, torch.Tensor]]]]) -> None:
        """Every destination of the chunks of one file, each chunk read once, in file order: the
        byte ranges of a window of chunks at a time (the file's store's ``read_ahead_bytes`` of
        staging buffers at most, for chunks not read straight into their destinations: one
        chunk at a time locally; in parallel from a bucket), each range checked against the
        file's size."""
        copies = [copy for _, layout, items in chunks if (copy := _chunk_copy(layout, items)) is not None]
        for window in windows(copies, lambda copy: copy.staged, file.read_ahead_bytes):
            reads = [(begin, view) for copy in window for begin, view in copy.reads]
            read_ranges([ByteRange(file, begin, len(view)) for begin, view in reads], [view for _, view in reads])
            for copy in window:
                copy.finish()


class RemoteDcpReader(DcpReader):
    """:class:`DcpReader` over a DCP checkpoint in object storage (see the module docstring).

    Its file system is ``FsspecReader``'s (``self.fs``, ``self.path`` as there), so what torch
    reads itself goes through the user's fsspec client as without ckptshim; ckptshim reads
    through :class:`~ckptshim.storage.Location` as it reads a local folder. ``remaps()`` says,
    once DCP has planned, whether the plan reads some key from stored chunks of another name or
    layout (the :class:`~ckptshim.execute.dcp_planner.RemappingLoadPlanner`'s ``remaps``)."""

    def __init__(self, location: Location, _extension_registry: Any = None,
                 listed: list[ObjectInfo] | None = None, remaps: Callable[[], bool] = lambda: True) -> None:
        from torch.distributed.checkpoint._fsspec_filesystem import FileSystem  # fsspec: for buckets only

        super().__init__(str(location), _extension_registry, listed)
        self.fs = FileSystem()  # as FsspecReader.__init__
        self.path = self.fs.init_path(str(location))
        self._remaps = remaps

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader.validate_checkpoint_id(checkpoint_id)

    def _reads_chunks(self) -> bool:
        """Only where ckptshim remaps keys: every other load's chunks are read by torch's own
        ``FsspecReader`` data path, as without ckptshim."""
        return self._remaps()


#: Chunks whose archive headers a reader fetches in one parallel batch (from a bucket).
HEADER_BATCH = 256
#: The most bytes a stored Python object may decode to through a stream extension (a small
#: value: optimizer hyper-parameters, a step count); more is refused before it is held.
OBJECT_LIMIT = 256 << 20


def _safe_object(data: bytes, where: str) -> bytes:
    """A stored Python object's bytes, once torch's ``weights_only`` unpickler accepts them.

    DCP's default planner unpickles objects with ``weights_only=False``; ckptshim hands on only
    objects that unpickle without running code from the checkpoint.
    """
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except pickle.UnpicklingError as error:
        why = next((line.strip() for line in str(error).splitlines() if "global" in line.lower()),
                   "it needs globals outside the allow-list")
        raise UnsafeCheckpointError(
            f"{where}: the stored object needs more than torch.load(weights_only=True) allows "
            f"({why}), and ckptshim will not unpickle it. If you trust the "
            "checkpoint, load it with the hook off (CKPTSHIM_DISABLE_HOOKS=torch-dcp), or leave "
            "this key out of the state dict you pass to dcp.load.") from None
    except Exception as error:
        raise CorruptCheckpointError(f"{where}: the stored object does not load "
                                     f"({type(error).__name__}: {error}); the file is damaged.") from None
    return data


def _span(layout: dcp.ChunkLayout, item: ReadItem) -> tuple[int, int, bool]:
    """The file byte range ``[begin, end)`` that holds ``item``'s block of the chunk, and
    whether the block is exactly that range in C order (so one read can fill it)."""
    ref, itemsize = layout.ref, layout.itemsize
    first = ref.offset + sum(o * s for o, s in zip(item.storage_offsets, ref.stride))
    last = first + sum((n - 1) * s for n, s in zip(item.lengths, ref.stride))
    expected, contiguous = 1, True
    for n, s in reversed(list(zip(item.lengths, ref.stride))):
        if n != 1:
            contiguous &= s == expected
            expected *= n
    return layout.start + first * itemsize, layout.start + (last + 1) * itemsize, contiguous


def _writable_bytes(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


@dataclass(frozen=True)
class _ChunkCopy:
    """How one stored chunk reaches its destinations: byte ranges of the file ``(start, where
    the bytes go)``, then ``finish()`` (filling destinations from the staging buffer of
    ``staged`` bytes; nothing where the reads went straight into them)."""

    reads: list[tuple[int, memoryview]]
    staged: int
    finish: Callable[[], None]


def _chunk_copy(layout: dcp.ChunkLayout, items: list[tuple[ReadItem, torch.Tensor]]) -> _ChunkCopy | None:
    """Fill every destination that needs part of one stored chunk, reading each byte once: with
    one read straight into each destination's memory where that memory is the block's bytes,
    else from one read of the bytes they need together, through
    :func:`~ckptshim.execute.destinations.write` (device memory through the staging buffer).
    ``None`` when no destination needs anything."""
    items = [(item, values_of(destination)) for item, destination in items if destination.numel()]
    if not items:
        return None
    dtype = getattr(torch, dtype_name(layout.ref.storage.dtype))
    spans = [_span(layout, item) for item, _ in items]
    direct = all(contiguous and type(d) is torch.Tensor and destinations.in_host_memory(d) and d.is_contiguous()
                 and d.dtype == dtype and d.shape == item.lengths for (item, d), (_, _, contiguous) in zip(items, spans))
    if direct and _disjoint(spans):
        return _ChunkCopy([(begin, _writable_bytes(destination)) for (_, destination), (begin, _, _)
                           in sorted(zip(items, spans), key=lambda pair: pair[1][0])], 0, lambda: None)
    low, high = min(s[0] for s in spans), max(s[1] for s in spans)
    buffer = np.empty(high - low, np.uint8)

    def finish() -> None:
        values = buffer.view(storage_dtype(dtype_name(layout.ref.storage.dtype)))
        itemsize = layout.itemsize
        for (item, destination), (begin, _, _) in zip(items, spans):
            block = np.lib.stride_tricks.as_strided(
                values[(begin - low) // itemsize:], shape=tuple(item.lengths),
                strides=tuple(s * itemsize for s in layout.ref.stride), writeable=False)
            destinations.write(destination, _split(destination, destinations.as_tensor(block, dtype)))
    return _ChunkCopy([(low, memoryview(buffer))], buffer.nbytes, finish)


class _BlockShaped:
    """``planner`` as torch's own reader sees it (for the chunks it reads): a strided copy's
    destination handed over as a buffer of the read item's lengths, which torch's reader
    requires, copied into the destination when committed."""

    def __init__(self, planner: LoadPlanner) -> None:
        self._planner = planner
        self._split: dict[ReadItem, torch.Tensor] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
        destination = self._planner.resolve_tensor(item)
        if destination.shape == item.lengths:
            return destination
        self._split[item] = destination
        return torch.empty(tuple(item.lengths), dtype=destination.dtype)

    def commit_tensor(self, item: ReadItem, tensor: torch.Tensor) -> None:
        destination = self._split.pop(item, None)
        if destination is not None:
            destinations.write(destination, _split(destination, tensor))
            tensor = destination
        self._planner.commit_tensor(item, tensor)


def _disjoint(spans: list[tuple[int, int, bool]]) -> bool:
    ordered = sorted(spans)
    return all(a[1] <= b[0] for a, b in zip(ordered, ordered[1:]))


def _raw_view(destination: torch.Tensor, entry: Entry) -> np.ndarray | None:
    """The plain tensor behind ``destination`` as a numpy array of ``entry``'s stored dtype (a
    view: writes land in it), or ``None`` where the bytes cannot go in as stored (another dtype,
    not in host memory, a subclass ckptshim does not know)."""
    tensor = values_of(destination)
    if (type(tensor) is not torch.Tensor or not destinations.in_host_memory(tensor)
            or dtype_name(tensor.dtype) != entry.dtype):
        return None
    bits = storage_dtype(entry.dtype)
    if tensor.is_floating_point() and bits.kind == "u":  # bfloat16, float8: numpy holds their bits
        tensor = tensor.view(getattr(torch, f"uint{8 * bits.itemsize}"))
    return tensor.numpy()


def _checkpoint_path(where: str | os.PathLike | Location) -> Path | Location:
    """An ``s3://``/``gs://`` URL as a :class:`~ckptshim.storage.Location` (``pathlib`` would
    collapse it to ``s3:/...``); anything else as the local path it names."""
    if isinstance(where, Location):
        return where
    if isinstance(where, str) and "://" in where:
        with contextlib.suppress(UnsupportedLocation, ValueError):
            found = Location.of(where)
            if found.is_remote:
                return found
    return Path(where)


class FormatReader(StorageReader):
    """``dcp.load`` from a ``torch.save`` file, a safetensors file or a Hugging Face directory:
    each tensor is one chunk. Every entry a rank reads is located first (a view of a memory map,
    its byte range checked against the file), then each read item's block is read by the format
    straight into its destination; where the destination cannot take the stored bytes as they are
    (another dtype, device memory, a tensor subclass), into a buffer of the stored dtype the size
    of that block (a rank's rows of one tensor), then written through the destination (a cast is
    torch's ``copy_``), so no page of the map is held. The blocks go to the format a window of
    its ``read_ahead_bytes`` at a time (one block locally; up to 256 MiB from a bucket, fetched
    in parallel): a window's staged blocks are all this reader holds beyond the destinations.

    ``fmt`` is the format the load's hook recognised at ``path`` (opened with no second
    detection); ``None`` for a file no format recognises, which :meth:`read_metadata` then
    refuses in the detector's words. ``listed``: the listing of a bucket's folder that the hook
    recognised it by, which ``fmt`` opens it from (a Hugging Face folder's: no second listing)."""

    def __init__(self, path: str | os.PathLike | Location, fmt: Format | None = None, hook: str = "dcp.load",
                 listed: list[ObjectInfo] | None = None) -> None:
        super().__init__()
        self.path = _checkpoint_path(path)
        self._hook = hook
        self.load_id = str(uuid.uuid4())
        self._format = fmt
        self._listed = (self.path, listed)
        self._checkpoint: Checkpoint | None = None

    @property
    def checkpoint(self) -> Checkpoint | None:
        """The checkpoint :meth:`read_metadata` opened (``None`` before), for the load's planner."""
        return self._checkpoint

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = _checkpoint_path(checkpoint_id)
        self.load_id = str(uuid.uuid4())

    @property
    def checkpoint_id(self) -> Path | Location:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return Path(checkpoint_id).exists()

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        from ckptshim.formats.detect import open_checkpoint  # every format: only for a checkpoint DCP cannot read

        try:  # an incomplete checkpoint is refused before planning: a missing shard, not its keys
            (listed_at, listed), self._listed = self._listed, (None, None)
            opened = open_checkpoint(self.path) if self._format is None else \
                self._format.open_checkpoint(self.path, listed) if listed is not None and listed_at == self.path else \
                self._format.open_checkpoint(self.path)
            self._checkpoint = opened
            opened.require_complete()
        except ShimError as error:
            return _refused(error)
        logger.info("%s: %s is a %s checkpoint (%s), which DCP cannot read; ckptshim reads it", self._hook,
                    self.path, self._checkpoint.format, self._checkpoint.version)
        entries = self._checkpoint.inventory.values()
        return Metadata(
            state_dict_metadata={join_key(e.key): _tensor_md(e.dtype, e.shape, [((0,) * len(e.shape), e.shape)])
                                 for e in entries},
            storage_data={MetadataIndex(join_key(e.key), (0,) * len(e.shape)): e for e in entries},
            storage_meta=StorageMeta(checkpoint_id=str(self.path), load_id=self.load_id))

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        assert self._checkpoint is not None, "read_metadata runs first"
        checkpoint = self._checkpoint
        located: dict[str, Entry] = {}
        resolved = _resolve(planner, plan.items)
        for item, _ in resolved:  # every entry located (its bytes there), before the first write
            fqn = item.storage_index.fqn
            if fqn not in located:
                located[fqn] = checkpoint.inventory[split_key(fqn)]
                checkpoint.check_entry(located[fqn])
        with progress.load_bar(sum(_nbytes(d) for _, d in resolved), "ckptshim: dcp.load"):
            for window in windows(resolved, lambda pair: _nbytes(pair[1]), checkpoint.read_ahead_bytes):
                blocks, staged = [], []
                for item, destination in window:
                    entry = located[item.storage_index.fqn]
                    raw = _raw_view(destination, entry) if destination.shape == item.lengths else None
                    if raw is None:  # a cast: the block alone, as stored, then copied in (no page of the map held)
                        raw = np.empty(tuple(item.lengths), storage_dtype(entry.dtype))
                        staged.append((destination, raw, entry.dtype))
                    blocks.append((entry, _block(item), raw))
                checkpoint.read_blocks(blocks)
                for destination, block, dtype in staged:
                    destinations.write(destination, _split(destination, destinations.as_tensor(block, getattr(torch, dtype))))
                progress.advance(sum(_nbytes(destination) for _, destination in window))
        for item, destination in resolved:
            planner.commit_tensor(item, destination)
        checkpoint.close()
        return _done()
