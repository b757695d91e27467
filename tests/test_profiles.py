"""Choosing a load's rules: one LoadContext, every Profile folded over the defaults in order."""

from __future__ import annotations

import pytest

from ckptshim.inventory import Entry, Inventory
from ckptshim.planner import plan
from ckptshim.rules import OwnWhenUnfit, TargetFacts
from ckptshim.rules.context import CALLS, LoadContext
from ckptshim.rules.layers import TORCH_SCAN_AXES
from ckptshim.rules.profiles import PROFILES, rules_for
from ckptshim.rules.profiles import maxtext


def inv(shapes: dict[str, tuple[int, ...]], sep: str = ".") -> Inventory:
    return Inventory([Entry(tuple(key.split(sep)), shape, "float32") for key, shape in shapes.items()], "test")


def test_every_profile_declares_the_protocol():
    names = [profile.name for profile in PROFILES]
    assert len(names) == len(set(names))
    for profile in PROFILES:
        assert callable(profile.applies) and callable(profile.rules)


def test_each_kind_of_call_gets_its_conventions():
    side = inv({"w": (2,)})
    torch_rules, dcp_rules = (rules_for(LoadContext(side, side, call)) for call in ("torch", "dcp"))
    jax_rules = rules_for(LoadContext(side, side, "jax"))
    assert torch_rules.drop_derivable and not dcp_rules.drop_derivable and not jax_rules.drop_derivable
    assert set(TORCH_SCAN_AXES) <= set(torch_rules.scan_axes) and set(TORCH_SCAN_AXES) <= set(dcp_rules.scan_axes)
    assert not set(TORCH_SCAN_AXES) & set(jax_rules.scan_axes)
    with pytest.raises(ValueError, match="no rules for a 'numpy' call; choose one of torch, dcp, jax"):
        LoadContext(side, side, "numpy")
    assert CALLS == ("torch", "dcp", "jax")


def test_the_targets_own_layouts_are_rules():
    """What the live target publishes (here a stand-in layout) is folded in like any profile's."""

    class Published:
        def pair(self, source, target, rules):
            raise AssertionError("not planned here")

    layout = Published()
    side = inv({"w": (2,)})
    facts = TargetFacts(layouts=(layout,))
    assert rules_for(LoadContext(side, side, "torch", facts)).layouts == (layout,)


def test_rng_state_kept_from_the_target_is_the_maxtext_profiles(monkeypatch):
    """By opt-in, rng state that does not fit keeps the target's own: a profile's rule, planned
    by the planner (no loader re-plans)."""
    source = inv({"decoder/layers_0/w": (4,), "decoder/layers_1/w": (4,), "decoder/layers_0/rngs/dropout/key": (2,)},
                 "/")
    target = inv({"decoder/layers/w": (2, 4), "decoder/layers/rngs/dropout/key": (2, 2)}, "/")
    context = LoadContext(source, target, "jax")
    assert rules_for(context).own_when_unfit is None
    monkeypatch.setenv("CKPTSHIM_RNG_FROM_TARGET", "1")
    assert maxtext.RNG_PROFILE.applies(context)
    rules = rules_for(context)
    assert rules.own_when_unfit == OwnWhenUnfit(frozenset({("decoder", "layers", "rngs", "dropout", "key")}),
                                                frozenset({("decoder", "layers_0", "rngs", "dropout", "key")}))
    found = plan(source, target, rules)
    assert found.complete
    assert {op.kind for op in found.ops} == {"stack", "synthesize"}
