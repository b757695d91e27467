"""Run by ``test_orbax_sharded.py`` in a fresh process with 4 forced CPU devices.

``XLA_FLAGS=--xla_force_host_platform_device_count=4`` must be set before jax initialises and
would change every other test's device count, so this runs on its own. It saves real Orbax
checkpoints (unscanned and scanned, 4 layers), restores each into the other layout sharded over
a 2x2 mesh (layer axis and model axis), and checks that every device's buffer equals its slice
and that the reads made were exactly the devices' slices, each once. Prints one JSON line.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec as P

import ckptshim  # noqa: F401  (installs the hooks)
from ckptshim.formats.orbax import OrbaxCheckpoint
from support.trees import nest

LAYERS, EMB, MLP = 4, 8, 16


def values() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    out = {}
    for i in range(LAYERS):
        out[f"params/decoder/layers_{i}/mlp/wi/kernel"] = rng.standard_normal((EMB, MLP)).astype(np.float32)
        out[f"params/decoder/layers_{i}/norm/scale"] = rng.standard_normal(EMB).astype(np.float32)
    out["params/decoder/embed"] = rng.standard_normal((MLP, EMB)).astype(np.float32)
    return out


def stacked(flat: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {k: v for k, v in flat.items() if "/layers_" not in k}
    for key in flat:
        if "/layers_0/" in key:
            out[key.replace("/layers_0/", "/layers/")] = np.stack(
                [flat[key.replace("/layers_0/", f"/layers_{i}/")] for i in range(LAYERS)], axis=1)
    return out


class Reads:
    """Counts every slice read ckptshim makes, by (key, index)."""

    def __init__(self) -> None:
        self.calls: Counter = Counter()
        self.bytes = 0
        self._original = OrbaxCheckpoint.read_into

    def __enter__(self):
        counter = self

        def counting(checkpoint, entry, index, out):
            counter.calls["/".join(entry.key), _bounds(index, entry.shape)] += 1
            counter.bytes += out.nbytes
            return counter._original(checkpoint, entry, index, out)

        OrbaxCheckpoint.read_into = counting
        return self

    def __exit__(self, *exc) -> None:
        OrbaxCheckpoint.read_into = self._original


def _bounds(index: tuple, shape: tuple[int, ...]) -> tuple:
    out, dims = [], iter(shape)
    for part in index:
        size = next(dims)
        out.append(part if isinstance(part, int) else part.indices(size)[:2])
    return tuple(out)


def check(restored: dict, expected: dict[str, np.ndarray], specs: dict[str, P], mesh) -> None:
    for key, want in expected.items():
        array = _get(restored, key)
        assert array.sharding == NamedSharding(mesh, specs[key]), (key, array.sharding)
        for shard in array.addressable_shards:
            assert np.array_equal(np.asarray(shard.data), want[shard.index]), (key, shard.device)


def _get(tree: dict, key: str):
    for part in key.split("/"):
        tree = tree[part]
    return tree


def expected_reads(target_key: str, array_shape, sharding, source_key_of) -> Counter:
    """The reads a restore makes for one target (per layer in each, for a stacked target): the
    process's distinct device slices read once each, or, where they are contiguous runs of the
    box they tile (split along one axis, every axis before it of extent one), that box read once."""
    slices = {tuple(s.indices(n)[:2] for s, n in zip(idx, array_shape))
              for idx in sharding.devices_indices_map(array_shape).values()}
    box = tuple((min(s[axis][0] for s in slices), max(s[axis][1] for s in slices)) for axis in range(len(array_shape)))
    varying = [axis for axis in range(len(array_shape)) if len({s[axis] for s in slices}) > 1]
    if len(varying) == 1 and all(box[axis][1] - box[axis][0] == 1 for axis in range(varying[0])):
        slices = {box}
    return Counter((key, sub) for index in slices for key, sub in source_key_of(target_key, index))


def main(root: Path) -> None:
    mesh = jax.make_mesh((2, 2), ("layers", "model"))
    flat = values()
    scanned = stacked(flat)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(root / "unscanned", nest(flat))
        checkpointer.save(root / "scanned", nest(scanned))
        checkpointer.wait_until_finished()

    # unscanned -> scanned: the layer axis (1) over "layers", the mlp axis over "model"
    specs = {"params/decoder/layers/mlp/wi/kernel": P(None, "layers", "model"),
             "params/decoder/layers/norm/scale": P(None, "layers"),
             "params/decoder/embed": P("model", None)}
    target = nest({k: jax.ShapeDtypeStruct(scanned[k].shape, scanned[k].dtype, sharding=NamedSharding(mesh, specs[k]))
                   for k in scanned})
    with Reads() as reads, ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(root / "unscanned", target)
    check(restored, scanned, specs, mesh)

    def per_layer(key, index):
        if "/layers/" not in key:
            return [(key, index)]
        (layer_start, layer_stop), inner = index[1], index[:1] + index[2:]
        return [(key.replace("/layers/", f"/layers_{i}/"), inner) for i in range(layer_start, layer_stop)]

    want = sum((expected_reads(k, scanned[k].shape, NamedSharding(mesh, specs[k]), per_layer) for k in scanned),
               Counter())
    assert reads.calls == want, (sorted(reads.calls.items()), sorted(want.items()))
    stacked_bytes = reads.bytes

    # scanned -> unscanned: layer i of the stacked arrays, mlp axis over "model" (2 devices each)
    specs_u = {k: (P(None, "model") if k.endswith("kernel") else P()) if "/layers_" in k else P("model", None)
               for k in flat}
    target_u = nest({k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, specs_u[k]))
                     for k, v in flat.items()})
    with Reads() as reads, ocp.StandardCheckpointer() as checkpointer:
        restored_u = checkpointer.restore(root / "scanned", target_u)
    check(restored_u, flat, specs_u, mesh)

    def one_layer(key, index):
        if "/layers_" not in key:
            return [(key, index)]
        layer = int(key.split("/layers_")[1].split("/")[0])
        whole = key.replace(f"/layers_{layer}/", "/layers/")
        return [(whole, index[:1] + (layer,) + index[1:])]

    want_u = sum((expected_reads(k, v.shape, NamedSharding(mesh, specs_u[k]), one_layer) for k, v in flat.items()),
                 Counter())
    assert reads.calls == want_u, (sorted(reads.calls.items()), sorted(want_u.items()))
    print(json.dumps({"devices": jax.device_count(), "stacked_reads": sum(want.values()),
                      "stacked_bytes_read": stacked_bytes,
                      "stacked_bytes_restored": sum(v.nbytes for v in scanned.values()),
                      "unstacked_reads": sum(want_u.values())}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
