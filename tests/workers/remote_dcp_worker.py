"""One rank of the remote multi-process DCP test (tests/test_remote_dcp.py, under torchrun).

``python -m torch.distributed.run --nproc_per_node=2 tests/workers/remote_dcp_worker.py URL OUT``
with the clients pointed at a local server: the ranks save a plain FSDP2 model to ``URL`` with
DCP's own ``FsspecWriter`` (one file per rank), then load it into a compiled FSDP2 model, which
ckptshim remaps (``_orig_mod.``) and reads from the bucket itself. Each rank checks its local
shards and writes ``OUT/rank<N>.json`` ("ok" or what went wrong) and ``OUT/reads<N>.json``:
the byte ranges it read, and where the values every rank holds whole are stored.
"""

from __future__ import annotations

import json
import sys
import warnings
from datetime import timedelta
from pathlib import Path

warnings.simplefilter("ignore")

import ckptshim  # noqa: E402,F401  (the hooks attach when torch.distributed.checkpoint is imported)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from ckptshim.storage import objects  # noqa: E402
from dcp_worker import fsdp2  # noqa: E402
from support.processes import run_rank_cases  # noqa: E402

#: (object name, bytes) of every range this rank asked the store for, in order.
READS: list[tuple[str, int]] = []


def _recorded(read_ranges):
    def recording(self, ranges, buffers):
        READS.extend((where.location.name, where.length, where.start) for where in ranges)
        return read_ranges(self, ranges, buffers)
    return recording


def local(state_dict: dict) -> dict:
    return {k.replace("_orig_mod.", ""): (v.to_local() if isinstance(v, DTensor) else v).clone()
            for k, v in state_dict.items()}


def case_save_then_load_compiled(mesh, url: str, out: Path) -> None:
    saved = fsdp2(0, mesh).state_dict()
    dcp.save({"model": saved}, checkpoint_id=url)
    dist.barrier()
    objects.FsspecObjects.read_ranges = _recorded(objects.FsspecObjects.read_ranges)
    loaded = torch.compile(fsdp2(11, mesh)).state_dict()
    assert set(local(loaded)) == set(saved) and any(isinstance(v, DTensor) for v in loaded.values())
    dcp.load({"model": loaded}, checkpoint_id=url)
    expected, found = local(saved), local(loaded)
    for key, value in found.items():
        assert torch.equal(value, expected[key]), f"{key}: local shard differs from the one this rank saved"
    (out / f"reads{dist.get_rank()}.json").write_text(json.dumps({"reads": READS, "whole": whole_values(url)}))


def whole_values(url: str) -> list[tuple[str, int, int]]:
    """``(file, start, end)`` of each value DCP's save wrote whole, once, for every rank (a value
    that is not sharded), from DCP's own reading of the metadata (our own save: trusted)."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FsspecReader(url).read_metadata()
    whole = []
    for index, stored in metadata.storage_data.items():
        value = metadata.state_dict_metadata[index.fqn]
        if not isinstance(value, TensorStorageMetadata) or len(value.chunks) == 1:
            whole.append((stored.relative_path, stored.offset, stored.offset + stored.length))
    return whole


def main(url: str, out: Path) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    run_rank_cases([case_save_then_load_compiled], mesh, url, out, report=out / f"rank{dist.get_rank()}.json")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
