"""PaxML's FLAX-type save reproduced with the real writers it calls (PaxML cannot be installed).

Shared by ``test_paxml_flax.py`` (whose docstring cites the PaxML and praxis sources each piece
follows) and the ``paxml_flax`` fuzz harness: a praxis-like ``NestedMap`` pytree, PaxML's
``TrainState`` fields, the nesting of a PaxML tensorstore run's arrays into that train state,
and Orbax's ``MsgpackHandler`` writing ``{'flattened_state', 'str_pytree_state'}``.
"""

from __future__ import annotations

import asyncio
import re

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from flax import struct


class NestedMap(dict):
    """praxis' NestedMap as far as pytrees see it: a dict node whose auxiliary data is its keys."""


jax.tree_util.register_pytree_with_keys(
    NestedMap,
    lambda m: ([(jax.tree_util.DictKey(k), m[k]) for k in sorted(m)], tuple(sorted(m))),
    lambda keys, values: NestedMap(zip(keys, values, strict=True)),
    lambda m: ([m[k] for k in sorted(m)], tuple(sorted(m))))


class TrainState(struct.PyTreeNode):
    """The fields of PaxML's ``TrainState``, in its order."""

    step: object
    mdl_vars: object
    opt_states: list
    extra_state: object = ()


def nested(flat: dict[tuple[str, ...], np.ndarray]) -> NestedMap:
    out = NestedMap()
    for key, value in flat.items():
        node = out
        for part in key[:-1]:
            node = node.setdefault(part, NestedMap())
        node[key[-1]] = value
    return out


def pax_train_state(stored: dict[tuple[str, ...], np.ndarray]) -> TrainState:
    """``opt_states_0.<prefix>_<i>.<...>``: list position 0, then tuple position i of ``<prefix>``."""
    chains: dict[str, dict[int, dict]] = {}
    for key, value in stored.items():
        if key[0] == "opt_states_0":
            prefix, i = re.fullmatch(r"(.+)_(\d+)", key[1]).groups()
            chains.setdefault(prefix, {}).setdefault(int(i), {})[key[2:]] = value
    opt_state = NestedMap({prefix: tuple(nested(by_index[i]) for i in range(len(by_index)))
                           for prefix, by_index in chains.items()})
    return TrainState(step=stored[("step",)],
                      mdl_vars=nested({k[1:]: v for k, v in stored.items() if k[0] == "mdl_vars"}),
                      opt_states=[opt_state])


def pax_payload(stored) -> dict:
    """What ``FlaxCheckpointHandler.async_save`` stores for this train state."""
    flattened_state, pytree_state = jax.tree_util.tree_flatten(jax.device_get(pax_train_state(stored)))
    return {"flattened_state": flattened_state, "str_pytree_state": str(pytree_state)}


def write_with_orbax(state_dir, payload) -> None:
    async def save():
        return await ocp.aggregate_handlers.MsgpackHandler().serialize(epath.Path(state_dir) / "checkpoint", payload)

    state_dir.mkdir(parents=True)
    asyncio.run(save()).result()
