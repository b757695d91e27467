"""Runs with ``CKPTSHIM_DISABLE=1``: the errors the frameworks themselves raise on the fixtures
the docs quote (docs/paxml.md, docs/gpt-neox.md, docs/deepspeed.md, docs/megatron-core.md,
docs/meta-llama.md, docs/torchtune.md, docs/litgpt.md, docs/jax.md). Usage: ``python native_errors_worker.py DIR``
(``DIR`` a scratch folder); prints one JSON line, case -> ``"Type: message"``."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import transformers

from support.fixtures import FIXTURES
from test_neox import NEOX, _neox_state_dict


def error_of(load) -> str:
    from torch.distributed.checkpoint import CheckpointException

    try:
        load()
    except CheckpointException as error:  # DCP's: every rank's own error, with its traceback
        return "\n".join(f"{type(exc).__name__}: {exc}" for exc, _ in error.failures.values())
    except Exception as error:  # the framework's own error, as a user reads it
        return f"{type(error).__name__}: {error}"
    return "loads"


def torch_cases() -> dict[str, str]:
    """DeepSpeed ZeRO and Megatron-Core checkpoints (docs/deepspeed.md, docs/megatron-core.md)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from support.fixtures import expected_arrays, fixture_module

    zero = FIXTURES / "deepspeed_zero" / "ws2" / "zero3_fp32"
    model = fixture_module("deepspeed_zero/produce.py").build_model()
    stage = zero / "global_step2"
    megatron = {key.split("/", 2)[2]: torch.zeros(row["shape"]) for key, row in expected_arrays("megatron_core").items()
                if key.startswith("torch_dist/tp1_pp1/")}
    return {
        "zero dcp": error_of(lambda: dcp.load(model.state_dict(), checkpoint_id=zero)),
        "zero3 module": error_of(lambda: model.load_state_dict(
            torch.load(stage / "zero_pp_rank_0_mp_rank_00_model_states.pt", weights_only=False)["module"])),
        "zero torch.load": error_of(lambda: torch.load(stage / "zero_pp_rank_0_mp_rank_00_optim_states.pt")),
        "megatron dcp": error_of(lambda: dcp.load(megatron, checkpoint_id=FIXTURES / "megatron_core" / "torch_dist"
                                                  / "tp1_pp1")),
        **hub_cases(),
    }


def hub_cases() -> dict[str, str]:
    """Meta's original Llama and a Megatron-Core Llama into ``LlamaForCausalLM`` (docs/meta-llama.md,
    docs/megatron-core.md)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from test_decoder_hub import FIXTURE, MEGATRON, llama, megatron_llama

    return {
        "meta dcp": error_of(lambda: dcp.load(llama().state_dict(), checkpoint_id=FIXTURE / "mp2")),
        "meta state dict": error_of(lambda: llama().load_state_dict(
            torch.load(FIXTURE / "mp1" / "consolidated.00.pth", weights_only=True))),
        "megatron into llama": error_of(lambda: dcp.load(megatron_llama().state_dict(),
                                                         checkpoint_id=MEGATRON / "tp2" / "iter_0000000")),
        "megatron zarr into llama": error_of(lambda: dcp.load(megatron_llama().state_dict(),
                                                              checkpoint_id=MEGATRON / "zarr_tp2" / "iter_0000000")),
        **tune_and_lit_cases(),
    }


def tune_and_lit_cases() -> dict[str, str]:
    """torchtune's and litgpt's checkpoints into ``LlamaForCausalLM`` (docs/torchtune.md, docs/litgpt.md)."""
    import torch.distributed.checkpoint as dcp

    from test_torchtune_litgpt import LITGPT, TORCHTUNE, hf_model, lit, lit_llama, tune

    epoch, lit_file = TORCHTUNE / "llama3" / "torchtune" / "epoch_0", LITGPT / "final" / "lit_model.pth"
    return {
        "torchtune dcp": error_of(lambda: dcp.load(hf_model(epoch).state_dict(), checkpoint_id=epoch)),
        "torchtune state dict": error_of(lambda: hf_model(epoch).load_state_dict(tune("llama3"))),
        "litgpt dcp": error_of(lambda: dcp.load(lit_llama().state_dict(), checkpoint_id=lit_file)),
        "litgpt state dict": error_of(lambda: lit_llama().load_state_dict(lit())),
    }


def jax_cases() -> dict[str, str]:
    """Orbax's v1 API on an old layout, and a flax 0.8 NNX state into today's (docs/jax.md)."""
    from flax import nnx

    from test_flax_nnx_legacy import Model

    old = FIXTURES / "orbax_0.2.3_unscanned" / "pytree_checkpointer"
    _, state = nnx.split(nnx.eval_shape(lambda: Model(nnx.Rngs(0))))
    return {
        "orbax v1 old layout": error_of(lambda: ocp.v1.load(old, {"params": {}}, checkpointable_name=None)),
        "flax 0.8 nnx": error_of(lambda: ocp.StandardCheckpointer().restore(FIXTURES / "flax_0.8.5_nnx" / "full", state)),
    }


def main() -> None:
    scratch = Path(sys.argv[1])
    root = Path(shutil.copytree(FIXTURES / "paxml_runs/TinySpmdRepeat/checkpoints", scratch / "checkpoints"))
    state = root / "checkpoint_00000001" / "state"
    target = {"mdl_vars": {"params": {"lm": {"final_ln": {"bias": jax.ShapeDtypeStruct((32,), np.float32)}}}}}
    config = transformers.AutoConfig.from_pretrained(NEOX / "pp1_mp1" / "hf")
    print(json.dumps({
        "paxml standard": error_of(lambda: ocp.StandardCheckpointer().restore(state, target)),
        "paxml pytree": error_of(lambda: ocp.PyTreeCheckpointer().restore(state)),
        "paxml manager": error_of(lambda: ocp.CheckpointManager(root).restore(1)),
        "neox into hf": error_of(lambda: transformers.GPTNeoXForCausalLM(config).load_state_dict(
            _neox_state_dict("pp1_mp1"))),
        **torch_cases(),
        **jax_cases(),
    }))


if __name__ == "__main__":
    main()
