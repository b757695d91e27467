"""Walk a Flax-style msgpack file and note where each array's bytes are, without copying them.

Flax (``flax.serialization.msgpack_serialize``) and old Orbax aggregate files store a nested
dict whose array leaves are msgpack *ext* values: type 1 (ndarray) or 3 (numpy scalar) holding
a small msgpack ``(shape, dtype name, raw bytes)`` triple. ``msgpack.unpackb`` would copy every
array into memory to build that tree; this walker reads the structure from a memory map and
records each array as an :class:`ArrayRef` (file offset, shape, dtype) instead, so listing a
multi-GiB file touches only its headers, and every value counts against a
:class:`~ckptshim.formats.base.Budget` (a file of millions of empty maps or small integers is
refused before it exhausts memory; time is linear in the file). Arrays over 1 GiB are split by Flax into
``{'__msgpack_chunked_array__': True, 'shape': ..., 'chunks': ...}``; those come back as one
:class:`ArrayRef` with several byte ranges.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptshim.errors import CorruptCheckpointError
from ckptshim.formats import located
from ckptshim.formats.base import Budget, as_values, numpy_dtype
from ckptshim.formats.located import Where
from ckptshim.inventory import DTYPE_SIZES, Entry, KeyPath, dtype_name, flatten
from ckptshim.storage import Location

_EXT_NDARRAY, _EXT_COMPLEX, _EXT_NPSCALAR = 1, 2, 3
_CHUNKED = "__msgpack_chunked_array__"
#: Nesting deeper than any checkpoint tree; each level costs this reader two Python frames, so
#: the limit keeps a hostile file's nesting well inside Python's recursion limit.
MAX_DEPTH = 128
#: What a number or array costs the budget beyond its one object: it becomes an inventory entry
#: (the entry, its key path, its location: about five objects' worth of memory).
ENTRY_OBJECTS = 5


@dataclass(frozen=True)
class ArrayRef:
    """An array stored in the file: C-order bytes in ``ranges`` (``(offset, length)`` pairs)."""

    shape: tuple[int, ...]
    dtype: str
    ranges: tuple[tuple[int, int], ...]


class _Reader:
    def __init__(self, data, where: str) -> None:
        self.data, self.where, self.pos = data, where, 0
        self.budget = Budget(where)  # one object per value; array bytes credited as found

    def fail(self, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{self.where}: {what} at byte {self.pos}; the file is damaged, truncated or not a Flax/Orbax "
            "msgpack checkpoint. Re-copy it from the original.")

    def take(self, n: int) -> int:
        start = self.pos
        if n < 0 or start + n > len(self.data):
            raise self.fail(f"needs {n} more bytes than the file holds")
        self.pos = start + n
        return start

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        return struct.unpack_from(fmt, self.data, self.take(size))[0]

    def text(self, n: int) -> str:
        start = self.take(n)
        try:
            return bytes(self.data[start:start + n]).decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail("a string that is not UTF-8") from None

    def value(self, depth: int = 0) -> Any:
        if depth > MAX_DEPTH:
            raise self.fail(f"nesting deeper than {MAX_DEPTH} levels, more than any checkpoint tree")
        self.budget.spend()
        b = self.data[self.take(1)]
        if b <= 0x7F or b >= 0xE0 or b in _SIMPLE or b in (0xC2, 0xC3):
            self.budget.spend(ENTRY_OBJECTS)  # a number: an entry of the inventory
        if b <= 0x7F:
            return b
        if b >= 0xE0:
            return b - 0x100
        if 0x80 <= b <= 0x8F:
            return self.mapping(b & 0x0F, depth)
        if 0x90 <= b <= 0x9F:
            return [self.value(depth + 1) for _ in range(b & 0x0F)]
        if 0xA0 <= b <= 0xBF:
            return self.text(b & 0x1F)
        simple = _SIMPLE.get(b)
        if simple is not None:
            return self.unpack(simple)
        if b == 0xC0:
            return None
        if b in (0xC2, 0xC3):
            return b == 0xC3
        if b in (0xC4, 0xC5, 0xC6):  # bin: keep the location, not the bytes
            n = self.unpack(_LENGTH[b])
            return _Bytes(self.take(n), n)
        if b in (0xD9, 0xDA, 0xDB):
            return self.text(self.unpack(_LENGTH[b]))
        if b in (0xDC, 0xDD):
            return [self.value(depth + 1) for _ in range(self.unpack(_LENGTH[b]))]
        if b in (0xDE, 0xDF):
            return self.mapping(self.unpack(_LENGTH[b]), depth)
        if b in _FIXEXT:
            return self.ext(_FIXEXT[b], depth)
        if b in (0xC7, 0xC8, 0xC9):
            return self.ext(self.unpack(_LENGTH[b]), depth)
        raise self.fail(f"byte 0x{b:02x}, which msgpack never uses")

    def mapping(self, n: int, depth: int) -> dict:
        out = {}
        for _ in range(n):
            key = self.value(depth + 1)
            if isinstance(key, bool) or not isinstance(key, (str, int)):
                # Flax and Orbax write string keys; str() of a nested container as a key grows
                # exponentially with nesting (each level escapes the quotes of the one below).
                raise self.fail(f"a map key that is a {type(key).__name__}, not a string")
            if str(key) in out:  # msgpack allows it, Python would keep the last: a guess
                raise self.fail(f"the map key {str(key)!r:.80} twice")
            out[str(key)] = self.value(depth + 1)
        return _unchunk(out, self) if out.get(_CHUNKED) is True else out

    def ext(self, n: int, depth: int) -> Any:
        code = self.unpack(">b")
        end = self.pos + n
        if code in (_EXT_NDARRAY, _EXT_NPSCALAR):
            triple = self.value(depth + 1)
            if not (isinstance(triple, list) and len(triple) == 3 and isinstance(triple[2], _Bytes)):
                raise self.fail("an array record that is not (shape, dtype, bytes)")
            shape, name, raw = triple
            try:
                dtype = dtype_name(name.decode() if isinstance(name, bytes) else name)
                shape = tuple(int(d) for d in shape)
            except (ValueError, TypeError, OverflowError):
                raise self.fail(f"an array record with dtype {name!r:.40} and shape {shape!r:.60}") from None
            if any(d < 0 for d in shape):
                raise self.fail(f"an array of negative shape {list(shape)}")
            if raw.length != math.prod(shape) * DTYPE_SIZES[dtype]:
                raise self.fail(f"an array {dtype}{list(shape)} whose data holds {raw.length} bytes")
            value: Any = ArrayRef(shape, dtype, ((raw.offset, raw.length),))
            self.budget.credit(raw.length)
            self.budget.spend(ENTRY_OBJECTS)
        elif code == _EXT_COMPLEX:
            pair = self.value(depth + 1)
            if not (isinstance(pair, list) and len(pair) == 2
                    and all(isinstance(x, (int, float)) for x in pair)):
                raise self.fail("a complex number record that is not (real, imag)")
            value = complex(*pair)
        else:
            raise self.fail(f"msgpack extension type {code}, which Flax never writes")
        if self.pos != end:
            raise self.fail("an extension record whose length does not match its content")
        return value


@dataclass(frozen=True)
class _Bytes:
    offset: int
    length: int


_SIMPLE = {0xCA: ">f", 0xCB: ">d", 0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q",
           0xD0: ">b", 0xD1: ">h", 0xD2: ">i", 0xD3: ">q"}
_LENGTH = {0xC4: ">B", 0xC5: ">H", 0xC6: ">I", 0xC7: ">B", 0xC8: ">H", 0xC9: ">I",
           0xD9: ">B", 0xDA: ">H", 0xDB: ">I", 0xDC: ">H", 0xDD: ">I", 0xDE: ">H", 0xDF: ">I"}
_FIXEXT = {0xD4: 1, 0xD5: 2, 0xD6: 4, 0xD7: 8, 0xD8: 16}


def _unchunk(node: dict, reader: _Reader) -> ArrayRef:
    """Flax's chunked form of a >1 GiB array -> one ArrayRef over all its chunks, in order."""
    try:
        shape = tuple(int(node["shape"][str(i)]) for i in range(len(node["shape"])))
        chunks = [node["chunks"][str(i)] for i in range(len(node["chunks"]))]
    except (KeyError, TypeError, ValueError, OverflowError):
        raise reader.fail("a chunked array without shape or chunks") from None
    if any(d < 0 for d in shape):
        raise reader.fail(f"a chunked array of negative shape {list(shape)}")
    if not chunks or not all(isinstance(c, ArrayRef) and c.dtype == chunks[0].dtype for c in chunks):
        raise reader.fail("a chunked array whose chunks are not arrays of one dtype")
    dtype = chunks[0].dtype
    ranges = tuple(r for c in chunks for r in c.ranges)
    if sum(n for _, n in ranges) != math.prod(shape) * DTYPE_SIZES[dtype]:
        raise reader.fail(f"a chunked array {dtype}{list(shape)} whose chunks do not add up")
    return ArrayRef(shape, dtype, ranges)


def read_tree(data, where: str) -> Any:
    """The tree stored in ``data`` (bytes or a memory map), arrays replaced by :class:`ArrayRef`."""
    reader = _Reader(data, where)
    tree = reader.value()
    if reader.pos != len(data):
        raise reader.fail(f"{len(data) - reader.pos} trailing bytes after the tree")
    return tree


@dataclass(frozen=True)
class Inline:
    """An entry's location in a msgpack file: an array's byte ranges, or a plain scalar."""

    ref: ArrayRef | None = None
    scalar: bool | int | float | None = None


def leaves(tree: Any) -> dict[KeyPath, Any]:
    """The tree's leaves that can be entries (arrays, numbers) or name one (strings)."""
    return {key: leaf for key, leaf in flatten(tree).items()
            if isinstance(leaf, (ArrayRef, bool, int, float, str))}


def inline_entry(key: KeyPath, leaf: ArrayRef | bool | int | float) -> Entry:
    """The entry for an inline array, or for a scalar (stored by msgpack as a plain number)."""
    if isinstance(leaf, ArrayRef):
        return Entry(key, leaf.shape, leaf.dtype, Inline(ref=leaf))
    if isinstance(leaf, bool):
        dtype = "bool"
    elif isinstance(leaf, int):  # msgpack's uint64 holds values past int64 (what numpy makes of them)
        dtype = "int64" if leaf < 2**63 else "uint64"
    else:
        dtype = "float64"
    return Entry(key, (), dtype, Inline(scalar=leaf))


def copy_inline(data, entry: Entry, index: tuple, out: np.ndarray) -> None:
    """Copy ``entry[index]`` (an :class:`Inline` in the mapped file ``data``) into ``out``, cast."""
    where: Inline = entry.location
    dtype = numpy_dtype(entry.dtype)
    if where.ref is None:
        value = np.asarray(where.scalar, dtype=dtype)
    else:
        parts = [np.frombuffer(data, dtype=np.uint8, count=n, offset=o) for o, n in where.ref.ranges]
        flat = parts[0] if len(parts) == 1 else np.concatenate(parts)  # chunked: >1 GiB arrays only
        value = flat.view(dtype.newbyteorder("<")).reshape(where.ref.shape)
    np.copyto(as_values(out, entry.dtype), value[index], casting="unsafe")


def is_msgpack_file(path: Where) -> bool:
    """Cheap: is ``path`` a file (or object) that starts like a msgpack map (as Flax trees do)?"""
    head = located.head(path, 1)
    return bool(head) and (0x80 <= head[0] <= 0x8F or head[0] in (0xDE, 0xDF))


def contents(path: Where, limit: int | None = None) -> Any:
    """The bytes of the msgpack file at ``path``, through its :class:`~ckptshim.storage.Location`
    (:meth:`~ckptshim.storage.Location.whole`): locally a read-only memory map, so that listing
    touches only the headers; from a bucket the whole object, as Flax and T5X read it (their
    arrays are inline). Refused beyond ``limit`` (where the file is metadata, whose size no
    other file vouches for) before a byte is read, on a disk as in a bucket."""
    return Location.of(path).whole(limit)