"""Story: a DCP checkpoint saved from a plain model loads into today's torch.compile'd model.

Without ckptshim, ``dcp.load`` fails with ``Missing key in checkpoint state_dict:
model._orig_mod.0.weight``; with it, the names are remapped and every tensor is read once,
straight into the compiled model's parameters. Also shows ``ckptshim plan`` on the same pair.
"""

from __future__ import annotations

import logging
import sys
import tempfile
import warnings
from pathlib import Path

import ckptshim


def build(seed: int):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))


def main() -> int:
    import torch
    import torch.distributed.checkpoint as dcp

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    warnings.filterwarnings("ignore", category=UserWarning)  # "no process group": one process
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "dcp_plain"
        dcp.save({"model": build(0).state_dict()}, checkpoint_id=old)     # yesterday's run

        model = torch.compile(build(1))                                   # today's code
        ckptshim.uninstall()
        try:
            dcp.load({"model": model.state_dict()}, checkpoint_id=old)
            print("without ckptshim: loaded?!")
            return 1
        except BaseException as error:  # DCP's CheckpointException (a BaseException) wraps each rank's
            print("without ckptshim:", str(error).strip().splitlines()[-1][:100])
        ckptshim.install()
        state_dict = model.state_dict()
        dcp.load({"model": state_dict}, checkpoint_id=old)                # logs one summary line
        reference = build(0).state_dict()
        assert all(torch.equal(state_dict["_orig_mod." + k], v) for k, v in reference.items())
        print(f"with ckptshim: {len(reference)} tensors loaded into the compiled model")
    return 0


if __name__ == "__main__":
    sys.exit(main())
