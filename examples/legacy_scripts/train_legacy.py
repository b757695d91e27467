"""A legacy training script, unedited: it never imports ckptshim.

It resumes a compiled model from a checkpoint a plain model wrote (``torch.save`` file given as
the first argument), as many old launch scripts do. Run directly it fails with torch's
``Missing key(s) in state_dict: "_orig_mod...``; run through ``ckptshim run`` it loads.
"""

import sys

import torch
from torch import nn

torch.manual_seed(1)
model = torch.compile(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)))
model.load_state_dict(torch.load(sys.argv[1], weights_only=True))
print(f"resumed {sum(p.numel() for p in model.parameters())} parameters from {sys.argv[1]}")
