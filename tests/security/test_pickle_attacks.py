"""``torch.save`` files whose pickle lies at the opcode level: the torch-file reader agrees with
``torch.load(weights_only=True)`` on every file torch accepts, refuses what torch refuses, and
refuses (rather than mis-reads) the few hostile files torch accepts but a state dict never is.

Every file is built from scratch (``hostile.py``): a protocol-2 pickle assembled opcode by
opcode inside a zip laid out as torch.save lays it out, so each test says exactly what the
attack is. Resource attacks run in a confined child (memory cap, time limit).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ckptshim.errors import CorruptCheckpointError, ShimError
from ckptshim.formats import torch_pickle
from hostile import (BUILD, EMPTY_DICT, EMPTY_LIST, APPEND, MARK, SETITEMS, call, confined, floats, get, glob,
                     integer, program, put, state_dict, storage, tensor, text, torch_archive, tuple_of)

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

FOUR = floats(1, 2, 3, 4)


def _write(tmp_path: Path, data_pkl: bytes, storages: dict | None = None, **archive) -> Path:
    path = tmp_path / "model.pt"
    path.write_bytes(torch_archive(data_pkl, {"0": FOUR} if storages is None else storages, **archive))
    return path


def _shim(path: Path) -> dict[str, np.ndarray]:
    checkpoint = torch_pickle.open_checkpoint(path)
    try:
        checkpoint.require_complete()
        return {".".join(e.key): np.array(checkpoint.read(e)) for e in checkpoint.inventory.values()}
    finally:
        checkpoint.close()


def _torch(path: Path) -> dict[str, np.ndarray]:
    return {key: value.numpy() for key, value in torch.load(path, weights_only=True).items()}


def _assert_same_as_torch(path: Path) -> None:
    expected, found = _torch(path), _shim(path)
    assert found.keys() == expected.keys()
    for key in expected:
        assert found[key].dtype == expected[key].dtype and np.array_equal(found[key], expected[key]), key


def _assert_both_refuse(path: Path, match: str) -> None:
    with pytest.raises(Exception):
        torch.load(path, weights_only=True)
    with pytest.raises(CorruptCheckpointError, match=match) as info:
        _shim(path)
    assert str(path) in str(info.value)


def _attributes(**names: bytes) -> bytes:
    """``BUILD`` with a dict of attribute name -> pickled value, applied to the top object."""
    return EMPTY_DICT + MARK + b"".join(text(k) + v for k, v in names.items()) + SETITEMS + BUILD


W = tensor(storage("0", 4), 0, (4,), (1,))


# -- files torch loads: ckptshim reads the same values --------------------------------------------


def test_control_a_plain_state_dict(tmp_path):
    _assert_same_as_torch(_write(tmp_path, program(state_dict({"w": W}))))


def test_state_dict_metadata_attribute_is_allowed(tmp_path):
    """torch.save writes a state dict's ``_metadata`` as BUILD state on the OrderedDict."""
    data = program(state_dict({"w": W}) + _attributes(_metadata=call("collections", "OrderedDict")))
    _assert_same_as_torch(_write(tmp_path, data))


def test_one_storage_key_with_two_dtypes_reads_as_the_first_record(tmp_path):
    """The second record names key 0 as int64: torch hands it the first record's float32
    storage; ckptshim read the bytes as int64 (garbage)."""
    data = program(state_dict({"a": W, "b": tensor(storage("0", 2, "LongStorage"), 0, (2,), (1,))}))
    path = _write(tmp_path, data)
    _assert_same_as_torch(path)
    assert _shim(path)["b"].tolist() == [1.0, 2.0]


def test_build_on_a_storage_changes_nothing(tmp_path):
    """torch lets BUILD give a storage attributes (they change nothing it reads); so does ckptshim."""
    record = tensor(storage("0", 4) + _attributes(numel=integer(10**12)), 0, (4,), (1,))
    _assert_same_as_torch(_write(tmp_path, program(state_dict({"w": record}))))


def test_memo_index_in_the_billions_costs_nothing(tmp_path):
    """``LONG_BINPUT 775000000``: CPython's C unpickler sized its memo table to it and zeroed
    about 12 GiB for a 6 KiB file. A memo that is a dictionary (as torch's own) costs one entry."""
    data = program(state_dict({"w": W + put(775_000_000), "v": get(775_000_000)}))
    path = _write(tmp_path, data)
    _assert_same_as_torch(path)
    outcome = confined(f"""
        from pathlib import Path
        from ckptshim.formats import torch_pickle
        checkpoint = torch_pickle.open_checkpoint(Path({str(path)!r}))
        print(sorted(".".join(k) for k in checkpoint.inventory))
        """, memory_mb=1024, seconds=60)
    assert outcome.returncode == 0, outcome.stderr[-2000:]
    assert "['v', 'w']" in outcome.stdout and outcome.peak_rss_mb < 300


# -- files torch refuses: ckptshim refuses them too -----------------------------------------------


@pytest.mark.parametrize("numel", [64, 2], ids=["more-elements-than-the-member", "fewer-elements"])
def test_storage_size_must_be_its_members_size(tmp_path, numel):
    """A storage claiming 64 floats over a 16-byte member: ``convert`` wrote the zip's own
    headers as weights. torch requires the member to hold exactly numel x itemsize bytes."""
    path = _write(tmp_path, program(state_dict({"w": tensor(storage("0", numel), 0, (numel,), (1,))})))
    _assert_both_refuse(path, "holds 16 bytes, but its storage record declares")


def test_tensor_past_the_first_records_storage(tmp_path):
    """The first record of key 0 is 2 int64; a later float32 [4] view of it reaches past it."""
    data = program(state_dict({"b": tensor(storage("0", 2, "LongStorage"), 0, (2,), (1,)), "a": W}))
    _assert_both_refuse(_write(tmp_path, data), "reaches past its storage")


@pytest.mark.parametrize("state", [
    pytest.param(_attributes(offset=integer(10**9)), id="dict"),
    pytest.param(tuple_of(EMPTY_DICT, EMPTY_DICT) + BUILD, id="state-and-slots"),
])
def test_build_on_a_tensor_record_is_refused(tmp_path, state):
    """BUILD after ``_rebuild_tensor_v2`` rewrote the frozen record after it was checked."""
    data = program(state_dict({"w": W + state}))
    _assert_both_refuse(_write(tmp_path, data), "tensor record followed by BUILD")


def test_protocol_4_opcodes_torch_does_not_read(tmp_path):
    """torch's weights_only unpickler has no FRAME, MEMOIZE or SHORT_BINUNICODE; ckptshim read
    such a file with CPython's unpickler all the same."""
    import pickle

    data = b"\x80\x04\x95" + (10).to_bytes(8, "little") + pickle.dumps({}, protocol=4)[11:]
    _assert_both_refuse(_write(tmp_path, data, storages={}), "an opcode torch.save files do not use")


# -- hostile files torch accepts: refused, never mis-read -----------------------------------------


@pytest.mark.parametrize("names", [
    pytest.param({"values": integer(5)}, id="values-is-an-int"),
    pytest.param({name: glob("collections", "OrderedDict") for name in ("values", "items", "keys", "__iter__")},
                 id="methods-hidden-by-a-class"),
])
def test_ordereddict_attribute_hiding_its_methods(tmp_path, names):
    """``values = 5`` made inspect raise TypeError; ``values = OrderedDict`` (and items, keys)
    made every tensor vanish: 'inspect: 0 arrays, complete', 'convert: an empty file, exit 0'.
    torch loads both; a state dict never carries such an attribute, and reading it would be a
    guess about which view of the dictionary is meant, so ckptshim refuses, naming them."""
    path = _write(tmp_path, program(state_dict({"w": W}) + _attributes(**names)))
    assert list(torch.load(path, weights_only=True)) == ["w"]
    with pytest.raises(CorruptCheckpointError, match="values") as info:
        _shim(path)
    assert str(path) in str(info.value) and "hide the dictionary's own methods" in str(info.value)


def test_duplicate_zip_member_is_refused(tmp_path):
    """Two ``data/0`` members: torch reads the first, Python's zipfile (and ckptshim) the last."""
    path = _write(tmp_path, program(state_dict({"w": W})), extra=[("archive/data/0", floats(9, 9, 9, 9))])
    assert torch.load(path, weights_only=True)["w"].tolist() == [1, 2, 3, 4]
    with pytest.raises(CorruptCheckpointError, match="holds 'archive/data/0' twice"):
        _shim(path)


def test_record_offset_moved_by_build_after_its_check_does_not_crash_the_process(tmp_path):
    """``dcp.load`` of a 697-byte .pt whose tensor record BUILD set to offset -2**40, stride
    2**40 after the record was checked: the view reached 4 TiB past the map (SIGSEGV/SIGBUS)."""
    record = W + _attributes(offset=integer(-2**40), shape=tuple_of(integer(2)), stride=tuple_of(integer(2**40)))
    path = _write(tmp_path, program(state_dict({"w": record})))
    outcome = confined(f"""
        import torch, torch.distributed.checkpoint as dcp, ckptshim
        try:
            dcp.load({{"w": torch.zeros(2)}}, checkpoint_id={str(path)!r}, no_dist=True)
        except BaseException as error:  # DCP's CheckpointException is not an Exception
            print("REFUSED", type(error).__name__, "BUILD" in str(error))
        """, memory_mb=4096, seconds=120)
    assert not outcome.signalled, f"the process died of signal {-outcome.returncode}"
    assert "REFUSED" in outcome.stdout and "True" in outcome.stdout, outcome.stdout + outcome.stderr[-2000:]


def _nested_tuple_key(levels: int) -> bytes:
    """A dict key that is a tuple nested ``levels`` deep, each level holding the one below
    twice (memo GET): a few hundred bytes, 2**levels elements to hash."""
    body = integer(1) + put(0)
    for level in range(levels):
        body = body + get(level) + b"\x86" + put(level + 1)  # TUPLE2 of (x, x)
    return body


def test_exponentially_shared_tuple_as_a_key_is_refused_fast(tmp_path):
    """CPython's unpickler (and torch's) hash a dict key as it is set; a 64-level shared tuple
    never finishes hashing. ckptshim refuses a key that cannot hash in constant time."""
    data = program(EMPTY_DICT + _nested_tuple_key(64) + W + b"s")  # SETITEM
    path = _write(tmp_path, data)
    outcome = confined(f"""
        from pathlib import Path
        from ckptshim.formats import torch_pickle
        try:
            torch_pickle.open_checkpoint(Path({str(path)!r}))
        except Exception as error:
            print("REFUSED", type(error).__name__, str(error)[:300])
        """, memory_mb=1024, seconds=30)
    assert not outcome.timed_out, "hashing the key did not finish"
    assert "REFUSED CorruptCheckpointError" in outcome.stdout and "dictionary key" in outcome.stdout


def test_deeply_nested_lists_are_refused_in_linear_time(tmp_path):
    """300,000 nested lists (900 KB): flattening the tree took time quadratic in its depth
    (over 60 s). ckptshim refuses nesting deeper than any state dict."""
    levels = 300_000
    nested = EMPTY_LIST * levels + APPEND * (levels - 1)
    path = _write(tmp_path, program(state_dict({"w": W, "deep": nested})))
    assert path.stat().st_size > 600_000
    outcome = confined(f"""
        import time
        from pathlib import Path
        from ckptshim.formats import torch_pickle
        start = time.perf_counter()
        try:
            torch_pickle.open_checkpoint(Path({str(path)!r}))
        except Exception as error:
            print("REFUSED", type(error).__name__, "nest deeper" in str(error))
        print("SECONDS", time.perf_counter() - start)
        """, memory_mb=1500, seconds=60)
    assert not outcome.timed_out and "REFUSED CorruptCheckpointError True" in outcome.stdout, \
        outcome.stdout + outcome.stderr[-2000:]
    seconds = float(outcome.stdout.split("SECONDS ")[1].split()[0])
    assert seconds < 10


def test_stride_zero_tensor_claiming_four_tebibytes(tmp_path):
    """A 4-byte storage viewed as [2**20]*3 with strides 0: torch loads it (an expanded view),
    so does ckptshim (inspect lists it as it is). ``convert`` cannot write 4 TiB: a clear
    refusal, not a MemoryError traceback, and nothing left behind."""
    record = tensor(storage("0", 1), 0, (2**20,) * 3, (0, 0, 0))
    path = _write(tmp_path, program(state_dict({"w": record})), storages={"0": floats(1.5)})
    loaded = torch.load(path, weights_only=True)["w"]
    found = _shim_entry(path)
    assert found.shape == tuple(loaded.shape) and found[5, 7, 9] == loaded[5, 7, 9].item() == 1.5
    outcome = confined(f"""
        import sys
        from ckptshim.cli import main
        sys.exit(main(["convert", {str(path)!r}, {str(tmp_path / "out.safetensors")!r}, "--to", "safetensors"]))
        """, memory_mb=3000, seconds=120)
    assert outcome.returncode == 1 and "Traceback" not in outcome.stderr, outcome.stderr[-3000:]
    assert "memory" in outcome.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt"]


def _shim_entry(path: Path) -> np.ndarray:
    checkpoint = torch_pickle.open_checkpoint(path)
    return checkpoint.read(checkpoint.inventory[("w",)])


def test_errors_name_the_file_and_never_escape_as_other_types(tmp_path):
    """Whatever the pickle does, what leaves the reader is a ShimError naming the file."""
    for body in (state_dict({"w": W}) + APPEND, call("collections", "OrderedDict", integer(5)), b"N" + b"R"):
        path = _write(tmp_path, program(body))
        with pytest.raises(ShimError) as info:
            torch_pickle.open_checkpoint(path)
        assert str(path) in str(info.value)
