"""safetensors files built from a valid layout plus structural mutations, and the verdict of the
``safetensors`` library itself on each, to hold ckptshim's header parser to.

A file is drawn as tensors (names, dtypes, shapes) laid out one after another as safetensors
writes them, rendered to JSON text piece by piece so that a mutation can say anything JSON (or
almost-JSON) can: a number written ``2.0``, ``2e0``, ``"2"``, ``-0`` or ``2**64``; offsets that
overlap, leave a gap or run backwards; a field twice or missing; an unknown field nested 124 to
200 deep, holding ``NaN``, ``1e400`` or a lone surrogate; a tensor as an array, ``null``, a name
twice; ``__metadata__`` as ``null``, numbers, a list, twice; bytes after the data or missing
from it; a header length off by one; a byte-order mark; a byte that is not UTF-8.

:func:`compare` opens the file with ``safetensors.safe_open`` and with ckptshim: the verdicts
must agree (ckptshim may only add "I do not read this dtype" where the library accepts), and
where both accept, every tensor must hold the same bytes.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import strategies as st

from ckptshim.errors import ShimError, UnknownFormatError
from ckptshim.formats import safetensors as ckptshim_safetensors
from ckptshim.formats.safetensors_header import DTYPES
from ckptshim.inventory import join_key

NAMES = ["w", "a.b", "layers.0.weight", "", "a..b", "é", "w2", "__metadata"]


@dataclass
class Member:
    """One member of the header object: its key and value as JSON text."""

    key: str
    value: str


@dataclass
class Layout:
    """A header's members (in order), and the data after it."""

    members: list[Member]
    data: bytes
    prefix: bytes = b""      # before the JSON text (a byte-order mark, whitespace)
    suffix: bytes = b""      # after it (padding, a NUL)
    length_delta: int = 0    # the header length field, off by this much
    notes: list[str] = field(default_factory=list)

    def render(self) -> bytes:
        text = "{" + ",".join(f"{m.key}:{m.value}" for m in self.members) + "}"
        header = self.prefix + text.encode("utf-8", "surrogatepass") + self.suffix
        return struct.pack("<Q", max(len(header) + self.length_delta, 0)) + header + self.data


def _dims(dtype: str) -> st.SearchStrategy[list[int]]:
    bits = DTYPES[dtype][0]
    dims = st.lists(st.integers(0, 4), max_size=3)
    return dims if bits % 8 == 0 else dims.map(lambda d: d + [2 if bits == 4 else 4])


def _tensor(name: str, dtype: str, shape: list[int], begin: int) -> tuple[Member, int]:
    count = 1
    for size in shape:
        count *= size
    end = begin + count * DTYPES[dtype][0] // 8
    value = json.dumps({"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}, separators=(",", ":"))
    return Member(json.dumps(name), value), end


@st.composite
def valid_layouts(draw) -> Layout:
    names = draw(st.lists(st.sampled_from(NAMES), max_size=4, unique=True))
    readable = [name for name, (_, ours) in DTYPES.items() if ours is not None]
    members, offset = [], 0
    for name in names:
        dtype = draw(st.one_of(st.sampled_from(readable), st.sampled_from(readable), st.sampled_from(list(DTYPES))))
        member, offset = _tensor(name, dtype, draw(_dims(dtype)), offset)
        members.append(member)
    order = draw(st.permutations(range(len(members))))
    data = bytes((i * 37 + 11) % 256 for i in range(offset))
    return Layout([members[i] for i in order], data)


# -- mutations: each takes the layout and draws how to change it ---------------------------------

_NUMBERS = ["2.0", "2e0", '"2"', "-2", "-0", "true", "null", "18446744073709551616", "18446744073709551615",
            "1e400", "9" * 30, "[2]", "{}"]
_UNKNOWN = ["1", "null", '"x"', "NaN", "Infinity", "1e400", "1e-400", "9" * 400, "-0", '"\\ud800"', '"\\udc00"',
            '"\\ud83d\\ude00"', '{"k":1,"k":2}', "[" * 124 + "]" * 124, "[" * 125 + "]" * 125, "[" * 126 + "]" * 126,
            "[" * 200 + "]" * 200, '{"a":' * 125 + "1" + "}" * 125]
_METADATA = ["null", '{"k":"v"}', '{"k":1}', "[]", '{"k":"v","k":"w"}', '{"k":null}', '"v"', '{"\\ud800":"v"}', "{}"]
_DTYPES_TEXT = ['"F32"', '"f32"', '"F33"', '{"F32":null}', '{"F32":1}', '["F32"]', '{"F32":null,"I8":null}', "null",
                '"F\\u0033\\u0032"', '"BF16"', '"U8"', '"F4"']


def _tensor_fields(member: Member) -> dict | None:
    """The fields of a tensor a mutation may change further (``None`` once it is no such object)."""
    try:
        value = json.loads(member.value)
    except ValueError:
        return None
    if not (isinstance(value, dict) and isinstance(value.get("shape"), list)
            and isinstance(value.get("data_offsets"), list) and len(value["data_offsets"]) == 2
            and "dtype" in value):
        return None
    return value


def _fields_text(fields: list[tuple[str, str]]) -> str:
    return "{" + ",".join(f"{json.dumps(k)}:{v}" for k, v in fields) + "}"


@st.composite
def _mutate(draw, layout: Layout) -> Layout:
    kind = draw(st.sampled_from([
        "number", "offsets", "dtype", "drop-field", "twice-field", "unknown-field", "as-array", "not-an-object",
        "name-twice", "metadata", "metadata-twice", "trailing-data", "missing-data", "length", "padding", "bom",
        "nul", "not-utf8", "name",
    ]))
    members = layout.members
    tensors = [i for i, m in enumerate(members) if _tensor_fields(m) is not None]
    layout.notes.append(kind)
    if kind in ("number", "offsets", "dtype", "drop-field", "twice-field", "unknown-field", "as-array",
                "not-an-object", "name-twice") and not tensors:
        kind = "metadata"
    if kind in ("number", "offsets", "dtype", "drop-field", "twice-field", "unknown-field", "as-array"):
        index = draw(st.sampled_from(tensors))
        fields = _tensor_fields(members[index])
        texts = [(name, json.dumps(value, separators=(",", ":"))) for name, value in fields.items()]
        if kind == "number":
            which = draw(st.sampled_from(["shape", "data_offsets"]))
            values = fields[which]
            if values:
                at = draw(st.integers(0, len(values) - 1))
                parts = [json.dumps(v) for v in values]
                parts[at] = draw(st.sampled_from(_NUMBERS))
                texts = [(n, "[" + ",".join(parts) + "]" if n == which else t) for n, t in texts]
        elif kind == "offsets":
            begin, end = fields["data_offsets"]
            change = draw(st.sampled_from(["begin", "end", "swap", "three", "one", "same-as-another"]))
            new = {"begin": [begin + draw(st.sampled_from([-4, -1, 1, 4])), end],
                   "end": [begin, end + draw(st.sampled_from([-4, -1, 1, 4]))], "swap": [end, begin],
                   "three": [begin, end, end], "one": [begin]}.get(change)
            if change == "same-as-another":
                other = _tensor_fields(members[draw(st.sampled_from(tensors))])
                new = other["data_offsets"]
            texts = [(n, json.dumps(new) if n == "data_offsets" else t) for n, t in texts]
        elif kind == "dtype":
            texts = [(n, draw(st.sampled_from(_DTYPES_TEXT)) if n == "dtype" else t) for n, t in texts]
        elif kind == "drop-field":
            texts.pop(draw(st.integers(0, len(texts) - 1)))
        elif kind == "twice-field":
            name, text = texts[draw(st.integers(0, len(texts) - 1))]
            texts.insert(draw(st.integers(0, len(texts))), (name, text if draw(st.booleans()) else "[0,0]"))
        elif kind == "unknown-field":
            texts.insert(draw(st.integers(0, len(texts))), (draw(st.sampled_from(["x", "__metadata__", "shape2"])),
                                                             draw(st.sampled_from(_UNKNOWN))))
        if kind == "as-array":
            parts = [t for _, t in texts][:draw(st.sampled_from([3, 3, 2]))]
            if draw(st.booleans()):
                parts.append("0")
            members[index] = Member(members[index].key, "[" + ",".join(parts) + "]")
        else:
            members[index] = Member(members[index].key, _fields_text(texts))
    elif kind == "not-an-object":
        members[draw(st.sampled_from(tensors))].value = draw(st.sampled_from(["null", "1", '"F32"', "[]", "{}"]))
    elif kind == "name-twice":
        member = members[draw(st.sampled_from(tensors))]
        value = member.value if draw(st.booleans()) else members[draw(st.sampled_from(tensors))].value
        members.insert(draw(st.integers(0, len(members))), Member(member.key, value))
    elif kind in ("metadata", "metadata-twice"):
        for _ in range(2 if kind == "metadata-twice" else 1):
            members.insert(draw(st.integers(0, len(members))), Member('"__metadata__"', draw(st.sampled_from(_METADATA))))
    elif kind == "trailing-data":
        layout.data += bytes(draw(st.integers(1, 8)))
    elif kind == "missing-data":
        layout.data = layout.data[:-draw(st.integers(1, 4))] if layout.data else layout.data
    elif kind == "length":
        layout.length_delta = draw(st.sampled_from([-1, 1, 8]))
    elif kind == "padding":
        layout.suffix += draw(st.sampled_from([b" ", b"        ", b"\n\t\r ", b"  \x0b"]))
        layout.prefix = draw(st.sampled_from([b"", b" "]))
    elif kind == "bom":
        layout.prefix = b"\xef\xbb\xbf"
    elif kind == "nul":
        layout.suffix += b"\x00"
    elif kind == "not-utf8":  # a byte no UTF-8 has, or a lead byte without its continuation
        if draw(st.booleans()):
            layout.suffix += b" \xff"
        else:
            layout.prefix = b"\xc3"
    elif kind == "name":
        if members:
            at = draw(st.integers(0, len(members) - 1))
            members[at] = Member(draw(st.sampled_from(['"\\ud800"', '"a\\u0000b"', '"\\u00e9"', '"a\x01"', '""'])),
                                 members[at].value)
    return layout


@st.composite
def files(draw) -> bytes:
    """A safetensors file: a valid layout, then up to three structural mutations."""
    layout = draw(valid_layouts())
    for _ in range(draw(st.integers(0, 3))):
        layout = draw(_mutate(layout))
    return layout.render()


# -- the verdicts --------------------------------------------------------------------------------


def library_verdict(path: Path) -> dict[str, bytes] | None:
    """What ``safetensors.safe_open`` makes of the file: each tensor's bytes (``None`` as the
    value of a tensor whose dtype torch does not compute with), or ``None`` when it refuses it."""
    import torch
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as opened:
            found = {}
            for name in opened.keys():
                try:
                    tensor = opened.get_tensor(name)
                    found[name] = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                except Exception:  # a dtype torch has no type (F6_*) or no bytes view for (F4)
                    found[name] = None
            return found
    except Exception:
        return None


def compare(path: Path, data: bytes) -> str:
    """Write ``data`` to ``path`` and hold ckptshim's verdict to the library's; returns the verdict
    (``"accepted"``, ``"refused"``, ``"unread dtype"``) for statistics."""
    path.write_bytes(data)
    expected = library_verdict(path)
    try:
        checkpoint = ckptshim_safetensors.open_checkpoint(path)
    except UnknownFormatError as error:  # a refusal too; where the library reads the file, only
        if expected is None:            # for what ckptshim does not read (a dtype, a shape)
            return "refused"
        assert "ckptshim does not read yet" in str(error), \
            f"ckptshim refused what safetensors reads ({error}) for {data[:300]!r}"
        return "unread dtype"
    except ShimError as error:
        assert expected is None, f"ckptshim refused ({error}) a file safetensors reads: {data[:300]!r}"
        return "refused"
    try:
        complete = checkpoint.complete
        if expected is None:
            assert not complete, f"ckptshim accepts a file safetensors refuses: {data[:300]!r}"
            return "refused"
        assert complete, f"ckptshim finds incomplete ({checkpoint.all_problems()}) what safetensors reads"
        names = {join_key(entry.key): entry for entry in checkpoint.inventory.values()}
        assert names.keys() == expected.keys(), (sorted(names), sorted(expected))
        for name, entry in names.items():
            if expected[name] is not None:
                assert checkpoint.read(entry).tobytes() == expected[name], name
        return "accepted"
    finally:
        checkpoint.close()
