"""ckptshim's safetensors header parser refuses exactly what the ``safetensors`` library refuses.

Before, it accepted overlapping ``data_offsets``, numbers written as strings, fractional
numbers (``4.9`` read as ``4``), bytes no tensor owns and a ``__metadata__`` that was no map of
strings -- each a file the library refuses, which ckptshim read into values no loader gives.
The rules are the library's (``safetensors/src/tensor.rs`` and the ``serde_json`` reading it
runs; see ``ckptshim/formats/safetensors_header.py``). Every case here is judged by the installed
``safetensors`` itself, at test time: the expected verdict is never written down by hand.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

pytest.importorskip("safetensors")
pytest.importorskip("torch")

from ckptshim.errors import CorruptCheckpointError  # noqa: E402
from ckptshim.formats import detect  # noqa: E402
from support.safetensors_headers import compare, files, library_verdict  # noqa: E402

F32x2 = '{"dtype":"F32","shape":[2],"data_offsets":[0,8]}'


def _file(header: str | bytes, data: bytes = bytes(range(8))) -> bytes:
    raw = header.encode() if isinstance(header, str) else header
    return struct.pack("<Q", len(raw)) + raw + data


CASES = {
    # the issue's cases: each was read into values before
    "overlapping-offsets": _file('{"a":' + F32x2 + ',"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}'),
    "number-as-string": _file('{"a":{"dtype":"F32","shape":["2"],"data_offsets":[0,8]}}'),
    "fractional-number": _file('{"a":{"dtype":"F32","shape":[1.9],"data_offsets":[0,4]}}', bytes(4)),
    "bytes-no-tensor-owns": _file('{"a":' + F32x2 + "}", bytes(12)),
    "gap-before-a-tensor": _file('{"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}'),
    "metadata-not-strings": _file('{"__metadata__":{"k":1},"a":' + F32x2 + "}"),
    "metadata-a-list": _file('{"__metadata__":[],"a":' + F32x2 + "}"),
    # the library's other rules
    "dtype-lowercase": _file('{"a":{"dtype":"f32","shape":[2],"data_offsets":[0,8]}}'),
    "dtype-as-serde-enum": _file('{"a":{"dtype":{"F32":null},"shape":[2],"data_offsets":[0,8]}}'),
    "tensor-as-array": _file('{"a":["F32",[2],[0,8]]}'),
    "tensor-as-array-of-4": _file('{"a":["F32",[2],[0,8],0]}'),
    "name-twice-last-fits": _file('{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":' + F32x2 + "}"),
    "name-twice-last-short": _file('{"a":' + F32x2 + ',"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'),
    "field-twice": _file('{"a":{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]}}'),
    "unknown-field": _file('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":[{"y":null}]}}'),
    "unknown-field-nan": _file('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":NaN}}'),
    "unknown-field-depth-127": _file('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":'
                                     + "[" * 125 + "]" * 125 + "}}"),
    "unknown-field-depth-128": _file('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":'
                                     + "[" * 126 + "]" * 126 + "}}"),
    "unknown-field-integer-1e308": _file('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1'
                                         + "0" * 308 + "}}"),
    "unknown-field-integer-1e309": _file('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1'
                                         + "0" * 309 + "}}"),
    "unknown-field-minus-zero": _file('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":-0}}'),
    "lone-surrogate-name": _file('{"\\ud800":' + F32x2 + "}"),
    "minus-zero": _file('{"a":{"dtype":"F32","shape":[2],"data_offsets":[-0,8]}}'),
    "size-2**64": _file('{"a":{"dtype":"F32","shape":[18446744073709551616,0],"data_offsets":[0,0]}}', b""),
    "shape-overflows-on-the-way": _file('{"a":{"dtype":"F32","shape":[4294967296,4294967296,0],"data_offsets":[0,0]}}', b""),
    "shape-zero-first": _file('{"a":{"dtype":"F32","shape":[0,4294967296,4294967296],"data_offsets":[0,0]}}', b""),
    "sub-byte-not-whole": _file('{"a":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}}', bytes(2)),
    "byte-order-mark": _file(b'\xef\xbb\xbf{"a":' + F32x2.encode() + b"}"),
    "padded-with-spaces": _file('{"a":' + F32x2 + "}    "),
    "nul-after-the-header": _file(b'{"a":' + F32x2.encode() + b"}\x00"),
    "two-empty-tensors-at-0": _file('{"a":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},'
                                    '"b":{"dtype":"I8","shape":[2,0],"data_offsets":[0,0]}}', b""),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_rule_is_the_librarys(tmp_path, name):
    compare(tmp_path / "model.safetensors", CASES[name])


@pytest.mark.parametrize("name", ["overlapping-offsets", "number-as-string", "fractional-number",
                                  "bytes-no-tensor-owns", "metadata-not-strings"])
def test_the_issues_files_are_refused_naming_the_file(tmp_path, name):
    """Each file of the issue: safetensors refuses it; so does ckptshim, naming it."""
    path = tmp_path / "model.safetensors"
    path.write_bytes(CASES[name])
    assert library_verdict(path) is None
    with pytest.raises(CorruptCheckpointError) as info:
        detect.open_checkpoint(path)
    assert str(path) in str(info.value)


def test_header_of_more_than_100_million_bytes_is_refused(tmp_path):
    """The library's limit is 100,000,000 bytes (not 100 MiB); both sides of it."""
    for length, accepted in ((100_000_000, True), (100_000_001, False)):
        path = tmp_path / "model.safetensors"
        path.write_bytes(struct.pack("<Q", length) + b"{}" + b" " * (length - 2))
        assert (library_verdict(path) is not None) is accepted
        assert compare(path, path.read_bytes()) == ("accepted" if accepted else "refused")
        path.unlink()


@settings(max_examples=400, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(files())
def test_random_header_mutations_get_the_librarys_verdict(tmp_path_factory, data):
    """Valid layouts with up to three structural mutations each: ckptshim's verdict is the
    library's, and where both accept, every tensor holds the same bytes."""
    compare(tmp_path_factory.mktemp("st") / "model.safetensors", data)


def test_what_ckptshim_writes_the_library_reads(tmp_path):
    """``convert`` writes safetensors headers too, from the same dtype table: the library reads
    what it wrote (every dtype both read, in one file), to the same bytes."""
    import numpy as np
    from safetensors.numpy import save_file

    from ckptshim.api import convert

    source = tmp_path / "source.safetensors"
    save_file({"f32": np.arange(4, dtype=np.float32), "i16": np.ones((2, 3), np.int16),
               "c64": np.full(2, 1 + 2j, np.complex64), "b": np.array([True, False]),
               "u64": np.arange(3, dtype=np.uint64), "empty": np.zeros((0, 5), np.float64)}, source)
    out = Path(convert(source, tmp_path / "out.safetensors", "safetensors"))
    assert compare(out, out.read_bytes()) == "accepted"
