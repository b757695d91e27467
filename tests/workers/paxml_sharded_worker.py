"""Run by ``test_paxml.py`` in a fresh process with 4 forced CPU devices (see
``test_orbax_sharded.py`` for why), on the real PaxML ``state/`` folder given as argv[1]:

- restores it unrepeated into targets sharded over a 2x2 mesh and checks every device's buffer
  against its slice of ``numpy.take`` of the natively read stack;
- restores it into a MaxText GPT-3 train state scanned on axis 1 (layer axes moved, the fused
  ``combined_qkv`` split), sharded over the same mesh, and checks every device's buffer against
  its slice of the converter's numpy transforms (``test_paxml_gpt3.expected_state``);
- asks for a sharding that does not divide an array (the fused ``qkv_proj``'s axis of 3 over 2
  devices) and reports the error it gets.

Prints one JSON line.
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
from test_paxml_gpt3 import expected_state


def sharded(mesh, expected: dict) -> dict:
    """Targets sharded over both mesh axes wherever a dimension divides evenly."""
    target = {}
    for key, value in expected.items():
        spec = P(*(name if n % 2 == 0 else None for name, n in zip(("a", "b"), value.shape)))
        target[key] = jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=NamedSharding(mesh, spec))
    return target


def check(restored: dict, target: dict, expected: dict) -> dict:
    checked = 0
    for key, array in restored.items():
        assert array.sharding == target[key].sharding, key
        for shard in array.addressable_shards:
            assert np.array_equal(np.asarray(shard.data), expected[key][shard.index]), (key, shard.index)
            checked += 1
    return {"arrays": len(restored), "shards": checked}


def main(state_dir: Path) -> None:
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 2), ("a", "b"))
    checkpoint = inspect(state_dir)
    stored = {key: checkpoint.read(entry).copy() for key, entry in checkpoint.inventory.items()}
    checkpoint.close()
    expected = {}
    for key, value in stored.items():
        if "repeat" in key and key[0] == "mdl_vars":
            at = key.index("repeat")
            for layer in range(value.shape[0]):
                expected[key[:at] + (f"x_layers_{layer}",) + key[at + 3:]] = np.take(value, layer, axis=0)
    target = sharded(mesh, expected)
    restored = flatten(ocp.PyTreeCheckpointer().restore(state_dir, args=ocp.args.PyTreeRestore(
        unflatten(target), partial_restore=True)))
    report = {"devices": len(jax.devices()), "unrepeated": check(restored, target, expected)}

    expected = expected_state(stored, "scan1", fused=False)
    target = sharded(mesh, expected)
    restored = flatten(ocp.StandardCheckpointer().restore(state_dir, unflatten(target)))
    report["maxtext"] = check(restored, target, expected)

    fused = expected_state(stored, "scan1", fused=True)
    key = ("params", "params", "decoder", "layers", "self_attention", "qkv_proj", "kernel")
    value = fused[key]  # [embed, layers, 3, heads, head_dim]: 3 does not split in 2
    bad = {key: jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=NamedSharding(mesh, P(None, None, "a")))}
    try:
        ocp.StandardCheckpointer().restore(state_dir, unflatten(bad))
        report["indivisible"] = "restored"
    except Exception as error:  # what kind of error, and whether ckptshim's note names the key
        report["indivisible"] = f"{type(error).__name__}: {error}"
        report["indivisible_notes"] = list(getattr(error, "__notes__", []))
    print(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
