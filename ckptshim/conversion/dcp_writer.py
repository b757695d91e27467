"""torch.distributed.checkpoint writer: DCP's own ``FileSystemWriter``, fed one array at a time.

DCP's ``.metadata`` is a pickle only torch should write, so the files come from torch's own
writer (in this single process, no process group). The state dict handed to it holds tensors
over the source's memory maps, not copies: torch reads each one when it writes it. torch's
writer reports no progress, so a save planner of our own watches it: with one writer thread,
torch asks the planner for each tensor just before writing it (a little ahead where CUDA is
available), so when it asks for the next one, or the save returns, the previous one is written.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from ckptshim.execute.arrays import PlannedArrays
from ckptshim.conversion.progress import Progress
from ckptshim.inventory import Entry, join_key

if TYPE_CHECKING:
    from ckptshim.conversion import Folder

#: What writing needs beyond ckptshim's own dependencies (see ckptshim.conversion.WRITERS).
NEEDS: tuple[str, ...] = ("torch",)


def _reporting_planner(entries: dict[str, Entry], progress: Progress):
    from torch.distributed.checkpoint import DefaultSavePlanner

    class ReportingSavePlanner(DefaultSavePlanner):
        """DCP's default save planner that reports each tensor once torch has written it."""

        def __init__(self) -> None:
            super().__init__()
            self._writing: Entry | None = None

        def resolve_data(self, write_item):
            self.finish()
            self._writing = entries[write_item.index.fqn]
            return super().resolve_data(write_item)

        def finish(self) -> None:
            if self._writing is not None:
                progress.written(self._writing)
                self._writing = None

    return ReportingSavePlanner()


def write(arrays: PlannedArrays, folder: Folder, destination_name: str, progress: Progress) -> None:
    """Save into ``folder`` through the storage writer ``dcp.save`` itself uses there
    (:meth:`Folder.dcp_writer <ckptshim.conversion.Folder.dcp_writer>`: ``FileSystemWriter``
    locally, ``FsspecWriter`` in a bucket)."""
    import torch
    import torch.distributed.checkpoint as dcp

    state_dict, entries = {}, {}
    for entry, value in arrays.values():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only maps: torch only reads them
            tensor = torch.from_numpy(value)
        dtype = getattr(torch, entry.dtype)
        key = join_key(entry.key, ".")
        state_dict[key], entries[key] = (tensor if tensor.dtype == dtype else tensor.view(dtype)), entry
    writer = folder.dcp_writer()
    planner = _reporting_planner(entries, progress)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group": this is a one-process save
        dcp.save(state_dict, storage_writer=writer, planner=planner, no_dist=True)
    planner.finish()
