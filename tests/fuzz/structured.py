"""Structure-aware fuzz harnesses: inputs built from the grammar an attacker would use, not from
byte flips of a fixture.

Byte flips of a real file rarely make a well-formed pickle that lies, a msgpack map of a million
empty maps, or a zstd frame whose header declares 4 GiB; each of those broke ckptshim (issue
14). These harnesses draw such inputs from hypothesis strategies:

- ``pickle_torch`` / ``pickle_dcp``: programs of pickle opcodes (BUILD, memo PUT/GET with small
  and huge indices, deep nesting, persistent ids, allowed and forbidden globals, the records
  torch.save writes), run through the torch-file reader inside a ``torch.save`` zip, and
  through DCP's ``.metadata`` reader. ``pickle_torch`` also checks agreement: a file ckptshim
  reads, ``torch.load(weights_only=True)`` reads too, to the same values.
- ``msgpack_tree``: msgpack values with empty and huge containers, counts that lie, deep
  nesting, extension records, keys repeated -- through the Flax reader.
- ``json_tree``: JSON with deep nesting, many empty containers, duplicate keys, huge numbers --
  through the zarr, safetensors-header and Orbax ``_METADATA`` parsers.
- ``compressed_chunk``: zstd frames (content sizes that lie, raw/RLE/compressed/reserved blocks,
  skippable frames), blosc headers and gzip trailers -- as a chunk of a per-leaf zarr
  checkpoint, listed and read.
- ``safetensors_header``: valid layouts with structural mutations (numbers as strings, floats,
  ``-0``, ``2**64``; overlapping offsets; fields twice or missing; unknown fields 200 deep;
  ``__metadata__`` of numbers; bytes no tensor owns) -- ckptshim's verdict must be
  ``safetensors.safe_open``'s, and the values equal where both read.
- ``ocdbt_graph``: an OCDBT index of many small nodes whose child references are rewritten to
  any node (itself, an ancestor, a sibling's child) with valid checksums.
- ``deepspeed_glob``: step folders named with glob characters beside the folders their patterns
  match: the files ckptshim vouches for are the ones DeepSpeed's own ``ckpt_layer_path_list``
  finds, or the folder is refused.
- ``planner_deep_keys``: key sets 60,000 components deep (wrappers, numbers, root prefixes)
  through the planner, in time linear in the components.

Every example runs under the harness's own limits (:class:`Limits`): what escapes must be a
``ShimError``; it must finish within ``seconds`` plus ``seconds_per_byte`` times the input size;
and the memory Python and numpy allocate for it (``tracemalloc``'s peak) must stay within
``base_mb`` plus ``per_byte`` times the input size.
"""

from __future__ import annotations

import io
import json
import struct
import time
import tracemalloc
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from hypothesis import strategies as st

from ckptshim.errors import ShimError
from ckptshim.formats import dcp, detect, torch_pickle
from ckptshim.formats.base import folder_bytes, read_regular
from support.fixtures import copy_fixture
from support.safetensors_headers import files as safetensors_files



@dataclass(frozen=True)
class Limits:
    """What one example may cost: time and traced memory, each a constant plus a cost per
    input byte -- linear in the input, as every parser's budget promises (with tracemalloc on,
    which slows allocation-heavy code two- to threefold)."""

    seconds: float = 10.0
    seconds_per_byte: float = 50e-6
    base_mb: float = 64.0
    per_byte: float = 32.0

    def seconds_for(self, size: int) -> float:
        return self.seconds + self.seconds_per_byte * size

    def bytes_for(self, size: int) -> float:
        return self.base_mb * 2**20 + self.per_byte * size


class LimitExceeded(AssertionError):
    """An example took longer or allocated more than its harness allows."""


def guarded(run: Callable[[], None], size: int, limits: Limits) -> None:
    """Run one example: only a ShimError may escape, within the time and memory limits."""
    started = tracemalloc.is_tracing()
    if not started:
        tracemalloc.start()
    tracemalloc.reset_peak()
    begin = time.perf_counter()
    try:
        run()
    except ShimError:
        pass
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        if not started:
            tracemalloc.stop()
    elapsed = time.perf_counter() - begin
    if elapsed > limits.seconds_for(size):
        raise LimitExceeded(f"took {elapsed:.1f} s (limit {limits.seconds_for(size):.1f} s) for {size} input bytes")
    if peak > limits.bytes_for(size):
        raise LimitExceeded(f"allocated {peak / 2**20:.1f} MiB (limit {limits.bytes_for(size) / 2**20:.1f}) "
                            f"for {size} input bytes")


# -- pickle programs ------------------------------------------------------------------------------

_GLOBALS = [("collections", "OrderedDict"), ("torch._utils", "_rebuild_tensor_v2"),
            ("torch._utils", "_rebuild_parameter"), ("torch", "FloatStorage"), ("torch", "LongStorage"),
            ("torch", "HalfStorage"), ("builtins", "set"), ("builtins", "eval"), ("os", "system"),
            ("torch", "Size"), ("torch", "float32"), ("numpy", "ndarray"),
            ("torch.distributed.checkpoint.metadata", "Metadata"),
            ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
            ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
            ("torch.distributed.checkpoint.metadata", "TensorProperties"),
            ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
            ("torch.distributed.checkpoint.filesystem", "_StorageInfo")]
_TEXTS = ["storage", "0", "1", "cpu", "w", "values", "items", "keys", "_metadata", "offset", "stride",
          "shape", "state_dict_metadata", "storage_data", "planner_data", "size", "chunks", "properties",
          "dtype", "offsets", "sizes", "fqn", "relative_path", "length", "__0_0.distcp", ""]


def _text(value: str) -> bytes:
    raw = value.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def _int(value: int) -> bytes:
    if 0 <= value < 256:
        return b"K" + bytes([value])
    if -2**31 <= value < 2**31:
        return b"J" + struct.pack("<i", value)
    raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


_STORAGE_RECORD = (b"(" + _text("storage") + b"ctorch\nFloatStorage\n" + _text("0") + _text("cpu")
                   + b"K\x04tQ")
_TENSOR_RECORD = (b"ctorch._utils\n_rebuild_tensor_v2\n(" + _STORAGE_RECORD + b"K\x00K\x04\x85K\x01\x85\x89"
                  b"ccollections\nOrderedDict\n)RtR")

_OPCODES = st.sampled_from([b"(", b"t", b")", b"]", b"}", b"a", b"e", b"s", b"u", b"b", b"R", b"\x81",
                            b"\x85", b"\x86", b"\x87", b"N", b"\x88", b"\x89", b"Q", b"0", b"1", b"2",
                            b"\x8f", b"\x90", b"\x91", b"\x94", b".", b"i", b"o", b"\x82x"])


def _op() -> st.SearchStrategy[bytes]:
    memo_index = st.one_of(st.integers(0, 8), st.integers(0, 2**32 - 1), st.just(775_000_000))
    return st.one_of(
        _OPCODES,
        st.sampled_from(_GLOBALS).map(lambda g: b"c" + f"{g[0]}\n{g[1]}\n".encode()),
        st.sampled_from(_TEXTS).map(_text),
        st.integers(-2**70, 2**70).map(_int),
        st.sampled_from([-1, 0, 1, 4, 2**31 - 1, 2**40]).map(_int),
        st.floats(allow_nan=True, allow_infinity=True).map(lambda f: b"G" + struct.pack(">d", f)),
        memo_index.map(lambda i: b"q" + bytes([i % 256]) if i < 256 else b"r" + struct.pack("<I", i)),
        memo_index.map(lambda i: b"h" + bytes([i % 256]) if i < 256 else b"j" + struct.pack("<I", i)),
        st.just(_STORAGE_RECORD), st.just(_TENSOR_RECORD),
        st.integers(1, 3000).map(lambda n: b"]" * n + b"a" * (n - 1)),  # deep nesting
        st.integers(1, 64).map(_shared_tuple),
    )


def _shared_tuple(levels: int) -> bytes:
    body = b"K\x01q\x00"
    for level in range(levels):
        body += b"h" + bytes([level % 256]) + b"\x86q" + bytes([(level + 1) % 256])
    return body


def pickle_programs() -> st.SearchStrategy[bytes]:
    """Opcode programs: a state dict skeleton with fuzzed opcodes spliced in, or bare sequences."""
    ops = st.lists(_op(), min_size=1, max_size=40).map(b"".join)
    skeleton = st.tuples(ops, ops).map(lambda pair: b"\x80\x02ccollections\nOrderedDict\n)R(" + _text("w")
                                       + _TENSOR_RECORD + pair[0] + b"u" + pair[1] + b".")
    bare = ops.map(lambda body: b"\x80\x02" + body + b".")
    return st.one_of(skeleton, bare)


def _torch_archive(data_pkl: bytes, storage: bytes) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        archive.writestr("archive/data.pkl", data_pkl)
        archive.writestr("archive/byteorder", b"little")
        archive.writestr("archive/data/0", storage)
        archive.writestr("archive/version", b"3\n")
    return out.getvalue()


def _flat(tree, prefix=()) -> dict:
    if isinstance(tree, dict):
        return {k: v for key, value in tree.items() for k, v in _flat(value, prefix + (str(key),)).items()}
    if isinstance(tree, (list, tuple)):
        return {k: v for i, value in enumerate(tree) for k, v in _flat(value, prefix + (str(i),)).items()}
    return {prefix: tree}


class TorchPickleTarget:
    """A fuzzed ``data.pkl`` in a torch.save zip, opened and read; when ckptshim reads it,
    ``torch.load(weights_only=True)`` must read it to the same values."""

    limits = Limits()

    def __init__(self, workdir: Path) -> None:
        import torch.serialization  # noqa: F401 -- imported once here, not timed in the first example
        self.path = workdir / "model.pt"

    def __call__(self, data_pkl: bytes, storage_size: int = 16) -> None:
        storage = np.arange(storage_size // 4, dtype="<f4").tobytes()
        self.path.write_bytes(_torch_archive(data_pkl, storage))
        guarded(self._check, len(data_pkl), self.limits)

    def _check(self) -> None:
        checkpoint = torch_pickle.open_checkpoint(self.path)
        checkpoint.require_complete()
        found = {e.key: np.array(checkpoint.read(e)) for e in checkpoint.inventory.values()}
        _agrees_with_torch(self.path, found)


def _agrees_with_torch(path: Path, found: dict) -> None:
    import torch

    try:
        loaded = torch.load(path, weights_only=True)
    except Exception as error:
        raise AssertionError(f"ckptshim read a file torch refuses ({type(error).__name__}: {error})") from None
    tensors = {tuple(part for component in key for part in component.split(".")): value
               for key, value in _flat(loaded).items() if isinstance(value, torch.Tensor)}
    assert tensors.keys() == found.keys(), (sorted(tensors), sorted(found))
    for key, value in tensors.items():
        expected = value.numpy() if value.dtype != torch.bfloat16 else value.view(torch.uint16).numpy()
        assert np.array_equal(expected.view(found[key].dtype), found[key], equal_nan=True), key


class DcpMetadataTarget:
    """A fuzzed ``.metadata`` pickle (protocol 2-5 opcodes) through DCP's metadata reader."""

    limits = Limits()

    def __init__(self, workdir: Path) -> None:
        self.path = workdir / ".metadata"

    def __call__(self, program: bytes) -> None:
        self.path.write_bytes(program)
        guarded(lambda: dcp.load_metadata(self.path), len(program), self.limits)


# -- msgpack trees ----------------------------------------------------------------------------------


def _pack_map(items: list[tuple[bytes, bytes]], lie: int = 0) -> bytes:
    count = max(len(items) + lie, 0)  # a count that lies: more (or fewer) than follow
    head = bytes([0x80 | count]) if count < 16 else b"\xde" + struct.pack(">H", count) if count < 2**16 \
        else b"\xdf" + struct.pack(">I", count & 0xFFFFFFFF)
    return head + b"".join(k + v for k, v in items)


def _pack_array(items: list[bytes], lie: int = 0) -> bytes:
    count = max(len(items) + lie, 0)
    head = bytes([0x90 | count]) if count < 16 else b"\xdc" + struct.pack(">H", count) if count < 2**16 \
        else b"\xdd" + struct.pack(">I", count & 0xFFFFFFFF)
    return head + b"".join(items)


def _pack_str(text: str) -> bytes:
    raw = text.encode()
    return (bytes([0xA0 | len(raw)]) if len(raw) < 32 else b"\xd9" + bytes([len(raw)])) + raw


def _ext_array(shape: list[int], dtype: str, nbytes: int) -> bytes:
    inner = _pack_array([_pack_array([_int_msgpack(d) for d in shape]), _pack_str(dtype),
                         b"\xc6" + struct.pack(">I", nbytes) + bytes(nbytes)])
    return b"\xc9" + struct.pack(">I", len(inner)) + b"\x01" + inner


def _int_msgpack(value: int) -> bytes:
    if 0 <= value < 128:
        return bytes([value])
    if -32 <= value < 0:
        return struct.pack(">b", value)
    return b"\xd3" + struct.pack(">q", max(min(value, 2**63 - 1), -2**63))


def msgpack_values(depth: int = 6) -> st.SearchStrategy[bytes]:
    leaves = st.one_of(
        st.integers(-2**63, 2**63 - 1).map(_int_msgpack),
        st.floats().map(lambda f: b"\xcb" + struct.pack(">d", f)),
        st.text(max_size=8).map(_pack_str), st.just(b"\xc0"), st.just(b"\xc3"),
        st.tuples(st.lists(st.integers(-2, 64), max_size=3), st.sampled_from(["float32", "int8", "bfloat16", "x"]),
                  st.integers(0, 64)).map(lambda t: _ext_array(*t)),
        st.integers(1, 200_000).map(lambda n: b"\xdf" + struct.pack(">I", n) + b"\xa1a\x80" * min(n, 50_000)),
        st.integers(1, 400_000).map(lambda n: b"\xdd" + struct.pack(">I", n) + b"\x01" * n),
        st.integers(100, 3000).map(lambda n: b"\x91" * n + b"\xc0"),
        st.binary(max_size=16),
    )

    def containers(children: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
        keys = st.one_of(st.sampled_from(["a", "b", "__msgpack_chunked_array__", "shape", "chunks", "0"]).map(_pack_str),
                         st.integers(0, 3).map(_int_msgpack), children)
        lie = st.sampled_from([0, 0, 0, 1, -1, 2**31])
        return st.one_of(
            st.tuples(st.lists(st.tuples(keys, children), max_size=6), lie).map(lambda t: _pack_map(*t)),
            st.tuples(st.lists(children, max_size=6), lie).map(lambda t: _pack_array(*t)))

    return st.recursive(leaves, containers, max_leaves=20)


class FlaxMsgpackTarget:
    """A fuzzed msgpack tree as a legacy Flax ``checkpoint_1``, opened and read: one input byte
    can be one entry (a small integer), listed and read (about 25 us and 350 bytes each)."""

    limits = Limits(seconds_per_byte=200e-6, per_byte=512.0)

    def __init__(self, workdir: Path) -> None:
        self.path = workdir / "checkpoint_1"

    def __call__(self, data: bytes) -> None:
        self.path.write_bytes(b"\x81\xa1t" + data)
        guarded(lambda: _exercise(self.path), len(data), self.limits)


def _exercise(path: Path) -> None:
    checkpoint = detect.open_checkpoint(path)
    try:
        checkpoint.require_complete()
        for entry in checkpoint.inventory.values():
            checkpoint.read(entry)
    finally:
        checkpoint.close()


# -- JSON trees -------------------------------------------------------------------------------------


def json_texts() -> st.SearchStrategy[bytes]:
    scalars = st.one_of(st.integers(-2**80, 2**80), st.floats(allow_nan=False), st.text(max_size=6), st.none(),
                        st.booleans()).map(json.dumps)
    tree = st.recursive(scalars, lambda children: st.one_of(
        st.lists(children, max_size=5).map(lambda xs: "[" + ",".join(xs) + "]"),
        st.lists(st.tuples(st.sampled_from(["shape", "chunks", "dtype", "zarr_format", "a", "a"]), children),
                 max_size=5).map(lambda kv: "{" + ",".join(f"{json.dumps(k)}:{v}" for k, v in kv) + "}")),
        max_leaves=25)
    bombs = st.one_of(st.integers(1000, 200_000).map(lambda n: "[" * n + "]" * n),
                      st.integers(1000, 300_000).map(lambda n: "[" + "[]," * n + "[]]"),
                      st.just("1" * 5000), st.just("1e99999"))
    return st.one_of(tree, bombs).map(str.encode)


class JsonTarget:
    """Fuzzed JSON through each JSON parser: zarr metadata, a safetensors header, Orbax's
    ``_METADATA`` (``strict_json`` under the parse functions that read them)."""

    limits = Limits(per_byte=64.0)

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir

    def __call__(self, text: bytes) -> None:
        from ckptshim.formats import orbax, safetensors, zarr
        from ckptshim.storage import Location

        def run() -> None:
            try:
                zarr.parse(text, "<fuzz .zarray>").missing_chunks({"0", "0.0"})
            except ShimError:
                pass
            path = self.workdir / "model.safetensors"
            path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(64))
            try:
                header, start = safetensors.read_header(Location.of(path))
                safetensors.entries(path, header, start)
            except ShimError:
                pass
            item = self.workdir / "item"
            item.mkdir(exist_ok=True)
            (item / orbax.METADATA).write_bytes(text)
            orbax._metadata_leaves(item / orbax.METADATA, lambda: read_regular(item / orbax.METADATA),
                                   folder_bytes(item))
        guarded(run, len(text), self.limits)


# -- compressed chunks -----------------------------------------------------------------------------


def _zstd_block(kind: int, size: int, last: bool) -> bytes:
    header = struct.pack("<I", int(last) | kind << 1 | (size & 0x1FFFFF) << 3)[:3]
    return header + (b"\0" if kind == 1 else bytes(min(size, 4096)) if kind in (0, 2) else b"")


def zstd_frames() -> st.SearchStrategy[bytes]:
    block = st.tuples(st.integers(0, 3), st.sampled_from([0, 1, 127, 128, 2**17, 2**21 - 1]))
    frame = st.tuples(st.sampled_from([0, 1, 2, 3]), st.booleans(), st.booleans(),
                      st.sampled_from([0, 4, 128, 2**32, 2**63]), st.lists(block, min_size=0, max_size=6)).map(
        lambda t: struct.pack("<I", 0xFD2FB528) + bytes([t[0] << 6 | t[1] << 5 | t[2] << 2])
        + (b"" if t[1] else b"\x48") + (b"" if t[0] == 0 and not t[1] else
                                         t[3].to_bytes((1, 2, 4, 8)[t[0]], "little", signed=False)
                                         if t[3] < 256 ** (1, 2, 4, 8)[t[0]] else b"\xff" * (1, 2, 4, 8)[t[0]])
        + b"".join(_zstd_block(k, n, i == len(t[4]) - 1) for i, (k, n) in enumerate(t[4])))
    skippable = st.binary(max_size=16).map(lambda b: struct.pack("<II", 0x184D2A50, len(b)) + b)
    return st.lists(st.one_of(frame, skippable), min_size=1, max_size=3).map(b"".join)


def blosc_chunks() -> st.SearchStrategy[bytes]:
    return st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1), st.binary(max_size=64)).map(
        lambda t: struct.pack("<BBBBIII", 2, 1, 2, 4, t[0], 128, t[1]) + t[2])


def gzip_chunks() -> st.SearchStrategy[bytes]:
    import gzip

    return st.tuples(st.binary(max_size=256), st.integers(0, 2**32 - 1), st.booleans()).map(
        lambda t: gzip.compress(t[0])[:-4] + (struct.pack("<I", t[1]) if t[2] else struct.pack("<I", len(t[0]))))


class CompressedChunkTarget:
    """A fuzzed chunk as the one chunk of a per-leaf zarr array (float32[32]), listed and read
    through the Orbax legacy layout, with the array's compressor set to the chunk's kind."""

    limits = Limits(seconds=20.0)
    ARRAY = "params.decoder.decoder_norm.scale"

    def __init__(self, workdir: Path) -> None:
        self.root = copy_fixture("orbax_0.2.3_unscanned/pytree_checkpointer", workdir, "per_leaf")
        self.zarray = json.loads((self.root / self.ARRAY / ".zarray").read_text())

    def __call__(self, kind: str, chunk: bytes) -> None:
        compressor = {"zstd": {"id": "zstd", "level": 1}, "blosc": {"id": "blosc", "cname": "lz4", "clevel": 5,
                                                                    "shuffle": 1},
                      "gzip": {"id": "gzip", "level": 1}}[kind]
        (self.root / self.ARRAY / ".zarray").write_text(json.dumps({**self.zarray, "compressor": compressor}))
        (self.root / self.ARRAY / "0").write_bytes(chunk)
        guarded(lambda: _exercise(self.root), len(chunk), self.limits)


def chunks() -> st.SearchStrategy[tuple[str, bytes]]:
    return st.one_of(zstd_frames().map(lambda c: ("zstd", c)), blosc_chunks().map(lambda c: ("blosc", c)),
                     gzip_chunks().map(lambda c: ("gzip", c)))


# -- safetensors headers: the library's verdict ----------------------------------------------------


class SafetensorsHeaderTarget:
    """A safetensors file (a valid layout, structurally mutated: ``support.safetensors_headers``)
    opened by ckptshim and by ``safetensors.safe_open``: the verdicts agree, and so does every
    tensor's bytes where both read the file."""

    limits = Limits()

    def __init__(self, workdir: Path) -> None:
        import safetensors  # noqa: F401 -- imported once here, not timed in the first example
        import torch  # noqa: F401
        self.path = workdir / "model.safetensors"

    def __call__(self, data: bytes) -> None:
        from support.safetensors_headers import compare

        guarded(lambda: compare(self.path, data), len(data), self.limits)


# -- OCDBT index graphs ----------------------------------------------------------------------------


@st.composite
def ocdbt_rewrites(draw) -> list[tuple[int, int, int, int]]:
    """Up to four child references rewritten: (interior node, child, target node, byte shift of
    the target: 0 for a node, else a location inside or past one, which fails its checksum)."""
    rewrite = st.tuples(st.integers(0, 63), st.integers(0, 7), st.integers(0, 127),
                        st.sampled_from([0, 0, 0, 0, 1, -1, 7]))
    return draw(st.lists(rewrite, min_size=1, max_size=4))


class OcdbtGraphTarget:
    """An Orbax OCDBT item whose index (several levels of small uncompressed nodes, written by
    tensorstore) has child references rewritten to any node -- itself, an ancestor, a sibling's
    child, a leaf, past the end of one -- with valid checksums (``support.ocdbt_nodes``), then
    opened and read. Only a ShimError may come out, within the limits: a walk that follows a
    cycle or a shared node does not end."""

    limits = Limits(seconds=30.0)
    SOURCE = "orbax_0.12.8_scanned/standard_checkpointer_scanned"

    def __init__(self, workdir: Path) -> None:
        from support.fixtures import FIXTURES
        from support.ocdbt_nodes import deep_database, interior_nodes

        self.item = deep_database(FIXTURES / self.SOURCE, workdir / "item")
        self.interior = interior_nodes(self.item)
        self.nodes = [self.interior[0][0]] + [child for _, below in self.interior for child in below]
        self.data = {path: path.read_bytes() for path in (self.item / "d").iterdir()}

    def __call__(self, rewrites: list[tuple[int, int, int, int]]) -> None:
        from support.ocdbt_nodes import parse_location, point_child_at

        for path, data in self.data.items():  # the intact database again
            path.write_bytes(data)
        for node, child, target, shift in rewrites:
            parent, below = self.interior[node % len(self.interior)]
            file, offset, length = parse_location(self.nodes[target % len(self.nodes)])
            head = self.nodes[0].rsplit(":", 2)[0]
            point_child_at(self.item, parent, child % len(below), f"{head}:{offset + shift}:{length}")
        guarded(lambda: _exercise(self.item), 0, self.limits)


# -- glob-pattern folder names: what DeepSpeed's load_state_dir would read ---------------------------

_NAME_PARTS = ["global_step", "1", "2", "[", "]", "[1]", "[!1]", "*", "?", "[[]", "-", "x"]


@st.composite
def glob_folders(draw) -> tuple[list[str], list[tuple[int, str]], int]:
    """Step folder names built from glob characters, the layer files (folder, name) in them, and
    which folder is loaded."""
    names = draw(st.lists(st.lists(st.sampled_from(_NAME_PARTS), min_size=1, max_size=4).map("".join),
                          min_size=1, max_size=4, unique=True))
    files = st.tuples(st.integers(0, len(names) - 1), st.sampled_from(
        ["layer_00-model_00-model_states.pt", "layer_02-model_states.pt", "layer_2-model_states.pt",
         "layer_05-x-model_states.pt", "layer_002-model_states.pt", "mp_rank_00_model_states.pt"]))
    return names, draw(st.lists(files, max_size=6)), draw(st.integers(0, len(names) - 1))


class DeepspeedGlobTarget:
    """Folders named with glob characters, layer files in them, and one loaded: either ckptshim
    refuses the folder (UnsafeCheckpointError), or the files it says DeepSpeed reads are exactly
    what DeepSpeed's own ``PipelineModule.ckpt_layer_path_list`` globs, layer by layer -- and
    ``inspect`` of a ``latest`` naming the folder reads no other folder's files."""

    limits = Limits()

    def __init__(self, workdir: Path) -> None:
        from deepspeed.runtime.pipe.module import PipelineModule

        self.workdir, self.listing = workdir, PipelineModule.ckpt_layer_path_list

    def __call__(self, names: list[str], files: list[tuple[int, str]], loaded: int) -> None:
        import os
        import shutil
        from types import SimpleNamespace

        from ckptshim.errors import UnsafeCheckpointError
        from ckptshim.formats import deepspeed_pipeline

        root = self.workdir / "ckpt"
        shutil.rmtree(root, ignore_errors=True)
        for name in names:
            (root / name).mkdir(parents=True, exist_ok=True)
        for folder, name in files:
            (root / names[folder] / name).write_bytes(b"")
        (root / "latest").write_text(names[loaded])
        load_dir, layers = root / names[loaded], range(8)
        stage = SimpleNamespace(_local_start=0)
        deepspeed = {os.path.realpath(p) for i in layers for p in self.listing(stage, str(load_dir), i)}

        def check() -> None:
            try:
                ours = deepspeed_pipeline.files_deepspeed_reads(load_dir, layers)
            except UnsafeCheckpointError:
                assert any(c in names[loaded] for c in "*?["), "refused a folder whose path is no pattern"
                return
            assert {os.path.realpath(p) for p in ours} == deepspeed, (names[loaded], sorted(deepspeed))
            detect.open_checkpoint(root).close()  # its latest names the folder: refused or read
        guarded(check, 0, self.limits)


# -- deep keys through the planner -----------------------------------------------------------------


@st.composite
def deep_key_sets(draw) -> tuple[list[tuple[str, ...]], list[tuple[str, ...]]]:
    """Two key sets of keys thousands of components deep: a shared deep stem, wrapper names and
    numbers inside it, one side under a root name or not, leaves added, dropped or renamed."""
    depth = draw(st.sampled_from([1, 10, 1000, 20_000, 60_000]))
    parts = st.sampled_from(["c", "module", "_orig_mod", "0", "1", "layers", "model", "x"])
    pattern = draw(st.lists(parts, min_size=1, max_size=6))
    stem = tuple(f"{pattern[i % len(pattern)]}" + ("" if pattern[i % len(pattern)].isdigit() else str(i % 7))
                 for i in range(depth))
    leaves = draw(st.lists(st.sampled_from(["w", "b", "0", "1", "weight", "inv_freq"]), min_size=1, max_size=4,
                           unique=True))
    source = [stem + (leaf,) for leaf in leaves]
    target = list(source)
    for change in draw(st.lists(st.sampled_from(["root", "unroot", "drop", "add", "wrap", "number"]), max_size=3)):
        if change == "root":
            target = [("model",) + key for key in target]
        elif change == "unroot":
            source = [("_orig_mod",) + key for key in source]
        elif change == "drop" and len(target) > 1:
            target = target[1:]
        elif change == "add":
            target = target + [stem + ("extra",)]
        elif change == "wrap":
            source = [key[:1] + ("module",) + key[1:] for key in source]
        elif change == "number":
            target = [key[:-1] + ("layers", "0", key[-1]) for key in target]
    return source, target


class PlannerDeepKeysTarget:
    """Key sets whose keys are up to 60,000 components deep, planned: only a ShimError (a
    PlanError) may come out, in time linear in the keys' components. The limit is per component:
    at most 7 us each untraced, up to 170 us under tracemalloc on a 2-core machine running five
    times its load; a quadratic step would take minutes on two keys 60,000 deep."""

    limits = Limits(seconds=10.0, seconds_per_byte=250e-6, per_byte=512.0)

    def __init__(self, workdir: Path) -> None:
        pass

    def __call__(self, source: list[tuple[str, ...]], target: list[tuple[str, ...]]) -> None:
        from ckptshim.inventory import Entry, Inventory
        from ckptshim.planner import explain, plan
        from ckptshim.rules.context import LoadContext
        from ckptshim.rules.profiles import rules_for

        def run() -> None:
            left = Inventory([Entry(k, (2,), "float32", i) for i, k in enumerate(dict.fromkeys(source))], "checkpoint")
            right = Inventory([Entry(k, (2,), "float32", i) for i, k in enumerate(dict.fromkeys(target))], "target")
            explain(plan(left, right, rules_for(LoadContext(left, right, "torch"))))
        guarded(run, sum(map(len, source)) + sum(map(len, target)), self.limits)


# -- text shown on a terminal ----------------------------------------------------------------------

#: What names from a checkpoint are made of: digits (grouped into ranges), separators, the table's
#: cell separator, control characters and escape sequences, unpaired surrogates, wide characters.
_KEY_ALPHABET = st.sampled_from(list("0123456789._/-{}, ab") + ["\x1b", "\x07", "\r", "\n", "\t", "\x1f", "\x00",
                                                                "\x7f", "\x9b", "\u200b", "\u2028", "\udcff", "é",
                                                                "中", "\\", "'", '"', "\x1b]0;x\x07", "07"])


def key_texts() -> st.SearchStrategy[list[str]]:
    return st.lists(st.lists(_KEY_ALPHABET, max_size=40).map("".join), min_size=1, max_size=30)


class KeytextTarget:
    """Every string that reaches a terminal passes :func:`~ckptshim.keytext.shown`: whatever it
    holds, what it shows is printable; a printable name is shown as it is; and a table of rows
    of such names groups into rows of as many cells, each printable (a cell may hold the
    separator the grouping joins cells with)."""

    limits = Limits(seconds=5.0, seconds_per_byte=1e-3)

    def __init__(self, workdir: Path) -> None:
        pass

    def __call__(self, names: list[str]) -> None:
        from ckptshim.keytext import compress, group_rows, shown, shown_lines

        def run() -> None:
            for name in names:
                text = shown(name)
                assert text.isprintable() and (text == name or not name.isprintable()), (name, text)
            assert all(line.isprintable() for line in shown_lines("\n".join(names)).split("\n"))
            rows = group_rows((name, "float32", "(2,)", "8 B") for name in names)
            assert all(len(cells) == 4 and all(cell.isprintable() for cell in cells) for cells, _ in rows), rows
            assert sum(count for _, count in rows) == len(names)
            assert all(shown(line).isprintable() for line in compress(names))
        guarded(run, sum(map(len, names)), self.limits)


# -- the registry ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Structured:
    """One structure-aware harness: a strategy of inputs and the target that takes them."""

    name: str
    parser: str
    inputs: Callable[[], st.SearchStrategy]
    target: Callable[[Path], Callable[..., None]]
    examples: int = 150


HARNESSES: tuple[Structured, ...] = (
    Structured("pickle_torch", "formats/safe_pickle.py + torch_globals.py + torch_pickle.py (agreement with torch.load)",
               lambda: st.tuples(pickle_programs(), st.sampled_from([0, 8, 16, 64])), TorchPickleTarget),
    Structured("pickle_dcp", "formats/safe_pickle.py + dcp.py: _find_class, parse_metadata",
               lambda: pickle_programs().map(lambda p: b"\x80\x04" + p[2:]), DcpMetadataTarget),
    Structured("msgpack_tree", "formats/msgpack_tree.py: read_tree, Budget",
               lambda: msgpack_values(), FlaxMsgpackTarget),
    Structured("json_tree", "formats/base.py: strict_json (zarr, safetensors, Orbax _METADATA)",
               lambda: json_texts(), JsonTarget, examples=60),
    Structured("compressed_chunk", "formats/frames.py: needed_length, declared_content (zstd, blosc, gzip)",
               lambda: chunks(), CompressedChunkTarget, examples=100),
    Structured("safetensors_header", "formats/safetensors_header.py (agreement with safetensors.safe_open)",
               lambda: safetensors_files(), SafetensorsHeaderTarget, examples=150),
    Structured("ocdbt_graph", "formats/kvstore.py: ocdbt_index, _walk (node graphs that are no tree)",
               lambda: ocdbt_rewrites(), OcdbtGraphTarget, examples=25),
    Structured("deepspeed_glob", "formats/deepspeed_pipeline.py: files_deepspeed_reads, require_pattern_is_itself",
               lambda: glob_folders(), DeepspeedGlobTarget, examples=60),
    Structured("keytext", "keytext.py: shown, shown_lines, group_rows, compress (every string a terminal shows)",
               lambda: key_texts(), KeytextTarget, examples=300),
    Structured("planner_deep_keys", "rules/roots.py, planner/: keys 60,000 components deep",
               lambda: deep_key_sets(), PlannerDeepKeysTarget, examples=12),
)
BY_NAME = {h.name: h for h in HARNESSES}


def call(target: Callable[..., None], example) -> None:
    """Feed one drawn example to a target (tuples are spread into arguments)."""
    target(*example) if isinstance(example, tuple) else target(example)
