"""Loads into device memory: the one staging path (``execute/staging.py``) and CUDA destinations.

On a CPU-only machine the staging path is exercised by making every destination count as device
memory (``destinations.in_host_memory``, the one device check of every writer): the DCP
reader's chunk copies, ``FormatReader``'s copies and the torch executor's stacked writes then
all go through the bounded staging buffer, and the values must still be the checkpoint's, bit
for bit. The CUDA tests at the end run only where a GPU is present.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, strategies as st

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

import ckptshim  # noqa: E402
from ckptshim.execute import destinations, staging  # noqa: E402
from support.fixtures import FIXTURES  # noqa: E402
from support.markers import QUIET  # noqa: E402
from support.tensors import bits  # noqa: E402
from test_dcp import build, module_from, reference, stacked_twin  # noqa: E402
from torch.distributed.checkpoint.state_dict import set_model_state_dict  # noqa: E402

pytestmark = QUIET
TINY = FIXTURES / "torch_dcp_single"


# -- the staging buffer -------------------------------------------------------------------------------


@given(shape=st.lists(st.integers(0, 6), max_size=4).map(tuple), itemsize=st.sampled_from([1, 2, 4, 8]),
       capacity=st.integers(8, 200))
def test_blocks_cover_every_element_once_and_fit_the_buffer(shape, itemsize, capacity):
    seen = np.zeros(shape, np.int64)
    for index in staging.blocks(shape, itemsize, capacity):
        assert seen[index].size * itemsize <= capacity
        seen[index] += 1
    assert (seen == 1).all()


def test_copy_through_a_buffer_smaller_than_a_row(monkeypatch):
    """A transposed float32 source into a strided bfloat16 destination, 24 bytes at a time (a row
    is 28): the same bits as one ``copy_``, and the buffer never larger."""
    monkeypatch.setattr(staging, "CAPACITY", 24)
    source = torch.randn(7, 5, 6).transpose(0, 2)
    staged, direct = torch.zeros(6, 5, 14, dtype=torch.bfloat16), torch.zeros(6, 5, 14, dtype=torch.bfloat16)
    staging.copy(staged[:, :, ::2], source)
    direct[:, :, ::2].copy_(source)
    assert torch.equal(bits(staged), bits(direct))


# -- every writer through the staging path ------------------------------------------------------------


@pytest.fixture
def staged_copies(monkeypatch) -> list[int]:
    """Every destination counts as device memory; the bytes each staged copy moved, in order."""
    moved: list[int] = []
    copy = staging.copy

    def counting(destination, source):
        moved.append(source.numel() * source.element_size())
        copy(destination, source)

    monkeypatch.setattr(destinations, "in_host_memory", lambda tensor: False)
    monkeypatch.setattr(staging, "copy", counting)
    monkeypatch.setattr(staging, "CAPACITY", 4096)  # an lm_head of 64 KiB takes 16 blocks
    ckptshim.install()
    return moved


def assert_reference(state_dict: dict) -> None:
    expected = reference()
    for key, value in state_dict.items():
        plain = key.removeprefix("model.").replace("_orig_mod.", "")
        assert torch.equal(bits(value), bits(expected[plain])), key


@pytest.mark.parametrize("folder", ["dcp_plain", "torch_save/model.pt"])
def test_dcp_load_stages_every_tensor(staged_copies, folder):
    state_dict = torch.compile(build(seed=3)).state_dict()
    dcp.load({"model": state_dict} if folder == "dcp_plain" else state_dict, checkpoint_id=TINY / folder)
    assert_reference(state_dict)
    assert len(staged_copies) == len(state_dict)


@pytest.mark.parametrize("call", ["load_state_dict", "set_model_state_dict", "dcp.load"])
def test_stacked_writes_stage_every_layer(staged_copies, call):
    module = module_from(stacked_twin(reference()))
    if call == "load_state_dict":
        module.load_state_dict(reference())
    elif call == "set_model_state_dict":
        set_model_state_dict(module, reference())
    else:
        dcp.load(module.state_dict(), checkpoint_id=TINY / "dcp_plain")
    ref = reference()
    for key, value in module.state_dict().items():
        if key.startswith("layers."):
            expected = torch.stack([ref[f"layers.{i}.{key[7:]}"] for i in range(2)])
        else:
            expected = ref[key]
        assert torch.equal(bits(value), bits(expected)), key
    assert staged_copies, "no write went through the staging buffer"


# -- CUDA destinations (where a GPU is present) ---------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


@cuda
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_dcp_load_into_a_model_on_cuda(compiled):
    model = build(seed=3).cuda()
    if compiled:
        model = torch.compile(model)
    state_dict = model.state_dict()
    dcp.load({"model": state_dict}, checkpoint_id=TINY / "dcp_plain")
    assert all(value.is_cuda for value in state_dict.values())
    assert_reference(state_dict)


@cuda
def test_load_state_dict_into_a_model_on_cuda():
    model = torch.compile(build(seed=3).cuda())
    model.load_state_dict(torch.load(TINY / "torch_save" / "model.pt", weights_only=True))
    assert_reference(model.state_dict())


@cuda
def test_float8_dcp_into_a_float8_model_on_cuda(tmp_path):
    pytest.importorskip("torchao.float8")
    from support.float8 import float8, mismatches

    dcp.save({"model": torch.compile(float8(build(seed=0))).state_dict()}, checkpoint_id=tmp_path / "float8")
    model = float8(build(seed=3)).cuda()
    dcp.load({"model": model.state_dict()}, checkpoint_id=tmp_path / "float8")
    assert not mismatches(model.state_dict(), reference())


@cuda
def test_fsdp2_on_one_gpu(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1)
    try:
        model = build(seed=3).cuda()
        mesh = init_device_mesh("cuda", (1,))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        state_dict = torch.compile(model).state_dict()
        dcp.load({"model": state_dict}, checkpoint_id=TINY / "dcp_plain")
        assert_reference({key: value.full_tensor() if isinstance(value, DTensor) else value
                          for key, value in state_dict.items()})
    finally:
        dist.destroy_process_group()
