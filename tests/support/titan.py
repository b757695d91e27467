"""torchtitan 0.3.0's models of tests/fixtures/hf_to_torchtitan, as tests build them without torchtitan.

torchtitan cannot be installed beside the pinned test environment (see the fixture's
``produce.py``), so the fixture's manifest records each real torchtitan model's state dict as the
converter allocated it: every key, shape, dtype, and which keys share one tensor (Qwen3's tied
``lm_head``/``tok_embeddings``). :func:`model` builds a module with exactly those parameters
(nested as the keys say, tied ones one ``Parameter``) -- what ``dcp.load`` and
``set_model_state_dict`` see of a torchtitan model -- filled with values unlike the checkpoint's.
"""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from support.fixtures import FIXTURES, load_manifest

FIXTURE = FIXTURES / "hf_to_torchtitan"
MODELS = ("llama3", "qwen3")


def layout(name: str) -> list[dict]:
    """The torchtitan model's state dict rows: ``key``, ``shape``, ``dtype`` (and ``tied_to``)."""
    return load_manifest("hf_to_torchtitan")["torchtitan_state_dict"][name]


def model(name: str, seed: int = 1234) -> nn.Module:
    """A module whose state dict is the torchtitan model's (keys, shapes, dtypes, ties)."""
    root = nn.Module()
    generator = torch.Generator().manual_seed(seed)
    owners: dict[str, nn.Parameter] = {}
    for row in layout(name):
        *path, leaf = row["key"].split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        if "tied_to" in row:
            parameter = owners[row["tied_to"]]
        else:
            parameter = nn.Parameter(torch.randn(row["shape"], generator=generator).to(getattr(torch, row["dtype"])))
        owners[row["key"]] = parameter
        module.register_parameter(leaf, parameter)
    return root


def converted(name: str) -> dict[str, torch.Tensor]:
    """What torchtitan's ``convert_from_hf.py`` wrote for the model (its DCP checkpoint, read by DCP)."""
    reader = dcp.FileSystemReader(FIXTURE / name / "dcp")
    metadata = reader.read_metadata()
    state = {key: torch.empty(md.size, dtype=md.properties.dtype) for key, md in metadata.state_dict_metadata.items()}
    dcp.load(state, storage_reader=reader)
    return state
