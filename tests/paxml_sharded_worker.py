"""Run by ``test_paxml.py`` in a fresh process with 4 forced CPU devices (see
``test_orbax_sharded.py`` for why): restores the real PaxML ``state/`` folder given as argv[1]
unrepeated into targets sharded over a 2x2 mesh and checks every device's buffer against its
slice of ``numpy.take`` of the natively read stack. Prints one JSON line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec as P

import ckptshim  # noqa: F401  (installs the hooks)
from ckptshim.api import inspect
from ckptshim.inventory import flatten, unflatten


def main(state_dir: Path) -> None:
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 2), ("a", "b"))
    checkpoint = inspect(state_dir)
    stored = {key: checkpoint.read(entry).copy() for key, entry in checkpoint.inventory.items()}
    checkpoint.close()
    expected, target = {}, {}
    for key, value in stored.items():
        if "repeat" in key and key[0] == "mdl_vars":
            at = key.index("repeat")
            for layer in range(value.shape[0]):
                expected[key[:at] + (f"x_layers_{layer}",) + key[at + 3:]] = np.take(value, layer, axis=0)
    for key, value in expected.items():
        spec = P(*(name if n % 2 == 0 else None for name, n in zip(("a", "b"), value.shape)))
        target[key] = jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=NamedSharding(mesh, spec))
    restored = flatten(ocp.PyTreeCheckpointer().restore(state_dir, args=ocp.args.PyTreeRestore(
        unflatten(target), partial_restore=True)))
    checked = 0
    for key, array in restored.items():
        assert array.sharding == target[key].sharding, key
        for shard in array.addressable_shards:
            assert np.array_equal(np.asarray(shard.data), expected[key][shard.index]), (key, shard.index)
            checked += 1
    print(json.dumps({"devices": len(jax.devices()), "arrays": len(restored), "shards": checked}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
