"""The PaxML GPT-3 -> MaxText profile on a real PaxML run (``paxml_runs/TinySpmdRepeat``).

Expected values are computed here from the natively read PaxML arrays with the transforms of
MaxText's own converter (``convert_gpt3_ckpt_from_paxml.py``, ``keystr_map``), transcribed below
independently of the profile's rows: ``numpy.moveaxis`` of the layer axis to MaxText's
``param_scan_axis``, ``x[:, i]`` of the fused ``combined_qkv``, ``x.T`` of the logits weight, and
for an unscanned target ``numpy.take`` of layer ``i``. Every restored leaf must equal them bit for bit.
The restore sharded over several devices runs in ``test_paxml.py``'s one subprocess.
"""

from __future__ import annotations

import json
import logging
import re

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import ckptshim  # noqa: F401  (hooks on)
from ckptshim.cli import main as cli
from ckptshim.errors import ShimError
from ckptshim.inventory import Entry, Inventory, KeyPath, flatten, unflatten
from ckptshim.ops import Rename, Split, Transpose
from ckptshim.planner import plan
from ckptshim.rules.context import LoadContext
from ckptshim.rules.profiles import rules_for
from support.plans import inverse
from support.fixtures import copy_fixture
from support.native import diagnosis
from test_paxml import PAX, STEP, native
from test_plan_properties import execute, same_bits

R = "transformer/repeat/sub/x_layers_0/"


def converter(axis: int) -> dict[str, tuple[str, object]]:
    """MaxText name (under the params root) -> (PaxML name under ``params/lm``, transform), as in
    the converter's ``keystr_map`` with ``cfg.param_scan_axis = axis``."""
    def move(x):
        return np.moveaxis(x, 0, axis)

    table = {
        "token_embedder/embedding": ("softmax/logits_ffn/linear/w", lambda x: x.T),
        "decoder/position_embedder/embedding": ("position_emb/emb_var", None),
        "decoder/layers/self_attention/qkv_proj/kernel": (
            R + "self_attention/combined_qkv/w", lambda x: np.moveaxis(x, [2, 0], [0, axis])),
        "decoder/layers/self_attention/qkv_proj/bias": (R + "self_attention/combined_qkv/b", move),
        "decoder/layers/self_attention/out/kernel": (
            R + "self_attention/post/w", lambda x: np.moveaxis(x, [0, 1], [axis, -1])),
        "decoder/layers/self_attention/out/bias": (R + "self_attention/post/b", move),
        "decoder/decoder_norm/scale": ("final_ln/scale", lambda x: x.T),
        "decoder/decoder_norm/bias": ("final_ln/bias", None),
    }
    for i, name in enumerate(("query", "key", "value")):
        for leaf, pax in (("kernel", "w"), ("bias", "b")):
            table[f"decoder/layers/self_attention/{name}/{leaf}"] = (
                R + f"self_attention/combined_qkv/{pax}", lambda x, i=i: np.moveaxis(x[:, i], 0, axis))
    for maxtext, pax in (("pre_self_attention_norm", "layer_norm"), ("mlp/mlp_layer_norm", "ff_layer/layer_norm")):
        for leaf in ("scale", "bias"):
            table[f"decoder/layers/{maxtext}/{leaf}"] = (R + f"{pax}/{leaf}", move)
    for maxtext, pax in (("wi", "ffn_layer1"), ("wo", "ffn_layer2")):
        table[f"decoder/layers/mlp/{maxtext}/kernel"] = (R + f"ff_layer/{pax}/linear/w", move)
        table[f"decoder/layers/mlp/{maxtext}/bias"] = (R + f"ff_layer/{pax}/bias/b", move)
    return table


ROOTS = {"params/params": "mdl_vars/params/lm", "opt_state/mu/params": "opt_states_0/{prefix}/m/params/lm",
         "opt_state/nu/params": "opt_states_0/{prefix}/v/params/lm"}


def K(text: str) -> tuple[str, ...]:
    return tuple(text.split("/"))


def expected_state(stored, layout: str, fused: bool, *, only_present: bool = True) -> dict:
    """The MaxText train state (params, Adam moments, count, step) the converter would write,
    for ``layout`` "scan1", "scan0" or "unscanned" (layer ``i`` of the scan1 stack); rows whose
    PaxML source the run lacks are left out (``only_present``) or listed as ``None``."""
    table = converter(0 if layout == "scan0" else 1)
    skip = ("/query/", "/key/", "/value/") if fused else ("/qkv_proj/",)
    out = {}
    for name, (pax, transform) in table.items():
        if any(s in name for s in skip):
            continue
        for root, pax_root in ROOTS.items():
            source = K(pax_root.format(prefix="p_2_i-1_2" if pax.startswith(R) else "no_prefix_2") + "/" + pax)
            if source not in stored:
                if not only_present:
                    out[K(f"{root}/{name}")] = None
                continue
            value = transform(stored[source]) if transform else stored[source]
            if layout == "unscanned" and "/layers/" in name:
                for i in range(value.shape[1]):
                    out[K(f"{root}/{name}".replace("/layers/", f"/layers_{i}/"))] = np.take(value, i, axis=1)
            else:
                out[K(f"{root}/{name}")] = value
    out[K("opt_state/count")] = stored[K("opt_states_0/no_prefix_0/count")]
    out[K("step")] = stored[K("step")].astype(np.int32)  # MaxText's step is int32, PaxML's uint32
    return out


def abstract(expected: dict) -> dict:
    return unflatten({key: jax.ShapeDtypeStruct(value.shape, value.dtype) for key, value in expected.items()})


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory):
    return copy_fixture(f"{PAX}/checkpoints/{STEP}", tmp_path_factory.mktemp("pax_gpt3")) / "state"


@pytest.fixture(scope="module")
def stored(state_dir):
    return native(state_dir)


def test_inspect_shows_the_fused_and_stacked_arrays(state_dir, capsys):
    assert cli(["inspect", str(state_dir), "--json"]) == 0
    arrays = {a["key"]: a for a in json.loads(capsys.readouterr().out)["entries"]}
    assert arrays["mdl_vars/params/lm/" + R + "self_attention/combined_qkv/w"]["shape"] == [2, 3, 32, 4, 8]
    assert arrays["opt_states_0/p_2_i-1_2/m/params/lm/" + R + "self_attention/post/w"]["shape"] == [2, 32, 4, 8]


@pytest.mark.parametrize("layout,fused,checkpointer", [
    ("scan1", False, ocp.StandardCheckpointer), ("scan1", True, ocp.StandardCheckpointer),
    ("scan0", False, ocp.StandardCheckpointer), ("unscanned", False, ocp.StandardCheckpointer),
    ("unscanned", True, ocp.StandardCheckpointer), ("scan1", False, ocp.PyTreeCheckpointer)])
def test_restore_into_maxtext_equals_the_converters_numpy(state_dir, stored, layout, fused, checkpointer, caplog):
    expected = expected_state(stored, layout, fused)
    with caplog.at_level(logging.INFO, logger="ckptshim"):
        restored = flatten(checkpointer().restore(state_dir, abstract(expected)))
    assert set(restored) == set(expected)
    for key, value in restored.items():
        assert isinstance(value, jax.Array), key
        assert value.dtype == expected[key].dtype and np.asarray(value).tobytes() == expected[key].tobytes(), key
    summary = next(r.getMessage() for r in caplog.records if r.levelno == logging.INFO)
    assert bool(re.search(r"perm 1,0,2[;)]", summary)) == (layout == "scan1")  # mlp/wi [L,E,F] -> [E,L,F]
    assert ("split (axes 0" in summary) == (layout == "unscanned")


@pytest.mark.parametrize("layout", ["scan1", "unscanned"])
def test_the_plan_uses_the_layout_ops_and_inverts(stored, layout):
    """Scanned on axis 1: a layer norm's [layers, embed] moves to [embed, layers]; the fused
    [layers, 3, embed, heads, head_dim] splits on axis 1 into query/key/value [embed, layers, ...].
    The inverse plan (joins, inverse transposes) gives back every PaxML array it read, bit for bit."""
    expected = expected_state(stored, layout, fused=False)
    source = Inventory([Entry(k, v.shape, v.dtype.name) for k, v in stored.items()], "pax")
    target = Inventory([Entry(k, v.shape, v.dtype.name) for k, v in expected.items()], "maxtext")
    p = plan(source, target, rules_for(LoadContext(source, target, "jax")))
    assert p.producer(K("opt_state/count")) == Rename(K("opt_states_0/no_prefix_0/count"), K("opt_state/count"))
    if layout == "scan1":
        norm = p.producer(K("params/params/decoder/layers/pre_self_attention_norm/scale"))
        assert norm == Transpose(K("mdl_vars/params/lm/" + R + "layer_norm/scale"), norm.target, (1, 0))
        qkv = p.producer(K("params/params/decoder/layers/self_attention/key/kernel"))
        assert isinstance(qkv, Split) and qkv.axes == (1,) and qkv.perm == (1, 0, 2, 3)
    else:
        qkv = p.producer(K("params/params/decoder/layers_1/self_attention/key/kernel"))
        assert isinstance(qkv, Split) and qkv.axes == (0, 1) and qkv.targets.index(qkv.targets[4]) == 4
        assert qkv.targets[4] == K("params/params/decoder/layers_1/self_attention/key/kernel")  # 3 * 1 + 1
    out = execute(p, stored)
    assert all(same_bits(out[key], value) for key, value in expected.items() if key != ("step",))
    back = execute(inverse(p), out)
    assert set(back) == set(stored) - set(p.unexpected)
    assert all(same_bits(value, stored[key]) for key, value in back.items() if key != ("step",))


def test_refuses_an_unscanned_target_with_a_layer_too_many(state_dir, stored):
    expected = expected_state(stored, "unscanned", fused=False)
    for key in [k for k in expected if "layers_1" in k]:
        expected[tuple(part.replace("layers_1", "layers_2") for part in key)] = expected[key]
    with pytest.raises(ShimError, match=r"holds indices \(0,\)..\(1,\) \(layer\), but the target also asks for \[\(2,\)\]"):
        ocp.StandardCheckpointer().restore(state_dir, abstract(expected))


def test_refuses_a_target_shape_no_layer_axis_fits(state_dir, stored):
    expected = expected_state(stored, "scan1", fused=False)
    wi = K("params/params/decoder/layers/mlp/wi/kernel")
    expected[wi] = np.zeros((64, 2, 32), np.float32)  # [mlp, layers, embed]: transposed the wrong way
    with pytest.raises(ShimError, match=r"decoder/layers/mlp/wi/kernel has shape \(64, 2, 32\).*ffn_layer1/linear/w"):
        ocp.StandardCheckpointer().restore(state_dir, abstract(expected))


def test_without_the_profile_a_moved_layer_axis_is_not_guessed(state_dir, stored):
    """PaxML names with the layer axis moved to 1: no profile applies (the target is not MaxText),
    and ckptshim does not guess a transpose from shapes. The restore is Orbax's (which cannot read
    PaxML's layout), and ckptshim's note names the arrays that do not fit."""
    target = {key: np.moveaxis(value, 0, 1) if "repeat" in key and value.ndim > 1 else value
              for key, value in stored.items()}
    with pytest.raises(FileNotFoundError) as raised:
        ocp.StandardCheckpointer().restore(state_dir, abstract(target))
    assert re.search(r"match by name but not by shape:\n.*x_layers_0", diagnosis(raised.value))


def test_notes_the_rows_the_checkpoint_lacks(state_dir, stored):
    """MaxText's GPT-3 has attention biases and a position embedding; this PaxML run has none: no
    plan, so Orbax's own error stands, and ckptshim's note names each row and where MaxText's
    converter would take it from."""
    expected = expected_state(stored, "scan1", fused=False, only_present=False)
    shapes = {"query/bias": (4, 2, 8), "key/bias": (4, 2, 8), "value/bias": (4, 2, 8), "out/bias": (32, 2),
              "position_embedder/embedding": (64, 32)}
    target = {key: next(np.zeros(s, np.float32) for tail, s in shapes.items() if "/".join(key).endswith(tail))
              if value is None else value for key, value in expected.items()}
    with pytest.raises(FileNotFoundError) as caught:
        ocp.StandardCheckpointer().restore(state_dir, abstract(target))
    message = diagnosis(caught.value)
    assert "15 key(s) the target needs are not in the checkpoint" in message
    assert ("\n  params/params/decoder/layers/self_attention/key/bias (MaxText's converter takes it from PaxML "
            "mdl_vars/params/lm/" + R + "self_attention/combined_qkv/b, which the checkpoint lacks)") in message
    assert "opt_state/mu/params/decoder/position_embedder/embedding" in message


def test_variables_gpt3_has_no_place_for_warn_and_strict_refuses(state_dir, stored, caplog, monkeypatch):
    target = abstract(expected_state(stored, "scan1", fused=True))
    with caplog.at_level(logging.WARNING, logger="ckptshim"):
        ocp.StandardCheckpointer().restore(state_dir, target)
    warning = next(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "per_dim_scale/per_dim_scale" in warning and "softmax/logits_ffn/bias/b" in warning
    monkeypatch.setenv("CKPTSHIM_STRICT", "1")
    with pytest.raises(ShimError, match="per_dim_scale.*CKPTSHIM_STRICT=1 refuses"):
        ocp.StandardCheckpointer().restore(state_dir, target)


def _square(layers: int, prefix: str) -> tuple[Inventory, Inventory, KeyPath]:
    """A PaxML GPT-3-like source whose embed width equals the layer count, and a MaxText target."""
    norm = K("mdl_vars/params/lm/" + R + "layer_norm/scale")
    moment = K(f"opt_states_0/{prefix}/m/params/lm/" + R + "layer_norm/scale")
    source = Inventory([Entry(norm, (layers, 4), "float32"), Entry(moment, (layers, 4), "float32")], "pax")
    target = Inventory([Entry(K("params/params/decoder/layers/pre_self_attention_norm/scale"), (4, 4), "float32"),
                        Entry(K("opt_state/mu/params/decoder/layers/pre_self_attention_norm/scale"), (4, 4), "float32")],
                       "maxtext")
    return source, target, moment



@pytest.mark.parametrize("prefix", ["p#4#i-1_2", "p_4_i-1_2"])
def test_square_shapes_take_maxtexts_default_axis_and_strict_refuses(prefix, monkeypatch):
    """[4, 4] fits the layer axis at 0 and at 1: MaxText's default param_scan_axis (1) is taken,
    a transpose; under CKPTSHIM_STRICT that is a guess, and refused. Both spellings of PaxML's
    Adam prefix are read."""
    source, target, moment = _square(4, prefix)
    p = plan(source, target, rules_for(LoadContext(source, target, "jax")))
    assert p.complete
    assert p.producer(K("opt_state/mu/params/decoder/layers/pre_self_attention_norm/scale")) == \
        Transpose(moment, K("opt_state/mu/params/decoder/layers/pre_self_attention_norm/scale"), (1, 0))
    monkeypatch.setenv("CKPTSHIM_STRICT", "1")
    with pytest.raises(ShimError, match="fits the layer axis at 0 or 1.*CKPTSHIM_STRICT=1"):
        plan(source, target, rules_for(LoadContext(source, target, "jax")))


@pytest.mark.parametrize("layout,fused", [("scan1", False), ("unscanned", True)])
def test_convert_like_a_maxtext_checkpoint_writes_what_the_restore_gives(state_dir, stored, tmp_path, layout, fused):
    """``ckptshim convert --to orbax --like <MaxText checkpoint>`` runs the same plan through the
    files executor (block reads: layer axes moved, ``combined_qkv`` split or kept fused): what it
    writes restores, with plain Orbax, bit for bit to the hooked restore of the PaxML run into the
    same tree, and to the converter's numpy transforms."""
    import ckptshim

    expected = expected_state(stored, layout, fused)
    expected[K("step")] = stored[K("step")]  # convert copies bytes exactly: PaxML's uint32 step
    like = tmp_path / "maxtext_layout"
    with ocp.StandardCheckpointer() as checkpointer:  # the layout only: zeros of each shape and dtype
        checkpointer.save(like, unflatten({key: np.zeros_like(value) for key, value in expected.items()}))
    out = ckptshim.convert(state_dir, tmp_path / "converted", to="orbax", like=like, progress=False)
    with ocp.StandardCheckpointer() as checkpointer:
        converted = flatten(checkpointer.restore(out))
        restored = flatten(checkpointer.restore(state_dir, abstract(expected)))
    assert set(converted) == set(restored) == set(expected)
    for key, value in expected.items():
        assert np.asarray(converted[key]).dtype == value.dtype, key
        assert np.asarray(converted[key]).tobytes() == np.asarray(restored[key]).tobytes() == value.tobytes(), key
