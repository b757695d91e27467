"""T5X seams against a stand-in ``t5x.checkpoints`` and Orbax restores of T5X checkpoints.

t5x is not on PyPI, so ``tests/t5x_standin/checkpoints.py`` -- the real module's names,
signatures and return structures with its legacy read path re-implemented (see its docstring)
-- is installed as package ``t5x`` in a temporary folder. Its own loader reads the legacy
fixture; the hook must make the Orbax-era fixture load through the same calls with the same
structure and bits, and both must equal the manifest.
"""

from __future__ import annotations

import shutil

import jax
import numpy as np
import pytest

from ckptshim.hooks import registry
from support.fixtures import array_sha256, copy_fixture
from support.trees import flat
from support.t5x_site import standin_t5x
from test_formats_t5x_paxml import T5X, t5x_expected


@pytest.fixture
def t5x(tmp_path):
    """``import t5x.checkpoints`` (the stand-in) with the ckptshim hook attached."""
    with standin_t5x() as checkpoints:
        yield checkpoints


def steps(tmp_path):
    legacy = copy_fixture(f"{T5X}/legacy_checkpointer", tmp_path) / "checkpoint_0"
    orbax_era = copy_fixture(f"{T5X}/orbax_checkpoint_manager", tmp_path) / "checkpoint_0"
    return legacy, orbax_era


def assert_manifest(tree) -> None:
    expected = t5x_expected()
    found = flat(tree)
    assert set(found) == set(expected)
    for key, value in found.items():
        array = np.asarray(value)
        assert [list(array.shape), str(array.dtype)] == [expected[key]["shape"], expected[key]["dtype"]], key
        assert array_sha256(array) == expected[key]["sha256"], key


def test_standin_alone_reads_legacy_and_fails_on_orbax_era_like_t5x(t5x, tmp_path):
    legacy, orbax_era = steps(tmp_path)
    registry.uninstall(["t5x"])
    assert_manifest(t5x.load_t5x_checkpoint(str(legacy)))
    with pytest.raises(ValueError, match="not a valid checkpoint"):
        t5x.load_t5x_checkpoint(str(orbax_era))


@pytest.mark.parametrize("lazy", [False, True])
def test_load_t5x_checkpoint_orbax_era_equals_legacy(t5x, tmp_path, lazy):
    legacy, orbax_era = steps(tmp_path)
    old = t5x.load_t5x_checkpoint(str(legacy), lazy_parameters=lazy)
    new = t5x.load_t5x_checkpoint(str(orbax_era), lazy_parameters=lazy)
    by_dir = t5x.load_t5x_checkpoint(str(orbax_era.parent), step=0, lazy_parameters=lazy)
    assert sorted(new) == sorted(old) == sorted(by_dir) == ["state", "target"]
    leaf_types = {type(v) for v in flat(new).values()}
    if lazy:
        assert leaf_types == {t5x.LazyAwaitableArray} == {type(v) for v in flat(old).values()}
        old, new, by_dir = ({k: v.get() for k, v in flat(t).items()} for t in (old, new, by_dir))
    else:
        assert leaf_types == {np.ndarray}
    for tree in (old, new, by_dir):
        assert_manifest(tree)


def test_load_t5x_checkpoint_remap_and_restore_dtype(t5x, tmp_path):
    legacy, orbax_era = steps(tmp_path)
    seen = []

    def rename(state, _target):
        seen.append(sorted(state))
        return {"target": {"renamed": state["target"]["decoder"]}, "state": state["state"]}

    for path in (legacy, orbax_era):
        remapped = t5x.load_t5x_checkpoint(str(path), state_transformation_fns=[rename],
                                           restore_dtype=np.float16)
        assert sorted(remapped["target"]) == ["renamed"]
        assert remapped["target"]["renamed"]["decoder_norm"]["scale"].dtype == np.float16
        assert remapped["state"]["param_states"]["decoder"]["decoder_norm"]["scale"]["v"].dtype == np.float32
        unmapped = t5x.load_t5x_checkpoint(str(path), state_transformation_fns=[rename], remap=False)
        assert sorted(unmapped["target"]) == ["decoder"]
    assert seen == [["state", "target"], ["state", "target"]]


class TrainState:
    """Minimal stand-in for t5x.train_state.FlaxOptimTrainState: state_dict/restore_state."""

    def __init__(self, state):
        self.state = state

    def state_dict(self):
        return self.state

    def restore_state(self, state_dict):
        return TrainState(state_dict)


def test_checkpointer_restore_reads_either_generation(t5x, tmp_path):
    legacy, orbax_era = steps(tmp_path)
    template = t5x.load_t5x_checkpoint(str(legacy))
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype), template)
    restored = {}
    for path in (legacy, orbax_era):
        checkpointer = t5x.Checkpointer(TrainState(abstract), None, str(path.parent))
        restored[path] = checkpointer.restore(step=0).state
        assert_manifest(restored[path])
    assert all(isinstance(v, jax.Array) for v in flat(restored[orbax_era]).values())
    lazy = t5x.Checkpointer(TrainState(abstract), None, str(orbax_era.parent)).restore(
        path=str(orbax_era), lazy_parameters=True, fallback_state={"extra": 1}).state
    assert lazy["extra"] == 1
    assert_manifest({k: v for k, v in lazy.items() if k != "extra"} | {
        "target": jax.tree.map(lambda x: x.get(), lazy["target"]),
        "state": jax.tree.map(lambda x: x.get(), lazy["state"])})


@pytest.mark.parametrize("checkpointer", ["PyTreeCheckpointer", "StandardCheckpointer"])
def test_orbax_restores_a_legacy_t5x_step(tmp_path, checkpointer):
    import orbax.checkpoint as ocp

    import ckptshim  # noqa: F401  (hooks on)

    legacy, orbax_era = steps(tmp_path)
    as_stored = getattr(ocp, checkpointer)().restore(legacy)
    assert sorted(as_stored) == ["state", "target"]
    assert_manifest(as_stored)
    native = ocp.StandardCheckpointer().restore(orbax_era / "state")
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), native)
    if checkpointer == "StandardCheckpointer":
        into_target = ocp.StandardCheckpointer().restore(legacy, abstract)
    else:
        into_target = ocp.PyTreeCheckpointer().restore(legacy, args=ocp.args.PyTreeRestore(abstract))
    assert all(isinstance(v, jax.Array) for v in flat(into_target).values())
    assert_manifest(into_target)
    assert_manifest(native)


def _placeholder_step(tmp_path):
    """A T5X step as T5X's Orbax path wrote it with Orbax < 0.5: ``state/checkpoint`` is an
    aggregate msgpack of the state dict whose arrays are ``PLACEHOLDER://<zarr folder>`` strings,
    the zarr folders beside it. Built from the legacy fixture's own bytes (no version key)."""
    import msgpack

    legacy = copy_fixture(f"{T5X}/legacy_checkpointer", tmp_path / "src") / "checkpoint_0"
    step = tmp_path / "old_orbax" / "checkpoint_0"
    state = step / "state"
    state.mkdir(parents=True)
    (step / "dataset").mkdir()
    tree = msgpack.unpackb((legacy / "checkpoint").read_bytes(), raw=False, strict_map_key=False)

    def placeholders(node):
        if isinstance(node, dict) and "kvstore" in node:
            folder = node["kvstore"]["path"].strip("/")
            shutil.copytree(legacy / folder, state / folder)
            return "PLACEHOLDER://" + folder
        if isinstance(node, dict):
            return {k: placeholders(v) for k, v in node.items()}
        return node

    contents = placeholders(tree["optimizer"])
    (state / "checkpoint").write_bytes(msgpack.packb({"state": contents["state"], "target": contents["target"]},
                                                     use_bin_type=True))
    return step


def test_load_t5x_checkpoint_reads_an_old_orbax_placeholder_step(t5x, tmp_path):
    step = _placeholder_step(tmp_path)
    registry.uninstall(["t5x"])
    with pytest.raises(ValueError, match="versions earlier than 2"):  # the first error
        t5x.load_t5x_checkpoint(str(step / "state"))
    with pytest.raises(AttributeError, match="'str' object has no attribute"):  # and its second
        t5x.load_t5x_checkpoint(str(step / "state"), remap=False)
    registry.install(["t5x"])
    for path in (step, step / "state", step / "state" / "checkpoint"):
        for remap in (True, False):
            assert_manifest(t5x.load_t5x_checkpoint(str(path), remap=remap))
