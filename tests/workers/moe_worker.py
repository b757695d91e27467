"""One rank of the two-rank FSDP2 load of a transformers-4 MoE checkpoint (run by
tests/test_transformers_mapping.py under torchrun).

``python -m torch.distributed.run --nproc_per_node=2 tests/workers/moe_worker.py FOLDER OUT``
builds transformers 5's Mixtral from the fixture's config, shards every parameter with FSDP2
(``fully_shard``, rows across the two ranks), and loads the transformers-4 folder (per-expert
``w1``/``w2``/``w3``) twice: ``dcp.load`` of the sharded state dict, then
``set_model_state_dict`` of the full per-expert state dict. After each, every local shard must
equal its rows of what ``from_pretrained`` gives. Writes ``OUT/rank<N>.json``: per case "ok" or
what went wrong, and for ``dcp.load`` the bytes this process read (``rchar`` of
``/proc/self/io``) and the bytes of its own shards.
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
from safetensors.torch import load_file  # noqa: E402
from support.processes import leave_process_group  # noqa: E402
from support.tensors import fsdp_dcp_load, fsdp_row_shards  # noqa: E402
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402


def sharded_model(folder: Path, mesh) -> torch.nn.Module:
    torch.manual_seed(1234)  # values unlike the checkpoint's
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def main(folder: Path, out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    expected = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    results: dict[str, object] = fsdp_dcp_load(lambda: sharded_model(folder, mesh), folder, expected)

    model = sharded_model(folder, mesh)
    try:
        set_model_state_dict(model, load_file(folder / "model.safetensors"),
                             options=StateDictOptions(full_state_dict=True))
        fsdp_row_shards(model.state_dict(), expected)
        results["set_model_state_dict"] = "ok"
    except Exception:
        results["set_model_state_dict"] = traceback.format_exc()

    (out / f"rank{rank}.json").write_text(json.dumps(results))
    leave_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
