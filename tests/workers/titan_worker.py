"""One rank of the two-rank FSDP2 load of a Hugging Face folder into a torchtitan-shaped model
(run by tests/test_torchtitan.py under torchrun).

``python -m torch.distributed.run --nproc_per_node=2 tests/workers/titan_worker.py NAME FOLDER OUT``
builds the torchtitan model of the fixture ``NAME`` (its state-dict layout, tests/support/titan.py),
shards every parameter with FSDP2 (``fully_shard`` per layer, then the root: rows across the two
ranks) and loads the Hugging Face ``FOLDER``: ``dcp.load`` of the sharded state dict, then (for
Qwen3, whose rows need no head count) ``set_model_state_dict`` of the full Hugging Face state
dict; then ``dcp.load`` of the state dict as tensor-parallel DTensors (column-wise linears split by
rows, row-wise ones by columns, as torchtitan's TP plans place them). After each, every local shard must equal its rows of what torchtitan's ``convert_from_hf.py``
wrote. Writes ``OUT/rank<N>.json``: per case "ok" or what went wrong, and for ``dcp.load`` the
bytes this process read (``rchar`` of ``/proc/self/io``) and the bytes of its own shards.
"""

from __future__ import annotations

import json
import sys
import traceback
import warnings
from pathlib import Path

warnings.simplefilter("ignore")

import ckptshim  # noqa: E402,F401  (the hooks attach when torch.distributed.checkpoint is imported)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from support.processes import leave_process_group  # noqa: E402
from support.tensors import fsdp_dcp_load, fsdp_row_shards  # noqa: E402
from support.titan import converted, layout, model  # noqa: E402
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor  # noqa: E402

#: Tensor-parallel placements as torchtitan's Llama/Qwen3 plans shard them: column-wise linears
#: split their rows (output features), row-wise ones their columns; the norms replicated.
TP_COLUMNS = ("wo", "w2")


def sharded_model(name: str, mesh) -> torch.nn.Module:
    titan = model(name)
    for layer in titan.layers.children():
        fully_shard(layer, mesh=mesh)
    return fully_shard(titan, mesh=mesh)


def tp_placement(key: str, shape: list[int]):
    if len(shape) == 1:
        return Replicate()
    return Shard(1) if key.split(".")[-2] in TP_COLUMNS else Shard(0)


def tp_state_dict(name: str, mesh) -> dict[str, DTensor]:
    """The torchtitan model's state dict as tensor-parallel DTensors (a tied key the same one)."""
    state: dict[str, DTensor] = {}
    for row in layout(name):
        if "tied_to" in row:
            state[row["key"]] = state[row["tied_to"]]
        else:
            state[row["key"]] = distribute_tensor(torch.zeros(row["shape"]), mesh, [tp_placement(row["key"], row["shape"])])
    return state


def main(name: str, folder: Path, out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    expected = converted(name)
    results: dict[str, object] = fsdp_dcp_load(lambda: sharded_model(name, mesh), folder, expected)

    state = tp_state_dict(name, mesh)
    try:
        dcp.load(state, checkpoint_id=folder)
        for key, value in state.items():
            want = distribute_tensor(expected[key], mesh, value.placements).to_local()
            assert torch.equal(value.to_local(), want), key
        results["tp_dcp_load"] = "ok"
    except Exception:
        results["tp_dcp_load"] = traceback.format_exc()

    if name == "qwen3":
        titan = sharded_model(name, mesh)
        try:
            set_model_state_dict(titan, load_file(folder / "model.safetensors"),
                                 options=StateDictOptions(full_state_dict=True))
            fsdp_row_shards(titan.state_dict(), expected)
            results["set_model_state_dict"] = "ok"
        except Exception:
            results["set_model_state_dict"] = traceback.format_exc()

    (out / f"rank{rank}.json").write_text(json.dumps(results))
    leave_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
