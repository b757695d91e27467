"""Story: GPT-NeoX (Pythia-style) checkpoints across the ``inv_freq`` persistence change.

transformers < 4.35 saved ``attention.rotary_emb.inv_freq`` (and causal ``attention.bias`` /
``masked_bias``) with the weights; today's transformers does not want them, and a NeoX-style
module that keeps ``inv_freq`` persistent misses it in new checkpoints. Both directions load
with ckptshim: derivable buffers are dropped, or left to the model's own computed value.
"""

from __future__ import annotations

import logging
import sys
import tempfile
from pathlib import Path

import ckptshim


def tiny_neox():
    import transformers

    config = transformers.GPTNeoXConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                        num_attention_heads=4, intermediate_size=64)
    return transformers.GPTNeoXForCausalLM(config)


def neox_style_rotary():
    """A GPT-NeoX (EleutherAI repo) style block: ``inv_freq`` is a persistent buffer."""
    import torch
    from torch import nn

    class Rotary(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.dense = nn.Linear(8, 8)
            self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)))

    return Rotary()


def main() -> int:
    import torch

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    model = tiny_neox()
    with tempfile.TemporaryDirectory() as tmp:
        # 1. an old-style checkpoint: today's weights plus the legacy buffers, as Pythia has them
        old = dict(model.state_dict())
        rotary_dims = int(32 // 4 * 0.25)  # head size x GPT-NeoX's default rotary_pct
        for i in range(2):
            old[f"gpt_neox.layers.{i}.attention.rotary_emb.inv_freq"] = \
                1.0 / (10000 ** (torch.arange(0, rotary_dims, 2).float() / rotary_dims))
            old[f"gpt_neox.layers.{i}.attention.bias"] = torch.tril(torch.ones(8, 8, dtype=torch.bool))[None, None]
            old[f"gpt_neox.layers.{i}.attention.masked_bias"] = torch.tensor(-1e9)
        torch.save(old, Path(tmp) / "pytorch_model.bin")
        fresh = tiny_neox()
        ckptshim.uninstall()
        try:
            fresh.load_state_dict(torch.load(Path(tmp) / "pytorch_model.bin", weights_only=True))
            print("without ckptshim: loaded?!")
            return 1
        except RuntimeError as error:
            print("without ckptshim:", str(error).splitlines()[1].strip()[:100])
        ckptshim.install()
        fresh.load_state_dict(torch.load(Path(tmp) / "pytorch_model.bin", weights_only=True))
        assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())
        print("with ckptshim: legacy buffers dropped, every weight loaded into transformers 5")

        # 2. the other way: a new checkpoint (no inv_freq) into a module that wants it persistent
        saved = {"dense.weight": torch.ones(8, 8), "dense.bias": torch.zeros(8)}
        rotary = neox_style_rotary()
        expected_inv_freq = rotary.inv_freq.clone()
        ckptshim.uninstall()
        try:
            rotary.load_state_dict(saved)
            print("without ckptshim: loaded?!")
            return 1
        except RuntimeError as error:
            print("without ckptshim:", str(error).splitlines()[1].strip()[:100])
        ckptshim.install()
        rotary.load_state_dict(saved)
        assert torch.equal(rotary.inv_freq, expected_inv_freq) and torch.equal(rotary.dense.weight, saved["dense.weight"])
        print("with ckptshim: missing inv_freq kept at the module's own computed value")
    return 0


if __name__ == "__main__":
    sys.exit(main())
