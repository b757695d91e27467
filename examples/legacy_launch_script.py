"""Story: a legacy launch script that never imports ckptshim, run through ``ckptshim run``.

``legacy_scripts/train_legacy.py`` resumes a torch.compile'd model from a plain model's
checkpoint. Run as is, torch refuses the keys; run as ``ckptshim run -- python train_legacy.py``
the bootstrap ``sitecustomize`` imports ckptshim in that process (and would in every torchrun
worker), so the same unedited script loads. The exit code is the script's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

SCRIPT = Path(__file__).parent / "legacy_scripts" / "train_legacy.py"


def main() -> int:
    import torch
    from torch import nn

    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTSHIM_")}
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / "plain.pt"
        torch.manual_seed(0)
        torch.save(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)).state_dict(), checkpoint)

        plain = subprocess.run([sys.executable, str(SCRIPT), str(checkpoint)], capture_output=True,
                               text=True, env=env, check=False)
        error = next((line for line in plain.stderr.splitlines() if "Missing key(s)" in line), "")
        print(f"without ckptshim: exit {plain.returncode}: {error.strip()[:100]}")

        shimmed = subprocess.run([sys.executable, "-m", "ckptshim", "run", "--log", "info", "--",
                                  sys.executable, str(SCRIPT), str(checkpoint)],
                                 capture_output=True, text=True, env=env, check=False)
        print(f"with ckptshim run: exit {shimmed.returncode}: {shimmed.stdout.strip()}")
        print("  " + "\n  ".join(line for line in shimmed.stderr.splitlines() if line.startswith("ckptshim:")))
        return 0 if plain.returncode != 0 and shimmed.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
