"""Tensor subclasses in torch files: ckptshim allows exactly what ``torch.load(weights_only=True)``
allows in this process -- torch's own globals plus its safe-globals registry, read at each load --
and runs none of it: a registered subclass is described by its inner tensor's record, a
registered class by an inert value.

Each hostile pickle is built from scratch (``hostile.py``), in the shape ``torch.save`` gives
torchao's float8 training weight (``_rebuild_from_type_v2(_rebuild_wrapper_subclass, cls, args,
state)``), then altered in one respect; each test says what torch does with the same file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import ckptshim
from ckptshim.errors import CorruptCheckpointError, ShimError, UnknownFormatError, UnsafeCheckpointError
from ckptshim.formats import torch_pickle
from hostile import (BUILD, EMPTY_DICT, EMPTY_TUPLE, NEWFALSE, attributes, call, floats, glob, integer, program,
                     runs_code, state_dict, storage, tensor, text, torch_archive, tuple_of, wrapper_subclass)

torch = pytest.importorskip("torch")
pytest.importorskip("torchao.float8")
dcp = pytest.importorskip("torch.distributed.checkpoint")

from support.float8 import build, float8  # noqa: E402
from torch.distributed.checkpoint import CheckpointException  # noqa: E402
from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig  # noqa: E402
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

FLOAT8_WEIGHT = "torchao.float8.fsdp_utils.WeightWithDynamicFloat8CastTensor"
FLOAT8_CLASSES = [WeightWithDynamicFloat8CastTensor, LinearMMConfig, ScaledMMConfig]
W = tensor(storage("0", 4), 0, (4,), (1,))
F8 = glob(*FLOAT8_WEIGHT.rsplit(".", 1))
CONFIG = glob(LinearMMConfig.__module__, "LinearMMConfig")


class Tripwire(torch.Tensor):
    """A tensor subclass whose ``__setstate__`` creates the folder its state names: torch calls it
    when it unpickles one (the process trusted the class); ckptshim never may."""

    def __setstate__(self, state):
        Path(state["marker"]).mkdir()


class TripwireConfig:
    """The same, for a registered class that is not a tensor (a configuration object)."""

    def __setstate__(self, state):
        Path(state["marker"]).mkdir()


def _write(tmp_path: Path, body: bytes, name: str = "model.pt") -> Path:
    path = tmp_path / name
    path.write_bytes(torch_archive(program(state_dict({"w": body})), {"0": floats(1, 2, 3, 4)}))
    return path


def _shim(path: Path) -> dict[str, np.ndarray]:
    checkpoint = torch_pickle.open_checkpoint(path)
    return {".".join(e.key): np.array(checkpoint.read(e)) for e in checkpoint.inventory.values()}


@pytest.fixture
def float8_unregistered():
    """torch's safe-globals registry without torchao's float8 classes (as in a process that never
    imported torchao), restored afterwards."""
    saved = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals([g for g in saved if g not in FLOAT8_CLASSES])
    yield
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals(saved)


# -- the control: a registered wrapper reads as its inner tensor, as torch reads it ---------------


def test_control_a_registered_float8_weight_reads_as_its_inner_tensor(tmp_path):
    path = _write(tmp_path, wrapper_subclass(F8, attributes({"_tensor": W})))
    loaded = torch.load(path, weights_only=True)["w"]
    assert isinstance(loaded, WeightWithDynamicFloat8CastTensor)
    assert _shim(path)["w"].tolist() == loaded._tensor.tolist() == [1, 2, 3, 4]


# -- what torch's registry does not hold is refused, naming it --------------------------------------


def test_subclass_not_in_the_registry_is_refused_naming_it(tmp_path, float8_unregistered):
    path = _write(tmp_path, wrapper_subclass(F8, attributes({"_tensor": W})))
    with pytest.raises(Exception, match="WeightWithDynamicFloat8CastTensor"):
        torch.load(path, weights_only=True)
    with pytest.raises(UnsafeCheckpointError, match=FLOAT8_WEIGHT) as info:
        _shim(path)
    assert str(path) in str(info.value) and "add_safe_globals" in str(info.value)


def test_the_registry_is_read_at_each_load(tmp_path, float8_unregistered):
    """``torch.serialization.safe_globals`` allows the class for the loads inside it, in torch
    and in ckptshim alike, and for no load after it."""
    path = _write(tmp_path, wrapper_subclass(F8, attributes({"_tensor": W})))
    with torch.serialization.safe_globals([WeightWithDynamicFloat8CastTensor]):
        assert torch.load(path, weights_only=True)["w"]._tensor.tolist() == _shim(path)["w"].tolist()
    with pytest.raises(UnsafeCheckpointError, match=FLOAT8_WEIGHT):
        _shim(path)


def test_dcp_chunks_of_an_unregistered_subclass_are_refused_like_torchs_own_reader(tmp_path, float8_unregistered):
    """A real float8 DCP checkpoint: DCP's reader (``torch.load(weights_only=True)`` per chunk)
    refuses it without torchao's registrations, ckptshim too, naming the class."""
    model = float8(build(seed=0))
    dcp.save(model.state_dict(), checkpoint_id=tmp_path / "float8")
    for hooks in ("off", "on"):
        (ckptshim.uninstall if hooks == "off" else ckptshim.install)()
        try:
            with pytest.raises(CheckpointException, match="WeightWithDynamicFloat8CastTensor"):
                dcp.load(model.state_dict(), checkpoint_id=tmp_path / "float8")
        finally:
            ckptshim.install()


def test_an_invented_subclass_is_refused_naming_it(tmp_path):
    path = _write(tmp_path, wrapper_subclass(glob("evil.tensors", "Shadow"), attributes({"_tensor": W})))
    with pytest.raises(Exception):
        torch.load(path, weights_only=True)
    with pytest.raises(UnsafeCheckpointError, match="evil.tensors.Shadow"):
        _shim(path)


def test_a_registered_global_in_a_module_torch_blocks_stays_refused(tmp_path):
    """``add_safe_globals([os.mkdir])`` does not make ``os`` loadable for torch, nor for ckptshim."""
    import os

    marker = tmp_path / "pwned"
    path = _write(tmp_path, runs_code(marker))
    with torch.serialization.safe_globals([os.mkdir]):
        with pytest.raises(Exception, match="blocked"):
            torch.load(path, weights_only=True)
        with pytest.raises(UnsafeCheckpointError, match="os.mkdir"):
            _shim(path)
    assert not marker.exists()


# -- a registered subclass with hostile state: refused or inert -------------------------------------


@pytest.mark.parametrize("body, torch_loads", [
    pytest.param(wrapper_subclass(F8, attributes({"_tensor": integer(5)})), True, id="inner-tensor-is-an-int"),
    pytest.param(wrapper_subclass(F8, attributes({"_tensor": W}), shape=(2, 2)), True, id="inner-tensor-of-another-shape"),
    pytest.param(wrapper_subclass(F8, attributes({"_tensor": tensor(storage("0", 2, "LongStorage"), 0, (2,), (1,))}),
                                  shape=(2,)), True, id="inner-tensor-of-another-dtype"),
    pytest.param(wrapper_subclass(F8, attributes({})), False, id="no-inner-tensor"),
])
def test_a_wrapper_whose_inner_tensor_is_not_its_values_is_refused(tmp_path, body, torch_loads):
    """torch sets whatever attributes the pickle gives, so it returns a float8 weight wrapping an
    int, or a [2, 2] weight around 4 floats; ckptshim reads a wrapper only as an inner tensor of
    the wrapper's own dtype and shape."""
    path = _write(tmp_path, body)
    if torch_loads:
        torch.load(path, weights_only=True)
    with pytest.raises(CorruptCheckpointError, match="_tensor is not a tensor of that dtype and shape") as info:
        _shim(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("body, match", [
    pytest.param(wrapper_subclass(F8, EMPTY_DICT + integer(1) + W + b"s"), "names are not strings",
                 id="attribute-name-is-an-int"),
    pytest.param(wrapper_subclass(F8, attributes({"_tensor": W}), func=CONFIG),
                 "other than torch's tensor rebuild functions", id="rebuilt-by-a-registered-class"),
    pytest.param(wrapper_subclass(CONFIG, attributes({"_tensor": W})), "not a tensor type",
                 id="wrapping-a-registered-class-that-is-no-tensor"),
    pytest.param(wrapper_subclass(F8, attributes({"_tensor": W})) + attributes({"_tensor": W}) + BUILD,
                 "tensor record followed by BUILD", id="build-after-the-wrapper"),
])
def test_a_wrapper_record_torch_refuses_is_refused(tmp_path, body, match):
    path = _write(tmp_path, body)
    with pytest.raises(Exception):
        torch.load(path, weights_only=True)
    with pytest.raises(CorruptCheckpointError, match=match):
        _shim(path)


def test_a_registered_subclass_never_runs_its_code(tmp_path):
    """torch calls a registered subclass's ``__setstate__`` on the checkpoint's state; ckptshim
    does not, and refuses a subclass it cannot read as one tensor of its values."""
    marker = tmp_path / "ran"
    rebuilt = call("torch._tensor", "_rebuild_from_type_v2", glob("torch._utils", "_rebuild_tensor_v2"),
                   glob(Tripwire.__module__, "Tripwire"),
                   tuple_of(storage("0", 4), integer(0), tuple_of(integer(4)), tuple_of(integer(1)), NEWFALSE,
                            call("collections", "OrderedDict")),
                   attributes({"marker": text(str(marker))}))
    path = _write(tmp_path, rebuilt)
    with torch.serialization.safe_globals([Tripwire]):
        with pytest.raises(UnknownFormatError, match="Tripwire, a tensor subclass that torch allows"):
            _shim(path)
        assert not marker.exists()
        torch.load(path, weights_only=True)
    assert marker.exists(), "torch did not run the registered class's code: the test proves nothing"


def test_a_registered_class_is_an_inert_value(tmp_path):
    """A registered non-tensor object beside the weights (NEWOBJ, then BUILD with its state):
    torch runs its ``__setstate__``; ckptshim keeps an inert value and reads the weights."""
    marker = tmp_path / "ran"
    config = (glob(TripwireConfig.__module__, "TripwireConfig") + EMPTY_TUPLE + b"\x81"  # NEWOBJ
              + attributes({"marker": text(str(marker))}) + BUILD)
    path = tmp_path / "model.pt"
    path.write_bytes(torch_archive(program(state_dict({"w": W, "config": config})), {"0": floats(1, 2, 3, 4)}))
    with torch.serialization.safe_globals([TripwireConfig]):
        assert _shim(path)["w"].tolist() == [1, 2, 3, 4]
        assert not marker.exists()
        torch.load(path, weights_only=True)
    assert marker.exists(), "torch did not run the registered class's code: the test proves nothing"


def test_errors_never_escape_as_other_types(tmp_path):
    """Whatever a wrapper record holds, what leaves the reader is a ShimError naming the file."""
    for state in (integer(5), tuple_of(integer(1), integer(2), integer(3)), attributes({"_tensor": F8})):
        path = _write(tmp_path, wrapper_subclass(F8, state))
        with pytest.raises(ShimError) as info:
            _shim(path)
        assert str(path) in str(info.value)
