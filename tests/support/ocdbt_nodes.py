"""OCDBT b-tree nodes taken apart and put back together, to build index graphs that are not trees.

Follows tensorstore's format description (``tensorstore/kvstore/ocdbt/index.rst``: "B+tree node
format"): an outer header (magic ``0x0cdb20de`` big-endian, the node's length as ``uint64le``,
version and compression as varints), the body (uncompressed here: databases written with
``"compression": None``), and a CRC-32C of everything before it. An interior node's body is its
height, a data file table, the entry count, then one column per field: key prefix and suffix
lengths, subtree prefix lengths, the key suffixes, and each child's data file, offset, length
and three statistics.

:func:`point_child_at` rewrites one child reference of an interior node to any location -- an
ancestor, itself -- keeping the node's length (a statistic of the same entry absorbs a change in
the varints' widths) and writing a valid checksum, so that only the graph lies.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

MAGIC = 0x0CDB20DE

_CRC_TABLE = []
for _byte in range(256):
    _crc = _byte
    for _ in range(8):
        _crc = (_crc >> 1) ^ 0x82F63B78 if _crc & 1 else _crc >> 1
    _CRC_TABLE.append(_crc)


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), as OCDBT's footers hold it."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


def _column(data: bytes, pos: int, count: int) -> tuple[list[int], int]:
    values = []
    for _ in range(count):
        value, pos = _read_varint(data, pos)
        values.append(value)
    return values, pos


@dataclass
class InteriorNode:
    """An uncompressed interior node: everything before the child columns kept as bytes, the
    columns (``ids``, ``offsets``, ``lengths``, ``stats``: three per child) as numbers."""

    head: bytes       # magic .. compression (the length field rewritten on encoding)
    prefix: bytes     # body up to the data file ids: height, file table, count, keys
    ids: list[int]
    offsets: list[int]
    lengths: list[int]
    stats: list[list[int]]

    @classmethod
    def decode(cls, raw: bytes) -> InteriorNode:
        (magic,) = struct.unpack_from(">I", raw)
        assert magic == MAGIC, "not an OCDBT b-tree node"
        assert struct.unpack_from("<Q", raw, 4)[0] == len(raw)
        pos = 12
        _version, pos = _read_varint(raw, pos)
        compression, pos = _read_varint(raw, pos)
        assert compression == 0, "a compressed node: write the database with compression None"
        head, body_start = raw[:pos], pos
        height = raw[pos]
        assert height > 0, "a leaf node"
        pos += 1
        files, pos = _read_varint(raw, pos)
        _, pos = _column(raw, pos, files - 1)
        suffixes, pos = _column(raw, pos, files)
        _, pos = _column(raw, pos, files)
        pos += sum(suffixes)
        count, pos = _read_varint(raw, pos)
        _, pos = _column(raw, pos, count - 1)
        key_suffixes, pos = _column(raw, pos, count)
        _, pos = _column(raw, pos, count)
        pos += sum(key_suffixes)
        prefix = raw[body_start:pos]
        ids, pos = _column(raw, pos, count)
        offsets, pos = _column(raw, pos, count)
        lengths, pos = _column(raw, pos, count)
        stats = [_column(raw, pos, count)[0]]
        pos = _column(raw, pos, count)[1]
        for _ in range(2):
            column, pos = _column(raw, pos, count)
            stats.append(column)
        assert pos == len(raw) - 4, "trailing bytes in the node"
        return cls(head, prefix, ids, offsets, lengths, stats)

    def encode(self) -> bytes:
        columns = [self.ids, self.offsets, self.lengths, *self.stats]
        body = self.prefix + b"".join(varint(v) for column in columns for v in column)
        head = bytearray(self.head)
        struct.pack_into("<Q", head, 4, len(head) + len(body) + 4)
        node = bytes(head) + body
        return node + struct.pack("<I", crc32c(node))


def parse_location(location: str) -> tuple[str, int, int]:
    """``"btreenode::d/abc:10:20"`` -> ``("d/abc", 10, 20)`` (no base path: one database)."""
    head, offset, length = location.rsplit(":", 2)
    return head.split(":", 2)[2], int(offset), int(length)


def point_child_at(root: Path, node: str, child: int, target: str) -> None:
    """Make child ``child`` of the interior node at location ``node`` (of the database at ``root``)
    the node at location ``target``, in place: same length, valid checksum."""
    file, offset, length = parse_location(node)
    target_file, target_offset, target_length = parse_location(target)
    assert target_file == file, "a child in another data file needs another file table entry"
    path = root / file
    data = bytearray(path.read_bytes())
    decoded = InteriorNode.decode(bytes(data[offset:offset + length]))
    widths = len(varint(decoded.offsets[child])) + len(varint(decoded.lengths[child]))
    decoded.offsets[child], decoded.lengths[child] = target_offset, target_length
    grown = len(varint(target_offset)) + len(varint(target_length)) - widths
    width = len(varint(decoded.stats[2][child])) - grown  # what the statistic's varint must take
    assert 1 <= width <= 9, "no statistic absorbs the difference"
    decoded.stats[2][child] = 0 if width == 1 else 2 ** (7 * (width - 1))
    encoded = decoded.encode()
    assert len(encoded) == length, (len(encoded), length)
    data[offset:offset + length] = encoded
    path.write_bytes(bytes(data))


# -- a database of many small nodes, and its graph -------------------------------------------------


def deep_database(source: Path, item: Path) -> Path:
    """``item``: a copy of the Orbax OCDBT item ``source`` whose database is written again by
    tensorstore, uncompressed and in nodes of at most 256 bytes -- the same keys and values
    under an index several levels high."""
    import shutil

    import tensorstore as ts

    from support.fixtures import writable_copy

    writable_copy(source, item)
    old = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{item}/"}).result()
    values = {key: old.read(key).result().value for key in old.list().result()}
    for name in ("manifest.ocdbt", "d", "ocdbt.process_0"):
        shutil.rmtree(item / name) if (item / name).is_dir() else (item / name).unlink()
    new = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{item}/",
                           "config": {"compression": None, "max_decoded_node_bytes": 256}}).result()
    transaction = ts.Transaction()
    for key, value in values.items():
        new.with_transaction(transaction)[key] = value
    transaction.commit_async().result()
    return item


def root_location(item: Path) -> str:
    """The location of the latest version's root node."""
    import tensorstore as ts

    manifest = ts.ocdbt.dump(ts.KvStore.open(f"file://{item}/").result()).result()
    return max(manifest["versions"], key=lambda v: v["generation_number"])["root"]["location"]


def children(item: Path, node: str) -> list[str]:
    """The locations an interior node points at (none for a leaf)."""
    import tensorstore as ts

    dumped = ts.ocdbt.dump(ts.KvStore.open(f"file://{item}/").result(), node).result()
    return [entry["location"] for entry in dumped["entries"]] if dumped["height"] else []


def interior_nodes(item: Path) -> list[tuple[str, list[str]]]:
    """Every interior node of the (intact) index with its children, root first."""
    found, pending = [], [root_location(item)]
    while pending:
        node = pending.pop(0)
        below = children(item, node)
        if below:
            found.append((node, below))
            pending += below
    return found
