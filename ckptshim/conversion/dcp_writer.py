"""torch.distributed.checkpoint writer: DCP's own ``FileSystemWriter``, fed one array at a time.

DCP's ``.metadata`` is a pickle only torch should write, so the files come from torch's own
writer (in this single process, no process group). The state dict handed to it holds tensors
over the source's memory maps, not copies: torch reads each one when it writes it. torch's
writer shows no progress of its own, so ``progress`` is accepted and ignored here.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

from ckptshim.conversion.arrays import PlannedArrays
from ckptshim.inventory import join_key


def write(arrays: PlannedArrays, folder: Path, destination_name: str, *, progress: bool | None = None,
          on_array: Callable[[str], None] | None = None) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    state_dict = {}
    for entry in arrays.entries:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only maps: torch only reads them
            tensor = torch.from_numpy(arrays.read(entry))
        dtype = getattr(torch, entry.dtype)
        state_dict[join_key(entry.key, ".")] = tensor if tensor.dtype == dtype else tensor.view(dtype)
        if on_array is not None:
            on_array(join_key(entry.key, arrays.sep))
    writer = dcp.FileSystemWriter(str(folder), single_file_per_rank=True, thread_count=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group": this is a one-process save
        dcp.save(state_dict, storage_writer=writer, no_dist=True)
