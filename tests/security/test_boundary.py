"""The trust boundary: while ckptshim reads a checkpoint's bytes, whatever goes wrong leaves as a
``ShimError`` naming the file -- one wrapper at each format reader's entry points (detection,
``open_checkpoint``, ``read``/``read_into`` and the futures they return), not case by case.

Each test makes one parser step raise an ordinary exception (as a hostile file makes some
``int()`` or ``.values()`` raise) and checks what comes out: a ``CorruptCheckpointError`` that
names the file and keeps the original exception as its cause.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptshim.errors import CorruptCheckpointError
from ckptshim.formats import detect, dcp, msgpack_tree, safetensors, torch_pickle, ts_arrays
from ckptshim.inventory import Inventory
from support.fixtures import FIXTURES

CHECKPOINTS = {
    "safetensors": FIXTURES / "hf_gptneox_tf4.30.2/safetensors/model.safetensors",
    "hf-dir": FIXTURES / "hf_gptneox_tf4.30.2/safetensors",
    "torch-pickle": FIXTURES / "torch_dcp_single/torch_save/model.pt",
    "torch-dcp": FIXTURES / "torch_dcp_single/dcp_plain",
    "deepspeed-pipeline": FIXTURES / "neox_deepspeed/pp1_mp1/checkpoint",
    "flax-msgpack": FIXTURES / "flax_0.6.11_legacy_msgpack/legacy_msgpack/checkpoint_1",
    "orbax": FIXTURES / "orbax_0.12.8_scanned/standard_checkpointer_scanned",
    "orbax-legacy": FIXTURES / "orbax_0.2.3_unscanned/pytree_checkpointer",
    "orbax-manager": FIXTURES / "maxtext_runs/tiny_scanned/checkpoints",
    "t5x": FIXTURES / "t5x_tiny_decoder/legacy_checkpointer/checkpoint_0",
    "paxml": FIXTURES / "paxml_runs/TinySpmdRepeat/checkpoints",
}


class Boom(TypeError):
    """What a parser step raises here: an ordinary exception, not a ckptshim one."""


def _boom(*args, **kwargs):
    raise Boom("an ordinary exception inside a parser")


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_opening_any_format_raises_only_shim_errors(name, monkeypatch):
    path = CHECKPOINTS[name]
    monkeypatch.setattr(Inventory, "__init__", _boom)
    with pytest.raises(CorruptCheckpointError, match="opening it failed") as info:
        detect.open_checkpoint(path)
    assert str(path) in str(info.value) and isinstance(info.value.__cause__, Boom)


def test_detection_raises_only_shim_errors(monkeypatch):
    monkeypatch.setattr(safetensors, "sniff", _boom)
    monkeypatch.setattr(detect.safetensors, "sniff", _boom)
    path = CHECKPOINTS["safetensors"]
    with pytest.raises(CorruptCheckpointError, match="recognising its format failed") as info:
        detect.detect(path)
    assert str(path) in str(info.value)


class _FailingFuture:
    def result(self):
        raise ValueError("DATA_LOSS: tensorstore could not decode a chunk")


@pytest.mark.parametrize("name, module, function, replacement", [
    ("safetensors", safetensors, "check_view", _boom),
    ("torch-pickle", torch_pickle, "check_view", _boom),
    ("torch-dcp", dcp, "read_chunk", _boom),
    ("flax-msgpack", msgpack_tree, "copy_inline", _boom),
    ("orbax-legacy", ts_arrays.TensorstoreArrays, "read_into", _boom),
])
def test_reading_any_format_raises_only_shim_errors(name, module, function, replacement, monkeypatch):
    checkpoint = detect.open_checkpoint(CHECKPOINTS[name])
    entry = next(iter(checkpoint.inventory.values()))
    monkeypatch.setattr(module, function, replacement)
    with pytest.raises(CorruptCheckpointError, match="reading .* failed") as info:
        checkpoint.read(entry)
    assert str(checkpoint.path) in str(info.value) and isinstance(info.value.__cause__, Boom)


def test_a_reads_future_raises_only_shim_errors(monkeypatch):
    """tensorstore reports a bad chunk when its future is waited on, outside ``read_into``."""
    import numpy as np

    checkpoint = detect.open_checkpoint(CHECKPOINTS["orbax"])
    entry = next(iter(checkpoint.inventory.values()))
    monkeypatch.setattr(ts_arrays.TensorstoreArrays, "read_into", lambda *args: _FailingFuture())
    pending = checkpoint.read_into(entry, (), np.empty(entry.shape, np.float32))
    with pytest.raises(CorruptCheckpointError, match="DATA_LOSS") as info:
        pending.result()
    assert str(checkpoint.path) in str(info.value) and "/".join(entry.key) in str(info.value)


def test_step_listings_raise_only_shim_errors(tmp_path, monkeypatch):
    """The hooks list step folders themselves (``orbax_manager.steps``, ``t5x.steps``...)."""
    from ckptshim.formats import orbax_manager

    monkeypatch.setattr(Path, "iterdir", _boom)
    with pytest.raises(CorruptCheckpointError, match="listing its step folders failed"):
        orbax_manager.steps(FIXTURES / "maxtext_runs/tiny_scanned/checkpoints")
