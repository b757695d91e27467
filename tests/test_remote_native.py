"""What works without ckptshim on object storage, against real local servers -- and the same
calls with ckptshim on, which must work identically (the step-aside rule).

Each case saves with the framework's own API to ``s3://`` or ``gs://`` and restores it twice:
with the hooks uninstalled (the native outcome this file pins) and with them installed, where
ckptshim has nothing to change and must step aside. Orbax routes only ``gs://`` to tensorstore
(an ``s3://`` save fails inside Orbax: "Checkpoint path should be absolute"), so its cases are
``gs://`` only.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import pytest
import torch
from torch import nn

import ckptshim
from support.markers import QUIET

pytestmark = [QUIET, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

T = TypeVar("T")
MODES = pytest.mark.parametrize("mode", ["native", "ckptshim"])


def restored(mode: str, call: Callable[[], T]) -> T:
    """``call()`` with ckptshim's hooks off (``"native"``) or on (``"ckptshim"``)."""
    if mode == "ckptshim":
        return call()
    ckptshim.uninstall()
    try:
        return call()
    finally:
        ckptshim.install()


# -- Orbax (gs:// only) --------------------------------------------------------------------------


def jax_tree() -> dict:
    import jax.numpy as jnp

    return {"dense": {"kernel": jnp.arange(24, dtype=jnp.float32).reshape(4, 6), "bias": jnp.full(6, 0.5, jnp.bfloat16)},
            "step": jnp.asarray(7, jnp.int32)}


def assert_same_tree(got: Any, want: Any) -> None:
    import jax

    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.dtype == b.dtype and np.asarray(a).tobytes() == np.asarray(b).tobytes()


def abstract(tree: dict) -> dict:
    import jax
    import orbax.checkpoint as ocp

    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


@MODES
def test_orbax_standard_checkpointer_gs(gs_bucket, mode):
    import orbax.checkpoint as ocp

    tree, path = jax_tree(), f"{gs_bucket}/standard/1"
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, tree)
        checkpointer.wait_until_finished()
        assert_same_tree(restored(mode, lambda: checkpointer.restore(path, abstract(tree))), tree)


@MODES
def test_orbax_pytree_checkpointer_gs(gs_bucket, mode):
    import orbax.checkpoint as ocp

    tree, path = jax_tree(), f"{gs_bucket}/pytree/1"
    checkpointer = ocp.PyTreeCheckpointer()
    checkpointer.save(path, tree)
    assert_same_tree(restored(mode, lambda: checkpointer.restore(path, item=abstract(tree))), tree)


@MODES
def test_orbax_checkpoint_manager_gs(gs_bucket, mode):
    import orbax.checkpoint as ocp

    tree = jax_tree()
    with ocp.CheckpointManager(f"{gs_bucket}/run") as manager:
        manager.save(3, args=ocp.args.StandardSave(tree))
        manager.wait_until_finished()
    with ocp.CheckpointManager(f"{gs_bucket}/run") as manager:
        assert manager.all_steps() == [3]
        got = restored(mode, lambda: manager.restore(3, args=ocp.args.StandardRestore(abstract(tree))))
    assert_same_tree(got, tree)


# -- DCP through fsspec (s3:// and gs://) --------------------------------------------------------


def torch_state() -> dict[str, torch.Tensor]:
    return {"weight": torch.arange(24, dtype=torch.float32).reshape(4, 6), "bias": torch.full((6,), 0.5, dtype=torch.bfloat16),
            "count": torch.tensor(7)}


def assert_same_state(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key in want:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key


def empty_like(state: dict) -> dict:
    return {key: torch.zeros_like(value) for key, value in state.items()}


@MODES
def test_dcp_checkpoint_id_url(bucket, mode):
    import torch.distributed.checkpoint as dcp

    state, url = torch_state(), f"{bucket}/dcp/step_1"
    dcp.save(state, checkpoint_id=url)
    target = empty_like(state)
    restored(mode, lambda: dcp.load(target, checkpoint_id=url))
    assert_same_state(target, state)


@MODES
def test_dcp_fsspec_reader_and_writer(bucket, mode):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    state, url = torch_state(), f"{bucket}/dcp/step_2"
    dcp.save(state, storage_writer=FsspecWriter(url))
    target = empty_like(state)
    restored(mode, lambda: dcp.load(target, storage_reader=FsspecReader(url)))
    assert_same_state(target, state)


# -- files the user fetches through fsspec, loaded into a module ---------------------------------


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


@MODES
def test_torch_file_through_fsspec(bucket, mode):
    import fsspec

    source = model()
    with fsspec.open(f"{bucket}/model.pt", "wb") as file:
        torch.save(source.state_dict(), file)
    with fsspec.open(f"{bucket}/model.pt", "rb") as file:
        state = torch.load(io.BytesIO(file.read()), weights_only=True)
    target = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    restored(mode, lambda: target.load_state_dict(state))
    assert_same_state(target.state_dict(), source.state_dict())


@MODES
def test_safetensors_through_fsspec(bucket, mode):
    import fsspec
    from safetensors.torch import load, save

    source = model()
    fs, path = fsspec.core.url_to_fs(f"{bucket}/model.safetensors")
    fs.pipe(path, save(source.state_dict()))
    state = load(fs.cat_file(path))
    target = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    restored(mode, lambda: target.load_state_dict(state))
    assert_same_state(target.state_dict(), source.state_dict())


@MODES
def test_lightning_fabric_save_and_load(bucket, mode):
    """Fabric writes and reads checkpoints at any fsspec URL itself (``cloud_io``)."""
    L = pytest.importorskip("lightning")

    fabric = L.Fabric(accelerator="cpu", devices=1)
    source = model()
    fabric.save(f"{bucket}/fabric/last.ckpt", {"model": source, "step": 5})
    target = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    state = {"model": target, "step": 0}
    restored(mode, lambda: fabric.load(f"{bucket}/fabric/last.ckpt", state))
    assert state["step"] == 5
    assert_same_state(target.state_dict(), source.state_dict())
