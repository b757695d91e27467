"""What every format provides: an inventory from metadata, and reads of exactly what is asked.

A format module declares the :class:`Format` protocol: ``NAME``, ``sniff(path) -> bool`` (cheap:
file names, magic bytes, version fields), ``READERS`` (which load calls can be given such a
checkpoint, each with the recogniser that says so: see :func:`ckptshim.formats.detect.detect`)
and ``open_checkpoint(path) -> Checkpoint``. Opening reads metadata only; bytes are read by
:meth:`Checkpoint.read` (a whole entry, usually a view of a memory map, so nothing is copied
until an executor writes it into its destination) or :meth:`Checkpoint.read_into` (one index
range of an entry, straight into a buffer the caller owns). Executors that read many entries go
through :meth:`Checkpoint.read_blocks` and :meth:`Checkpoint.read_each`, a window of what its
storage reads ahead at a time (:attr:`~ckptshim.storage.Location.read_ahead_bytes`: a bucket's
reads in parallel, as one byte range at a time would pay a round trip per tensor).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import re
import stat
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, BinaryIO, Protocol, TypeVar, runtime_checkable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ckptshim import extras
from ckptshim.errors import CorruptCheckpointError, ShimError, describe
from ckptshim.inventory import DTYPE_SIZES, Entry, Inventory
from ckptshim.keytext import shown
from ckptshim.storage import ByteRange, Location, local, read_ranges
from ckptshim.storage.local import entries, kind
from ckptshim.storage.problems import KIND_WORDS

_NO_NUMPY_TYPE = {"bfloat16": "<u2", "float8_e4m3fn": "u1", "float8_e5m2": "u1",
                  "float8_e4m3fnuz": "u1", "float8_e5m2fnuz": "u1"}


def storage_dtype(name: str) -> np.dtype:
    """The little-endian numpy dtype that holds ``name``'s bytes (bfloat16 -> uint16 bits)."""
    return np.dtype(_NO_NUMPY_TYPE.get(name, name)).newbyteorder("<") if name != "bool" else np.dtype(bool)


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype that computes with ``name``'s values (ml_dtypes for bfloat16 and float8)."""
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))


def as_values(out: np.ndarray, dtype: str) -> np.ndarray:
    """``out``, where a read copies ``dtype``'s values into it by value (tensorstore, a msgpack
    leaf): itself, or, where it holds the stored bits of a dtype numpy lacks (bfloat16 as uint16:
    :func:`storage_dtype`), a view of it as that dtype's values. A copy by value into the bits
    would turn each value into an integer (1.0 into 1); into this view it writes the stored
    bytes as they are, as :meth:`Checkpoint.read_into` promises."""
    if dtype in _NO_NUMPY_TYPE and out.dtype == storage_dtype(dtype):
        return out.view(numpy_dtype(dtype))
    return out


# -- the trust boundary ---------------------------------------------------------------------------


@contextlib.contextmanager
def reading(where: object, what: str = "reading it") -> Iterator[None]:
    """The trust boundary around ckptshim's parsing of a checkpoint's bytes at ``where``.

    A :class:`~ckptshim.errors.ShimError` passes; any other exception out of a parser (a
    ``TypeError`` from a value of the wrong type, a ``RecursionError``, a ``MemoryError``) is a
    checkpoint ckptshim cannot read, reported as a :class:`CorruptCheckpointError` naming the
    file -- never a raw traceback, and never a reason for a hook to hand the file to a loader
    that would unpickle it. The original exception is kept as the cause, for bug reports.
    """
    try:
        yield
    except ShimError:
        raise
    except Exception as error:
        raise unreadable(where, what, error) from error


def unreadable(where: object, what: str, error: BaseException) -> ShimError:
    """The error :func:`reading` raises for ``error``, an exception out of a parser: a
    :class:`~ckptshim.extras.MissingExtraError` where the parser needs a framework that is not
    installed (tensorstore, ml_dtypes), else a :class:`CorruptCheckpointError`."""
    if isinstance(error, ModuleNotFoundError):
        needs_extra = extras.missing(error, f"{where}: {what}")
        if needs_extra is not None:
            return needs_extra
    return CorruptCheckpointError(
        f"{where}: {what} failed ({describe(error)}); the checkpoint is "
        "corrupt, incomplete or not what its format says. Re-copy it from the original; if it "
        "is intact, this is a bug in ckptshim: please report it with this message.")


_Opener = TypeVar("_Opener", bound=Callable[..., Any])


def reader(open_checkpoint: _Opener) -> _Opener:
    """Decorate a format module's ``open_checkpoint(path)`` with :func:`reading` (see there)."""
    @functools.wraps(open_checkpoint)
    def opened(path: Path, *args: Any, **kwargs: Any) -> Any:
        with reading(path, "opening it"):
            return open_checkpoint(path, *args, **kwargs)
    return opened  # type: ignore[return-value]


class _GuardedFuture:
    """A read's future whose ``result()`` raises only ``ShimError`` (see :func:`reading`)."""

    def __init__(self, future: Any, where: object, what: str) -> None:
        self._future, self._where, self._what = future, where, what

    def result(self) -> Any:
        with reading(self._where, self._what):
            return self._future.result()


def _guarded(method: Callable[..., Any]) -> Callable[..., Any]:
    """``Checkpoint.read``/``read_into`` inside the trust boundary (as :func:`reading`, written
    out: reads of small entries are many), and so is a future it returns."""
    @functools.wraps(method)
    def guarded(self: Checkpoint, entry: Any, *args: Any) -> Any:
        try:
            result = method(self, entry, *args)
        except ShimError:
            raise
        except Exception as error:
            raise unreadable(self.path, _reading(self, entry), error) from error
        return result if result is None or isinstance(result, (np.ndarray, _GuardedFuture)) \
            else _GuardedFuture(result, self.path, _reading(self, entry))
    guarded.guarded = True  # type: ignore[attr-defined]
    return guarded


def _reading(checkpoint: Checkpoint, entry: Any) -> str:
    if isinstance(entry, Sequence) and not isinstance(entry, Entry):  # read_blocks' blocks
        return f"reading {len(entry)} arrays" + (f" from {_reading(checkpoint, entry[0][0])[8:]}" if entry else "")
    return f"reading {checkpoint.key_sep.join(getattr(entry, 'key', ()))!r}"


#: Bytes of bookkeeping (Python objects) a parser may build for one checkpoint whatever it
#: holds; beyond it, only in proportion to the array bytes the file holds (see :class:`Budget`).
ALLOWANCE_BYTES = 256 * 2**20
#: What one parsed object (a container, string, number or record) is counted as.
NODE_BYTES = 64


def metadata_limit(array_bytes: int) -> int:
    """The most bytes a metadata file of a checkpoint whose files hold ``array_bytes`` may have:
    the allowance of :class:`Budget`, plus a byte for each object it
    credits for the arrays (one per ``NODE_BYTES``): metadata describes structure, which grows with
    the arrays' count, not their bytes. A remote one larger is refused before it is fetched."""
    return ALLOWANCE_BYTES + max(array_bytes, 0) // NODE_BYTES


class Budget:
    """The objects a parser may build from one file: :data:`ALLOWANCE_BYTES` worth, plus one
    per :data:`NODE_BYTES` of array data the file holds (:meth:`credit`), each object counted
    as :data:`NODE_BYTES`.

    A checkpoint's structure (keys, records, containers) is small next to its arrays; one
    whose structure would take more memory than its arrays plus the allowance is built to
    exhaust memory (38 MB of empty msgpack maps, a million small integers) and is refused
    while the parser's memory is still within that bound. Every parser also does a constant
    amount of work per object, so its time is linear in the file.
    """

    __slots__ = ("where", "limit", "used")

    def __init__(self, where: object, array_bytes: int = 0) -> None:
        self.where = where
        self.limit = (ALLOWANCE_BYTES + max(array_bytes, 0)) // NODE_BYTES
        self.used = 0

    def credit(self, array_bytes: int) -> None:
        """Room for the structure of ``array_bytes`` more bytes of arrays found in the file."""
        self.limit += max(array_bytes, 0) // NODE_BYTES

    def left(self) -> int:
        return self.limit - self.used

    def spend(self, objects: int = 1) -> None:
        self.used += objects
        if self.used > self.limit:
            raise CorruptCheckpointError(
                f"{self.where}: describes more than {self.limit:,} objects, more structure than "
                f"its {max(self.limit * NODE_BYTES - ALLOWANCE_BYTES, 0):,} bytes of arrays need "
                f"(ckptshim allows {ALLOWANCE_BYTES // 2**20} MiB of metadata beyond them); "
                "refusing it before it exhausts memory. The file is damaged or built to do that.")


# -- opening the files of a checkpoint -----------------------------------------------------------


def open_regular(path: str | os.PathLike, buffering: int = -1) -> BinaryIO:
    """Open ``path``, a file of a checkpoint, for reading -- refusing, without blocking, anything
    but a regular file (a link is followed; where it may lead is checked when the checkpoint is
    opened, see :meth:`~ckptshim.storage.Location.refuse_links_leaving`). Every file ckptshim itself opens in a checkpoint
    is opened here, through :func:`ckptshim.storage.local.open_regular`. ``OSError`` (a missing
    file, no permission) passes to the caller, which knows what the file is for; a file of the
    wrong type is an :class:`UnsafeCheckpointError` naming it."""
    return local.open_regular(Location.of(path), buffering)


def read_regular(path: str | os.PathLike, limit: int | None = None) -> bytes:
    """The bytes of the regular file ``path`` (at most ``limit``), as :func:`open_regular` opens it."""
    with open_regular(path) as raw:
        return raw.read() if limit is None else raw.read(limit)


def regular_size(path: str | os.PathLike) -> int | None:
    """The size of the regular file at ``path`` (a link followed); ``None`` for anything else,
    or nothing."""
    try:
        found = os.stat(path)
    except OSError:
        return None
    return found.st_size if stat.S_ISREG(found.st_mode) else None


def folder_bytes(root: Path) -> int:
    """Bytes of the regular files under ``root`` (links not followed): what its arrays can hold."""
    return sum(entry.stat(follow_symlinks=False).st_size for entry in entries(root)
               if entry.is_file(follow_symlinks=False))


@dataclass(frozen=True)
class Piece:
    """What one file of a checkpoint holds for one array: all of it, or one part.

    Completeness reports say what a missing or short file costs by its pieces. ``part`` names
    the part in the format's own terms (``""``: the whole array; ``"[0:128, 0:64]"``: a block;
    ``"index of keys a .. b"``: an OCDBT index node); ``offset``/``length`` are its byte range in
    the file, where the metadata says.
    """

    key: str
    part: str = ""
    offset: int | None = None
    length: int | None = None

    def __str__(self) -> str:
        where = "" if self.offset is None else f" bytes {self.offset}..{self.offset + (self.length or 0)}"
        return f"{self.key}{' ' + self.part if self.part else ''}{where}"


@dataclass(frozen=True)
class FileInfo:
    """One file a checkpoint consists of, with the size its metadata implies.

    ``writer`` is what wrote the file, for reports per writer (``ocdbt.process_3``, ``rank 1``, an
    array's folder); ``pieces`` what it holds (see :class:`Piece`); ``notes`` free-form lines
    about it. ``kind`` is what is actually there: a regular file, or something ckptshim will
    not read as one (a directory, a device, a socket).
    """

    path: str
    size: int | None           # None: the file is missing
    expected_size: int | None = None
    notes: tuple[str, ...] = ()
    pieces: tuple[Piece, ...] = ()
    writer: str = ""
    kind: str = "file"

    @property
    def contents(self) -> tuple[str, ...]:
        """One line per note and per piece, in file order."""
        return self.notes + tuple(map(str, self.pieces))

    @property
    def problem(self) -> str | None:
        """What is wrong with the file, on one line (its name, from the checkpoint, :func:`shown`)."""
        if self.size is None:
            return f"{shown(self.path)}: missing"
        if self.kind != "file":
            return f"{shown(self.path)}: a {KIND_WORDS.get(self.kind, self.kind)}, not a regular file"
        if self.expected_size is not None and self.size < self.expected_size:
            return f"{shown(self.path)}: {self.size} bytes, but its metadata needs {self.expected_size}"
        return None

    @property
    def bytes_needed(self) -> int:
        """Bytes the metadata needs of this file (its size, where the metadata does not say)."""
        return self.expected_size if self.expected_size is not None else (self.size or 0)

    @property
    def bytes_present(self) -> int:
        """How many of :attr:`bytes_needed` are there to read."""
        return 0 if self.size is None or self.kind != "file" else min(self.size, self.bytes_needed)


#: One read of :meth:`Checkpoint.read_blocks`: ``entry[index]`` into ``out``.
Block = tuple[Entry, tuple, np.ndarray]
_Item = TypeVar("_Item")


def windows(items: Iterable[_Item], nbytes: Callable[[_Item], int], limit: int) -> Iterator[list[_Item]]:
    """``items`` in order, in consecutive groups of at most ``limit`` bytes (``nbytes`` of each);
    an item larger than ``limit`` is a group of its own, and so is every item when ``limit`` is 0."""
    group: list[_Item] = []
    held = 0
    for item in items:
        size = nbytes(item)
        if group and (not limit or held + size > limit):
            yield group
            group, held = [], 0
        group.append(item)
        held += size
    if group:
        yield group


#: What :attr:`Checkpoint.model_config` holds until the checkpoint's model config is read.
UNREAD: Any = type("Unread", (), {"__repr__": lambda self: "UNREAD"})()


@dataclass
class Checkpoint(ABC):
    """An opened checkpoint: metadata (inventory, files, problems) and reads on demand.

    ``key_sep`` is how the format's own tools spell key paths (``.`` for torch, ``/`` for JAX).
    """

    key_sep = "."

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Every format's reads run inside the trust boundary (:func:`reading`)."""
        super().__init_subclass__(**kwargs)
        for name in ("read", "read_into", "read_blocks", "check_entry"):
            method = cls.__dict__.get(name)
            if method is not None and not getattr(method, "guarded", False):
                setattr(cls, name, _guarded(method))

    path: Path
    format: str
    version: str
    inventory: Inventory
    files: tuple[FileInfo, ...] = ()
    problems: tuple[str, ...] = field(default=())
    #: the ``config.json`` of the model it holds, once read (:func:`ckptshim.formats.hf_dir.config_of`)
    model_config: Any = field(default=UNREAD, init=False, repr=False, compare=False)

    @property
    def complete(self) -> bool:
        return not self.problems and all(f.problem is None for f in self.files)

    def all_problems(self) -> list[str]:
        return list(self.problems) + [f.problem for f in self.files if f.problem is not None]

    @abstractmethod
    def read(self, entry: Entry) -> np.ndarray:
        """The whole array for ``entry``, in its storage dtype (see :func:`storage_dtype`).

        Usually a read-only view of a memory map: slicing it reads only the slice's pages.
        """

    @_guarded
    def read_into(self, entry: Entry, index: tuple, out: np.ndarray) -> Any:
        """Copy ``entry[index]`` into ``out``, cast to ``out.dtype`` (as Orbax casts on restore).

        An ``out`` of the stored dtype (:func:`storage_dtype`: bfloat16 as its uint16 bits) gets
        the stored bytes as they are. Returns ``None`` when done, or a future whose ``result()``
        waits for the copy. This default slices :meth:`read`'s view, so a memory-mapped format reads only the pages of
        that range; formats whose arrays are compressed chunks read just the chunks it needs.
        """
        value = self.read(entry)
        if out.dtype != value.dtype:  # a cast: by value, not by the stored bits
            value = value.view(numpy_dtype(entry.dtype))
        np.copyto(out, value[index], casting="unsafe")
        return None

    @property
    def read_ahead_bytes(self) -> int:
        """How many bytes of arrays an executor hands :meth:`read_blocks` at once: what the
        storage the checkpoint lies in reads ahead (:attr:`~ckptshim.storage.Location.read_ahead_bytes`)."""
        return Location.of(self.path).read_ahead_bytes

    @_guarded
    def read_blocks(self, blocks: Sequence[Block]) -> None:
        """Fill each block's ``out`` with ``entry[index]``, as :meth:`read_into` does: the blocks
        that are byte ranges of objects in a bucket (:meth:`byte_range`) by one parallel batch
        of them, straight into their buffers; then every other read started, and those that
        returned a future waited for (tensorstore reads them concurrently). Callers bound what
        they hand it (:attr:`read_ahead_bytes`)."""
        ranges = [self.byte_range(*block) for block in blocks]
        read_ranges([where for where in ranges if where is not None],
                     [memoryview(out.reshape(-1).view(np.uint8)) for (_, _, out), where in zip(blocks, ranges)
                      if where is not None])
        pending = [self.read_into(*block) for block, where in zip(blocks, ranges) if where is None]
        for future in pending:
            if future is not None:
                future.result()

    def byte_range(self, entry: Entry, index: tuple, out: np.ndarray) -> ByteRange | None:
        """The byte range of an object in a bucket that is ``entry[index]`` exactly as ``out``
        (C-contiguous) holds it, for :meth:`read_blocks` to fetch with the others; ``None`` for a
        block :meth:`read_into` reads. This default: ``None``."""
        return None

    def read_each(self, entries: Iterable[Entry]) -> Iterator[np.ndarray]:
        """Each entry's whole array in its storage dtype, in order, as :meth:`read` gives it. A
        checkpoint in a bucket reads ahead: a window of :attr:`read_ahead_bytes` at a time into
        new arrays, by one :meth:`read_blocks`; a local one gives :meth:`read`'s views, one by one."""
        limit = self.read_ahead_bytes
        if not limit:
            yield from map(self.read, entries)
            return
        for window in windows(entries, lambda entry: entry.nbytes, limit):
            arrays = [np.empty(entry.shape, storage_dtype(entry.dtype)) for entry in window]
            self.read_blocks([(entry, tuple(slice(0, n) for n in entry.shape), array)
                              for entry, array in zip(window, arrays)])
            yield from arrays

    @_guarded
    def check_entry(self, entry: Entry) -> None:
        """Raise unless every byte of ``entry`` is there to read: what a load checks of each
        entry before its first write. This default takes :meth:`read`'s view (a memory-mapped
        format checks its byte range against the file); a format whose :meth:`read` assembles
        the array checks the pieces it would assemble it from instead."""
        self.read(entry)

    def require_complete(self) -> None:
        problems = self.all_problems()
        if problems:
            raise CorruptCheckpointError(
                f"{self.path} ({self.format}) is incomplete:\n  " + "\n  ".join(problems)
                + "\nRestore the missing files (or re-copy the checkpoint) before loading it.")

    def close(self) -> None:
        """Release open files and maps (reads afterwards are an error)."""


def file_info(path: Path, expected_size: int | None = None, root: Path | None = None, *,
              pieces: tuple[Piece, ...] = (), writer: str = "") -> FileInfo:
    """What is at ``path`` (shown relative to ``root``): its size, and whether it is a regular
    file (a link inside the checkpoint is followed; links leaving it are refused at open)."""
    shown = os.path.relpath(path, root) if root is not None else str(path)
    try:
        found = path.stat()
    except (FileNotFoundError, NotADirectoryError):
        return FileInfo(shown, None, expected_size, pieces=pieces, writer=writer)
    return FileInfo(shown, found.st_size, expected_size, pieces=pieces, writer=writer, kind=kind(found.st_mode))


def check_view(entry: Entry, begin: int, end: int, available: int, where: str) -> None:
    """Refuse a byte range that does not fit the entry or runs past the end of its file."""
    needed = entry.nbytes
    if end - begin != needed:
        raise CorruptCheckpointError(
            f"{where}: {'.'.join(entry.key)!r} is declared {entry.dtype}{list(entry.shape)} "
            f"({needed} bytes) but its byte range holds {end - begin}; the metadata is corrupt.")
    if end > available:
        raise CorruptCheckpointError(
            f"{where}: {'.'.join(entry.key)!r} needs bytes up to {end} but the file has "
            f"{available}; the file is truncated. Re-copy it from the original.")


def contiguous(shape: tuple[int, ...], index: tuple) -> tuple[int, int] | None:
    """``(first element, count)`` when ``index`` (ranges and single indices) of a C-order array of
    ``shape`` is one run of elements (leading axes one index each, then one range, then every axis
    whole), else ``None``."""
    if len(index) != len(shape):
        return None
    bounds = [part.indices(size)[:2] if isinstance(part, slice) else (part, part + 1)
              for part, size in zip(index, shape)]
    lengths = [stop - start for start, stop in bounds]
    if any(length <= 0 for length in lengths):
        return None
    ranged = next((axis for axis, length in enumerate(lengths) if length != 1), len(shape))
    if any(lengths[axis] != shape[axis] for axis in range(ranged + 1, len(shape))):
        return None
    first = 0
    for (start, _), size in zip(bounds, shape):
        first = first * size + start
    return first, math.prod(lengths)


def step_folders(root: Path | Location, pattern: re.Pattern,
                 accept: Callable[[Any], Any]) -> dict[int, Any]:
    """Step number -> ``accept(child)``, in step order, for each child of ``root`` whose name
    ``pattern`` matches (its group 1 is the step) and that ``accept`` turns into a path (the
    step folder itself, or the file in it that holds the step).

    ``root`` may be a bucket prefix (a :class:`~ckptshim.storage.Location`), listed once.

    Two children naming one step (``checkpoint_1`` beside ``checkpoint_01``) are refused: which
    one the writer meant would be a guess.
    """
    with reading(root, "listing its step folders"):
        return _step_folders(root, pattern, accept)


def _step_folders(root: Path | Location, pattern: re.Pattern, accept: Callable[[Any], Any]) -> dict[int, Any]:
    if not root.is_dir():
        return {}
    found: dict[int, tuple[str, Any]] = {}
    listed = (info.location for info in root.list()) if isinstance(root, Location) else root.iterdir()
    # by name, and only the children the pattern matches: a per-array checkpoint folder holds
    # 100,000 children, and comparing Path objects costs microseconds each
    named = sorted(((child.name, child) for child in listed if pattern.match(child.name)), key=lambda pair: pair[0])
    for _, child in named:
        match = pattern.match(child.name)
        accepted = accept(child)
        if accepted is None:
            continue
        step = int(match.group(1))
        if step in found:
            raise CorruptCheckpointError(
                f"{root}: {found[step][0]} and {child.name} both hold step {step}; move the one "
                "that is not the checkpoint you mean out of this folder.")
        found[step] = child.name, accepted
    return {step: found[step][1] for step in sorted(found)}


def itemsize(dtype: str) -> int:
    return DTYPE_SIZES[dtype]


def strict_json(raw: str | bytes, array_bytes: int = 0) -> object:
    """``json.loads`` that refuses an object naming one key twice (a ``ValueError``).

    JSON allows duplicate keys and Python keeps the last one silently; in checkpoint metadata
    two values for one name mean the file was damaged or tampered with, and picking one would
    be a guess. Nesting too deep for Python's parser (a hostile file) is a ``ValueError`` too,
    and so is a document of more values than a :class:`Budget` credited with ``array_bytes``
    (what the arrays it describes hold) allows: counted before parsing, from its commas and
    brackets, so that a megabyte of ``[[],[],...]`` never becomes a million lists.
    """
    text = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else bytes(raw)
    require_json_budget(text, array_bytes)
    try:
        return json.loads(text, object_pairs_hook=_unique_pairs)
    except RecursionError:
        raise ValueError("JSON nested too deeply to parse") from None


def require_json_budget(text: bytes, array_bytes: int = 0) -> None:
    """``ValueError`` when the JSON ``text`` holds more values than a :class:`Budget` credited
    with ``array_bytes`` allows -- counted from its commas and brackets, before parsing."""
    values = text.count(b",") + text.count(b"[") + text.count(b"{") + 1  # at least the values
    budget = Budget("JSON", array_bytes)
    if values > budget.left():
        raise ValueError(f"JSON of about {values:,} values, more than {budget.left():,} (what "
                         f"{array_bytes:,} bytes of arrays and ckptshim's allowance for metadata "
                         "justify); refusing it before it exhausts memory")


def _unique_pairs(pairs: list[tuple[str, object]]) -> dict:
    out = dict(pairs)  # built in C; only an object with a duplicate key comes out shorter
    if len(out) != len(pairs):
        seen: set[str] = set()
        key = next(key for key, _ in pairs if key in seen or seen.add(key))
        raise ValueError(f"key {key!r} appears twice in one JSON object (duplicate key)")
    return out


@runtime_checkable
class Format(Protocol):
    """What a format declares: each is a module of :mod:`ckptshim.formats` with these names,
    registered once, in precedence order, in :data:`ckptshim.formats.detect.FORMATS`.

    - ``NAME``: how ckptshim names the format (``ckptshim inspect``, messages);
    - ``READERS``: for each kind of load call that can name such a checkpoint (``"torch"``,
      ``"jax"``), the fingerprint that says a path is one *that call* reads (a format may be
      recognised for ``inspect`` but named by no load call);
    - ``sniff(path)``: whether ``path`` is in this format, from cheap fingerprints (names,
      headers, version fields), reading no tensor bytes;
    - ``open_checkpoint(path)``: the opened :class:`Checkpoint` (metadata only).
    """

    NAME: str
    READERS: Mapping[str, Callable[[Path], bool]]

    def sniff(self, path: Path) -> bool: ...

    def open_checkpoint(self, path: Path) -> Checkpoint: ...
