"""The storage matrix (issue 31): a bucket never gives another value than a disk.

Generated, not listed by hand: every format ckptshim reads (:data:`FORMATS`: each written by its
library's own save path from one tree holding an array of each dtype, or a real fixture), x where
it is stored (:data:`STORAGES`: a local folder, ``gs://`` on this session's GCS server, ``s3://``
on moto), x dtype (:data:`DTYPES`, those the format stores), x how it is read (:data:`PATHS`: the
framework's own load with a remap, the framework's load with names matching, ``convert --to
safetensors|dcp``, ``inspect``), minus the cells a framework cannot have (:func:`applicable`).

Each cell compares the values it reads bit for bit with the same read of the local copy (a
refusal: the same exception type and text, the location's name aside); a local cell compares
them with the arrays written. One checkpoint per format holds every dtype and is uploaded once
for the module (or saved there by its framework, where the framework writes to that bucket);
each path runs once per (format, storage) and is kept, and each dtype's cell checks its own
arrays, so a cell costs little beyond its share of one read.

The GCS clients read the server's address once per process, so the ``gcs`` column runs against
the session's server (``--gcs-server``); :func:`test_the_gcs_column_on_fake_gcs_server` runs the
column again in a child pytest against fake-gcs-server. Cells that fail today for a known,
filed reason are in :data:`KNOWN`, one place, each a strict xfail.
"""

from __future__ import annotations

import fnmatch
import gc
import json
import re
import struct
import subprocess
import sys
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, reject, settings, strategies as st

import ckptshim  # as a user's training script does first: the hooks attach as the frameworks load
from support.fixtures import copy_fixture
from support.markers import QUIET
from support.processes import TESTS, environment

pytestmark = [QUIET, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

#: Each dtype the matrix writes, as numpy (ml_dtypes) names it.
DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
          "float16": np.dtype(np.float16), "int8": np.dtype(np.int8), "uint8": np.dtype(np.uint8),
          "bool": np.dtype(np.bool_), "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn)}
#: A real fixture holds the dtypes its producer wrote: one cell for all of them.
AS_WRITTEN = "as-written"
LAYERS = 2
SHAPE = (3, 4)
STORAGES = ("local", "gcs", "s3")
PATHS = ("load-remap", "load", "convert-safetensors", "convert-dcp", "inspect")

#: Cells that fail today for a filed reason: a pattern over the cell's id ("FORMAT-STORAGE-DTYPE-
#: PATH", fnmatch) and the reason. Each is a strict xfail: delete an entry once its fix lands.
KNOWN: dict[str, str] = {}
#: Cells the matrix found failing that are not fixed yet, as the same pattern -> reason: listed,
#: not run (formatting a failure once crashed the whole pytest session: CPython 3.11's "AST
#: constructor recursion depth mismatch", with aiohttp's finalizers running inside it; run such a
#: cell alone with ``--assert=plain`` to see its error). Delete an entry once its fix lands.
FINDINGS: dict[str, str] = {}


def written_arrays() -> dict[tuple[str, str], np.ndarray]:
    """``{("layers_0", "float32"): array, ...}``: seeded, every bit pattern of a float dtype possible
    (NaNs and infinities included), booleans 0 or 1."""
    rng = np.random.default_rng(31)
    out = {}
    for layer in range(LAYERS):
        for name, dtype in DTYPES.items():
            if dtype == np.bool_:
                value = rng.integers(0, 2, SHAPE).astype(np.bool_)
            else:
                value = np.frombuffer(rng.bytes(int(np.prod(SHAPE)) * dtype.itemsize), dtype).reshape(SHAPE)
            out[(f"layers_{layer}", name)] = value
    return out


def as_tensor(value: np.ndarray):
    """A torch tensor of ``value``'s dtype, shape and bits (numpy cannot hand torch bfloat16 or float8)."""
    import torch

    dtype = getattr(torch, value.dtype.name)
    if value.size == 0:
        return torch.empty(value.shape, dtype=dtype)
    return torch.frombuffer(bytearray(value.tobytes()), dtype=dtype).reshape(value.shape)


def torch_state(arrays: dict[tuple[str, str], np.ndarray]) -> dict:
    """The same arrays as a torch state dict, ``layers.0.float32``."""
    return {f"layers.{layer.removeprefix('layers_')}.{name}": as_tensor(value) for (layer, name), value in arrays.items()}


def jax_tree(arrays: dict[tuple[str, str], np.ndarray]) -> dict:
    import jax.numpy as jnp

    tree: dict = {}
    for (layer, name), value in arrays.items():
        tree.setdefault(layer, {})[name] = jnp.asarray(value)
    return tree


# -- the formats ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Format:
    """One format of the matrix. ``write(folder)`` writes it below a local folder with its
    library's own save and returns the checkpoint's name there; ``bucket_write(url)``, where the
    framework writes to that bucket itself, saves it at ``url``; ``side`` is the framework whose
    load calls read it; ``dtypes`` are those it stores. ``data`` (a glob below the checkpoint)
    names its data files: a damaged variant has the largest of them cut short by 4 bytes."""

    name: str
    side: str
    write: Callable[[Path], str]
    dtypes: tuple[str, ...] = tuple(DTYPES)
    bucket_write: Callable[[str], None] | None = None
    bucket_schemes: tuple[str, ...] = ()
    data: str = ""
    truncated: bool = False


def _safetensors(folder: Path) -> str:
    from safetensors.torch import save_file

    save_file(torch_state(written_arrays()), folder / "model.safetensors", metadata={"format": "pt"})
    return "model.safetensors"


def _hf(safe: bool, sharded: bool) -> Callable[[Path], str]:
    def write(folder: Path) -> str:
        from huggingface_hub import save_torch_state_dict

        (folder / "hf").mkdir()
        save_torch_state_dict(torch_state(written_arrays()), folder / "hf", safe_serialization=safe,
                              max_shard_size=200 if sharded else "10GB")
        (folder / "hf" / "config.json").write_text(json.dumps({"model_type": "storage-matrix"}))
        return "hf"
    return write


def _torch_save(folder: Path) -> str:
    import torch

    torch.save(torch_state(written_arrays()), folder / "model.pt")
    return "model.pt"


def _dcp(where: Path | str) -> str:
    import torch.distributed.checkpoint as dcp

    dcp.save(torch_state(written_arrays()), checkpoint_id=where if isinstance(where, str) else where / "dcp", no_dist=True)
    return "dcp"


def _orbax(ocdbt: bool) -> Callable[[Path | str], str]:
    def write(where: Path | str) -> str:
        import orbax.checkpoint as ocp

        with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=ocdbt)) as checkpointer:
            checkpointer.save(where if isinstance(where, str) else where / "item",
                              args=ocp.args.PyTreeSave(jax_tree(written_arrays())))
        return "item"
    return write


def _flax_msgpack(folder: Path) -> str:
    """Flax's legacy ``save_checkpoint`` layout: ``checkpoint_<step>`` files of its serializer's bytes."""
    from flax import serialization

    (folder / "flax").mkdir()
    (folder / "flax" / "checkpoint_1").write_bytes(serialization.to_bytes(jax_tree(written_arrays())))
    return "flax"


def _fixture(name: str, relative: str, commit: tuple[str, ...] = ()) -> Callable[[Path], str]:
    """A real fixture's copy; ``commit``: folders (relative to the checkpoint) given the
    ``commit_success.txt`` their producer's Orbax writes into a ``gs://`` step and its items."""
    def write(folder: Path) -> str:
        copy_fixture(name, folder, "fixture")
        for inner in commit:
            (folder / "fixture" / relative / inner / "commit_success.txt").write_text("done")
        return f"fixture/{relative}".rstrip("/")
    return write


WRITTEN: tuple[Format, ...] = (
    Format("safetensors", "torch", _safetensors, data="."),
    Format("hf-safetensors", "torch", _hf(safe=True, sharded=False), data="model.safetensors"),
    Format("hf-safetensors-sharded", "torch", _hf(safe=True, sharded=True), data="model-*.safetensors"),
    Format("torch-save", "torch", _torch_save, data="."),
    Format("hf-bin-sharded", "torch", _hf(safe=False, sharded=True), data="pytorch_model-*.bin"),
    Format("dcp", "torch", _dcp, bucket_write=_dcp, bucket_schemes=("gcs", "s3"), data="*.distcp"),
    # no damaged variant: a cut OCDBT data file's tail may be bytes no index node points at
    Format("orbax-ocdbt", "jax", _orbax(ocdbt=True), bucket_write=_orbax(ocdbt=True), bucket_schemes=("gcs",)),
    Format("orbax-per-leaf", "jax", _orbax(ocdbt=False), bucket_write=_orbax(ocdbt=False), bucket_schemes=("gcs",),
           data="layers_0.float32/0.0"),
    Format("flax-msgpack", "jax", _flax_msgpack, data="checkpoint_1"),
)
FORMATS: tuple[Format, ...] = (
    *WRITTEN,
    # each written format again, a data file cut short: refused, and refused alike everywhere
    *(replace(fmt, name=f"{fmt.name}-truncated", dtypes=(AS_WRITTEN,), truncated=True) for fmt in WRITTEN if fmt.data),
    Format("t5x-legacy", "t5x", _fixture("t5x_tiny_decoder/legacy_checkpointer", "checkpoint_0"),
           dtypes=(AS_WRITTEN,)),
    Format("t5x-orbax", "t5x", _fixture("t5x_tiny_decoder/orbax_checkpoint_manager", "checkpoint_0"),
           dtypes=(AS_WRITTEN,)),
    Format("paxml", "jax", _fixture("paxml_runs/TinySpmdRepeat", "checkpoints/checkpoint_00000001/state",
                                    commit=(".", "..")), dtypes=(AS_WRITTEN,)),
    # the decoder checkpoints torch's loads read through ckptshim alone (their dcp.load into a
    # model's state dict: tests/test_remote_decoders.py); a save root, read at the iteration it names
    Format("megatron-torch-dist", "torch", _fixture("megatron_llama/tp2", ""), dtypes=(AS_WRITTEN,)),
    Format("megatron-zarr", "torch", _fixture("megatron_llama/zarr_tp2", "iter_0000000"), dtypes=(AS_WRITTEN,)),
    Format("meta-llama", "torch", _fixture("meta_llama/mp2", ""), dtypes=(AS_WRITTEN,)),
    Format("torchtune", "torch", _fixture("torchtune_0.6.1/qwen2/torchtune/epoch_0", ""), dtypes=(AS_WRITTEN,)),
)
BY_NAME = {fmt.name: fmt for fmt in FORMATS}


def applicable(fmt: Format, storage: str, path: str) -> bool:
    """Whether the cell exists: the framework can be asked that, there."""
    if path.startswith("load") and fmt.side != "torch" and storage == "s3":
        return False  # Orbax, Flax and T5X reach object storage only by gs://
    if path == "load" and fmt.name.startswith("flax-msgpack") and storage != "local":
        return False  # Flax alone reads a URL through TensorFlow's gfile only (not installed): nothing to compare
    if path == "load-remap" and fmt.dtypes == (AS_WRITTEN,) and not fmt.truncated:
        return False  # a fixture's own remaps are its modules' tests
    if path == "load" and fmt.side == "torch" and fmt.dtypes == (AS_WRITTEN,):
        return False  # a torch fixture loads into its model's state dict: its modules' tests
    return True


def known(cell: str) -> str | None:
    """Why ``cell`` fails today, if :data:`KNOWN` says it does."""
    return next((reason for pattern, reason in KNOWN.items() if fnmatch.fnmatchcase(cell, pattern)), None)


def cells() -> list:
    out = []
    for fmt in FORMATS:
        for storage in STORAGES:
            for dtype in fmt.dtypes:
                for path in PATHS:
                    if not applicable(fmt, storage, path):
                        continue
                    cell = f"{fmt.name}-{storage}-{dtype}-{path}"
                    reason = known(cell)
                    found = next((why for pattern, why in FINDINGS.items() if fnmatch.fnmatchcase(cell, pattern)), None)
                    marks = ([pytest.mark.xfail(strict=True, reason=reason)] if reason else
                             [pytest.mark.xfail(run=False, reason=f"found by the matrix: {found}")] if found else [])
                    out.append(pytest.param(fmt.name, storage, dtype, path, id=cell, marks=marks))
    return out


# -- reading, as each path reads ----------------------------------------------------------------------

#: One array as a cell compares it: dtype name, shape, raw bytes.
Array = tuple[str, tuple[int, ...], bytes]


def from_numpy(value) -> Array:
    value = np.asarray(value)
    return value.dtype.name, tuple(value.shape), np.ascontiguousarray(value).tobytes()


def from_torch(value) -> Array:
    from support.tensors import bits

    return str(value.dtype).removeprefix("torch."), tuple(value.shape), bits(value).numpy().tobytes()


def safetensors_arrays(file: Path) -> dict[str, Array]:
    """A safetensors file's arrays by its header's offsets (no library between: every dtype)."""
    data = file.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    names = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
             "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32", "F64": "float64",
             "I16": "int16", "U16": "uint16", "U32": "uint32", "U64": "uint64"}
    body = data[8 + length:]
    return {key: (names[info["dtype"]], tuple(info["shape"]), body[info["data_offsets"][0]:info["data_offsets"][1]])
            for key, info in header.items() if key != "__metadata__"}


def dcp_arrays(folder: Path) -> dict[str, Array]:
    """A DCP folder (ckptshim's own output) read by torch's ``dcp.load``, hooks off."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(folder).read_metadata()
    state = {key: torch.empty(item.size, dtype=item.properties.dtype)
             for key, item in metadata.state_dict_metadata.items() if isinstance(item, TensorStorageMetadata)}
    ckptshim.uninstall()
    try:
        dcp.load(state, checkpoint_id=folder, no_dist=True)
    finally:
        ckptshim.install()
    return {key: from_torch(value) for key, value in state.items()}


def flat_jax(tree) -> dict[str, Array]:
    from support.trees import flat

    return {key: from_numpy(value) for key, value in flat(tree).items()}


def abstract(stacked: bool) -> dict:
    """The restore target of the written tree: as saved, or its layers stacked (Orbax's
    ``scan_layers``: ``layers/<dtype>`` of shape (LAYERS, *SHAPE))."""
    import jax

    if not stacked:
        return {f"layers_{i}": {name: jax.ShapeDtypeStruct(SHAPE, dtype) for name, dtype in DTYPES.items()}
                for i in range(LAYERS)}
    return {"layers": {name: jax.ShapeDtypeStruct((LAYERS, *SHAPE), dtype) for name, dtype in DTYPES.items()}}


def load(fmt: Format, where: str, scratch: Path, remap: bool) -> dict[str, Array]:
    """The framework's own load call: ``dcp.load`` of a torch state dict (into ``torch.compile``'s
    ``_orig_mod.`` names when remapping), an Orbax restore (into the layers stacked), Flax's
    ``restore_checkpoint``, T5X's ``load_t5x_checkpoint``."""
    if fmt.side == "torch":
        import torch
        import torch.distributed.checkpoint as dcp

        prefix = "_orig_mod." if remap else ""
        state = {prefix + key: torch.zeros_like(value) for key, value in torch_state(written_arrays()).items()}
        try:
            dcp.load(state, checkpoint_id=where, no_dist=True)
        except BaseException as error:
            error.destination_touched = any(value.any() for value in state.values())
            raise
        return {key: from_torch(value) for key, value in state.items()}
    if fmt.name == "t5x-orbax":
        from support.t5x_site import standin_t5x

        with standin_t5x() as t5x:
            return flat_jax(t5x.load_t5x_checkpoint(where))
    import orbax.checkpoint as ocp

    if fmt.name == "t5x-legacy":  # T5X's own loader reads it through gfile; Orbax's restore through ckptshim
        with ocp.PyTreeCheckpointer() as checkpointer:
            return flat_jax(checkpointer.restore(where))
    if fmt.name == "flax-msgpack":
        import jax
        from flax.training import checkpoints as flax_checkpoints

        target = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), abstract(stacked=remap))
        return flat_jax(flax_checkpoints.restore_checkpoint(where, target=target))

    with ocp.StandardCheckpointer() as checkpointer:
        if fmt.dtypes == (AS_WRITTEN,):
            return flat_jax(checkpointer.restore(where))
        return flat_jax(checkpointer.restore(where, abstract(stacked=remap)))


def convert_to(to: str) -> Callable[[Format, str, Path], dict[str, Array]]:
    def run(fmt: Format, where: str, scratch: Path) -> dict[str, Array]:
        from ckptshim.conversion import convert

        out = scratch / ("out.safetensors" if to == "safetensors" else "out")
        convert(where, out, to=to, progress=False)
        return safetensors_arrays(out) if to == "safetensors" else dcp_arrays(out)
    return run


def inspected(fmt: Format, where: str, scratch: Path) -> dict:
    from ckptshim.api import describe, inspect

    info = json.loads(json.dumps(describe(inspect(where))).replace(where.rstrip("/"), "CKPT"))
    info["files"] = [{**file, "path": file["path"]} for file in info["files"]]
    return info


RUN: dict[str, Callable[[Format, str, Path], object]] = {
    "load-remap": lambda fmt, where, scratch: load(fmt, where, scratch, remap=True),
    "load": lambda fmt, where, scratch: load(fmt, where, scratch, remap=False),
    "convert-safetensors": convert_to("safetensors"),
    "convert-dcp": convert_to("dcp"),
    "inspect": inspected,
}


@dataclass(frozen=True)
class Outcome:
    """What one path gave: its result, or the refusal (exception type and text, the checkpoint's
    location written ``CKPT``, and whether the destination was written into first)."""

    result: object = None
    refusal: tuple[str, str, bool | None] | None = None


def attempt(run: Callable[[], object], where: str) -> Outcome:
    from torch.distributed.checkpoint import CheckpointException  # DCP's, a BaseException

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return Outcome(result=run())
        except (Exception, CheckpointException) as error:  # the cell compares it with the local outcome
            if isinstance(error, CheckpointException):  # its text holds each rank's traceback: the errors alone
                text = "; ".join(f"{type(inner).__name__}: {inner}" for inner, _ in error.failures.values())
            else:
                text = str(error)
            text = text.replace(where.rstrip("/"), "CKPT")
            return Outcome(refusal=(type(error).__name__, text, getattr(error, "destination_touched", None)))


# -- the matrix ------------------------------------------------------------------------------------


class Matrix:
    """The module's checkpoints, where each is stored, and each path's outcome, made on first use."""

    def __init__(self, request, root: Path):
        self.request, self.root = request, root
        self.local_root = root / "local"
        self.local_root.mkdir()
        self.names: dict[str, str] = {}
        self.buckets: dict[str, str] = {}
        self.outcomes: dict[tuple[str, str, str], Outcome] = {}

    def local(self, fmt: Format) -> str:
        if fmt.name not in self.names:
            folder = self.local_root / fmt.name
            folder.mkdir()
            self.names[fmt.name] = str(folder / fmt.write(folder))
            if fmt.truncated:
                where = Path(self.names[fmt.name])
                files = {str(file): file.stat().st_size for file in ([where] if fmt.data == "." else where.glob(fmt.data))}
                truncate(max(files, key=files.get), files)
        return self.names[fmt.name]

    def bucket(self, storage: str) -> str:
        if storage not in self.buckets:
            server = self.request.getfixturevalue({"gcs": "gcs_server", "s3": "s3_server"}[storage])
            self.buckets[storage] = server.new_bucket("matrix")
        return self.buckets[storage]

    def where(self, fmt: Format, storage: str) -> str:
        local = self.local(fmt)
        if storage == "local":
            return local
        key = f"{fmt.name}@{storage}"
        if key not in self.names:
            prefix = f"{self.bucket(storage)}/{fmt.name}"
            relative = Path(local).relative_to(self.local_root / fmt.name).as_posix()
            if storage in fmt.bucket_schemes:
                fmt.bucket_write(f"{prefix}/{relative}")
                if fmt.truncated:
                    cut_object_short(f"{prefix}/{relative}", fmt.data)
            else:
                upload(self.local_root / fmt.name, prefix)
            self.names[key] = f"{prefix}/{relative}"
        return self.names[key]

    def outcome(self, fmt: Format, storage: str, path: str) -> Outcome:
        key = (fmt.name, storage, path)
        if key not in self.outcomes:
            where = self.where(fmt, storage)
            scratch = self.root / "out" / "-".join(key)
            scratch.mkdir(parents=True)
            self.outcomes[key] = attempt(lambda: RUN[path](fmt, where, scratch), where)
            # the clients' finalizers (aiohttp sessions) run now, not inside pytest's report of a later cell
            # (CPython 3.11 then fails in ast with "AST constructor recursion depth mismatch")
            gc.collect()
        return self.outcomes[key]


def truncate(file: str, sizes: dict[str, int]) -> None:
    with open(file, "r+b") as handle:
        handle.truncate(sizes[file] - 4)


def cut_object_short(url: str, data: str) -> None:
    """The largest object matching ``data`` below ``url`` rewritten 4 bytes shorter."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    fs.invalidate_cache()
    found = fs.glob(path if data == "." else f"{path}/{data}", detail=True)
    victim = max(found, key=lambda name: found[name]["size"])
    fs.pipe_file(victim, fs.cat_file(victim)[:-4])
    fs.invalidate_cache()


def upload(folder: Path, url: str) -> None:
    """Every file below ``folder`` to the prefix ``url``, in parallel, as the plain objects a copy
    (``gcloud storage cp -r``, ``aws s3 cp --recursive``) makes."""
    import fsspec

    fs, _ = fsspec.core.url_to_fs(url)
    fs.pipe({f"{url}/{file.relative_to(folder).as_posix()}": file.read_bytes()
             for file in folder.rglob("*") if file.is_file()})
    fs.invalidate_cache()


@pytest.fixture(scope="module")
def matrix(request, tmp_path_factory):
    return Matrix(request, tmp_path_factory.mktemp("matrix"))


def of_dtype(arrays: dict[str, Array], dtype: str) -> dict[str, Array]:
    """The arrays of one dtype's cell: those whose last key part names it (every key of a fixture)."""
    if dtype == AS_WRITTEN:
        return arrays
    return {key: value for key, value in arrays.items() if re.split(r"[./]", key)[-1] == dtype}


def cell_view(outcome: Outcome, path: str, dtype: str, unnamed_files: bool = False):
    """What a cell compares: the refusal, or its dtype's arrays (an inspect: its entries and the
    description around them; ``unnamed_files``: its files by their sizes, where two saves name
    their data files at random, as OCDBT does)."""
    if outcome.refusal is not None:
        return outcome.refusal
    if path == "inspect":
        info = dict(outcome.result)
        info["entries"] = [entry for entry in info["entries"]
                           if dtype == AS_WRITTEN or re.split(r"[./]", entry["key"])[-1] == dtype]
        info["files"] = sorted(("" if unnamed_files else Path(f["path"]).name, f["size"], f["expected_size"])
                               for f in info["files"])
        if unnamed_files:
            info["problems"] = [re.sub(r"[0-9a-f]{32}", "FILE", problem) for problem in info["problems"]]
        info.pop("path", None)
        return info
    return of_dtype(outcome.result, dtype)


def expected_values(fmt: Format, path: str, dtype: str) -> list[Array]:
    """What a local cell must read: the written arrays of its dtype (stacked where the path
    remaps into stacked layers)."""
    arrays = [value for (layer, name), value in written_arrays().items() if name == dtype]
    if path == "load-remap" and fmt.side != "torch":
        return [from_numpy(np.stack(arrays))]
    return sorted(from_numpy(value) for value in arrays)


@pytest.mark.parametrize("fmt, storage, dtype, path", cells())
def test_cell(matrix, fmt, storage, dtype, path):
    fmt = BY_NAME[fmt]
    got = matrix.outcome(fmt, storage, path)
    if storage == "local" and fmt.truncated:  # never read wrong silently
        if path == "inspect" and got.refusal is None:
            assert not got.result["complete"] and got.result["problems"], got.result
        else:
            assert got.refusal is not None and not got.refusal[2], got.result
        return
    if storage == "local":
        assert got.refusal is None, got.refusal
        if dtype == AS_WRITTEN:
            assert cell_view(got, path, dtype), "the fixture read as nothing"
        elif path == "inspect":
            entries = cell_view(got, path, dtype)["entries"]
            assert sorted((e["dtype"], tuple(e["shape"])) for e in entries) == \
                [(dtype, SHAPE)] * LAYERS, entries
        else:
            assert sorted(cell_view(got, path, dtype).values()) == expected_values(fmt, path, dtype)
        return
    here = matrix.outcome(fmt, "local", path)
    saved_there = storage in fmt.bucket_schemes  # by the framework itself: its files' names are its own
    assert cell_view(got, path, dtype, saved_there) == cell_view(here, path, dtype, saved_there)


# -- the gcs column against the other GCS server --------------------------------------------------


@pytest.mark.timeout(1200)  # the whole gcs column again: about 360 cells
def test_the_gcs_column_on_fake_gcs_server(request, tmp_path_factory):
    """The GCS clients read their server's address once per process: the gcs cells run again in
    a child pytest whose session server is fake-gcs-server. Its failures are this test's."""
    if request.config.getoption("--gcs-server") == "fake-gcs":
        pytest.skip("this session's GCS server is fake-gcs-server already")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEX",
                          "--gcs-server=fake-gcs", "-k", "gcs and not fake_gcs", __file__,
                          "--basetemp", str(tmp_path_factory.mktemp("fake-gcs-child"))],
                         cwd=TESTS.parent, env=environment(), capture_output=True, text=True, timeout=1100)
    summary = run.stdout[-6000:] + run.stderr[-2000:]
    assert run.returncode == 0, f"the matrix's gcs column on fake-gcs-server:\n{summary}"


# -- random trees ----------------------------------------------------------------------------------

#: The formats of the property test: one torch file, one torch folder, one JAX item.
RANDOM_FORMATS = ("safetensors", "dcp", "orbax-ocdbt")


@st.composite
def random_trees(draw) -> dict[str, np.ndarray]:
    """1-4 arrays: names, shapes (scalars and empty ones included), dtypes and bits all drawn."""
    names = draw(st.lists(st.from_regex(r"[a-z][a-z0-9_]{0,6}", fullmatch=True), min_size=1, max_size=4, unique=True))
    tree = {}
    for name in names:
        shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
        dtype = DTYPES[draw(st.sampled_from(sorted(DTYPES)))]
        size = int(np.prod(shape))
        if dtype == np.bool_:
            tree[name] = np.array(draw(st.lists(st.booleans(), min_size=size, max_size=size)), np.bool_).reshape(shape)
        else:
            tree[name] = np.frombuffer(draw(st.binary(min_size=size * dtype.itemsize, max_size=size * dtype.itemsize)),
                                       dtype).reshape(shape)
    return tree


def write_random(fmt: str, tree: dict[str, np.ndarray], folder: Path) -> Path:
    if fmt == "orbax-ocdbt":
        import jax.numpy as jnp
        import orbax.checkpoint as ocp

        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(folder / "item", {name: jnp.asarray(value) for name, value in tree.items()})
        return folder / "item"
    state = {name: as_tensor(value) for name, value in tree.items()}
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(state, folder / "model.safetensors")
        return folder / "model.safetensors"
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=folder / "dcp", no_dist=True)
    return folder / "dcp"


@pytest.mark.parametrize("storage", ["gcs", "s3"])
@settings(max_examples=10, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large])
@given(tree=random_trees(), fmt=st.sampled_from(RANDOM_FORMATS))
def test_random_trees_convert_from_a_bucket_to_the_same_bytes(matrix, storage, tree, fmt):
    """A random tree saved locally by its library and uploaded: ``convert --to safetensors`` of the
    bucket's copy writes the same bytes as of the local one (or refuses with the same words)."""
    from ckptshim.conversion import convert

    if any(known(f"{fmt}-{storage}-{value.dtype.name}-convert-safetensors") for value in tree.values()):
        reject()  # a matrix cell known to fail (KNOWN): drawn again once its entry is gone
    folder = matrix.root / "random" / uuid.uuid4().hex
    folder.mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            local = write_random(fmt, tree, folder)
        except Exception:
            reject()  # a tree the library itself does not save
    url = f"{matrix.bucket(storage)}/random-{folder.name}"
    upload(folder, url)
    remote = f"{url}/{local.relative_to(folder).as_posix()}"
    outs = {where: folder / f"out-{i}.safetensors" for i, where in enumerate((str(local), remote))}
    outcomes = [attempt(lambda: convert(where, out, to="safetensors", progress=False) and out.read_bytes(), where)
                for where, out in outs.items()]
    assert outcomes[1] == outcomes[0]
