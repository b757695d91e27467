"""What wrote a checkpoint, where its own metadata says so: the ``producer`` rules are chosen by.

Some producers store keys that are not their model's own names (Megatron-Core stacks the
transformer layers under one key); a profile maps them only when the checkpoint says who wrote
it, never because names look like that producer's. Read here, from the checkpoint's files,
because the rules (below the formats) read no files.
"""

from __future__ import annotations

from typing import Any

from ckptshim.formats import megatron_core as megatron_core_format
from ckptshim.formats import model_yaml
from ckptshim.formats.base import Checkpoint
from ckptshim.inventory import Inventory
from ckptshim.loading.paths import item_location
from ckptshim.rules.decoder import read_dims
from ckptshim.rules.profiles import megatron_core


def producer(location: Any) -> str | None:
    """:data:`megatron_core.PRODUCER <ckptshim.rules.profiles.megatron_core.PRODUCER>` for a folder
    whose ``metadata.json`` names a Megatron-Core sharded backend (``torch_dist``, ``zarr``);
    ``None`` for anything else (a URL of a scheme ckptshim does not read included)."""
    where = None if location is None else item_location(location)
    if where is None:
        return None
    return megatron_core.PRODUCER if megatron_core_format.config(where) is not None else None


def producer_config(location: Any) -> dict | None:
    """The model description a producer keeps beside its checkpoint where it is no Hugging Face
    ``config.json``: Megatron's ``run_config.yaml`` in its folder (the head counts of its fused
    QKV), litgpt's ``model_config.yaml`` beside ``lit_model.pth`` (``n_head``, ``n_query_groups``)."""
    where = None if location is None else item_location(location)
    if where is None:
        return None
    megatron = megatron_core_format.run_config(where)
    return megatron if megatron is not None else model_yaml.litgpt_config(where)


def model_names(checkpoint: Checkpoint) -> tuple[Inventory, str] | None:
    """For a checkpoint whose producer stores other names than its model's, the inventory the
    model has (what ``inspect`` lists and ``convert`` writes without ``--like``) and a line that
    says so; ``None`` where the stored names are the model's. The layers it lists are bounded by
    the bytes of the checkpoint's files present, not by the count its metadata declares."""
    if producer(checkpoint.path) != megatron_core.PRODUCER:
        return None
    names, objects = megatron_core.model_names(checkpoint.inventory, sum(f.bytes_present for f in checkpoint.files))
    dims = read_dims(producer_config(checkpoint.path))
    note = ("listed as the model names them (GPTModel.state_dict()): Megatron-Core's stacked layers "
            "one per global layer index, the local spec's layer norms under their own names"
            + (f"; {objects} stored _extra_state object(s) left out" if objects else "")
            + (f"; Megatron-Core wrote it, {dims.text()} ({dims.origin})" if dims else ""))
    return names, note
