"""Hash and expansion bombs: one value referred to many ways, so that hashing it (as a dictionary
key) or printing it (in an error message) takes time exponential in a few hundred bytes of pickle.

The key attack goes around the interpreter's own check of ``SETITEM`` keys: a dictionary built
by a global from a list of pairs -- ``collections.OrderedDict(pairs)`` through ``REDUCE``, in a
``torch.save`` file, a DCP ``.metadata`` and DeepSpeed's engine state (``argparse.Namespace``).
``torch.load(weights_only=True)`` hangs on the torch file too; ckptshim refuses it. The message
attack puts such a value where a parser's error message used to quote it (``str(value)[:80]``
builds the whole string first), or where a label is built from it (a DCP or DeepSpeed version).
Each attack runs in a confined child with a time limit: a regression fails instead of hanging.
"""

from __future__ import annotations

import pickle

import pytest

from ckptshim.errors import MAX_MESSAGE, CorruptCheckpointError
from ckptshim.formats import detect
from hostile import (APPENDS, EMPTY_LIST, MARK, TUPLE2, call, confined, floats, program, read_dcp_metadata,
                     shared_tuple, state_dict, storage, tensor, text, torch_archive, write_dcp_metadata,
                     write_sharded_dcp)
from support.fixtures import FIXTURES, writable_copy

LEVELS = 64  # 2**64 leaves: no hash or str() of it ever finishes


def _opened(path, seconds: float = 30):
    """Open ``path`` in a confined child; what came out (``OPENED <version>`` or ``REFUSED ...``)."""
    return confined(f"""
        from pathlib import Path
        from ckptshim.formats import detect
        try:
            checkpoint = detect.open_checkpoint(Path({str(path)!r}))
            print("OPENED", checkpoint.version, len(checkpoint.inventory))
        except Exception as error:
            print("REFUSED", type(error).__name__, len(str(error)), str(error)[:400])
        """, memory_mb=1024, seconds=seconds)


def _pairs(*pairs: bytes) -> bytes:
    """A list of already-pickled (key, value) tuples."""
    return EMPTY_LIST + MARK + b"".join(pairs) + APPENDS


def _tensor4() -> bytes:
    return tensor(storage("0", 4), 0, (4,), (1,))


def test_ordered_dict_from_pairs_reads_as_torch_reads_it(tmp_path):
    """The control: ``OrderedDict([("w", tensor)])`` through REDUCE, with a plain key."""
    torch = pytest.importorskip("torch")
    path = tmp_path / "model.pt"
    path.write_bytes(torch_archive(program(call("collections", "OrderedDict", _pairs(text("w") + _tensor4() + TUPLE2))),
                                   {"0": floats(1, 2, 3, 4)}))
    checkpoint = detect.open_checkpoint(path)
    assert list(checkpoint.inventory) == [("w",)]
    assert checkpoint.read(checkpoint.inventory[("w",)]).tolist() == [1, 2, 3, 4]
    assert torch.load(path, weights_only=True)["w"].tolist() == [1, 2, 3, 4]


def test_torch_file_ordered_dict_keyed_by_an_exponentially_hashing_tuple(tmp_path):
    """Before: ``dict(pairs)`` hashed the key for ever, inside ``open_checkpoint``."""
    path = tmp_path / "model.pt"
    bomb = call("collections", "OrderedDict", _pairs(shared_tuple(LEVELS) + _tensor4() + TUPLE2))
    path.write_bytes(torch_archive(program(bomb), {"0": floats(1, 2, 3, 4)}))
    outcome = _opened(path)
    assert not outcome.timed_out, "hashing the key did not finish"
    assert "REFUSED CorruptCheckpointError" in outcome.stdout and "model.pt" in outcome.stdout, \
        outcome.stdout + outcome.stderr[-2000:]
    assert "dictionary key or set member" in outcome.stdout


def _dcp_folder(tmp_path):
    torch = pytest.importorskip("torch")
    folder = tmp_path / "ckpt"
    write_sharded_dcp(folder, {"w": torch.arange(16.0).reshape(4, 4)}, {"w": [((0, 0), (4, 4))]})
    return folder


def test_dcp_metadata_ordered_dict_keyed_by_an_exponentially_hashing_tuple(tmp_path):
    """``.metadata`` building ``OrderedDict([(((x, x), (x, x))..., 1)])`` after the metadata
    object (and popping it again). Before: hashed for ever."""
    folder = _dcp_folder(tmp_path)
    raw = pickle.dumps(read_dcp_metadata(folder), protocol=4)
    bomb = call("collections", "OrderedDict", _pairs(shared_tuple(LEVELS) + b"K\x01" + TUPLE2))
    (folder / ".metadata").write_bytes(raw[:-1] + bomb + b"0.")
    outcome = _opened(folder)
    assert not outcome.timed_out, "hashing the key did not finish"
    assert "REFUSED CorruptCheckpointError" in outcome.stdout and ".metadata" in outcome.stdout, \
        outcome.stdout + outcome.stderr[-2000:]


class _Shared(tuple):
    """Pickled as a plain tuple (by ``pickle.dumps``, memoised: a few bytes per level)."""


def _shared_value(levels: int = LEVELS) -> tuple:
    value: tuple = (1,)
    for _ in range(levels):
        value = (value, value)
    return value


@pytest.mark.parametrize("where", ["chunk sizes", "storage file", "version"])
def test_dcp_metadata_value_shared_many_ways_is_refused_with_a_short_message(tmp_path, where):
    """A DCP record field holding a tuple 64 levels deep. Before: the chunk sizes' error message
    was ``str(sizes)[:80]`` (the whole string built first), the storage file name ``str()`` of
    the value, the version printed into ``inspect``'s label -- each for ever."""
    folder = _dcp_folder(tmp_path)
    metadata = read_dcp_metadata(folder)
    if where == "chunk sizes":
        metadata.state_dict_metadata["w"].chunks[0].sizes = _shared_value()
    elif where == "storage file":
        (info,) = metadata.storage_data.values()
        object.__setattr__(info, "relative_path", _shared_value())
    else:
        metadata.version = _shared_value()
    write_dcp_metadata(folder, metadata)
    assert (folder / ".metadata").stat().st_size < 20_000
    outcome = _opened(folder)
    assert not outcome.timed_out, "formatting the value did not finish"
    assert "REFUSED CorruptCheckpointError" in outcome.stdout and ".metadata" in outcome.stdout, \
        outcome.stdout + outcome.stderr[-2000:]
    assert int(outcome.stdout.split()[2]) < 2000  # the message's length


def _neox_with_engine_state(tmp_path, engine: bytes):
    """The NeoX pp1 fixture whose ``mp_rank_00`` file holds ``engine`` (a pickled dict body)."""
    step = writable_copy(FIXTURES / "neox_deepspeed/pp1_mp1/checkpoint/global_step0", tmp_path / "global_step0")
    (step / "mp_rank_00_model_states.pt").write_bytes(torch_archive(program(engine), {}))
    return step


@pytest.mark.parametrize("attack", ["ds_version", "numpy.dtype", "argparse.Namespace"])
def test_deepspeed_engine_state_shared_many_ways_is_refused(tmp_path, attack):
    """A tuple 64 levels deep in the engine state beside the layer files: as ``ds_version``
    (printed into the checkpoint's label), given to ``numpy.dtype`` (which used to run
    ``str()`` of it) and as a key of ``argparse.Namespace(pairs)`` (hashed). Refused -- by the
    walk's bound on shared structure, by the stand-ins' own checks -- naming the file."""
    bomb = {"ds_version": shared_tuple(LEVELS),
            "numpy.dtype": call("numpy", "dtype", shared_tuple(LEVELS), b"\x89", b"\x88"),
            "argparse.Namespace": call("argparse", "Namespace", _pairs(shared_tuple(LEVELS) + b"K\x01" + TUPLE2))}
    step = _neox_with_engine_state(tmp_path, state_dict({attack.split(".")[-1]: bomb[attack]}, ordered=False))
    outcome = _opened(step)
    assert not outcome.timed_out, "the engine state did not finish"
    assert "REFUSED CorruptCheckpointError" in outcome.stdout and "mp_rank_00" in outcome.stdout, \
        outcome.stdout + outcome.stderr[-2000:]


def test_a_message_listing_many_long_problems_keeps_its_beginning_and_end(tmp_path):
    """A torch file naming 5,000 storages of 1,000-character keys that it does not hold: the
    refusal of a load lists them all (5 MB of text); the error keeps at most ``MAX_MESSAGE``
    characters, its beginning (the file) and its end (what to do)."""
    keys = [f"{i:04d}" + "k" * 1000 for i in range(5000)]
    body = state_dict({f"w{i}": tensor(storage(key, 1), 0, (1,), (1,)) for i, key in enumerate(keys)})
    path = tmp_path / "model.pt"
    path.write_bytes(torch_archive(program(body), {}))
    checkpoint = detect.open_checkpoint(path)
    assert len(checkpoint.all_problems()) == 5000
    with pytest.raises(CorruptCheckpointError) as info:
        checkpoint.require_complete()
    message = str(info.value)
    assert len(message) <= MAX_MESSAGE + 100 and "characters left out" in message
    assert message.startswith(str(path)) and message.endswith("before loading it.")
