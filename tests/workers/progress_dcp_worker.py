"""Runs under ``torchrun`` with stderr on a terminal (tests/test_progress.py): each rank loads the
DCP checkpoint ``argv[1]`` into a torch.compile'd model's names through ckptshim, so every rank
reads the whole checkpoint; only rank 0 may show a bar."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import ckptshim  # noqa: F401  (hooks on)
from ckptshim.api import inspect
from support.processes import leave_process_group

dist.init_process_group("gloo")
checkpoint = inspect(sys.argv[1])
state = {"model": {"_orig_mod." + ".".join(key[1:]): torch.empty(entry.shape, dtype=getattr(torch, entry.dtype))
                   for key, entry in checkpoint.inventory.items() if key[0] == "model"}}
dcp.load(state, checkpoint_id=sys.argv[1])
print(f"loaded on rank {dist.get_rank()}", file=sys.stderr, flush=True)
leave_process_group()
