"""A Hugging Face Llama 3 / Qwen3 folder restored by Orbax straight into MaxText params.

The expected values are MaxText 0.2.5's own converter's output (``to_maxtext``, run by the
fixture's producer on the same folders: ``tests/fixtures/hf_to_maxtext``); every restored array
must equal it bit for bit -- the Llama query transposed, split into heads, its rotary halves
interleaved and scaled by ``float32(1/sqrt(12))`` rounded to bfloat16, as the converter does.
The restore sharded over a 2x2 mesh of CPU devices runs in ``hf_maxtext_worker.py``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import ckptshim  # noqa: F401  (hooks on)
from ckptshim.errors import PlanError, ShimError
from ckptshim.inventory import Entry, Inventory, flatten, unflatten
from ckptshim.ops import Rename, Scale
from ckptshim.planner import plan, summary
from ckptshim.rules import Paired
from ckptshim.rules.context import LoadContext
from ckptshim.rules.profiles import rules_for
from support.fixtures import FIXTURES, writable_copy
from support.processes import run_device_worker

HERE = FIXTURES / "hf_to_maxtext"
CASES = [(model, layout) for model in ("llama3", "qwen3") for layout in ("scanned", "unscanned")]


def folder(model: str, hf: str = "hf", root: Path | None = None) -> Path:
    """The fixture folder ``<model>/<hf>`` (copied under ``root`` when given)."""
    source = HERE / model / hf
    return source if root is None else (root / model / hf if (root / model / hf).exists()
                                         else writable_copy(source, root / model / hf))


def expected(model: str, layout: str) -> dict:
    """MaxText's converter's arrays, keyed as in a MaxText train state's ``params/params/...``."""
    from safetensors.numpy import load_file
    import ml_dtypes  # noqa: F401  (safetensors.numpy reads bfloat16 through it)

    found = load_file(str(HERE / model / f"maxtext_{layout}.safetensors"))
    return {("params",) + tuple(key.split("/")): value for key, value in found.items()}


def abstract(arrays: dict) -> dict:
    return unflatten({key: jax.ShapeDtypeStruct(v.shape, v.dtype) for key, v in arrays.items()})


def same_bits(restored: dict, want: dict) -> None:
    assert restored.keys() == want.keys()
    for key, value in want.items():
        got = np.asarray(restored[key])
        assert got.dtype == value.dtype and np.array_equal(got.view(np.uint16), value.view(np.uint16)), key


@pytest.mark.parametrize("model,layout", CASES)
def test_standard_restore_of_the_folder_equals_to_maxtext(model, layout):
    want = expected(model, layout)
    same_bits(flatten(ocp.StandardCheckpointer().restore(folder(model), abstract(want))), want)


@pytest.mark.parametrize("model,layout", [("llama3", "scanned"), ("qwen3", "unscanned")])
def test_pytree_restore_of_the_weights_file_equals_to_maxtext(model, layout):
    """The ``model.safetensors`` file itself (``config.json`` beside it), by PyTreeCheckpointer."""
    want = expected(model, layout)
    restored = ocp.PyTreeCheckpointer().restore(folder(model) / "model.safetensors",
                                                args=ocp.args.PyTreeRestore(abstract(want)))
    same_bits(flatten(restored), want)


@pytest.mark.parametrize("item", ["items", "default"])
def test_a_checkpoint_manager_step_holding_the_folder_as_its_item(tmp_path, item):
    """MaxText's checkpoint directory with the Hugging Face folder as step 0's item: the
    manager's restore reads it as the folder itself (``items`` by name, a single-item manager's
    ``default``)."""

    want = expected("llama3", "scanned")
    shutil.copytree(folder("llama3"), tmp_path / "0" / item)
    if item == "default":
        with ocp.CheckpointManager(tmp_path) as manager:
            restored = manager.restore(0, args=ocp.args.StandardRestore(abstract(want)))
    else:
        with ocp.CheckpointManager(tmp_path, item_names=(item,)) as manager:
            restored = manager.restore(0, args=ocp.args.Composite(items=ocp.args.StandardRestore(abstract(want))))[item]
    same_bits(flatten(restored), want)


def test_a_sharded_folder_restores_the_same():
    want = expected("llama3", "scanned")
    assert len(list(folder("llama3", "hf_sharded").glob("*.safetensors"))) > 1
    same_bits(flatten(ocp.StandardCheckpointer().restore(folder("llama3", "hf_sharded"), abstract(want))), want)


def test_into_float32_params_the_query_is_rounded_as_the_converter_rounds_it():
    """A float32 target: the converter's bfloat16 values, cast (the scale rounds to the stored
    bfloat16 before the cast, as to_maxtext does, not to float32)."""
    want = expected("llama3", "unscanned")
    target = unflatten({key: jax.ShapeDtypeStruct(v.shape, np.float32) for key, v in want.items()})
    restored = flatten(ocp.StandardCheckpointer().restore(folder("llama3"), target))
    for key, value in want.items():
        assert np.array_equal(np.asarray(restored[key]), value.astype(np.float32)), key


def test_the_plan_names_the_scale_once_per_query(caplog):
    source = _inventory(folder("llama3") / "model.safetensors")
    target = Inventory([Entry(key, v.shape, "bfloat16") for key, v in expected("llama3", "scanned").items()], "t")
    config = json.loads((folder("llama3") / "config.json").read_text())
    found = plan(source, target, rules_for(LoadContext(source, target, "jax", model_config=config)))
    assert found.complete
    scales = [op for op in found.ops if op.kind == Scale.kind]
    assert len(scales) == 1 and scales[0].factor == float(np.float32(1 / np.sqrt(12)))
    assert "1 scaled (x 0.28867512941360474 in float32, rounded to bfloat16: MaxText's Llama" in summary(found)


def _inventory(path: Path) -> Inventory:
    from ckptshim.formats.detect import open_checkpoint

    checkpoint = open_checkpoint(path)
    checkpoint.close()
    return checkpoint.inventory


def test_without_config_json_it_refuses(tmp_path):
    copy = writable_copy(folder("llama3"), tmp_path / "hf")
    (copy / "config.json").unlink()
    want = expected("llama3", "scanned")
    with pytest.raises(ShimError, match=r"needs the model's config.json \(heads, head_dim, layers\)"):
        ocp.StandardCheckpointer().restore(copy, abstract(want))


def test_a_head_count_that_does_not_divide_is_refused(tmp_path):
    copy = writable_copy(folder("llama3"), tmp_path / "hf")
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "num_attention_heads": 5}))
    want = expected("llama3", "scanned")
    with pytest.raises(ShimError, match=r"self_attn\.[qo]_proj\.weight has shape \(48, 48\): its axis [01] is "
                                        r"not config.json's num_attention_heads 5 x head_dim 12 = 60"):
        ocp.StandardCheckpointer().restore(copy, abstract(want))


def test_strict_accepts_the_scale_the_profile_expects(monkeypatch):
    monkeypatch.setenv("CKPTSHIM_STRICT", "1")
    want = expected("llama3", "unscanned")
    same_bits(flatten(ocp.StandardCheckpointer().restore(folder("llama3"), abstract(want))), want)


class _Scaling:
    """A layout that scales without saying why the target would expect it."""

    def pair(self, source, target, rules):
        return Paired((Rename(("w",), ("w",)), Scale((("w",),), (("w",),), 0.5, 2.0, "float32")))


def test_strict_refuses_a_scale_nobody_expects(monkeypatch):
    source = Inventory([Entry(("w",), (2,), "float32")], "ckpt")
    rules = rules_for(LoadContext(source, source, "jax")).extend(layouts=(_Scaling(),))
    assert summary(plan(source, source, rules)) == "1 scaled (x 0.5 in float32, rounded to float32)"
    monkeypatch.setenv("CKPTSHIM_STRICT", "1")
    with pytest.raises(PlanError, match=r"'?w'?: the plan's step `w: scale\(x 0.5.*CKPTSHIM_STRICT=1 refuses it"):
        plan(source, source, rules_for(LoadContext(source, source, "jax")).extend(layouts=(_Scaling(),)))


def test_each_device_of_a_2x2_mesh_reads_only_its_slice(tmp_path):
    report = run_device_worker("hf_maxtext_worker.py", str(tmp_path))
    assert report.pop("devices") == 4
    for case, found in report.items():
        # every device block read once (a block two devices hold, once): the model's bytes, once
        assert found["bytes_read"] == found["bytes_restored"] == found["bytes_whole"], case
        assert found["shards"] == 4 * found["arrays"], case
    assert set(report) == {f"{m}/{hf}/{layout}" for m, hf in (("llama3", "hf"), ("llama3", "hf_sharded"),
                                                               ("qwen3", "hf")) for layout in ("scanned", "unscanned")}


def _load(path: Path) -> dict:
    from safetensors.numpy import load_file

    return load_file(str(path))


def _logits(hf: Path, model: str) -> np.ndarray:
    import torch
    import transformers

    cls = transformers.LlamaForCausalLM if model == "llama3" else transformers.Qwen3ForCausalLM
    loaded = cls.from_pretrained(hf).eval()
    with torch.no_grad():
        return loaded(torch.from_numpy(np.load(HERE / "ref_input_ids.npy"))).logits.float().numpy()


@pytest.mark.parametrize("model,layout", CASES)
def test_convert_back_like_the_hf_folder_is_maxtexts_own_way_back(model, layout, tmp_path):
    """MaxText params saved by Orbax, ``ckptshim convert --to safetensors --like <hf_dir>``: the
    tensors MaxText's ``to_huggingface`` hooks make, bit for bit; transformers loads them and
    computes the original logits -- exactly for Qwen3, whose every tensor comes back as it was;
    for Llama the query went through two bfloat16 roundings (scaled by float32(1/sqrt(12)), then
    by float32(sqrt(12))), so its logits come back close, not bit-exact (docs/maxtext.md)."""
    import jax.numpy as jnp

    from ckptshim.cli import main as cli

    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "maxtext", unflatten({k: jnp.asarray(v) for k, v in expected(model, layout).items()}))
    out = tmp_path / "hf"
    out.mkdir()
    assert cli(["convert", str(tmp_path / "maxtext"), str(out / "model.safetensors"), "--to", "safetensors",
                "--like", str(folder(model))]) == 0
    back, maxtexts, original = _load(out / "model.safetensors"), _load(HERE / model / "to_huggingface.safetensors"), \
        _load(folder(model) / "model.safetensors")
    assert back.keys() == maxtexts.keys() == original.keys()
    for key, value in maxtexts.items():
        assert np.array_equal(back[key].view(np.uint16), value.view(np.uint16)), key
    changed = sorted(k for k in original if not np.array_equal(back[k].view(np.uint16), original[k].view(np.uint16)))
    assert changed == ([f"model.layers.{i}.self_attn.q_proj.weight" for i in range(2)] if model == "llama3" else [])
    for name in ("config.json", "generation_config.json"):
        shutil.copy(folder(model) / name, out / name)
    # the original folder's logits, computed here: bfloat16 products round differently on another CPU
    logits, reference = _logits(out, model), _logits(folder(model), model)
    if model == "qwen3":
        assert np.array_equal(logits, reference)
    else:
        np.testing.assert_allclose(logits, reference, atol=0.02)


def test_optimizer_moments_in_the_target_are_never_filled_with_weights():
    """A train state's ``opt_state/mu/params/decoder/...`` is shaped like the params, but a
    Hugging Face folder holds no moments: those keys stay missing (the restore is refused)."""
    source = _inventory(folder("qwen3") / "model.safetensors")
    params = expected("qwen3", "scanned")
    moments = {("opt_state", "mu") + key[1:]: value for key, value in params.items()}
    target = Inventory([Entry(key, v.shape, "bfloat16") for key, v in {**params, **moments}.items()], "t")
    config = json.loads((folder("qwen3") / "config.json").read_text())
    found = plan(source, target, rules_for(LoadContext(source, target, "jax", model_config=config)))
    assert not any(key[0] == "opt_state" for op in found.ops for key in op.targets)
    assert sorted(found.missing) == sorted(moments)
