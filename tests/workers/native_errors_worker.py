"""Runs with ``CKPTSHIM_DISABLE=1``: the errors the frameworks themselves raise on the fixtures
the docs quote (docs/paxml.md, docs/gpt-neox.md). Usage: ``python native_errors_worker.py DIR``
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
    try:
        load()
    except Exception as error:  # the framework's own error, as a user reads it
        return f"{type(error).__name__}: {error}"
    return "loads"


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
    }))


if __name__ == "__main__":
    main()
