"""Damage to a copy of a checkpoint, one function per kind, generated from the real files.

Each function takes the copy's root, the format's row of the table (which file holds the
metadata, which one data) and a folder outside the copy, damages the copy in place, and returns
the name the refusal must mention (the damaged file, or what the damaged metadata points at).
Nothing here writes a checkpoint from scratch: every damaged file starts as the real library's
output and is changed the way a bad copy, a bad disk or a hostile author would change it.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack

Damage = Callable[[Path, Any, Path], str]

#: A path that must never come into existence: the forbidden global below would create it.
PWNED = "pwned-by-checkpoint"


def _data(root: Path, fmt) -> Path:
    return root / fmt.data


def _meta(root: Path, fmt) -> Path:
    return root / fmt.metadata


# -- files gone, cut short, overwritten ------------------------------------------------------


def delete(root: Path, fmt, outside: Path) -> str:
    path = _data(root, fmt)
    path.unlink()
    return fmt.names_missing or path.name


def _truncate(fraction: float | None, keep: int = 0) -> Damage:
    def damage(root: Path, fmt, outside: Path) -> str:
        path = _data(root, fmt)
        size = path.stat().st_size
        cut = keep if fraction is None else int(size * fraction)
        os.truncate(path, min(cut, size - 1))
        return path.name
    return damage


def _overwrite(fill: Callable[[int], bytes]) -> Damage:
    """Overwrite 4 KiB of the data file where a record starts (``fmt.record_offset``): a
    compressed chunk's frame header, a zip member's local header. (The middle of raw tensor
    bytes would be a change no reader can notice.)"""
    def damage(root: Path, fmt, outside: Path) -> str:
        path = _data(root, fmt)
        data = bytearray(path.read_bytes())
        start = fmt.record_offset(path)
        end = min(len(data), start + 4096)
        data[start:end] = fill(end - start)
        path.write_bytes(bytes(data))
        return fmt.data_name(path)
    return damage


def _garbage(n: int) -> bytes:
    """Bytes no compressor or archive format accepts as a header (deterministic)."""
    return bytes((i * 151 + 7) % 251 for i in range(n))


def flip_metadata(root: Path, fmt, outside: Path) -> str:
    """Flip every bit of the metadata's first structural byte (``{``, msgpack's map header,
    pickle's PROTO, the zip entry of ``data.pkl``)."""
    path = _meta(root, fmt)
    data = bytearray(path.read_bytes())
    offset = fmt.flip_offset(path)
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))
    return path.name


def empty_directory(root: Path, fmt, outside: Path) -> str:
    target = root / fmt.load if fmt.load else root
    for child in target.iterdir():
        shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
    return target.name


# -- metadata that says something wrong -------------------------------------------------------


def _retype(what: str) -> Damage:
    """The metadata gives the first array another dtype (of another item size) or shape."""
    def damage(root: Path, fmt, outside: Path) -> str:
        return fmt.retype(root, what)
    return damage


def duplicate_key(root: Path, fmt, outside: Path) -> str:
    """The metadata lists one key twice (JSON and msgpack allow it; parsers keep the last)."""
    return fmt.duplicate(root)


def escape(kind: str) -> Damage:
    """The metadata points at something outside the checkpoint: ``../``, an absolute path, or a
    symlink inside the checkpoint whose target lies outside. The outside copy exists and is
    valid, so only the path check can refuse it."""
    def damage(root: Path, fmt, outside: Path) -> str:
        inside = root / fmt.escape_target
        escaped = outside / inside.name
        shutil.copytree(inside, escaped) if inside.is_dir() else shutil.copy(inside, escaped)
        if kind == "symlink":
            shutil.rmtree(inside) if inside.is_dir() else inside.unlink()
            inside.symlink_to(escaped, target_is_directory=escaped.is_dir())
            return inside.name
        reference = os.path.relpath(escaped, inside.parent) if kind == "dotdot" else str(escaped)
        return fmt.point_at(root, reference)
    return damage


class _Mkdir:
    """Pickles as ``os.mkdir(path)``: a global no checkpoint reader may call."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


def forbidden_global(root: Path, fmt, outside: Path) -> str:
    """A ``torch.save`` archive (or DCP ``.metadata``) whose pickle calls ``os.mkdir``."""
    return fmt.plant_global(root, _Mkdir(str(outside / PWNED)))


def msgpack_bomb(kind: str) -> Damage:
    """A msgpack file whose headers declare sizes no file holds: a map of 2**32 - 1 entries, a
    binary of 4 GiB, or an array record of 2**40 x 2**40 elements."""
    def damage(root: Path, fmt, outside: Path) -> str:
        path = root / fmt.msgpack_file
        if kind == "count":
            data = b"\x81\xa6target\xdf\xff\xff\xff\xff" + b"\xa1a\x00" * 8
        elif kind == "bytes":
            data = b"\x81\xa6target\xc6\xff\xff\xff\xf0" + b"\x00" * 16
        else:
            record = msgpack.packb([[2**40, 2**40], "float32", b"\x00" * 16])
            data = msgpack.packb({"target": {"w": msgpack.ExtType(1, record)}})
        path.write_bytes(data)
        return path.name
    return damage


# -- helpers the table uses to edit specific formats -----------------------------------------


def zip_member_offset(path: Path, suffix: str) -> int:
    """Where the data of the zip member ending in ``suffix`` starts (its first byte)."""
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith(suffix))
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        header = f.read(30)
    name_length, extra_length = struct.unpack("<HH", header[26:30])
    return info.header_offset + 30 + name_length + extra_length


def middle_member_header(path: Path) -> int:
    """Where the local header of the zip archive's middle member starts."""
    with zipfile.ZipFile(path) as archive:
        members = archive.infolist()
    return members[len(members) // 2].header_offset


def rewrite_msgpack(path: Path, edit: Callable[[Any], None]) -> None:
    tree = msgpack.unpackb(path.read_bytes(), raw=False, strict_map_key=False)
    edit(tree)
    path.write_bytes(msgpack.packb(tree))


def rewrite_safetensors_header(path: Path, edit: Callable[[dict], None] | None = None,
                               text: Callable[[str], str] | None = None) -> None:
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = data[8:8 + length].decode()
    if edit is not None:
        document = json.loads(header)
        edit(document)
        header = json.dumps(document)
    if text is not None:
        header = text(header)
    encoded = header.encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data[8 + length:])


def duplicate_first_json_member(text: str, container: str | None = None) -> str:
    """``{"a": 1, ...}`` -> ``{"a": 1, "a": 1, ...}`` for the first member of the object at
    key ``container`` (or the top level), done on the text since parsers merge duplicates."""
    document = json.loads(text)
    inner = document if container is None else document[container]
    key = next(k for k in inner if k != "__metadata__")
    member = json.dumps({key: inner[key]})[1:-1]
    compact = json.dumps(document)
    if container is None:
        return "{" + member + ", " + compact[1:]
    head = json.dumps(container) + ": {"
    assert compact.count(head) == 1, head
    return compact.replace(head, head + member + ", ", 1)


KINDS: dict[str, Damage] = {
    "delete": delete,
    "truncate_0": _truncate(None, 0),
    "truncate_64": _truncate(None, 64),
    "truncate_half": _truncate(0.5),
    "zero_chunk": _overwrite(bytes),
    "bad_compression": _overwrite(_garbage),
    "flip_metadata": flip_metadata,
    "wrong_dtype": _retype("dtype"),
    "wrong_shape": _retype("shape"),
    "duplicate_key": duplicate_key,
    "escape_dotdot": escape("dotdot"),
    "escape_absolute": escape("absolute"),
    "escape_symlink": escape("symlink"),
    "empty_directory": empty_directory,
    "forbidden_global": forbidden_global,
    "msgpack_bomb_count": msgpack_bomb("count"),
    "msgpack_bomb_bytes": msgpack_bomb("bytes"),
    "msgpack_bomb_shape": msgpack_bomb("shape"),
}
