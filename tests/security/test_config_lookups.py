"""A ``config.json`` whose ``architectures`` names a transformers placeholder class.

transformers puts a placeholder (``DummyObject``) in place of every class whose backend is not
installed -- image processors without torchvision or PIL -- and any attribute of it raises
``ImportError``. ckptshim looked up each name's ``base_model_prefix``; a placeholder made that
lookup raise out of ``dcp.load`` (as DCP's ``CheckpointException``), ``load_state_dict`` and
``ckptshim plan`` (a traceback). Now such a name gives no prefix, and the load is what the same
config without it gives: transformers' own ``from_pretrained`` values.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
dcp = pytest.importorskip("torch.distributed.checkpoint")

import ckptshim  # noqa: E402
from support.fixtures import FIXTURES, writable_copy  # noqa: E402
from support.processes import environment  # noqa: E402

MIXTRAL = FIXTURES / "transformers4_moe" / "mixtral" / "safetensors"
#: A class name transformers 5 lists whose backend (torchvision) this environment lacks.
PLACEHOLDER = "SiglipImageProcessor"

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning"),
              pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None,
                                 reason="torchvision is installed: no placeholder to name")]


@pytest.fixture(autouse=True)
def _hooks_on():
    ckptshim.install()
    yield


def test_the_name_is_a_placeholder_that_raises_on_any_attribute():
    placeholder = getattr(transformers, PLACEHOLDER)
    with pytest.raises(ImportError):
        placeholder.base_model_prefix  # noqa: B018


def _folder(tmp_path, architectures: list[str]):
    folder = writable_copy(MIXTRAL, tmp_path / "mixtral")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": architectures}))
    return folder


def _reference() -> dict:
    from transformers import AutoModelForCausalLM

    return dict(AutoModelForCausalLM.from_pretrained(MIXTRAL).state_dict())


def _fresh():
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(1234)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(MIXTRAL), dtype=torch.float32).eval()


@pytest.mark.parametrize("architectures", [[PLACEHOLDER], [PLACEHOLDER, "MixtralForCausalLM"]])
def test_dcp_load_of_the_folder_equals_from_pretrained(tmp_path, architectures):
    """``dcp.load`` of the folder (a plain state dict: only config.json names the model).
    Before: ``CheckpointException`` wrapping the placeholder's ``ImportError``."""
    folder = _folder(tmp_path, architectures)
    model = _fresh()
    dcp.load(model.state_dict(), checkpoint_id=folder)
    expected, actual = _reference(), model.state_dict()
    assert actual.keys() == expected.keys()
    assert all(torch.equal(actual[key], expected[key]) for key in expected)


def test_plan_cli_with_the_placeholder_plans(tmp_path):
    """``ckptshim plan`` of the folder onto itself re-saved by transformers 5. Before: a
    traceback ending in ``ImportError``."""
    folder = _folder(tmp_path, [PLACEHOLDER])
    resaved = tmp_path / "v5"
    transformers.AutoModelForCausalLM.from_pretrained(MIXTRAL).save_pretrained(resaved, save_original_format=False)
    run = subprocess.run([sys.executable, "-m", "ckptshim", "plan", str(folder), "--like", str(resaved)],
                         capture_output=True, text=True, env=environment(), check=False, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Traceback" not in run.stderr and "mlp.experts.gate_up_proj" in run.stdout
