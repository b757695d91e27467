"""The crashes the fuzz harnesses found, each pinned as its smallest input (or hand-made hostile
file of the same kind): each must now be a ``ShimError`` that names the file, fast and without
a large allocation. Inputs go through the harness's own load path (``Target.load``), which is
what ``ckptshim inspect`` and every load do with a checkpoint.
"""

from __future__ import annotations

import io
import json
import pickle
import struct
import time
import tracemalloc
import zipfile

import msgpack
import numpy as np
import pytest

import harnesses
from ckptshim.errors import CorruptCheckpointError, ShimError
from ckptshim.formats import flax_msgpack, zarr


def target(name: str, tmp_path) -> harnesses.Target:
    return harnesses.Target(harnesses.BY_NAME[name], tmp_path)


def refused(t: harnesses.Target, data: bytes, match: str, kind: type[ShimError] = CorruptCheckpointError):
    """``data`` is refused by ``t``'s parser with ``kind``, naming the fuzzed file (or stand-in)."""
    with pytest.raises(kind, match=match) as info:
        t.load(data)
    assert t.member.name in str(info.value) or t.harness.direct is not None
    return info.value


# -- torch.save zip archives (torch_pickle.py) --------------------------------------------------


def _central_headers(data: bytes) -> list[int]:
    found, at = [], data.find(b"PK\x01\x02")
    while at >= 0:
        found.append(at)
        at = data.find(b"PK\x01\x02", at + 4)
    return found


def test_zip_member_name_not_utf8(tmp_path):
    """Found: a flag bit saying "UTF-8 names" over a name that is not UTF-8 (UnicodeDecodeError)."""
    t = target("torch_pickle", tmp_path)
    data = bytearray(t.seed)
    header = _central_headers(t.seed)[0]
    data[header + 9] |= 0x08  # general purpose flag bit 11 (in the high byte): names are UTF-8
    data[header + 46] = 0xFF
    refused(t, bytes(data), "not a readable torch.save zip archive .*UnicodeDecodeError")


def test_zip_version_from_the_future(tmp_path):
    """Found: a member needing zip version 10.8 to extract (NotImplementedError from zipfile)."""
    t = target("torch_pickle", tmp_path)
    data = bytearray(t.seed)
    for header in _central_headers(t.seed):
        data[header + 6] = 108  # version needed to extract
    refused(t, bytes(data), "not a readable torch.save zip archive .*zip file version")


def _archive(seed: bytes, data_pkl: bytes, compress: int = zipfile.ZIP_STORED, size: int = 0) -> bytes:
    """The seed archive with ``data.pkl`` replaced (and, with ``size``, inflating to that many
    bytes): every other member as torch.save wrote it."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(seed)) as source, zipfile.ZipFile(out, "w") as archive:
        for info in source.infolist():
            if not info.filename.endswith("/data.pkl"):
                archive.writestr(info.filename, source.read(info), zipfile.ZIP_STORED)
                continue
            replaced = zipfile.ZipInfo(info.filename)
            replaced.compress_type = compress
            with archive.open(replaced, "w", force_zip64=True) as member:
                member.write(data_pkl)
                for _ in range(size // 2**20):
                    member.write(bytes(2**20))
    return out.getvalue()


def test_compressed_data_pkl_is_refused_before_inflating(tmp_path):
    """A deflated data.pkl of 64 MiB (a zip bomb: 64 KiB on disk) is refused unread."""
    t = target("torch_pickle", tmp_path)
    with zipfile.ZipFile(io.BytesIO(t.seed)) as source:
        pkl = source.read(next(n for n in source.namelist() if n.endswith("/data.pkl")))
    bomb = _archive(t.seed, pkl, zipfile.ZIP_DEFLATED, size=64 * 2**20)
    assert len(bomb) < 2**20
    tracemalloc.start()
    try:
        refused(t, bomb, "data.pkl is compressed")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20


def _laughs():
    """64 levels of ``[x, x]``: a few hundred bytes of pickle, 2**64 nodes to walk or print."""
    tree: list = []
    for _ in range(64):
        tree = [tree, tree]
    return tree


def _cycle():
    tree = []
    tree.append(tree)
    return tree


@pytest.mark.parametrize("tree, why", [
    pytest.param(_cycle(), "refer to themselves", id="list-holding-itself"),
    pytest.param(_laughs(), "refer to themselves", id="exponential-sharing"),
    pytest.param({1: 0, "1": 1}, "spell the path component", id="keys-spelling-one-path"),
])
def test_object_graphs_a_state_dict_never_has(tmp_path, tree, why):
    """A container holding itself made flatten() loop forever; 64 levels of [x, x] made it walk
    2**64 nodes; {1: a, '1': b} raised a bare ValueError."""
    t = target("torch_pickle", tmp_path)
    start = time.perf_counter()
    refused(t, _archive(t.seed, pickle.dumps(tree, protocol=2)), why)
    assert time.perf_counter() - start < 5


def _rebuild(storage: bytes, offset: bytes, size: bytes, stride: bytes) -> bytes:
    """A protocol-2 pickle of ``{"x": _rebuild_tensor_v2(storage, offset, size, stride, False, {})}``."""
    return (b"\x80\x02}X\x01\x00\x00\x00xctorch._utils\n_rebuild_tensor_v2\n(" + storage + offset
            + size + stride + b"\x89}tRs.")


_STORAGE = b"(X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x02tQ"


@pytest.mark.parametrize("data_pkl, why", [
    pytest.param(_rebuild(b"X\x03\x00\x00\x00abc", b"K\x00", b")", b")"), "a tensor record that is not",
                 id="storage-not-a-storage"),
    pytest.param(_rebuild(_STORAGE, b"J\xff\xff\xff\xff", b")", b")"), "a tensor record that is not",
                 id="negative-offset"),
    pytest.param(_rebuild(_STORAGE, b"K\x00", b"X\x02\x00\x00\x00ab\x85", b"K\x01\x85"),
                 "a tensor record that is not", id="size-a-string"),
    pytest.param(_rebuild(_STORAGE, b"K\x03", b")", b")"), "reaches past its storage",
                 id="scalar-past-its-storage"),
    pytest.param(_rebuild(pickle.dumps(_laughs(), protocol=2)[2:-1], b"K\x00", b")", b")"),
                 r"a tensor record that is not .*\(list, int, tuple, tuple\)", id="storage-too-big-to-print"),
])
def test_tensor_records_torch_never_writes(tmp_path, data_pkl, why):
    """_rebuild_tensor_v2's arguments were taken as given: a string as storage or sizes failed
    later with AttributeError/TypeError; a 0-d tensor past its 2-element storage with a
    ValueError from numpy. The refusal names the arguments' types: their repr could be 2**64 long."""
    t = target("torch_pickle", tmp_path)
    start = time.perf_counter()
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as out:
        out.writestr("archive/data.pkl", data_pkl)
        out.writestr("archive/byteorder", "little")
        out.writestr("archive/data/0", bytes(8))
    refused(t, archive.getvalue(), why)
    assert time.perf_counter() - start < 5


# -- msgpack trees (msgpack_tree.py: Flax, Orbax aggregate, T5X) --------------------------------


def _ext_nest(levels: int) -> bytes:
    value = b"\xc0"
    for _ in range(levels):
        value = b"\xc9" + struct.pack(">I", len(value)) + b"\x01" + value
    return value


@pytest.mark.parametrize("data", [
    pytest.param(b"\x81\xa1a" * 2000 + b"\xc0", id="maps"),
    pytest.param(b"\x81\xa1a" + b"\x91" * 2000 + b"\xc0", id="arrays"),
    pytest.param(b"\x81\xa1a" + _ext_nest(2000), id="ext-records"),
])
def test_msgpack_nesting_is_bounded(tmp_path, data):
    """Found: 2000 nested maps or arrays hit Python's recursion limit before the old 512-level
    check (two frames per level); nested ext records reset the depth count entirely."""
    refused(target("flax_msgpack", tmp_path), data, "nesting deeper than")


def _array(shape, dtype: str = "float32", nbytes: int = 24) -> msgpack.ExtType:
    return msgpack.ExtType(1, msgpack.packb([shape, dtype, bytes(nbytes)]))


@pytest.mark.parametrize("tree, why", [
    pytest.param({"w": _array([-2, -3])}, "negative shape", id="negative-shape"),
    pytest.param({"w": msgpack.ExtType(2, msgpack.packb([1.0]))}, "complex number record",
                 id="complex-not-a-pair"),
    pytest.param({"w": _array([float("inf")])}, "an array record", id="infinite-shape"),
])
def test_msgpack_array_records_flax_never_writes(tmp_path, tree, why):
    refused(target("flax_msgpack", tmp_path), msgpack.packb(tree), why)


def test_msgpack_map_keys_are_strings(tmp_path):
    """Found (atheris; 4 GiB and 20 s): maps nested as map keys, each str() escaping the quotes
    of the one below, grew exponentially; Flax and Orbax write string keys only."""
    data = b"\x81" * 100 + b"\xa1'" * 100 + b"\xc0"
    start = time.perf_counter()
    refused(target("flax_msgpack", tmp_path), data, "a map key that is a dict")
    assert time.perf_counter() - start < 5


def test_msgpack_uint64_scalar_reads_exactly(tmp_path):
    """Found: a scalar past int64 (msgpack uint64) was listed as int64 and failed to read with
    OverflowError; it is a uint64 entry and reads bit-exactly."""
    path = tmp_path / "checkpoint_1"
    path.write_bytes(msgpack.packb({"step": 2**64 - 1, "count": -(2**63)}))
    checkpoint = flax_msgpack.open_checkpoint(path)
    read = {e.key: checkpoint.read(e) for e in checkpoint.inventory.values()}
    assert read[("step",)].dtype == np.uint64 and int(read[("step",)]) == 2**64 - 1
    assert read[("count",)].dtype == np.int64 and int(read[("count",)]) == -(2**63)


# -- safetensors header ---------------------------------------------------------------------------


def _safetensors(header: bytes) -> bytes:
    return struct.pack("<Q", len(header)) + header + bytes(8)


@pytest.mark.parametrize("header, why", [
    pytest.param(b'{"a":' + b"[" * 5000 + b"]" * 5000 + b"}", "nested deeper than 127 levels", id="nested-json"),
    pytest.param(b'{"w":{"dtype":"F32","shape":[1e999],"data_offsets":[0,4]}}', "out of range",
                 id="infinite-size"),
])
def test_safetensors_headers(tmp_path, header, why):
    refused(target("safetensors", tmp_path), _safetensors(header), why)


# -- JSON and zarr metadata (hf_dir, orbax, paxml, zarr: fixed at the parse site) ---------------


@pytest.mark.parametrize("name, why", [
    ("hf_index", "not a valid weight index"), ("orbax_metadata", "not a valid Orbax metadata"),
    ("zarr_v2_file", "zarr metadata is not valid"), ("paxml_metadata", "not a valid PaxML metadata"),
])
def test_json_nested_too_deep(tmp_path, name, why):
    """Found: RecursionError out of json.loads for each JSON file ckptshim reads."""
    refused(target(name, tmp_path), b"[" * 100_000 + b"]" * 100_000, why)


@pytest.mark.parametrize("change, why", [
    pytest.param({"chunks": [0]}, "with chunks", id="zero-chunk"),
    pytest.param({"shape": [-32]}, "with chunks", id="negative-shape"),
    pytest.param({"shape": [32, 1]}, "with chunks", id="chunks-per-axis"),
    pytest.param({"dtype": "<04"}, "SyntaxError", id="dtype-numpy-reads-as-python"),
    pytest.param({"dimension_separator": {}}, "separator", id="separator-not-a-string"),
])
def test_zarr_metadata(tmp_path, change, why):
    """Found: ZeroDivisionError, SyntaxError (numpy parses '<04' as a Python literal),
    AttributeError, and chunk keys enumerated past the array's real axes."""
    t = target("zarr_v2", tmp_path)
    refused(t, json.dumps({**json.loads(t.seed), **change}).encode(), why)


def test_zarr_astronomical_chunk_grid_is_counted_not_enumerated():
    """Found: shape [2**62] in 1-element chunks enumerated 2**62 chunk keys (OverflowError in
    itertools.product, or no end); missing chunks are counted from what the store lists."""
    raw = json.dumps({"zarr_format": 2, "shape": [2**62, 3], "chunks": [1, 2], "dtype": "<f4",
                      "fill_value": None}).encode()
    array = zarr.parse(raw, "x/.zarray")
    start = time.perf_counter()
    missing, first = array.missing_chunks({"0.0", "0.1", "1.1", "0.2", "junk", "00.0"})
    assert time.perf_counter() - start < 1
    assert missing == 2**63 - 3 and first == ["1.0", "2.0", "2.1", "3.0"]


def test_zarr_chunk_keys_in_c_order():
    raw = json.dumps({"zarr_format": 3, "shape": [3, 0], "chunk_grid": {"configuration": {"chunk_shape": [2, 1]}},
                      "data_type": "float32"}).encode()
    assert list(zarr.parse(raw, "zarr.json").chunk_keys()) == []
    raw = raw.replace(b"[3, 0]", b"[3, 2]")
    assert list(zarr.parse(raw, "zarr.json").chunk_keys()) == ["c/0/0", "c/0/1", "c/1/0", "c/1/1"]


@pytest.mark.parametrize("shard", ["x" * 5000, 5, "a\x00b"], ids=["too-long", "not-a-string", "nul-byte"])
def test_hf_index_shard_names(tmp_path, shard):
    """Found: OSError (file name too long) and TypeError out of the weight index's shard names."""
    t = target("hf_index", tmp_path)
    refused(t, json.dumps({"weight_map": {"embed_out.weight": shard}}).encode(), "is not a file name")


def test_deepspeed_latest_too_long(tmp_path):
    """Found: OSError (file name too long) when ``latest`` names a 300-character folder."""
    refused(target("deepspeed_latest", tmp_path), b"global_step" + b"0" * 300, "does not exist")


@pytest.mark.parametrize("unpadded", [[1e999], [-1], "ab"], ids=["infinite", "negative", "string"])
def test_paxml_unpadded_shapes(tmp_path, unpadded):
    """Found: OverflowError from an unpadded_shape of 1e999; a negative one was accepted."""
    t = target("paxml_metadata", tmp_path)
    meta = json.loads(t.seed)
    meta["train_state_metadata"]["mdl_vars"]["params"]["lm"]["final_ln"]["bias"]["unpadded_shape"] = unpadded
    refused(t, json.dumps(meta).encode(), "unpadded")


def test_dcp_metadata_dtype_that_is_no_dtype(tmp_path):
    """Found (atheris): one changed memo index made a tensor's dtype the string
    'ChunkStorageMetadata', which failed later with KeyError when sizing the entry."""
    t = target("dcp_metadata", tmp_path)
    refused(t, harnesses.mutate(t.seed, [("set", 1231, 39)]), "is not a torch dtype")


def test_t5x_spec_path_with_nul_bytes(tmp_path):
    """Found (atheris): NUL bytes in a tensorstore spec's path raised ValueError from realpath."""
    t = target("t5x_msgpack", tmp_path)
    folder = b"target.decoder.layers_0.mlp.wi_0.kernel/"
    assert folder in t.seed
    refused(t, t.seed.replace(folder, folder.replace(b"mlp", b"\x00\x00\x00")), "with a relative folder name")


def test_paxml_flax_treedef_string_with_a_nul_byte(tmp_path):
    """Found (tests/fuzz): a NUL byte inside a quoted key of ``str_pytree_state`` reached
    ``ast.literal_eval``, which raised SyntaxError."""
    t = target("paxml_flax", tmp_path)
    refused(t, harnesses.mutate(t.seed, [("pack", 309191, 0)]), "a string Python cannot read back")
