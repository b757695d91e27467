"""The planner, with plain tuples only: no torch, no jax, no tensor bytes."""

from __future__ import annotations

import random
import sys

import pytest

from ckptshim.errors import PlanError, ShimError
from ckptshim.inventory import Entry, Inventory, join_key
from ckptshim.ops import Cast, Drop, DropIfDerived, Rename, Stack, Synthesize, Unstack
from ckptshim.planner import Mismatch, Plan, explain, plan, summary
from ckptshim.rules import DEFAULT_RULES, Alias, Rules, ScanAxis
from support.plans import inverse


def K(text: str) -> tuple[str, ...]:
    """``"a.b"`` or ``"a/b"`` -> ``("a", "b")``."""
    return tuple(text.split("/" if "/" in text else "."))


def inv(spec: dict, dtype: str = "float32", source: str = "") -> Inventory:
    """``{"a.b": shape}`` or ``{"a.b": (shape, dtype)}`` -> Inventory."""
    entries = []
    for key, value in spec.items():
        if len(value) == 2 and isinstance(value[1], str):
            shape, dt = value
        else:
            shape, dt = value, dtype
        entries.append(Entry(K(key), tuple(shape), dt))
    return Inventory(entries, source=source)


def test_module_does_not_import_frameworks():
    # The planner must be usable without torch or jax; importing it must not pull them in.
    import subprocess

    code = ("import sys, ckptshim.planner, ckptshim.rules; "
            "print('torch' in sys.modules, 'jax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=str(__import__("pathlib").Path(__file__).resolve().parents[1]),
                         check=True)
    assert out.stdout.split() == ["False", "False"]


def test_public_plan_function_survives_the_planner_package_import():
    # Hooks import the planner package; importing a submodule sets it as an attribute of its
    # parent, so a subpackage named like a public function would replace that function.
    import subprocess

    code = ("import ckptshim, ckptshim.planner, ckptshim.api; "
            "print(ckptshim.plan is ckptshim.api.plan)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.split() == ["True"]


# -- exact names -------------------------------------------------------------------------------


def test_exact_match_is_identity():
    spec = {"embed.weight": (10, 4), "layers.0.w": (4, 4), "step": ()}
    p = plan(inv(spec), inv(spec))
    assert p.is_identity
    assert p.complete
    assert p.ops == tuple(Rename(K(k), K(k)) for k in spec)
    assert (p.missing, p.unexpected, p.mismatched) == ((), (), ())
    assert summary(p) == "nothing to change"
    assert explain(p) == []
    assert p.producer(K("step")) == Rename(K("step"), K("step"))
    assert p.producer(K("nope")) is None


def test_ops_follow_target_order():
    src = inv({"a": (1,), "b": (2,), "c": (3,)})
    tgt = inv({"c": (3,), "a": (1,), "b": (2,)})
    assert [op.target for op in plan(src, tgt).ops] == [K("c"), K("a"), K("b")]


def test_empty_inventories():
    p = plan(inv({}), inv({}))
    assert p.ops == () and p.complete and p.is_identity


# -- wrapper prefixes --------------------------------------------------------------------------

WRAPPERS = ["_orig_mod", "module", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"]
BASE = ("encoder", "layers", "3", "attn", "weight")


@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("depth", [0, 1, 3, 4])
@pytest.mark.parametrize("wrapped_side", ["source", "target"])
def test_wrapper_at_any_depth_either_direction(wrapper, depth, wrapped_side):
    wrapped = BASE[:depth] + (wrapper,) + BASE[depth:]
    src_key, tgt_key = (wrapped, BASE) if wrapped_side == "source" else (BASE, wrapped)
    src = Inventory([Entry(src_key, (4, 4), "float32"), Entry(("head",), (4,), "float32")])
    tgt = Inventory([Entry(tgt_key, (4, 4), "float32"), Entry(("head",), (4,), "float32")])
    p = plan(src, tgt)
    assert p.complete
    assert not p.is_identity
    assert p.ops == (Rename(src_key, tgt_key), Rename(("head",), ("head",)))
    assert summary(p) == f"1 renamed ({join_key(src_key)} -> {join_key(tgt_key)})"


def test_several_nested_wrappers_on_both_sides():
    src = inv({"_orig_mod.layers.0._checkpoint_wrapped_module.w": (2,),
               "_orig_mod.layers.1._checkpoint_wrapped_module.w": (2,)})
    tgt = inv({"module._fsdp_wrapped_module.layers.0.w": (2,),
               "module._fsdp_wrapped_module.layers.1.w": (2,)})
    p = plan(src, tgt)
    assert p.complete
    assert p.ops == (
        Rename(K("_orig_mod.layers.0._checkpoint_wrapped_module.w"),
               K("module._fsdp_wrapped_module.layers.0.w")),
        Rename(K("_orig_mod.layers.1._checkpoint_wrapped_module.w"),
               K("module._fsdp_wrapped_module.layers.1.w")),
    )


def test_a_leaf_named_like_a_wrapper_is_not_stripped():
    p = plan(inv({"block.module": (3,)}), inv({"block": (3,)}))
    assert p.ops == ()
    assert p.missing == (K("block"),) and p.unexpected == (K("block.module"),)


def test_wrappers_can_be_turned_off_by_rules():
    p = plan(inv({"module.w": (3,)}), inv({"w": (3,)}), Rules(wrappers=frozenset()))
    assert p.missing == (K("w"),) and p.unexpected == (K("module.w"),)


def test_two_checkpoint_keys_collapsing_to_one_name_is_an_error():
    with pytest.raises(PlanError) as info:
        plan(inv({"module.w": (3,), "_orig_mod.w": (3,)}), inv({"w": (3,)}))
    message = str(info.value)
    assert "checkpoint keys 'module.w' and '_orig_mod.w' both mean 'w'" in message


def test_two_target_keys_collapsing_to_one_name_is_an_error():
    with pytest.raises(PlanError) as info:
        plan(inv({"w": (3,)}), inv({"module.w": (3,), "_orig_mod.w": (3,)}))
    assert "target keys 'module.w' and '_orig_mod.w' both mean 'w'" in str(info.value)


def test_exact_match_wins_over_a_wrapped_duplicate():
    # The exact key is consumed first; the wrapped copy is left over, never guessed into place.
    p = plan(inv({"w": (3,), "_orig_mod.w": (3,)}), inv({"w": (3,)}))
    assert p.ops == (Rename(K("w"), K("w")),)
    assert p.unexpected == (K("_orig_mod.w"),)


# -- stacking and unstacking -------------------------------------------------------------------


def maxtext_per_layer(n: int, shape=(8, 16)) -> dict:
    return {f"decoder/layers_{i}/mlp/wi/kernel": shape for i in range(n)}


def test_per_layer_to_stacked_axis_1_maxtext():
    src = inv(maxtext_per_layer(4))
    tgt = inv({"decoder/layers/mlp/wi/kernel": (8, 4, 16)})
    p = plan(src, tgt)
    assert p.complete
    assert p.ops == (Stack(tuple(K(f"decoder/layers_{i}/mlp/wi/kernel") for i in range(4)),
                           K("decoder/layers/mlp/wi/kernel"), 1),)
    assert p.producer(K("decoder/layers/mlp/wi/kernel")) is p.ops[0]
    assert summary(p) == "4 stacked (axis 1)"
    assert explain(p, "/") == [
        "decoder/layers_{0..3}/mlp/wi/kernel -> stack(axis=1) -> decoder/layers/mlp/wi/kernel"]


def test_per_layer_to_stacked_axis_0_torch():
    src = inv({f"model.layers.{i}.mlp.w": (4, 5) for i in range(3)})
    tgt = inv({"model.layers.mlp.w": (3, 4, 5)})  # 3 layers of (4, 5): axis 0 only
    p = plan(src, tgt)
    assert p.ops == (Stack(tuple(K(f"model.layers.{i}.mlp.w") for i in range(3)),
                           K("model.layers.mlp.w"), 0),)
    assert explain(p) == ["model.layers.{0..2}.mlp.w -> stack(axis=0) -> model.layers.mlp.w"]


def test_stack_axis_2_and_last():
    src = inv({f"layers_{i}/w": (2, 3) for i in range(5)})
    p = plan(src, inv({"layers/w": (2, 3, 5)}))
    assert p.ops[0].axis == 2


def test_stack_sources_are_in_numeric_layer_order():
    names = [f"layers.{i}.w" for i in range(12)]
    random.Random(0).shuffle(names)
    p = plan(inv({n: (2,) for n in names}), inv({"layers.w": (12, 2)}))
    (op,) = p.ops
    assert op.sources == tuple(K(f"layers.{i}.w") for i in range(12))
    assert explain(p) == ["layers.{0..11}.w -> stack(axis=0) -> layers.w"]


def test_stacked_to_per_layer_maxtext():
    src = inv({"decoder/layers/mlp/wi/kernel": (8, 4, 16)})
    tgt = inv(maxtext_per_layer(4))
    p = plan(src, tgt)
    assert p.complete
    op = Unstack(K("decoder/layers/mlp/wi/kernel"),
                 tuple(K(f"decoder/layers_{i}/mlp/wi/kernel") for i in range(4)), 1)
    assert p.ops == (op,)  # one op, listed once although it produces four keys
    for i in range(4):
        assert p.producer(K(f"decoder/layers_{i}/mlp/wi/kernel")) == op
    assert summary(p) == "4 unstacked (axis 1)"
    assert explain(p, "/") == [
        "decoder/layers/mlp/wi/kernel -> unstack(axis=1) -> decoder/layers_{0..3}/mlp/wi/kernel"]


def test_stacked_to_per_layer_torch_with_wrappers():
    src = inv({"_orig_mod.layers.w": (3, 2)})
    tgt = inv({f"module.layers.{i}.w": (2,) for i in range(3)})
    p = plan(src, tgt)
    assert p.ops == (Unstack(K("_orig_mod.layers.w"),
                             tuple(K(f"module.layers.{i}.w") for i in range(3)), 0),)


def test_stack_shape_mismatch_is_recorded_not_guessed():
    src = inv({f"layers.{i}.w": (3,) for i in range(4)})
    p = plan(src, inv({"layers.w": (5, 3)}))  # five layers wanted, four present
    assert p.ops == ()
    assert p.mismatched == (Mismatch(K("layers.0.w"), K("layers.w"), (3,), (5, 3),
                                     "shape (as 4 stacked layers)"),)
    assert p.unexpected == () and p.missing == ()
    assert not p.complete


def test_unstack_shape_mismatch_is_recorded():
    p = plan(inv({"layers.w": (3, 3)}), inv({"layers.0.w": (3,), "layers.1.w": (3,)}))
    assert p.mismatched == (Mismatch(K("layers.w"), K("layers.0.w"), (3, 3), (3,),
                                     "shape (one of 2 layers)"),)
    assert not p.complete


def test_layers_with_different_shapes_refused():
    with pytest.raises(PlanError, match=r"the layers of 'layers\.w' have different shapes"):
        plan(inv({"layers.0.w": (3,), "layers.1.w": (4,)}), inv({"layers.w": (2, 3)}))


def test_same_layer_twice_refused():
    with pytest.raises(PlanError, match=r"'layers\.3\.w' and 'layers_3\.w' are both layer 3"):
        plan(inv({"layers.3.w": (3,), "layers_3.w": (3,)}), inv({"layers.w": (4, 3)}))


def test_stacked_or_per_layer_source_both_possible_is_an_error():
    src = inv({"layers.0.experts.0.w": (3,), "layers.0.experts.1.w": (3,),
               "layers.experts.w": (2, 2, 3)})
    with pytest.raises(PlanError, match="could come from .* ckptshim will not guess"):
        plan(src, inv({"layers.0.experts.w": (2, 3)}))


# -- ambiguous stacking axis -------------------------------------------------------------------


def square_case(extra_src=None, extra_tgt=None):
    src = {f"decoder/layers_{i}/attn/q": (4, 4) for i in range(4)}
    tgt = {"decoder/layers/attn/q": (4, 4, 4)}
    src.update(extra_src or {})
    tgt.update(extra_tgt or {})
    return inv(src), inv(tgt)


def test_ambiguous_axis_is_an_error():
    src, tgt = square_case()
    with pytest.raises(PlanError) as info:
        plan(src, tgt)
    message = str(info.value)
    assert "'decoder.layers.attn.q' could be stacked along axis 0 or 1 or 2" in message
    assert "ScanAxis" in message
    assert "sibling" not in message


def test_ambiguous_axis_resolved_by_scan_axis_rule():
    src, tgt = square_case()
    p = plan(src, tgt, Rules(scan_axes=(ScanAxis("layers", 1),)))
    assert p.ops[0] == Stack(tuple(K(f"decoder/layers_{i}/attn/q") for i in range(4)),
                             K("decoder/layers/attn/q"), 1)
    p = plan(src, tgt, DEFAULT_RULES.extend(scan_axes=[ScanAxis("decoder", 2)]))
    assert p.ops[0].axis == 2


def test_scan_axis_rule_for_other_component_does_not_apply():
    src, tgt = square_case()
    with pytest.raises(PlanError, match="could be stacked along axis 0 or 1 or 2"):
        plan(src, tgt, Rules(scan_axes=(ScanAxis("encoder", 1),)))


def test_scan_axis_rule_never_overrides_shapes():
    # Shapes admit only axis 1; a rule saying 0 is irrelevant.
    p = plan(inv(maxtext_per_layer(4)), inv({"decoder/layers/mlp/wi/kernel": (8, 4, 16)}),
             Rules(scan_axes=(ScanAxis("layers", 0),)))
    assert p.ops[0].axis == 1


def test_ambiguous_axis_resolved_by_siblings():
    src, tgt = square_case(maxtext_per_layer(4), {"decoder/layers/mlp/wi/kernel": (8, 4, 16)})
    p = plan(src, tgt)
    assert p.complete
    assert {op.target: op.axis for op in p.ops} == {
        K("decoder/layers/attn/q"): 1, K("decoder/layers/mlp/wi/kernel"): 1}


def test_ambiguous_axis_resolved_by_siblings_when_unstacking():
    src = inv({"decoder/layers/attn/q": (4, 4, 4), "decoder/layers/mlp/wi/kernel": (8, 4, 16)})
    tgt = inv({**{f"decoder/layers_{i}/attn/q": (4, 4) for i in range(4)}, **maxtext_per_layer(4)})
    p = plan(src, tgt)
    assert p.complete
    assert {op.source: op.axis for op in p.ops} == {
        K("decoder/layers/attn/q"): 1, K("decoder/layers/mlp/wi/kernel"): 1}


def test_siblings_under_another_stack_root_do_not_help():
    src, tgt = square_case({f"encoder/layers_{i}/mlp/wi/kernel": (8, 16) for i in range(4)},
                           {"encoder/layers/mlp/wi/kernel": (8, 4, 16)})
    with pytest.raises(PlanError, match="could be stacked along axis 0 or 1 or 2"):
        plan(src, tgt)


def test_siblings_that_disagree_do_not_help():
    src, tgt = square_case(
        {**maxtext_per_layer(4), **{f"decoder/layers_{i}/norm/scale": (16,) for i in range(4)}},
        {"decoder/layers/mlp/wi/kernel": (8, 4, 16), "decoder/layers/norm/scale": (4, 16)})
    with pytest.raises(PlanError, match="sibling layers do not agree"):
        plan(src, tgt)


def test_sibling_axis_that_does_not_fit_is_not_used():
    # q (3 layers of (3, 3) -> (3, 3, 3)) fits axes 0, 1, 2; its sibling w can only be axis 3.
    src = {f"layers_{i}/q": (3, 3) for i in range(3)}
    src.update({f"layers_{i}/w": (2, 5, 7) for i in range(3)})
    tgt = {"layers/q": (3, 3, 3), "layers/w": (2, 5, 7, 3)}
    with pytest.raises(PlanError, match="could be stacked along axis 0 or 1 or 2"):
        plan(inv(src), inv(tgt))


def test_strict_rules_refuse_the_sibling_guess():
    src, tgt = square_case(maxtext_per_layer(4), {"decoder/layers/mlp/wi/kernel": (8, 4, 16)})
    with pytest.raises(PlanError, match="CKPTSHIM_STRICT=1 forbids taking the axis from siblings"):
        plan(src, tgt, Rules(strict=True))
    # ... but a scan-axis rule is not a guess, so strict accepts it.
    p = plan(src, tgt, Rules(strict=True, scan_axes=(ScanAxis("layers", 1),)))
    assert [op.axis for op in p.ops] == [1, 1]


# -- incomplete layer lists ------------------------------------------------------------------


def test_missing_layer_in_checkpoint_is_named():
    src = inv({f"layers.{i}.w": (3,) for i in (0, 1, 3)})
    with pytest.raises(PlanError) as info:
        plan(src, inv({"layers.w": (4, 3)}))
    message = str(info.value)
    assert "checkpoint has layers {0..1,3} of 'layers.w' but not {2}" in message


def test_missing_first_layer_in_checkpoint_is_named():
    src = inv({f"decoder/layers_{i}/w": (3,) for i in (1, 2, 3)})
    with pytest.raises(PlanError, match=r"has layers \{1\.\.3\} of 'decoder\.layers\.w' but not \{0\}"):
        plan(src, inv({"decoder/layers/w": (4, 3)}))


def test_missing_layer_in_target_is_named():
    tgt = inv({f"layers.{i}.w": (3,) for i in (0, 1, 3)})
    with pytest.raises(PlanError, match=r"target has layers \{0\.\.1,3\} of 'layers\.w' but not \{2\}"):
        plan(inv({"layers.w": (4, 3)}), tgt)


# -- names that are not layer lists ------------------------------------------------------------


def test_wi_0_wi_1_are_never_stacked():
    src = inv({"mlp/wi_0/kernel": (8, 16), "mlp/wi_1/kernel": (8, 16)})
    p = plan(src, inv({"mlp/wi/kernel": (2, 8, 16)}))
    assert p.ops == ()
    assert p.missing == (K("mlp/wi/kernel"),)
    assert p.unexpected == (K("mlp/wi_0/kernel"), K("mlp/wi_1/kernel"))


def test_wi_0_wi_1_inside_layers_stack_separately():
    src = {}
    for i in range(3):
        src[f"decoder/layers_{i}/mlp/wi_0/kernel"] = (8, 16)
        src[f"decoder/layers_{i}/mlp/wi_1/kernel"] = (8, 16)
    tgt = {"decoder/layers/mlp/wi_0/kernel": (8, 3, 16), "decoder/layers/mlp/wi_1/kernel": (8, 3, 16)}
    p = plan(inv(src), inv(tgt))
    assert p.complete
    assert p.ops == tuple(
        Stack(tuple(K(f"decoder/layers_{i}/mlp/{w}/kernel") for i in range(3)),
              K(f"decoder/layers/mlp/{w}/kernel"), 1) for w in ("wi_0", "wi_1"))
    assert explain(p, "/") == [
        "decoder/layers_{0..2}/mlp/wi_0/kernel -> stack(axis=1) -> decoder/layers/mlp/wi_0/kernel",
        "decoder/layers_{0..2}/mlp/wi_1/kernel -> stack(axis=1) -> decoder/layers/mlp/wi_1/kernel",
    ]


def test_unknown_list_name_is_not_stacked_unless_a_rule_says_so():
    src = inv({f"stages.{i}.w": (3,) for i in range(2)})
    tgt = inv({"stages.w": (2, 3)})
    assert plan(src, tgt).ops == ()
    p = plan(src, tgt, DEFAULT_RULES.extend(layer_lists={"stages"}))
    assert p.ops == (Stack((K("stages.0.w"), K("stages.1.w")), K("stages.w"), 0),)


# -- derivable buffers, drop, synthesize -------------------------------------------------------


def test_derivable_buffers_are_dropped():
    src = inv({
        "gpt_neox.layers.0.attention.query_key_value.weight": (12, 4),
        "gpt_neox.layers.0.attention.bias": (1, 1, 8, 8),
        "gpt_neox.layers.0.attention.masked_bias": (),
        "gpt_neox.layers.0.attention.rotary_emb.inv_freq": (2,),
        "_orig_mod.layers.1.attention.rotary_emb.inv_freq": (2,),
        "gpt_neox.layers.0.attention.dense.bias": (4,),
    })
    tgt = inv({"gpt_neox.layers.0.attention.query_key_value.weight": (12, 4)})
    p = plan(src, tgt)
    drops = [op for op in p.ops if isinstance(op, (Drop, DropIfDerived))]
    assert drops == [  # by name alone: the executor drops them only once their values check out
        DropIfDerived(K("gpt_neox.layers.0.attention.bias"), "attention.bias"),
        DropIfDerived(K("gpt_neox.layers.0.attention.masked_bias"), "attention.masked_bias"),
        DropIfDerived(K("gpt_neox.layers.0.attention.rotary_emb.inv_freq"), "inv_freq"),
        DropIfDerived(K("_orig_mod.layers.1.attention.rotary_emb.inv_freq"), "inv_freq"),
    ]
    # A real parameter that merely ends in "bias" is not derivable: it stays unexpected.
    assert p.unexpected == (K("gpt_neox.layers.0.attention.dense.bias"),)
    assert summary(p) == "4 dropped (attention.bias, attention.masked_bias, inv_freq), 1 unexpected"


def test_derivable_buffer_the_target_wants_is_loaded_not_dropped():
    spec = {"rotary_emb.inv_freq": (2,), "w": (3,)}
    p = plan(inv(spec), inv(spec))
    assert p.is_identity


def test_rules_drop_names_exact_canonical_keys():
    src = inv({"w": (3,), "_orig_mod.running_buf": (3,), "other_buf": (3,)})
    p = plan(src, inv({"w": (3,)}), Rules(drop=frozenset({K("running_buf")})))
    assert [op for op in p.ops if isinstance(op, (Drop, DropIfDerived))] == [  # checked by the executor
        DropIfDerived(K("_orig_mod.running_buf"), "not persistent in target")]
    assert p.unexpected == (K("other_buf"),)


def test_rules_synthesize_fills_missing_target_keys():
    src = inv({"w": (3,)})
    tgt = inv({"w": (3,), "layers.0.attention.bias": (1, 8, 8), "counter": ()})
    rules = Rules(synthesize=frozenset({K("layers.0.attention.bias"), K("counter")}))
    p = plan(src, tgt, rules)
    assert p.complete
    assert p.ops == (Rename(K("w"), K("w")),
                     Synthesize(K("layers.0.attention.bias"), "attention.bias"),
                     Synthesize(K("counter"), "target's own value"))
    assert summary(p) == "2 synthesized (attention.bias, target's own value)"
    assert p.producer(K("counter")) == Synthesize(K("counter"), "target's own value")


def test_synthesize_does_not_override_a_checkpoint_value():
    spec = {"w": (3,), "counter": ()}
    p = plan(inv(spec), inv(spec), Rules(synthesize=frozenset({K("counter")})))
    assert p.is_identity


def test_without_rules_a_missing_buffer_is_missing():
    p = plan(inv({"w": (3,)}), inv({"w": (3,), "layers.0.attention.bias": (1, 8, 8)}))
    assert p.missing == (K("layers.0.attention.bias"),)
    assert not p.complete


def test_rules_extend_adds_to_collections_and_overrides_scalars():
    rules = DEFAULT_RULES.extend(drop=[K("a")], wrappers={"_wrapped"}, strict=True,
                                 scan_axes=[ScanAxis("layers", 1)])
    assert rules.drop == frozenset({K("a")})
    assert "_wrapped" in rules.wrappers and "_orig_mod" in rules.wrappers
    assert rules.strict is True and DEFAULT_RULES.strict is False
    assert rules.scan_axes == (ScanAxis("layers", 1),)
    assert rules.extend(drop=[K("b")]).drop == frozenset({K("a"), K("b")})


# -- dtypes -------------------------------------------------------------------------------------


def test_cast_recorded_after_its_producer():
    p = plan(inv({"w": (4,), "v": (2,)}), inv({"w": ((4,), "bfloat16"), "v": (2,)}))
    assert p.complete
    assert not p.is_identity
    assert p.ops == (Rename(K("w"), K("w")), Cast(K("w"), "float32", "bfloat16"),
                     Rename(K("v"), K("v")))
    assert p.casts() == {K("w"): Cast(K("w"), "float32", "bfloat16")}
    assert summary(p) == "1 cast (float32 -> bfloat16)"
    assert explain(p) == ["w: cast float32 -> bfloat16"]


def test_cast_on_stack_and_unstack():
    src = inv({f"layers.{i}.w": ((3,), "float32") for i in range(2)})
    tgt = inv({"layers.w": ((2, 3), "bfloat16")})
    p = plan(src, tgt)
    assert p.ops[1] == Cast(K("layers.w"), "float32", "bfloat16")
    q = plan(tgt, src)
    assert q.ops == (Unstack(K("layers.w"), (K("layers.0.w"), K("layers.1.w")), 0),
                     Cast(K("layers.0.w"), "bfloat16", "float32"),
                     Cast(K("layers.1.w"), "bfloat16", "float32"))
    assert summary(q) == "2 unstacked (axis 0), 2 cast (bfloat16 -> float32)"


def test_cast_refused_when_not_allowed():
    p = plan(inv({"w": (4,)}), inv({"w": ((4,), "float16")}), Rules(allow_cast=False))
    assert p.casts() == {}
    assert p.mismatched == (Mismatch(K("w"), K("w"), ("float32",), ("float16",), "dtype"),)
    with pytest.raises(PlanError, match=r"1 key\(s\) match by name and shape but not by dtype.*\n"
                                        r"  w: target dtype float16 but checkpoint w has float32\n"):
        p.require_complete()


@pytest.mark.parametrize("src_dtype, tgt_dtype", [
    ("float32", "bfloat16"), ("float64", "float32"), ("int32", "float32"), ("float32", "int64"),
    ("int64", "int32"),
])
def test_strict_refuses_narrowing_casts(src_dtype, tgt_dtype):
    p = plan(inv({"w": ((4,), src_dtype)}), inv({"w": ((4,), tgt_dtype)}), Rules(strict=True))
    assert p.casts() == {}
    assert p.mismatched == (Mismatch(K("w"), K("w"), (src_dtype,), (tgt_dtype,), "dtype"),)
    # without strict the same cast is planned
    q = plan(inv({"w": ((4,), src_dtype)}), inv({"w": ((4,), tgt_dtype)}))
    assert q.casts() == {K("w"): Cast(K("w"), src_dtype, tgt_dtype)}


@pytest.mark.parametrize("src_dtype, tgt_dtype", [
    ("bfloat16", "float32"), ("float16", "float64"), ("int8", "int32"),
])
def test_strict_allows_widening_casts(src_dtype, tgt_dtype):
    p = plan(inv({"w": ((4,), src_dtype)}), inv({"w": ((4,), tgt_dtype)}), Rules(strict=True))
    assert p.complete
    assert p.casts() == {K("w"): Cast(K("w"), src_dtype, tgt_dtype)}


# -- mismatches and error messages -------------------------------------------------------------


def test_shape_mismatch_and_require_complete():
    p = plan(inv({"w": (4, 5), "b": (4,)}, source="old.bin"), inv({"w": (4, 4), "b": (4,)}, source="model"))
    assert p.mismatched == (Mismatch(K("w"), K("w"), (4, 5), (4, 4)),)
    assert p.ops == (Rename(K("b"), K("b")),)
    assert not p.complete and not p.is_identity
    assert summary(p) == "1 mismatched"
    assert explain(p) == ["mismatch: w: target shape (4, 4) but checkpoint w has (4, 5)"]
    with pytest.raises(PlanError) as info:
        p.require_complete()
    assert str(info.value).splitlines() == [
        "checkpoint old.bin does not fit target model:",
        "1 key(s) match by name but not by shape:",
        "  w: target shape (4, 4) but checkpoint w has (4, 5)",
        "A key whose shape differs loads in no mode, strict or not: build the target with the "
        "checkpoint's configuration, or leave that key out.",
    ]


def test_missing_key_error_lists_nearest_candidates():
    src = inv({"encoder.attention.q.weight": (4, 4), "encoder.attention.k.weight": (4, 4),
               "decoder.mlp.bias": (4,)})
    tgt = inv({"encoder.attn.q.weight": (4, 4), "encoder.attention.k.weight": (4, 4)})
    p = plan(src, tgt)
    assert p.missing == (K("encoder.attn.q.weight"),)
    assert p.unexpected == (K("encoder.attention.q.weight"), K("decoder.mlp.bias"))
    with pytest.raises(PlanError) as info:
        p.require_complete()
    lines = str(info.value).splitlines()
    assert "1 key(s) the target needs are not in the checkpoint:" in lines
    assert "  encoder.attn.q.weight (nearest in checkpoint: encoder.attention.q.weight)" in lines
    assert "2 checkpoint key(s) the target has no place for:" in lines
    assert "  decoder.mlp.bias" in lines
    # allow_* flags silence their part of the check
    with pytest.raises(PlanError) as info:
        p.require_complete(allow_missing=True)
    assert "not in the checkpoint" not in str(info.value)
    p.require_complete(allow_missing=True, allow_unexpected=True)


def test_require_complete_says_when_lists_are_cut():
    names = "abcdefghijklmnopqrst"  # keys that differ in a letter, not a number, are not grouped
    src = inv({f"old_{c}": (1,) for c in names})
    tgt = inv({f"new_{c}": (1,) for c in names})
    with pytest.raises(PlanError) as info:
        plan(src, tgt).require_complete()
    message = str(info.value)
    assert "20 key(s) the target needs" in message
    assert "(lists cut at 12 lines; `ckptshim plan` shows every key)" in message
    assert "  new_l" in message and "  new_m" not in message


def test_plan_error_is_a_shim_error_and_framework_errors():
    with pytest.raises(PlanError) as info:
        plan(inv({"module.w": (3,), "_orig_mod.w": (3,)}), inv({"w": (3,)}))
    assert isinstance(info.value, ShimError)
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, ValueError)


# -- aliases ----------------------------------------------------------------------------------


@pytest.mark.parametrize("forward", [True, False])
def test_alias_prefix_both_directions(forward):
    rules = Rules(aliases=(Alias(K("lm_head"), K("embed_out"), "prefix"),))
    a, b = inv({"embed_out.weight": (8, 4)}), inv({"lm_head.weight": (8, 4)})
    src, tgt = (a, b) if forward else (b, a)
    p = plan(src, tgt, rules)
    assert p.complete
    assert p.ops == (Rename(next(iter(src)), next(iter(tgt))),)


def test_alias_prefix_only_at_the_start():
    rules = Rules(aliases=(Alias(K("lm_head"), K("embed_out"), "prefix"),))
    p = plan(inv({"x.embed_out.weight": (8, 4)}), inv({"x.lm_head.weight": (8, 4)}), rules)
    assert p.ops == () and p.missing == (K("x.lm_head.weight"),)


@pytest.mark.parametrize("forward", [True, False])
def test_alias_suffix_both_directions(forward):
    rules = Rules(aliases=(Alias(K("kernel"), K("kernel/value"), "suffix"),))
    a, b = inv({"dense/kernel/value": (4, 4)}), inv({"dense/kernel": (4, 4)})
    src, tgt = (a, b) if forward else (b, a)
    p = plan(src, tgt, rules)
    assert p.ops == (Rename(next(iter(src)), next(iter(tgt))),)


@pytest.mark.parametrize("forward", [True, False])
def test_alias_anywhere_both_directions(forward):
    rules = Rules(aliases=(Alias(("attn",), ("self_attention",)),))
    a = inv({"layers.0.self_attention.q": (4,), "layers.1.self_attention.q": (4,)})
    b = inv({"layers.0.attn.q": (4,), "layers.1.attn.q": (4,)})
    src, tgt = (a, b) if forward else (b, a)
    p = plan(src, tgt, rules)
    assert p.ops == tuple(Rename(s, t) for s, t in zip(src, tgt))


def test_alias_combined_with_wrappers_and_stacking():
    rules = Rules(aliases=(Alias(("attn",), ("self_attention",)),))
    src = inv({f"_orig_mod.layers.{i}.self_attention.q": (4,) for i in range(3)})
    p = plan(src, inv({"layers.attn.q": (3, 4)}), rules)
    assert p.ops == (Stack(tuple(src), K("layers.attn.q"), 0),)


def test_model_using_both_spellings_is_ambiguous():
    rules = Rules(aliases=(Alias(K("lm_head"), K("embed_out"), "prefix"),))
    with pytest.raises(PlanError, match="both mean 'lm_head.weight'"):
        plan(inv({"embed_out.weight": (4,), "lm_head.weight": (4,)}), inv({"head.weight": (4,)}),
             rules)


def test_alias_rewrite_unit():
    assert Alias(K("a"), K("x.y"), "prefix").rewrite(K("x.y.z")) == K("a.z")
    assert Alias(K("a"), K("x.y"), "prefix").rewrite(K("q.x.y")) == K("q.x.y")
    assert Alias(K("a"), K("x.y"), "suffix").rewrite(K("q.x.y")) == K("q.a")
    assert Alias(K("a"), K("x.y"), "suffix").rewrite(K("x.y.q")) == K("x.y.q")
    assert Alias(K("a.b"), K("x"), "anywhere").rewrite(K("x.q.x")) == K("a.b.q.a.b")
    assert Alias(K("a"), K("x.y"), "anywhere").rewrite(K("x.q.y")) == K("x.q.y")


# -- inverse ------------------------------------------------------------------------------------


def rich_plan() -> Plan:
    src = inv({
        "_orig_mod.embed.weight": (10, 4),
        **{f"_orig_mod.layers.{i}.w": (4, 4) for i in range(3)},
        "_orig_mod.head.w": (4, 3, 2),
        "_orig_mod.layers.0.rotary.inv_freq": (2,),
    })
    tgt = inv({
        "embed.weight": (10, 4),
        "layers.w": (4, 3, 4),
        **{f"head.{i}.w": (4, 2) for i in range(3)},
        "norm_buf": (4,),
    })
    rules = Rules(layer_lists=DEFAULT_RULES.layer_lists | {"head"},
                  synthesize=frozenset({K("norm_buf")}))
    return plan(src, tgt, rules)


def test_rich_plan_ops():
    p = rich_plan()
    assert p.complete
    assert p.ops == (
        Rename(K("_orig_mod.embed.weight"), K("embed.weight")),
        Stack(tuple(K(f"_orig_mod.layers.{i}.w") for i in range(3)), K("layers.w"), 1),
        Unstack(K("_orig_mod.head.w"), tuple(K(f"head.{i}.w") for i in range(3)), 1),
        Synthesize(K("norm_buf"), "target's own value"),
        DropIfDerived(K("_orig_mod.layers.0.rotary.inv_freq"), "inv_freq"),
    )
    assert summary(p) == ("1 renamed (_orig_mod.embed.weight -> embed.weight), 3 stacked (axis 1), "
                          "3 unstacked (axis 1), 1 synthesized (target's own value), 1 dropped (inv_freq)")
    assert explain(p) == [
        "_orig_mod.embed.weight -> rename -> embed.weight",
        "_orig_mod.layers.{0..2}.w -> stack(axis=1) -> layers.w",
        "_orig_mod.head.w -> unstack(axis=1) -> head.{0..2}.w",
        "(not in checkpoint) -> synthesize(target's own value) -> norm_buf",
        "_orig_mod.layers.0.rotary.inv_freq -> drop(inv_freq) once its value is checked",
    ]


def test_inverse_swaps_everything():
    p = rich_plan()
    q = inverse(p)
    assert q.source is p.target and q.target is p.source
    assert q.ops == (
        Rename(K("embed.weight"), K("_orig_mod.embed.weight")),
        Unstack(K("layers.w"), tuple(K(f"_orig_mod.layers.{i}.w") for i in range(3)), 1),
        Stack(tuple(K(f"head.{i}.w") for i in range(3)), K("_orig_mod.head.w"), 1),
        Drop(K("norm_buf"), "target's own value"),
        Synthesize(K("_orig_mod.layers.0.rotary.inv_freq"), "inv_freq"),
    )
    assert q.producer(K("_orig_mod.layers.1.w")) == q.ops[1]
    assert q.complete


def test_inverse_of_inverse_is_the_original():
    p = rich_plan()
    assert inverse(inverse(p)).ops == p.ops
    r = plan(inv({"a": (1,), "b": (2,)}), inv({"a": (1,), "c": (3,), "b": (4,)}))
    rr = inverse(inverse(r))
    assert (rr.ops, rr.missing, rr.unexpected, rr.mismatched) == (
        r.ops, r.missing, r.unexpected, r.mismatched)
    assert inverse(r).missing == r.unexpected == ()
    assert inverse(r).unexpected == r.missing == (K("c"),)
    assert inverse(r).mismatched == (Mismatch(K("b"), K("b"), (4,), (2,)),)


def test_inverse_of_a_cast():
    p = plan(inv({"w": (4,)}), inv({"w": ((4,), "bfloat16")}))
    assert inverse(p).ops == (Rename(K("w"), K("w")), Cast(K("w"), "bfloat16", "float32"))
    assert inverse(inverse(p)).ops == p.ops


def test_inverse_of_a_stack_with_a_cast():
    src = inv({f"layers.{i}.w": ((3,), "float32") for i in range(2)})
    tgt = inv({"layers.w": ((2, 3), "bfloat16")})
    q = inverse(plan(src, tgt))
    assert q.ops == (Unstack(K("layers.w"), (K("layers.0.w"), K("layers.1.w")), 0),
                     Cast(K("layers.0.w"), "bfloat16", "float32"),
                     Cast(K("layers.1.w"), "bfloat16", "float32"))


def test_inverse_of_inverse_of_a_stack_with_a_cast():
    src = inv({f"layers.{i}.w": ((3,), "float32") for i in range(2)})
    tgt = inv({"layers.w": ((2, 3), "bfloat16")})
    p = plan(src, tgt)
    assert inverse(inverse(p)).ops == p.ops


def test_inverse_of_an_unstack_with_casts_has_one_cast():
    p = plan(inv({"layers.w": ((2, 3), "bfloat16")}),
             inv({f"layers.{i}.w": ((3,), "float32") for i in range(2)}))
    assert inverse(p).ops == (Stack((K("layers.0.w"), K("layers.1.w")), K("layers.w"), 0),
                               Cast(K("layers.w"), "float32", "bfloat16"))


# -- regressions (minimal reproductions of fixed bugs) --------------------------------------------


def test_two_targets_for_one_layer_never_make_a_complete_plan():
    tgt = inv({"layers.0.w": (3,), "layers.1.w": (3,), "layers_0.w": (3,), "layers_1.w": (3,)})
    try:
        p = plan(inv({"layers.w": (2, 3)}), tgt)
    except PlanError:
        return
    unproduced = [k for k in p.target if p.producer(k) is None and k not in p.missing]
    assert unproduced == []


def test_layers_with_different_dtypes_are_not_stacked_under_one_cast():
    src = inv({"layers.0.w": ((3,), "float32"), "layers.1.w": ((3,), "int32")})
    tgt = inv({"layers.w": ((2, 3), "bfloat16")})
    try:
        p = plan(src, tgt)
    except PlanError:
        return
    for cast in p.casts().values():
        producer = p.producer(cast.target)
        assert {p.source[k].dtype for k in producer.sources} == {cast.source_dtype}


def test_casts_follow_their_producer():
    src = inv({"layers.w": ((2, 3), "float16")})
    tgt = inv({"layers.1.w": ((3,), "float32"), "layers.0.w": ((3,), "float32")})
    p = plan(src, tgt)
    assert p.complete
    position = {id(op): i for i, op in enumerate(p.ops)}
    for i, op in enumerate(p.ops):
        if isinstance(op, Cast):
            assert position[id(p.producer(op.target))] < i, p.ops


# -- housekeeping ---------------------------------------------------------------------------------


def test_plan_restores_the_garbage_collector_state():
    import gc

    assert gc.isenabled()
    plan(inv({"w": (3,)}), inv({"w": (3,)}))
    assert gc.isenabled()
    with pytest.raises(PlanError):
        plan(inv({"module.w": (3,), "_orig_mod.w": (3,)}), inv({"w": (3,)}))
    assert gc.isenabled()
    gc.disable()
    try:
        plan(inv({"w": (3,)}), inv({"w": (3,)}))
        assert not gc.isenabled()  # a caller's choice is left alone
    finally:
        gc.enable()


# -- root prefixes and tied weights ---------------------------------------------------------------


def test_an_exact_root_prefix_is_set_aside_and_said():
    """``model.`` on every checkpoint key (a LightningModule's attribute), or on every target key
    (a Hugging Face head's ``base_model_prefix``), when without it the key sets and shapes agree."""
    from ckptshim.rules.context import LoadContext
    from ckptshim.rules.profiles import rules_for

    bare = inv({"layers.0.w": (2, 3), "norm.w": (3,)})
    wrapped = inv({"model.layers.0.w": (2, 3), "model.norm.w": (3,)})
    for source, target, said in ((wrapped, bare, "removed from"), (bare, wrapped, "added to")):
        found = plan(source, target, rules_for(LoadContext(source, target, "torch")))
        assert found.complete
        assert f"root prefix 'model.' {said} every checkpoint key" in summary(found)
        assert explain(found)[0] == f"(root prefix 'model.' {said} every checkpoint key)"


def test_a_root_prefix_that_is_not_exact_is_not_one():
    """A key more, another shape, a longer shared path that still differs: no root prefix is
    taken, and the planner reports what does not match. Wrapper names are the wrapper pass's
    business; a shared path is only a candidate, which the plan takes where it is exact."""
    from ckptshim.rules.context import LoadContext
    from ckptshim.rules.profiles import rules_for
    from ckptshim.rules.roots import root_prefix

    bare = inv({"layers.0.w": (2, 3), "norm.w": (3,)})
    for source, target in ((inv({"model.layers.0.w": (2, 3), "model.norm.w": (4,)}), bare),
                           (inv({"model.layers.0.w": (2, 3), "model.norm.w": (3,), "model.x": (1,)}),
                            inv({"layers.0.w": (2, 3), "norm.w": (3,), "y": (1,)})),
                           (inv({"model.layers.0.w": (2, 3), "model.norm.w": (3,), "model.extra": (1,)}), bare)):
        found = plan(source, target, rules_for(LoadContext(source, target, "torch")))
        assert not found.complete and not found.notes
        assert set(found.unexpected) | {m.source for m in found.mismatched} == set(source)
    assert root_prefix(inv({"_orig_mod.layers.0.w": (2, 3), "_orig_mod.norm.w": (3,)}), bare) is None
    assert root_prefix(inv({"a.b.layers.0.w": (2, 3), "a.b.norm.w": (3,)}), bare).prefix == ("a", "b")
    source = inv({"model.layers.0.w": (2, 3), "model.norm.w": (3,), "model.extra": (1,)})
    found = plan(source, bare, rules_for(LoadContext(source, bare, "torch")))
    assert set(found.unexpected) == set(source) and set(found.missing) == set(bare)


def test_an_optimizers_state_beside_the_model_is_set_aside_not_planned():
    """A training loop's ``{"model": ..., "optimizer": optimizer.state_dict()}`` (``litgpt
    pretrain``'s file): the optimizer's entry is set aside, said in the note, and in no op; an
    entry that is not wholly an optimizer's state (an array outside ``state.<index>``), or one the
    target has an entry of, is not, and the plan reports what does not match."""
    from ckptshim.rules.context import LoadContext
    from ckptshim.rules.profiles import rules_for
    from ckptshim.rules.roots import RootPrefix, root_prefix

    bare = inv({"layers.0.w": (2, 3), "norm.w": (3,)})
    model = {"model.layers.0.w": (2, 3), "model.norm.w": (3,)}
    optimizer = {"optimizer.state.0.exp_avg": (2, 3), "optimizer.state.0.step": (), "optimizer.state.1.exp_avg": (3,)}
    source = inv({**model, **optimizer})
    assert root_prefix(source, bare) == RootPrefix("checkpoint", ("model",), frozenset({"optimizer"}))
    found = plan(source, bare, rules_for(LoadContext(source, bare, "torch")))
    assert found.complete and not any(key[0] == "optimizer" for op in found.ops for key in op.sources)
    assert found.notes == ("root prefix 'model.' removed from every checkpoint key; 'optimizer' set aside: an "
                           "optimizer's state, not weights",)
    for other in (inv({**model, **optimizer, "optimizer.head.w": (3,)}), inv({**model, "optimizer.state.0.w": (3,)})):
        assert root_prefix(other, bare) is None
        assert not plan(other, bare, rules_for(LoadContext(other, bare, "torch"))).complete
    wanted = inv({"layers.0.w": (2, 3), "norm.w": (3,), "optimizer.state.0.exp_avg": (2, 3)})
    assert root_prefix(source, wanted) is None


def test_a_root_prefix_composes_with_wrappers_and_stacking():
    """Lightning's ``model.`` on the checkpoint, ``_orig_mod.`` on the target, layers stacked in
    the target: each rule exact on its own, all taken together; and a partial load whose sides
    merely share a leading name is not re-keyed."""
    from ckptshim.ops import Stack
    from ckptshim.rules.context import LoadContext
    from ckptshim.rules.profiles import rules_for
    from ckptshim.rules.roots import heads

    source = inv({"model.layers.0.w": (3,), "model.layers.1.w": (3,), "model.norm.w": (3,)})
    target = inv({"_orig_mod.layers.w": (2, 3), "_orig_mod.norm.w": (3,)})
    assert heads(target) == {"layers", "norm"} and heads(source, 1) == {"layers", "norm"}
    found = plan(source, target, rules_for(LoadContext(source, target, "torch")))
    assert found.complete and found.notes == ("root prefix 'model.' removed from every checkpoint key",)
    stack = next(op for op in found.ops if isinstance(op, Stack))
    assert stack.sources == (K("model.layers.0.w"), K("model.layers.1.w")) and stack.target == K("_orig_mod.layers.w")
    partial = inv({"enc.0.w": (3,), "enc.1.w": (3,)})
    whole = inv({"enc.0.w": (3,), "enc.1.w": (3,), "dec.w": (3,)})
    found = plan(partial, whole, rules_for(LoadContext(partial, whole, "torch")))
    assert found.missing == (K("dec.w"),) and not found.unexpected and not found.notes


def test_a_missing_key_tied_to_a_loaded_one_is_tied():
    from ckptshim.ops import Tie

    rules = DEFAULT_RULES.extend(tied=frozenset({frozenset({K("embed.w"), K("head.w")})}))
    found = plan(inv({"embed.w": (4, 2)}), inv({"embed.w": (4, 2), "head.w": (4, 2)}), rules)
    assert found.complete and found.ops[-1] == Tie(K("head.w"), K("embed.w"))
    assert summary(found) == "1 tied (head.w = embed.w)"
    assert explain(found) == ["(tied to embed.w) -> tie -> head.w"]
    untied = plan(inv({"embed.w": (4, 2)}), inv({"embed.w": (4, 2), "head.w": (4, 2)}))
    assert untied.missing == (K("head.w"),)
