"""Run by ``test_hf_maxtext.py`` in a fresh process with 4 forced CPU devices (see
``test_orbax_sharded.py`` for why): each Hugging Face fixture folder restored by Orbax into
MaxText params sharded over a 2x2 mesh, scanned and unscanned, every device's buffer checked
against its slice of MaxText's own converter's output, and every byte the safetensors reads copy
counted. Prints one JSON line.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec as P

import ckptshim  # noqa: F401  (installs the hooks)
from ckptshim.formats.safetensors import SafetensorsCheckpoint
from ckptshim.inventory import flatten, unflatten
from test_hf_maxtext import expected, folder


class Counting:
    """Counts the bytes every safetensors read copies, and the reads (a read's own inner reads,
    into a buffer it then copies or casts from, not again)."""

    def __init__(self) -> None:
        self.bytes = self.reads = self._depth = 0
        self._original = SafetensorsCheckpoint.read_into

    def __enter__(self) -> "Counting":
        counter = self

        def counting(checkpoint, entry, index, out):
            if counter._depth:  # read_into reading into its own buffer first: the same bytes
                return counter._original(checkpoint, entry, index, out)
            counter.bytes += out.nbytes
            counter.reads += 1
            counter._depth += 1
            try:
                return counter._original(checkpoint, entry, index, out)
            finally:
                counter._depth -= 1

        SafetensorsCheckpoint.read_into = counting
        return self

    def __exit__(self, *exc) -> None:
        SafetensorsCheckpoint.read_into = self._original


def sharded(mesh, arrays: dict) -> dict:
    """Targets sharded over both mesh axes wherever a dimension divides evenly."""
    target = {}
    for key, value in arrays.items():
        names = iter(("a", "b"))
        spec = P(*(next(names, None) if n % 2 == 0 else None for n in value.shape))
        target[key] = jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=NamedSharding(mesh, spec))
    return target


def distinct_bytes(target: dict, arrays: dict) -> int:
    """The bytes of every distinct device block of every target (a replicated block once)."""
    total = 0
    for key, value in arrays.items():
        blocks = {tuple(part.indices(n)[:2] for part, n in zip(index, value.shape))
                  for index in target[key].sharding.devices_indices_map(value.shape).values()}
        total += sum(math.prod(b - a for a, b in block) for block in blocks) * value.itemsize
    return total


def main(root: Path) -> None:
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 2), ("a", "b"))
    report = {"devices": len(jax.devices())}
    for model, hf in (("llama3", "hf"), ("llama3", "hf_sharded"), ("qwen3", "hf")):
        for layout in ("scanned", "unscanned"):
            want = expected(model, layout)
            target = sharded(mesh, want)
            with Counting() as counted:
                restored = flatten(ocp.StandardCheckpointer().restore(folder(model, hf, root), unflatten(target)))
            shards = 0
            for key, array in restored.items():
                assert array.sharding == target[key].sharding, key
                for shard in array.addressable_shards:
                    got = np.asarray(shard.data)
                    assert np.array_equal(got.view(np.uint16), want[key][shard.index].view(np.uint16)), (key, shard.index)
                    shards += 1
            distinct = distinct_bytes(target, want)
            report[f"{model}/{hf}/{layout}"] = {"arrays": len(restored), "shards": shards, "bytes_read": counted.bytes,
                                                "reads": counted.reads, "bytes_restored": distinct,
                                                "bytes_whole": sum(v.nbytes for v in want.values())}
    print(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
