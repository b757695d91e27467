"""The calls a damaged checkpoint is loaded through, each with the destination it would write.

A loader is built from the intact copy (so the destination has the checkpoint's real layout, or
the other layout the hook must map onto), then called after the damage. ``destination()``
lists the caller's own tensors or arrays, which the test hashes before and after.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import ckptshim
from ckptshim import api
from ckptshim.errors import ShimError
from ckptshim.inventory import Inventory, unflatten
from support.fixtures import FIXTURES


@dataclass
class Load:
    call: Callable[[], Any]
    destination: Callable[[], Iterable[Any]] = lambda: ()


def digest(values: Iterable[Any]) -> str:
    """One hash over every destination value's bytes, dtype and shape."""
    h = hashlib.sha256()
    for value in values:
        array = value.detach().cpu().contiguous().view(-1).view(_byte_dtype()).numpy() \
            if _is_tensor(value) else np.asarray(value)
        h.update(f"{getattr(value, 'dtype', '')}{getattr(value, 'shape', '')}".encode())
        h.update(np.ascontiguousarray(array).tobytes())
    return h.hexdigest()


def _is_tensor(value: Any) -> bool:
    return type(value).__module__.startswith("torch")


def _byte_dtype():
    import torch

    return torch.uint8


def refusal(error: BaseException) -> ShimError | None:
    """ckptshim's error itself, or the one DCP's ``CheckpointException`` carries for a rank."""
    if isinstance(error, ShimError):
        return error
    failures = getattr(error, "failures", None) or {}
    found = [exc for exc, _ in failures.values() if isinstance(exc, ShimError)]
    return found[0] if found and len(found) == len(failures) else None


def _inventory(path: Path) -> Inventory:
    checkpoint = ckptshim.inspect(path)
    checkpoint.close()
    return checkpoint.inventory


def _check(path: Path) -> None:
    checkpoint = ckptshim.inspect(path)
    try:
        checkpoint.require_complete()
    finally:
        checkpoint.close()


def inspect(fmt, path: Path, original: Path) -> Load:
    return Load(lambda: _check(path))


def plan(fmt, path: Path, original: Path) -> Load:
    """A dry run of the damaged checkpoint against the intact original."""
    return Load(lambda: api.plan(path, like=original))


def dcp(fmt, path: Path, original: Path) -> Load:
    """``dcp.load`` into a state dict of the checkpoint's keys (DCP reads straight into it)."""
    import torch
    import torch.distributed.checkpoint as dcp_module

    checkpoint = ckptshim.inspect(path)
    checkpoint.close()
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for entry in checkpoint.inventory.values():
        dtype = getattr(torch, entry.dtype)
        values = torch.randint(0, 2 if dtype == torch.bool else 100, entry.shape, generator=generator)
        tensors[entry.key] = values.to(dtype)
    if checkpoint.format == "torch-dcp":  # DCP saved {"model": model.state_dict()}: nest it again
        state: dict = {}
        for key, tensor in tensors.items():
            state.setdefault(key[0], {})[".".join(key[1:])] = tensor
    else:
        state = {".".join(key): tensor for key, tensor in tensors.items()}
    return Load(lambda: dcp_module.load(state, checkpoint_id=path), lambda: tensors.values())


def _jax_target(fmt, path: Path) -> dict:
    """Concrete arrays in the layout the hook must restore into (another one where it exists,
    so that ckptshim -- not the framework -- does the reading)."""
    import jax.numpy as jnp

    inventory = _inventory(FIXTURES / fmt.target if fmt.target else path / fmt.item)
    leaves = {}
    for entry in inventory.values():
        if fmt.target_keys and entry.key[0] not in fmt.target_keys:
            continue
        count = int(np.prod(entry.shape))
        leaves[entry.key] = jnp.asarray(np.arange(count).reshape(entry.shape) % 5, dtype=jnp.dtype(entry.dtype))
    return unflatten(leaves)


def _leaves(tree: Any) -> list[Any]:
    import jax

    return jax.tree_util.tree_leaves(tree)


def orbax(fmt, path: Path, original: Path) -> Load:
    import orbax.checkpoint as ocp

    target = _jax_target(fmt, path)

    def call() -> Any:
        with ocp.StandardCheckpointer() as checkpointer:
            return checkpointer.restore(path, target)
    return Load(call, lambda: _leaves(target))


def pytree(fmt, path: Path, original: Path) -> Load:
    """``PyTreeCheckpointer().restore`` with ``PyTreeRestore`` args (Orbax's older entry point)."""
    import orbax.checkpoint as ocp

    target = _jax_target(fmt, path)

    def call() -> Any:
        with ocp.PyTreeCheckpointer() as checkpointer:
            return checkpointer.restore(path, args=ocp.args.PyTreeRestore(target))
    return Load(call, lambda: _leaves(target))


def manager(fmt, path: Path, original: Path) -> Load:
    """``CheckpointManager(root).restore(step, args=Composite(items=StandardRestore(target)))``:
    the manager's own step and item resolution before the item is read."""
    import orbax.checkpoint as ocp

    target = _jax_target(fmt, path)

    def call() -> Any:
        with ocp.CheckpointManager(path) as checkpoints:
            return checkpoints.restore(fmt.step, args=ocp.args.Composite(items=ocp.args.StandardRestore(target)))
    return Load(call, lambda: _leaves(target))


def flax(fmt, path: Path, original: Path) -> Load:
    from flax.training import checkpoints

    target = _jax_target(fmt, path)
    return Load(lambda: checkpoints.restore_checkpoint(path.parent, target=target), lambda: _leaves(target))


def t5x(fmt, path: Path, original: Path) -> Load:
    import t5x.checkpoints  # the stand-in, installed by the suite's fixture

    return Load(lambda: t5x.checkpoints.load_t5x_checkpoint(str(path)))


def deepspeed(fmt, path: Path, original: Path) -> Load:
    """What the ``load_state_dir`` hook does for one pipeline stage: plan every layer's state
    dict from the checkpoint (all checks), then each layer's own ``load_state_dict``."""
    from ckptshim.formats.detect import open_checkpoint
    from ckptshim.loading.deepspeed import layer_state_dicts
    from test_neox import neox_layers

    layers = neox_layers()

    def call() -> None:
        source = open_checkpoint(path)
        try:
            states = layer_state_dicts(source, layers, 0, 1)
        finally:
            source.close()
        for index, layer in layers.items():
            layer.load_state_dict(states.get(index, {}))
    return Load(call, lambda: [t for layer in layers.values() for t in layer.state_dict().values()])


LOADERS: dict[str, Callable[[Any, Path, Path], Load]] = {
    "inspect": inspect, "plan": plan, "dcp": dcp, "orbax": orbax, "pytree": pytree, "manager": manager,
    "flax": flax, "t5x": t5x, "deepspeed": deepspeed,
}
