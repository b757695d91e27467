"""The fault suite's shared set-up: its fixtures saved once, the T5X stand-in, and the count.

``pytest -q tests`` ends with ``N fault cases, N passed``, counted from the reports of ``test_faults.py::test_fault``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

_counts = {"cases": 0, "passed": 0}


def pytest_runtest_logreport(report) -> None:
    if "test_faults.py::test_fault[" not in report.nodeid:
        return
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        _counts["cases"] += 1
        _counts["passed"] += report.passed


def pytest_terminal_summary(terminalreporter) -> None:
    if _counts["cases"]:
        terminalreporter.write_line(f"{_counts['cases']} fault cases, {_counts['passed']} passed")


@pytest.fixture(scope="session")
def built(tmp_path_factory) -> dict[str, Path]:
    """Checkpoints the fixtures lack, saved by the real library: a sharded Hugging Face folder
    (huggingface_hub's ``save_torch_state_dict``, as ``save_pretrained`` shards) of the
    transformers 4.30.2 GPT-NeoX weights."""
    from huggingface_hub import save_torch_state_dict
    from safetensors.torch import load_file

    from support.fixtures import FIXTURES

    root = tmp_path_factory.mktemp("built")
    folder = root / "hf_sharded"
    folder.mkdir()
    state = load_file(FIXTURES / "hf_gptneox_tf4.30.2/safetensors/model.safetensors")
    save_torch_state_dict(state, folder, max_shard_size=300_000)
    shutil.copy(FIXTURES / "hf_gptneox_tf4.30.2/safetensors/config.json", folder)
    assert sorted(p.name for p in folder.glob("*.safetensors")) == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    return {"hf_sharded": folder}


@pytest.fixture(scope="module")
def t5x_standin(tmp_path_factory):
    """``import t5x.checkpoints`` is the stand-in (tests/t5x_standin), with ckptshim's hook on,
    for this module only: a later module's stand-in is another module object, which the hook
    must patch afresh."""
    from support.t5x_site import standin_t5x

    with standin_t5x() as checkpoints:
        yield checkpoints
