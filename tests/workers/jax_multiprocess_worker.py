"""One process of ``test_jax_multiprocess.py``'s launch: real ``jax.distributed`` on localhost.

Started N times by ``support.jax_processes.launch`` (``argv``: process id, process count,
coordinator port, the launch's folder), 2 forced CPU devices each, gloo CPU collectives. Every process runs every case below in
the same order, each restore through the Orbax hook into targets sharded over all N x 2 devices,
and writes ``process<i>.json``: per case ``"ok"`` or the error, plus what it measured.

- ``save_then_scan``: the processes save an unscanned tree together (a real multi-process Orbax
  save: ``ocdbt.process_<i>/`` folders, one chunk per device's shard), then restore it into a
  scanned target sharded by rows. Bytes read from ``/proc/self/io`` around the restore: each
  process reads only the chunks of its own rows.
- ``maxtext``, ``paxml_gpt3``, ``legacy_orbax``, ``t5x``: the real fixtures (written by one
  process) restored across processes: unscanned -> scanned MaxText, PaxML GPT-3 -> MaxText,
  an Orbax 0.2.3 folder -> scanned, a legacy T5X step; every addressable shard bit-exact against
  numpy on the single-process read.
- ``refused_from_metadata``: a target with a layer too many; no plan fits it, so every process
  agrees to leave the restore to Orbax, which refuses it alike everywhere, with ckptshim's
  reading (the layers) as a note.
- ``damaged_chunk_one_process``: a chunk only the last process's shards need is damaged in its
  content (metadata intact): that process fails reading it, every other one raises ``PeerError``
  naming it, all within seconds.
- ``process_that_never_reports``: the last process skips a restore; the others stop after the
  agreement timeout (3 s here), naming it.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import traceback
from pathlib import Path

from support.jax_processes import join

PROCESS, COUNT, ARGS = join()
OUT = Path(ARGS[0])

import jax  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from ckptshim import log  # noqa: E402  (importing ckptshim installs the hooks)
from ckptshim.api import inspect  # noqa: E402
from ckptshim.errors import PeerError, ShimError  # noqa: E402
from ckptshim.formats import kvstore  # noqa: E402
from ckptshim.formats.base import numpy_dtype  # noqa: E402
from ckptshim.inventory import flatten  # noqa: E402
from support.pagecache import drop_cache, io_counters  # noqa: E402
from support.trees import nest, scanned_expected  # noqa: E402
from test_paxml_gpt3 import expected_state  # noqa: E402

LAYERS, ROWS, COLS = 4, 256, 1024  # save_then_scan: 4 layers of 1 MiB float32


def grid_mesh():
    return jax.make_mesh((COUNT, 2), ("a", "b"))


def row_mesh():
    return jax.make_mesh((2 * COUNT,), ("x",))


def spread(mesh, shape: tuple[int, ...]) -> NamedSharding:
    """Each mesh axis on the first dimension it divides that no other axis took."""
    spec: list = [None] * len(shape)
    for name in mesh.axis_names:
        size = mesh.shape[name]
        free = next((d for d, n in enumerate(shape) if spec[d] is None and n % size == 0 and n >= size), None)
        if free is not None:
            spec[free] = name
    return NamedSharding(mesh, P(*spec))


def abstract(expected: dict, mesh) -> dict:
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=spread(mesh, v.shape)) for k, v in expected.items()}


def check(restored: dict, target: dict, expected: dict) -> dict:
    """Every addressable shard of every restored array equals its slice of the expectation."""
    shards = 0
    assert set(restored) == set(expected), sorted(set(restored) ^ set(expected))
    for key, array in restored.items():
        assert array.sharding == target[key].sharding, key
        assert not array.is_fully_addressable, key  # a global array across the processes
        for shard in array.addressable_shards:
            want = np.asarray(expected[key])[shard.index]
            assert np.asarray(shard.data).tobytes() == np.ascontiguousarray(want).tobytes(), (key, shard.index)
            shards += 1
    return {"arrays": len(restored), "shards_checked": shards}


def stored(path: Path) -> dict:
    """Every array as ckptshim reads it in one process (what the single-process tests check
    against the fixtures' manifests)."""
    checkpoint = inspect(path)
    try:
        return {key: checkpoint.read(entry).view(numpy_dtype(entry.dtype)).copy()
                for key, entry in checkpoint.inventory.items()}
    finally:
        checkpoint.close()


def layer_values(layer: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(layer)
    return {"w": rng.standard_normal((ROWS, COLS), dtype=np.float32),
            "b": rng.standard_normal((ROWS,), dtype=np.float32)}


def unscanned_values() -> dict[str, np.ndarray]:
    """The values the multi-process save writes, one ``layers_{i}`` subtree per layer."""
    return {f"params/layers_{i}/{name}": value for i in range(LAYERS) for name, value in layer_values(i).items()}


def scanned_by_rows() -> tuple[dict[str, np.ndarray], dict[str, jax.ShapeDtypeStruct]]:
    """Those values stacked on axis 1, and a target of their shapes with rows sharded over
    every process's devices."""
    mesh = row_mesh()
    expected = scanned_expected(unscanned_values(), LAYERS, lambda key: 1)
    return expected, {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, P("x")))
                      for k, v in expected.items()}


# -- cases --------------------------------------------------------------------------------------


def case_save_then_scan() -> dict:
    mesh = row_mesh()
    rows = NamedSharding(mesh, P("x"))
    flat = unscanned_values()
    tree = nest({k: jax.make_array_from_callback(v.shape, rows, lambda index, v=v: v[index]) for k, v in flat.items()})
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(OUT / "mp_unscanned", tree)
        checkpointer.wait_until_finished()
    multihost_utils.sync_global_devices("saved")
    expected, target = scanned_by_rows()
    drop_cache(OUT / "mp_unscanned")
    multihost_utils.sync_global_devices("cache dropped")
    before = io_counters()
    start = time.perf_counter()
    with ocp.StandardCheckpointer() as checkpointer:
        restored = flatten(checkpointer.restore(OUT / "mp_unscanned", nest(target)))
    seconds = time.perf_counter() - start
    after = io_counters()
    restored = {"/".join(k): v for k, v in restored.items()}
    return {**check(restored, target, expected), "seconds": seconds,
            "rchar": after["rchar"] - before["rchar"], "read_bytes": after["read_bytes"] - before["read_bytes"],
            "array_bytes": sum(v.nbytes for v in expected.values()),
            "stored_bytes": sum(kvstore.ocdbt_index(OUT / "mp_unscanned").files.values())}


def case_maxtext() -> dict:
    runs = OUT / "fixtures" / "maxtext_runs"
    source = stored(runs / "tiny_unscanned/checkpoints/1/items")
    unscanned = {"/".join(k): v for k, v in source.items() if k[0] in ("params", "opt_state", "step")}
    expected = scanned_expected(unscanned, 3, lambda key: 0 if "/rngs/" in key else 1)
    target = abstract(expected, grid_mesh())
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(runs / "tiny_unscanned/checkpoints/1/items", nest(target))
    return check({"/".join(k): v for k, v in flatten(restored).items()}, target, expected)


def case_paxml_gpt3() -> dict:
    state_dir = OUT / "fixtures" / "TinySpmdRepeat/checkpoints/checkpoint_00000001/state"
    expected = {"/".join(k): v for k, v in expected_state(stored(state_dir), "scan1", fused=False).items()}
    target = abstract(expected, grid_mesh())
    restored = ocp.StandardCheckpointer().restore(state_dir, nest(target))
    return check({"/".join(k): v for k, v in flatten(restored).items()}, target, expected)


def case_legacy_orbax() -> dict:
    path = OUT / "fixtures" / "orbax_0.2.3_unscanned/pytree_checkpointer"
    unscanned = {"/".join(k): v for k, v in stored(path).items()}
    expected = scanned_expected(unscanned, 3, lambda key: 1)
    target = abstract(expected, grid_mesh())
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(path, nest(target))
    return check({"/".join(k): v for k, v in flatten(restored).items()}, target, expected)


def case_t5x() -> dict:
    step = OUT / "fixtures" / "legacy_checkpointer/checkpoint_0"
    expected = {"/".join(k): v for k, v in stored(step).items() if k[0] == "target"}
    target = abstract(expected, grid_mesh())
    restored = ocp.PyTreeCheckpointer().restore(step, args=ocp.args.PyTreeRestore(nest(target), partial_restore=True))
    return check({"/".join(k): v for k, v in flatten(restored).items()}, target, expected)


def case_refused_from_metadata() -> dict:
    mesh = row_mesh()
    expected = scanned_expected(unscanned_values(), LAYERS, lambda key: 1)
    target = {k: jax.ShapeDtypeStruct(v.shape[:1] + (LAYERS + 1,) + v.shape[2:], v.dtype,
                                      sharding=NamedSharding(mesh, P("x"))) for k, v in expected.items()}
    start = time.perf_counter()
    try:
        ocp.StandardCheckpointer().restore(OUT / "mp_unscanned", nest(target))
    except ValueError as error:
        return {"refused": type(error).__name__, "shim_error": isinstance(error, ShimError), "message": str(error),
                "notes": list(getattr(error, "__notes__", [])), "seconds": time.perf_counter() - start}
    raise AssertionError("a target with a layer too many was restored")


def case_damaged_chunk_one_process() -> dict:
    damaged = OUT / "damaged"
    last = 2 * COUNT - 1  # the last device's rows belong to the last process only
    if PROCESS == 0:
        shutil.copytree(OUT / "mp_unscanned", damaged)
        chunk = f"params.layers_2.w/{last}.0"
        where = kvstore.ocdbt_index(damaged, keep=(chunk,)).kept[chunk]
        with open(damaged / where.file, "r+b") as f:  # the zstd frame's magic number, zeroed
            f.seek(where.offset)
            f.write(b"\0\0\0\0")
    multihost_utils.sync_global_devices("damaged")
    expected, target = scanned_by_rows()
    start = time.perf_counter()
    try:
        ocp.StandardCheckpointer().restore(damaged, nest(target))
    except ShimError as error:
        return {"raised": type(error).__name__, "message": str(error), "seconds": time.perf_counter() - start,
                "peer": isinstance(error, PeerError)}
    raise AssertionError("a damaged chunk was restored without an error")


def case_process_that_never_reports() -> dict:
    """The last process does not take part in a restore (a crash or hang, as the others see it):
    the others stop after ``CKPTSHIM_AGREEMENT_TIMEOUT`` seconds, naming it."""
    os.environ["CKPTSHIM_AGREEMENT_TIMEOUT"] = "3"
    if PROCESS == COUNT - 1:
        return {"skipped": True}
    expected, target = scanned_by_rows()
    start = time.perf_counter()
    try:
        ocp.StandardCheckpointer().restore(OUT / "mp_unscanned", nest(target))
    except PeerError as error:
        return {"message": str(error), "seconds": time.perf_counter() - start}
    raise AssertionError("restored although a process never reported")


CASES = [case_save_then_scan, case_maxtext, case_paxml_gpt3, case_legacy_orbax, case_t5x,
         case_refused_from_metadata, case_damaged_chunk_one_process, case_process_that_never_reports]


def main() -> None:
    results: dict[str, object] = {"devices": jax.device_count(), "local_devices": jax.local_device_count(),
                                  "shows_progress": log.first_process()}
    for case in CASES:
        try:
            results[case.__name__] = {"status": "ok", **case()}
        except Exception:
            results[case.__name__] = {"status": traceback.format_exc()[-3000:]}
    (OUT / f"process{PROCESS}.json").write_text(json.dumps(results, indent=1))
    multihost_utils.sync_global_devices("done")


if __name__ == "__main__":
    main()
