"""Fuzz targets: one per parser that interprets bytes read from a checkpoint.

Each :class:`Harness` names a real fixture (the *seed*) and the one file in it whose bytes are
fuzzed. :meth:`Target.__call__` writes the fuzzed bytes over that file in a private working copy
of the fixture and then does what ``ckptshim inspect`` and every load do with a checkpoint:
detect its format, open it, describe it, and -- when it is complete -- read every entry. The
only acceptable failure is a :class:`~ckptshim.errors.ShimError`; anything else escaping is a
bug in the parser (an unhandled ``KeyError`` would reach a user as a traceback, or make a hook
fall back to the framework's own, unsafe, loader).

The same harnesses drive ``tests/fuzz/test_fuzz.py`` (hypothesis, a bounded number of derandomized
examples per target) and ``bench/fuzz.py`` (atheris, or long hypothesis runs, for minutes).
Mutations start from real fixtures so that fuzzed inputs get past the magic bytes and reach
the deep code: bit flips, byte overwrites, truncations, splices of the seed into itself, and
insertions of huge length prefixes.
"""

from __future__ import annotations

import json
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hypothesis import strategies as st

from ckptshim import api
from ckptshim.errors import ShimError
from ckptshim.formats import detect, kvstore, zarr
from ckptshim.keytext import shown
from ckptshim.loading import producers
from support.fixtures import FIXTURES, writable_copy


#: Bytes that make parsers believe in huge sizes or counts: msgpack array32/map32/bin32/str32
#: headers, 4- and 8-byte lengths (both byte orders), pickle LONG4/BINUNICODE8/FRAME headers,
#: JSON numbers past any int64, and deep nesting openers.
HUGE = (b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff",
        b"\xdb\x7f\xff\xff\xff", b"\xc9\xff\xff\xff\xff\x01", b"\xff\xff\xff\xff",
        b"\xff\xff\xff\xff\xff\xff\xff\x7f", b"\x8b\xff\xff\xff\x7f", b"\x8d" + b"\xff" * 7 + b"\x7f",
        b"\x95" + b"\xff" * 7 + b"\x7f", b"99999999999999999999999", b"-1", b"1e999",
        b"[" * 2000, b"\x91" * 2000, b"\x81\xa1a" * 1000, b"(" * 2000)


def exercise(path: Path) -> None:
    """Do with ``path`` what ``ckptshim inspect`` and a load do: detect, open, describe, list
    under the model's names (Megatron-Core's stacked layers), check completeness, read every
    entry; every problem it reports is a line a terminal shows as it is (no control character)."""
    checkpoint = detect.open_checkpoint(path)
    try:
        json.dumps(api.describe(checkpoint))
        producers.model_names(checkpoint)
        for problem in checkpoint.all_problems():
            assert shown(problem).isprintable(), repr(problem)
        checkpoint.require_complete()
        for entry in checkpoint.inventory.values():
            checkpoint.read(entry)
    finally:
        checkpoint.close()


def parse_zarr(data: bytes, where: str) -> None:
    """What Orbax, T5X and PaxML listings do with one array's ``.zarray``/``zarr.json`` bytes
    (read from a folder or an OCDBT database): parse them and look for missing chunks."""
    zarr.parse(data, where).missing_chunks({"0", "0.0", "c/0/0/0", "junk"})


#: What a marker harness checks against: a folder (made once per process) whose objects a
#: fuzzed marker names, at the first level and in a subfolder.
_MARKED: list[Path] = []


def check_marker(data: bytes, where: str) -> None:
    """What a reader of a folder ``convert`` wrote to a bucket does with its marker (the same
    code reads a local folder): check every name it lists against one listing; each problem a
    line without control characters, whatever names the marker holds."""
    from ckptshim.formats import marker
    from ckptshim.storage import Location

    if not _MARKED:
        folder = Path(tempfile.mkdtemp(prefix="ckptshim-fuzz-marker-"))
        (folder / "sub").mkdir()
        for name, size in _MARKER_OBJECTS.items():
            (folder / name).write_bytes(b"\0" * size)
        _MARKED.append(folder)
    root = Location.of(_MARKED[0])
    (_MARKED[0] / marker.MARKER).write_bytes(data)
    listed = {info.location.name: info for info in root.list() if info.kind == "file"}
    for problem in marker.problems(root, listed):
        assert problem.isprintable(), repr(problem)


_MARKER_OBJECTS = {"model.safetensors": 24, "sub/__0_0.distcp": 8}


def _seed_marker() -> bytes:
    """A marker as ``conversion/bucket.py`` writes one, naming the folder's objects and one gone."""
    objects = dict(sorted({**_MARKER_OBJECTS, "sub/gone.distcp": 4}.items()))
    return json.dumps({"written_by": "ckptshim convert", "objects": objects}, indent=1).encode()


def _shard_hf_in_subfolder(root: Path) -> None:
    """:func:`_shard_hf`, its shards then moved into ``shards/`` and the index naming them there
    (an index may name files in subfolders; transformers reads them)."""
    _shard_hf(root)
    index = root / "model.safetensors.index.json"
    document = json.loads(index.read_text())
    (root / "shards").mkdir()
    for shard in set(document["weight_map"].values()):
        (root / shard).rename(root / "shards" / shard)
    document["weight_map"] = {key: f"shards/{shard}" for key, shard in document["weight_map"].items()}
    index.write_text(json.dumps(document, indent=2))


@dataclass(frozen=True)
class Harness:
    """One parser, reached through one file of one real fixture."""

    name: str
    #: What interprets the bytes (module and function), for reports and docs/safety.md.
    parser: str
    #: The fixture file or folder copied as the working checkpoint (relative to tests/fixtures).
    fixture: str
    #: The file inside the working copy whose bytes are fuzzed ("" when ``fixture`` is a file).
    member: str = ""
    #: Where ckptshim is pointed, relative to the working copy ("" = the copy itself).
    open_at: str = ""
    #: Instead of opening a checkpoint, hand the bytes straight to this parser (for bytes that
    #: ckptshim gets from a key-value store rather than a file: zarr metadata inside OCDBT).
    direct: Callable[[bytes, str], None] | None = None
    #: Where the seed comes from when it is not ``fixture/member`` on disk (see :func:`_seed_zarr3`).
    seed_from: Callable[[], bytes] | None = None
    #: Finishes a working copy that the fixtures do not hold as such (see :func:`_shard_hf`).
    prepare: Callable[[Path], None] | None = None
    #: Examples per run in the normal test suite (sized so that the file stays within budget).
    examples: int = 300

    def seed(self) -> bytes:
        if self.seed_from is not None:
            return self.seed_from()
        return (FIXTURES / self.fixture / self.member).read_bytes()


class Target:
    """A harness bound to a private, writable copy of its fixture; call it with fuzzed bytes."""

    def __init__(self, harness: Harness, workdir: Path) -> None:
        self.harness = harness
        self.root = workdir / harness.name
        if harness.direct is None:
            source = FIXTURES / harness.fixture
            if source.is_dir():
                writable_copy(source, self.root)
            else:  # keep the file's name: formats recognise some files by it
                self.root.mkdir(parents=True)
                self.root = writable_copy(source, self.root / source.name)
            if harness.prepare is not None:
                harness.prepare(self.root)
        self.member = self.root / harness.member if harness.member else self.root
        self.seed = harness.seed() if harness.direct is not None else self.member.read_bytes()

    def load(self, data: bytes) -> None:
        """Put ``data`` in place and parse it; whatever the parser raises comes out."""
        if self.harness.direct is not None:
            self.harness.direct(data, f"<fuzz {self.harness.name}>")
            return
        self.member.write_bytes(data)
        exercise(self.root / self.harness.open_at if self.harness.open_at else self.root)

    def __call__(self, data: bytes) -> None:
        """The fuzz target: :meth:`load`, with a ``ShimError`` (a refusal) as the one good failure."""
        try:
            self.load(data)
        except ShimError:
            pass


def _shard_hf(root: Path) -> None:
    """Re-save the fixture's ``model.safetensors`` as shards plus ``model.safetensors.index.json``
    with huggingface_hub's own writer (what ``save_pretrained`` uses): no fixture is sharded."""
    import safetensors.torch
    from huggingface_hub import save_torch_state_dict

    state = safetensors.torch.load_file(root / "model.safetensors")
    (root / "model.safetensors").unlink()
    save_torch_state_dict(state, root, max_shard_size="200KB")


def _seed_zarr3() -> bytes:
    """A real ``zarr.json`` as MaxText's Orbax 0.12.8 wrote it, read out of its OCDBT database."""
    root = FIXTURES / "maxtext_runs/tiny_scanned/checkpoints/0/items"
    key = next(k for k in kvstore.list_keys(root, True) if k.endswith("wi_0.kernel/zarr.json"))
    value = kvstore.read_values(root, True, [key])[key]
    assert value is not None
    return value


def _write_paxml_flax(root: Path) -> None:
    """Beside the copied PaxML run, its FLAX-type save (``flax/checkpoint_1/state/checkpoint``)
    as ``tests/support/paxml_flax_writer.py`` reproduces it with the real Orbax writer."""
    from support.paxml_flax_writer import pax_payload, write_with_orbax

    checkpoint = detect.open_checkpoint(root)
    try:
        arrays = {key: checkpoint.read(entry).copy() for key, entry in checkpoint.inventory.items()}
    finally:
        checkpoint.close()
    write_with_orbax(root / "flax" / "checkpoint_1" / "state", pax_payload(arrays))


_DS = "neox_deepspeed/pp1_mp1/checkpoint"
_PAX = "paxml_runs/TinySpmdRepeat/checkpoints/checkpoint_00000000"
_ZERO = "deepspeed_zero/ws3/zero2_bf16"
_MEGATRON_ZARR = "megatron_core/zarr/tp2_pp1"

HARNESSES: tuple[Harness, ...] = (
    Harness("torch_pickle", "formats/torch_pickle.py: read_archive (safe_pickle, torch_globals), tensor_view",
            "neox_deepspeed/pp1_mp1/checkpoint/global_step0/layer_05-model_00-model_states.pt"),
    Harness("torch_pickle_model", "formats/torch_pickle.py (a whole model's archive)",
            "torch_dcp_single/torch_save/model.pt", examples=180),
    Harness("safetensors", "formats/safetensors.py: read_header, entries",
            "hf_gptneox_tf4.30.2/safetensors/model.safetensors", examples=450),
    Harness("hf_index", "formats/hf_dir.py: open_checkpoint (weight index JSON)",
            "hf_gptneox_tf4.30.2/safetensors", "model.safetensors.index.json", prepare=_shard_hf,
            examples=450),
    Harness("hf_index_subfolders", "formats/hf_dir.py: open_checkpoint (an index naming shards in a subfolder)",
            "hf_gptneox_tf4.30.2/safetensors", "model.safetensors.index.json", prepare=_shard_hf_in_subfolder,
            examples=300),
    Harness("marker", "formats/marker.py: problems (ckptshim-complete.json, names checked by one listing)",
            "hf_gptneox_tf4.30.2/safetensors", direct=check_marker, seed_from=_seed_marker, examples=600),
    Harness("hf_config", "formats/hf_dir.py: model_config (config.json beside the weights)",
            "transformers4_moe/mixtral/safetensors", "config.json", examples=300),
    Harness("dcp_metadata", "formats/dcp.py: load_metadata (safe_pickle), parse_metadata",
            "torch_dcp_single/dcp_plain", ".metadata", examples=450),
    Harness("dcp_chunks", "formats/dcp.py: read_layout (torch.save archives in .distcp)",
            "torch_dcp_single/dcp_plain", "__0_0.distcp", examples=180),
    Harness("deepspeed_mp_rank", "formats/deepspeed_pipeline.py: MP_RANK_GLOBALS stand-ins",
            _DS, "global_step0/mp_rank_00_model_states.pt", examples=180),
    Harness("deepspeed_layer", "formats/deepspeed_pipeline.py: layer files, shard merge",
            _DS, "global_step0/layer_05-model_00-model_states.pt", examples=180),
    Harness("deepspeed_latest", "formats/deepspeed_pipeline.py: step_directory (latest tag)",
            _DS, "latest", examples=300),
    Harness("deepspeed_zero_latest", "formats/deepspeed_pipeline.py: read_latest (as the engine's resume and "
            "deepspeed_zero.tag_folder read it)", _ZERO, "latest", examples=200),
    Harness("deepspeed_zero_optim", "formats/deepspeed_zero.py: ZERO_GLOBALS stand-ins, ZeRO-1/2 partitions",
            _ZERO, "global_step2/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", examples=180),
    Harness("deepspeed_zero_model", "formats/deepspeed_zero.py: model states, ZeRO-3 pieces and frozen fragments",
            "deepspeed_zero/ws2/zero3_fp32", "global_step2/zero_pp_rank_0_mp_rank_00_model_states.pt",
            examples=180),
    Harness("megatron_zarray", "formats/megatron_core.py: _array (.zarray of a raw-chunk array), reads",
            _MEGATRON_ZARR, "decoder.layers.self_attention.linear_qkv.weight/.zarray", examples=180),
    Harness("megatron_dcp_metadata", "formats/dcp.py + rules/profiles/megatron_core.py: model_names (torch_dist "
            ".metadata: stacked layer counts)", "megatron_core/torch_dist/tp1_pp1", ".metadata", examples=180),
    Harness("megatron_config", "formats/megatron_core.py: config (metadata.json)",
            _MEGATRON_ZARR, "metadata.json", examples=120),
    Harness("flax_msgpack", "formats/msgpack_tree.py: read_tree (Flax legacy file)",
            "flax_0.6.11_legacy_msgpack/legacy_msgpack/checkpoint_1", examples=300),
    Harness("orbax_aggregate", "formats/msgpack_tree.py + orbax.py (legacy aggregate)",
            "orbax_0.2.3_unscanned/pytree_checkpointer", "checkpoint", examples=180),
    Harness("orbax_metadata", "formats/orbax.py: _metadata_leaves (_METADATA JSON)",
            "orbax_0.12.8_scanned/standard_checkpointer_scanned", "_METADATA", examples=120),
    Harness("ocdbt_manifest", "formats/kvstore.py: ocdbt_index, read_values (tensorstore)",
            "orbax_0.12.8_scanned/standard_checkpointer_scanned", "manifest.ocdbt", examples=120),
    Harness("zarr_v2_file", "formats/zarr.py: parse (.zarray in a per-leaf folder)",
            "orbax_0.2.3_unscanned/pytree_checkpointer",
            "params.decoder.decoder_norm.scale/.zarray", examples=180),
    Harness("zarr_v2", "formats/zarr.py: parse, chunk_keys (v2 .zarray)",
            "orbax_0.2.3_unscanned/pytree_checkpointer", "params.decoder.decoder_norm.scale/.zarray",
            direct=parse_zarr, examples=900),
    Harness("zarr_v3", "formats/zarr.py: parse, chunk_keys (v3 zarr.json from OCDBT)",
            "maxtext_runs/tiny_scanned", direct=parse_zarr, seed_from=_seed_zarr3, examples=900),
    Harness("t5x_msgpack", "formats/t5x.py: read_contents, local_folder (legacy msgpack)",
            "t5x_tiny_decoder/legacy_checkpointer/checkpoint_0", "checkpoint", examples=180),
    Harness("paxml_metadata", "formats/paxml.py: _version, unpadded_shapes",
            _PAX, "metadata/metadata", examples=120),
    Harness("paxml_flax", "formats/paxml_flax.py: parse (str_pytree_state), leaf_names",
            "paxml_runs/TinySpmdRepeat/checkpoints/checkpoint_00000001/state",
            "flax/checkpoint_1/state/checkpoint", open_at="flax/checkpoint_1/state",
            prepare=_write_paxml_flax, examples=180),
    Harness("zstd_chunk", "formats/frames.py: needed_length (zstd frame and block headers)",
            "orbax_0.2.3_unscanned/pytree_checkpointer", "params.decoder.decoder_norm.scale/0",
            examples=300),
)

BY_NAME = {h.name: h for h in HARNESSES}


def targets(workdir: Path | None = None) -> dict[str, Target]:
    """Every harness bound to a working copy under ``workdir`` (a new temporary folder if None)."""
    workdir = Path(tempfile.mkdtemp(prefix="ckptshim-fuzz-")) if workdir is None else workdir
    return {h.name: Target(h, workdir) for h in HARNESSES}


# -- mutations --------------------------------------------------------------------------------


def mutate(seed: bytes, ops: list[tuple]) -> bytes:
    """Apply byte-level mutations to ``seed``; each op is a tuple drawn by a fuzzer:

    ``("flip", pos, bit)``, ``("set", pos, byte)``, ``("truncate", pos)``,
    ``("delete", pos, n)``, ``("splice", pos, src, n)`` (copy ``n`` seed bytes from ``src`` over
    ``pos``), ``("insert", pos, k)`` (insert :data:`HUGE` ``[k]``), ``("pack", pos, n)``
    (overwrite with ``n`` as a 4-byte little-endian length). Positions wrap around the data.
    """
    data = bytearray(seed)
    for op in ops:
        kind, pos = op[0], op[1] % (len(data) + 1)
        if kind == "flip" and data:
            data[pos % len(data)] ^= 1 << op[2]
        elif kind == "set" and data:
            data[pos % len(data)] = op[2]
        elif kind == "truncate":
            del data[pos:]
        elif kind == "delete":
            del data[pos:pos + op[2]]
        elif kind == "splice" and seed:
            src = op[2] % len(seed)
            data[pos:pos + op[3]] = seed[src:src + op[3]]
        elif kind == "insert":
            data[pos:pos] = HUGE[op[2] % len(HUGE)]
        elif kind == "pack":
            data[pos:pos + 4] = struct.pack("<I", op[2] & 0xFFFFFFFF)
    return bytes(data)


def positions(size: int) -> st.SearchStrategy[int]:
    """Anywhere, but mostly near either end, where headers, pickles and zip directories sit."""
    return st.one_of(st.integers(0, min(size, 4096)), st.integers(max(0, size - 1024), size),
                     st.integers(0, size))


def ops(size: int) -> st.SearchStrategy[list[tuple]]:
    pos = positions(size)
    op = st.one_of(
        st.tuples(st.just("flip"), pos, st.integers(0, 7)),
        st.tuples(st.just("set"), pos, st.sampled_from([0, 0x7F, 0x80, 0xC1, 0xFF]) | st.integers(0, 255)),
        st.tuples(st.just("truncate"), pos),
        st.tuples(st.just("delete"), pos, st.integers(1, 64)),
        st.tuples(st.just("splice"), pos, st.integers(0, size), st.integers(1, 256)),
        st.tuples(st.just("insert"), pos, st.integers(0, len(HUGE) - 1)),
        st.tuples(st.just("pack"), pos, st.integers(0, 2**32 - 1)),
    )
    return st.lists(op, min_size=1, max_size=4)


def inputs(seed: bytes) -> st.SearchStrategy[bytes]:
    """Mutations of the real seed, or arbitrary bytes."""
    return st.one_of(ops(len(seed)).map(lambda o: mutate(seed, o)),
                     st.binary(max_size=512)) if seed else st.binary(max_size=512)
