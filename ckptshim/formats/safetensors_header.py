"""A safetensors header, validated exactly as the ``safetensors`` library validates it.

ckptshim reads safetensors files without the library, so its parser must refuse whatever the
library refuses: a more lenient one reads a file the format says is broken into values no
loader would produce (overlapping tensors, ``4.9`` read as ``4``, bytes no tensor owns). The
rules are those of ``safetensors/src/tensor.rs`` (``SafeTensors::read_metadata``,
``Metadata::validate``, safetensors 0.8) and of the ``serde_json`` deserialisation it runs:

- the file: an 8-byte little-endian header length ``n`` of at most ``100_000_000``, ``8 + n``
  bytes present; the header UTF-8 JSON (no byte-order mark) of nesting depth at most 127,
  numbers that fit ``u64``/``i64``/``f64`` (no ``NaN``, no ``Infinity``, no ``1e400``), strings
  without unpaired surrogate escapes, nothing but whitespace after the value;
- the header a JSON object. ``__metadata__`` at most once: ``null`` or an object of strings;
  any other member a tensor (a name given twice: each value is checked, the last one counts),
  either an object with the fields ``dtype``, ``shape`` and ``data_offsets`` (each once; other
  fields ignored) or an array of exactly those three;
- ``dtype`` one of the library's names (``"F32"``, ``"BF16"``, ...), as a string or a map of
  that name to ``null`` (serde's spelling of an enum); ``shape`` an array of integers in
  ``0..2**64``; ``data_offsets`` an array of exactly two (``-0``, ``2.0`` and ``"2"`` are not);
- sorted by their offsets, the tensors tile the data exactly: each begins where the previous
  one ended (the first at 0), its length is its elements times its dtype's bits over 8 (a
  whole number of bytes; the element count, multiplied axis by axis, and the bit count each
  within ``u64``), and the last one ends where the file does.

One departure, in how it is reported rather than in what is accepted: a file shorter than its
header says is read as incomplete (``inspect`` says which bytes are missing, a load refuses it),
where the library says only that the file is not covered.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from ckptshim.errors import brief, describe
from ckptshim.formats.base import require_json_budget

#: safetensors' ``MAX_HEADER_SIZE``: the most bytes a header may take.
MAX_HEADER = 100_000_000
#: serde_json's recursion limit: containers nested deeper than this are refused.
MAX_DEPTH = 127
_U64 = 2**64 - 1

#: safetensors' dtype names: bits per element, and ckptshim's name for the dtype (``None``:
#: arrays ckptshim does not read yet).
DTYPES: dict[str, tuple[int, str | None]] = {
    "BOOL": (8, "bool"), "F4": (4, None), "F6_E2M3": (6, None), "F6_E3M2": (6, None),
    "U8": (8, "uint8"), "I8": (8, "int8"), "F8_E5M2": (8, "float8_e5m2"), "F8_E4M3": (8, "float8_e4m3fn"),
    "F8_E8M0": (8, None), "F8_E4M3FNUZ": (8, "float8_e4m3fnuz"), "F8_E5M2FNUZ": (8, "float8_e5m2fnuz"),
    "I16": (16, "int16"), "U16": (16, "uint16"), "F16": (16, "float16"), "BF16": (16, "bfloat16"),
    "I32": (32, "int32"), "U32": (32, "uint32"), "F32": (32, "float32"), "C64": (64, "complex64"),
    "F64": (64, "float64"), "I64": (64, "int64"), "U64": (64, "uint64"),
}
_FIELDS = ("dtype", "shape", "data_offsets")
_FIELD_SET = frozenset(_FIELDS)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


class HeaderError(ValueError):
    """What makes a header one the safetensors library refuses."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as the header declares it: its safetensors dtype, shape and byte range in the
    data (which starts after the header)."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class Header:
    """A validated header: the tensors by name, the ``__metadata__`` strings (``None`` when
    absent or ``null``), and where the data ends (relative to its start)."""

    tensors: dict[str, TensorInfo]
    metadata: dict[str, str] | None
    data_length: int


def parse(raw: bytes, data_bytes: int = 0) -> Header:
    """The header ``raw`` (its ``n`` bytes, after the length), or :class:`HeaderError` naming
    the rule it breaks. ``data_bytes`` (what follows the header in the file) is the credit of
    the JSON budget (see :func:`~ckptshim.formats.base.require_json_budget`)."""
    require_json_budget(raw, data_bytes)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise HeaderError(f"not UTF-8 ({error.reason} at byte {error.start})") from None
    # ``-0`` is a float to serde_json (so no size); only a header that holds one pays for reading
    # every integer through Python (one beyond 64 bits is refused where it is read: _sizes, _ignored)
    integers = _integer if b"-0" in raw else None
    try:
        root = json.loads(text, object_pairs_hook=_object, parse_int=integers, parse_float=_float,
                          parse_constant=_constant)
    except RecursionError:
        raise HeaderError(f"nested deeper than {MAX_DEPTH} levels") from None
    except HeaderError:
        raise
    except json.JSONDecodeError as error:
        raise HeaderError(f"not JSON ({error.msg} at character {error.pos})") from None
    except ValueError as error:  # an integer of more digits than Python converts
        raise HeaderError(f"not JSON safetensors reads ({describe(error, 100)})") from None
    paired = _SURROGATE_ESCAPE.search(raw) is None  # else: each string checked where it is read
    if type(root) not in _OBJECTS:
        raise HeaderError(f"a JSON {_kind(root)}, not an object")
    metadata, seen_metadata, tensors = None, False, {}
    for name, value in _members(root):
        _text(name, paired)
        if name == "__metadata__":
            if seen_metadata:
                raise HeaderError("__metadata__ given twice")
            seen_metadata, metadata = True, _metadata(value, paired)
        else:  # as serde reads a map into a HashMap: every value checked, the last one kept
            tensors[name] = _tensor(name, value, paired)
    return Header(tensors, metadata, _tiled(tensors))


class _Object(list):
    """A JSON object naming a key twice, as its (key, value) pairs in order (serde reads each
    occurrence); an object without duplicates is a plain ``dict``."""


_OBJECTS = (dict, _Object)


def _object(pairs: list[tuple[str, object]]) -> dict | _Object:
    found = dict(pairs)  # built in C; only an object naming a key twice comes out shorter
    return found if len(found) == len(pairs) else _Object(pairs)


def _members(value: dict | _Object):
    return value.items() if type(value) is dict else value


def _integer(text: str) -> int | float:
    """A JSON integer as serde_json reads it: ``u64``, else ``i64``, else an ``f64`` (``-0``
    too) -- an ``f64`` is no size -- and one beyond ``f64`` is refused."""
    value = int(text)
    if text == "-0" or value > _U64 or value < -2**63:
        return _float(text)
    return value


def _float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise HeaderError(f"the number {text[:40]} is out of range")
    return value


def _constant(text: str) -> float:
    raise HeaderError(f"{text} is not JSON")


def _text(value: str, paired: bool) -> str:
    """A string as serde_json reads one: no unpaired surrogate (``"\\ud800"``)."""
    if not paired and not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise HeaderError("a string holding an unpaired surrogate escape") from None
    return value


def _kind(value: object) -> str:
    return {dict: "object", _Object: "object", list: "array", str: "string", bool: "boolean", int: "integer",
            float: "number", type(None): "null"}.get(type(value), type(value).__name__)


def _metadata(value: object, paired: bool) -> dict[str, str] | None:
    if value is None:
        return None
    if type(value) not in _OBJECTS:
        raise HeaderError(f"__metadata__ is a JSON {_kind(value)}, not an object of strings")
    out = {}
    for key, text in _members(value):
        if type(text) is not str:
            raise HeaderError(f"__metadata__[{brief(key, 60)}] is a JSON {_kind(text)}, not a string")
        out[_text(key, paired)] = _text(text, paired)
    return out


def _tensor(name: str, value: object, paired: bool) -> TensorInfo:
    if type(value) is dict and value.keys() == _FIELD_SET:
        fields = value  # what nearly every header holds: the three fields, once each
    elif type(value) is list:
        if len(value) != 3:
            raise HeaderError(f"{brief(name)} is an array of {len(value)} values, not (dtype, shape, data_offsets)")
        fields = dict(zip(_FIELDS, value))
    elif type(value) in _OBJECTS:
        fields = {}
        for field, item in _members(value):
            _text(field, paired)
            if field in _FIELDS:
                if field in fields:
                    raise HeaderError(f"{brief(name)} gives {field} twice")
                fields[field] = item
            else:  # ignored, but still JSON serde_json reads: nesting, strings
                _ignored(item, paired)
        missing = [field for field in _FIELDS if field not in fields]
        if missing:
            raise HeaderError(f"{brief(name)} has no {', '.join(missing)}")
    else:
        raise HeaderError(f"{brief(name)} is a JSON {_kind(value)}, not a tensor's description")
    shape = _sizes(name, "shape", fields["shape"])
    offsets = _sizes(name, "data_offsets", fields["data_offsets"])
    if len(offsets) != 2:
        raise HeaderError(f"{brief(name)}: data_offsets holds {len(offsets)} numbers, not 2")
    return TensorInfo(_dtype(name, fields["dtype"], paired), shape, offsets[0], offsets[1])


def _dtype(name: str, value: object, paired: bool) -> str:
    if type(value) is dict and len(value) == 1 and None in value.values():  # {"F32": null}
        (value,) = value
    if type(value) is not str or value not in DTYPES:
        raise HeaderError(f"{brief(name)}: dtype {brief(value, 40)} is not one of safetensors' "
                          f"({', '.join(DTYPES)})")
    return _text(value, paired)


def _sizes(name: str, field: str, value: object) -> tuple[int, ...]:
    """An array of integers in ``0..2**64`` (a JSON ``true`` is none; nor is ``2.0``)."""
    if type(value) is not list:
        raise HeaderError(f"{brief(name)}: {field} is a JSON {_kind(value)}, not an array of sizes")
    for item in value:
        if type(item) is not int or not 0 <= item <= _U64:
            raise HeaderError(f"{brief(name)}: {field} holds {brief(item, 40)}, not an integer in 0..2**64-1")
    return tuple(value)


def _ignored(value: object, paired: bool) -> None:
    """A value serde_json parses and ignores (an unknown field): at most :data:`MAX_DEPTH`
    deep counting the header object and the tensor's (so 125 levels here), its strings valid."""
    pending = [(value, 3)]
    while pending:
        item, depth = pending.pop()
        if type(item) is str:
            _text(item, paired)
        elif type(item) is int and not -2**63 <= item <= _U64:  # an f64 to serde_json
            try:
                float(item)
            except OverflowError:
                raise HeaderError(f"an integer of {item.bit_length()} bits is out of range") from None
        elif type(item) is list or type(item) in _OBJECTS:
            if depth > MAX_DEPTH:
                raise HeaderError(f"nested deeper than {MAX_DEPTH} levels")
            for part in (item if type(item) is list else _members(item)):
                if type(item) is not list:
                    _text(part[0], paired)
                    part = part[1]
                pending.append((part, depth + 1))


def _tiled(tensors: dict[str, TensorInfo]) -> int:
    """Where the data ends, once the tensors, in order of their offsets, tile it exactly.

    Headers list their tensors in that order as a rule: they are checked in the order given, and
    sorted (as the library sorts them) only when that order is not already one of the offsets.
    """
    try:
        return _chain(tensors.items())
    except _OutOfOrder:
        return _chain(sorted(tensors.items(), key=lambda item: (item[1].begin, item[1].end)), last=True)


class _OutOfOrder(HeaderError):
    """A tensor that does not begin where the one before it ends."""


def _chain(ordered, last: bool = False) -> int:
    end = 0
    for name, info in ordered:
        if info.begin != end or info.end < info.begin:
            raise (HeaderError if last else _OutOfOrder)(
                f"{brief(name)} holds bytes {info.begin}..{info.end} of the data, where the tensor "
                f"before it ends at {end}: tensors overlap, leave bytes no tensor owns, or end before "
                "they begin")
        elements = 1
        for size in info.shape:  # as safetensors multiplies: overflowing on the way is refused
            elements *= size
            if elements > _U64:
                raise HeaderError(f"{brief(name)}: shape {brief(info.shape, 60)} overflows 64 bits")
        bits = elements * DTYPES[info.dtype][0]
        if bits > _U64:
            raise HeaderError(f"{brief(name)}: shape {brief(info.shape, 60)} of {info.dtype} overflows 64 bits")
        if bits % 8:
            raise HeaderError(f"{brief(name)}: {elements} x {info.dtype} is not a whole number of bytes")
        if info.end - info.begin != bits // 8:
            raise HeaderError(f"{brief(name)} is declared {info.dtype}{list(info.shape)[:8]} ({bits // 8} bytes) "
                              f"but its data_offsets span {info.end - info.begin}")
        end = info.end
    return end
