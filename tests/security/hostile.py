"""Building hostile checkpoints from scratch: pickles opcode by opcode, torch.save archives around
them, and a runner that confines an attack to a child process with a memory and time limit.

Every attack test builds its input here by what the attack *is* (a BUILD after a tensor record,
a memo index in the billions, a map of a million empty maps), not by flipping bytes of a
fixture: byte flips rarely produce a well-formed pickle or msgpack that lies.
"""

from __future__ import annotations

import io
import os
import pickle
import resource
import struct
import subprocess
import sys
import textwrap
import zipfile
from dataclasses import dataclass
from pathlib import Path

# -- pickle opcodes (protocol 2; see pickletools) --------------------------------------------------

PROTO = b"\x80\x02"
MARK, STOP, TUPLE, REDUCE, BUILD = b"(", b".", b"t", b"R", b"b"
EMPTY_DICT, EMPTY_LIST, EMPTY_TUPLE = b"}", b"]", b")"
SETITEM, SETITEMS, APPEND, APPENDS = b"s", b"u", b"a", b"e"
TUPLE1, TUPLE2, TUPLE3 = b"\x85", b"\x86", b"\x87"
NONE, NEWTRUE, NEWFALSE, BINPERSID = b"N", b"\x88", b"\x89", b"Q"


def glob(module: str, name: str) -> bytes:
    """GLOBAL: push ``module.name`` (what ``find_class`` is asked for)."""
    return b"c" + f"{module}\n{name}\n".encode()


def text(value: str) -> bytes:
    raw = value.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def integer(value: int) -> bytes:
    if 0 <= value < 256:
        return b"K" + bytes([value])
    if -2**31 <= value < 2**31:
        return b"J" + struct.pack("<i", value)
    raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw  # LONG1


def floating(value: float) -> bytes:
    return b"G" + struct.pack(">d", value)  # BINFLOAT


def put(index: int) -> bytes:
    """BINPUT / LONG_BINPUT: store the top of the stack in the memo at ``index``."""
    return b"q" + bytes([index]) if index < 256 else b"r" + struct.pack("<I", index)


def get(index: int) -> bytes:
    return b"h" + bytes([index]) if index < 256 else b"j" + struct.pack("<I", index)


def tuple_of(*items: bytes) -> bytes:
    return MARK + b"".join(items) + TUPLE


def call(module: str, name: str, *args: bytes) -> bytes:
    """``module.name(*args)`` through GLOBAL, a tuple and REDUCE."""
    return glob(module, name) + tuple_of(*args) + REDUCE


def storage(key: str, numel: int, kind: str = "FloatStorage") -> bytes:
    """A persistent id as torch.save writes it: ``('storage', torch.<kind>, key, 'cpu', numel)``."""
    return tuple_of(text("storage"), glob("torch", kind), text(key), text("cpu"), integer(numel)) + BINPERSID


def tensor(storage_record: bytes, offset: int, shape: tuple[int, ...], stride: tuple[int, ...]) -> bytes:
    """``torch._utils._rebuild_tensor_v2(storage, offset, shape, stride, False, OrderedDict())``."""
    return call("torch._utils", "_rebuild_tensor_v2", storage_record, integer(offset),
                tuple_of(*map(integer, shape)), tuple_of(*map(integer, stride)), NEWFALSE,
                call("collections", "OrderedDict"))


def attributes(items: dict[str, bytes]) -> bytes:
    """A dict of attribute name -> already-pickled value."""
    return EMPTY_DICT + MARK + b"".join(text(k) + v for k, v in items.items()) + SETITEMS


def wrapper_subclass(cls: bytes, state: bytes, shape: tuple[int, ...] = (4,), dtype: str = "float32",
                     func: bytes | None = None) -> bytes:
    """A tensor subclass as ``torch.save`` pickles one that owns no storage (torchao's float8
    training weight): ``torch._tensor._rebuild_from_type_v2(_rebuild_wrapper_subclass, cls,
    (cls, torch.<dtype>, shape, strides, 0, torch.strided, cpu, False), state)`` -- ``func`` in
    place of ``_rebuild_wrapper_subclass``, if given."""
    strides = [1] * len(shape)
    for axis in range(len(shape) - 2, -1, -1):
        strides[axis] = strides[axis + 1] * shape[axis + 1]
    args = tuple_of(cls, glob("torch", dtype), tuple_of(*map(integer, shape)), tuple_of(*map(integer, strides)),
                    integer(0), call("torch.serialization", "_get_layout", text("torch.strided")),
                    call("torch", "device", text("cpu")), NEWFALSE)
    rebuild = func if func is not None else glob("torch._utils", "_rebuild_wrapper_subclass")
    return call("torch._tensor", "_rebuild_from_type_v2", rebuild, cls, args, state)


def state_dict(items: dict[str, bytes], ordered: bool = True) -> bytes:
    """A dict (an ``OrderedDict``, as ``model.state_dict()`` is) of already-pickled values."""
    opener = call("collections", "OrderedDict") if ordered else EMPTY_DICT
    return opener + MARK + b"".join(text(k) + v for k, v in items.items()) + SETITEMS


def shared_tuple(levels: int, memo: int = 10**6, leaf: bytes = b"K\x01") -> bytes:
    """A tuple ``levels`` deep whose every level is ``(previous, previous)``: the pickle grows by
    a few bytes per level, the tree it describes (what ``hash``, ``str`` or a walk visits) by a
    factor of two. Uses memo slots ``memo`` to ``memo + levels``."""
    body = leaf + put(memo)
    for level in range(levels):
        body += get(memo + level) + TUPLE2 + put(memo + level + 1)  # (top, top): one item on the stack
    return body


def program(body: bytes) -> bytes:
    """A complete pickle: protocol header, ``body`` (which leaves one object), STOP."""
    return PROTO + body + STOP


def runs_code(marker: Path) -> bytes:
    """A pickled object whose unpickling creates the folder ``marker``: ``os.mkdir(marker)``, the
    shape of every ``__reduce__`` exploit (``os.system`` would do the same through a shell)."""
    return call("os", "mkdir", text(str(marker)))


# -- torch.save archives --------------------------------------------------------------------------


def torch_archive(data_pkl: bytes, storages: dict[str, bytes], *, prefix: str = "archive",
                  extra: list[tuple[str, bytes]] = ()) -> bytes:
    """A zip laid out as ``torch.save`` lays it out: ``data.pkl`` first, ``byteorder``, one
    stored member ``data/<key>`` per storage, ``version``; ``extra`` members are appended as
    given (a name twice is possible: ``zipfile`` warns and writes it)."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr(f"{prefix}/data.pkl", data_pkl)
        archive.writestr(f"{prefix}/byteorder", b"little")
        for key, raw in storages.items():
            archive.writestr(f"{prefix}/data/{key}", raw)
        archive.writestr(f"{prefix}/version", b"3\n")
        for name, raw in extra:
            with _quiet_duplicates():
                archive.writestr(name, raw)
    return out.getvalue()


class _quiet_duplicates:
    def __enter__(self):
        import warnings

        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("ignore", UserWarning)

    def __exit__(self, *exc):
        self._catch.__exit__(*exc)


def floats(*values: float) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


# -- running an attack under limits --------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """How a confined child ended: its exit status, what it printed, and its peak memory."""

    returncode: int
    stdout: str
    stderr: str
    peak_rss_mb: float
    timed_out: bool

    @property
    def signalled(self) -> bool:
        return self.returncode < 0


def confined(code: str, *, memory_mb: int = 1500, seconds: float = 60, cwd: Path | None = None) -> Outcome:
    """Run ``code`` (Python source) in a fresh interpreter whose address space is capped at
    ``memory_mb`` and whose run is cut off after ``seconds``: a regression that allocates
    gigabytes or loops fails the test instead of taking the machine down.

    The child imports the ckptshim this process imported, in a clean environment; it reports
    its own peak RSS on its last line of stdout as ``PEAK_RSS_MB=<n>``.
    """
    source = textwrap.dedent(code) + textwrap.dedent("""
        import re as _re  # VmHWM: this process's own peak (ru_maxrss counts the forked parent's)
        _peak = _re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read())
        print(f"PEAK_RSS_MB={int(_peak.group(1)) / 1024:.1f}")
        """)
    limit = memory_mb * 2**20

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    import ckptshim

    # the ckptshim under test, and nothing a previous test left in the environment (a launcher
    # bootstrap folder on PYTHONPATH, CKPTSHIM_* switches)
    env = {key: value for key, value in os.environ.items() if not key.startswith("CKPTSHIM_")}
    env.update(PYTHONPATH=str(Path(ckptshim.__file__).resolve().parent.parent), JAX_PLATFORMS="cpu",
               OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="3")
    try:
        done = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True,
                              timeout=seconds, preexec_fn=cap, env=env, cwd=cwd)
    except subprocess.TimeoutExpired as expired:
        return Outcome(-9, _text(expired.stdout), _text(expired.stderr), 0.0, True)
    peak = 0.0
    for line in done.stdout.splitlines():
        if line.startswith("PEAK_RSS_MB="):
            peak = float(line.split("=", 1)[1])
    return Outcome(done.returncode, done.stdout, done.stderr, peak, False)


def _text(raw: bytes | str | None) -> str:
    return raw.decode(errors="replace") if isinstance(raw, bytes) else (raw or "")


def pickle_size(tree: object) -> int:
    return len(pickle.dumps(tree, protocol=2))


# -- DCP folders built from torch's own classes ----------------------------------------------------


class Mkdir:
    """Pickles as ``os.mkdir(path)``: what an attacker's ``__reduce__`` looks like. Saved with
    ``dcp.save`` or ``torch.save`` (nothing runs then); it runs only if something unpickles it
    without an allow-list."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return os.mkdir, (self.path,)


def read_dcp_metadata(folder: Path, name: str = ".metadata"):
    """A DCP folder's metadata as torch's own objects (our own, trusted, just-saved file)."""
    with open(folder / name, "rb") as f:
        return pickle.load(f)


def write_dcp_metadata(folder: Path, metadata, name: str = ".metadata") -> None:
    with open(folder / name, "wb") as f:
        pickle.dump(metadata, f)


def add_chunk_file(folder: Path, name: str, archives: list[bytes]) -> list[tuple[int, int]]:
    """Write ``archives`` (torch.save archives) back to back into ``folder/name``, as DCP's
    writer lays chunks out; returns each one's ``(offset, length)``."""
    spans, offset = [], 0
    with open(folder / name, "wb") as out:
        for archive in archives:
            out.write(archive)
            spans.append((offset, len(archive)))
            offset += len(archive)
    return spans


def torch_saved(value) -> bytes:
    import torch

    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def write_sharded_dcp(folder: Path, tensors: dict, chunks: dict[str, list[tuple[tuple, tuple]]]) -> None:
    """A DCP folder as ``FileSystemWriter`` lays one out, with each tensor of ``tensors`` stored
    as the given ``(offsets, sizes)`` chunks (each chunk its own torch.save archive of that
    block, all in ``__0_0.distcp``) and ``.metadata`` built from torch's own metadata classes."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                       TensorProperties, TensorStorageMetadata)

    folder.mkdir(parents=True, exist_ok=True)
    archives, keys, records = [], [], {}
    for fqn, value in tensors.items():
        blocks = []
        for offsets, sizes in chunks[fqn]:
            block = value[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].clone()
            archives.append(torch_saved(block))
            keys.append(MetadataIndex(fqn, torch.Size(offsets)))
            blocks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
        records[fqn] = TensorStorageMetadata(TensorProperties(dtype=value.dtype), value.size(), blocks)
    spans = add_chunk_file(folder, "__0_0.distcp", archives)
    storage = {key: _StorageInfo("__0_0.distcp", offset, length) for key, (offset, length) in zip(keys, spans)}
    write_dcp_metadata(folder, Metadata(state_dict_metadata=records, storage_data=storage,
                                        planner_data={fqn: (fqn,) for fqn in tensors}, version="1.0.0"))


def refusal(error: BaseException):
    """ckptshim's own error: the exception itself, or what DCP's ``CheckpointException``
    carries from every rank; ``None`` when the failure was not a ckptshim refusal."""
    from ckptshim.errors import ShimError

    if isinstance(error, ShimError):
        return error
    failures = getattr(error, "failures", None) or {}
    found = [exc for exc, _ in failures.values() if isinstance(exc, ShimError)]
    return found[0] if found and len(found) == len(failures) else None
