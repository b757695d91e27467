"""PaxML ``CheckpointType.FLAX`` checkpoints: ``checkpoint_<step>/state/checkpoint``.

PaxML cannot be installed here, so these checkpoints are PaxML's FLAX save reproduced with the
real writers it calls: the train state of the real run ``paxml_runs/TinySpmdRepeat`` (its arrays
read from the tensorstore fixture) is nested as PaxML nests it -- a Flax-struct ``TrainState``
(``paxml/train_states.py``) of praxis ``NestedMap``s (registered as ``praxis/pytypes.py`` does),
the optimizer states a list of ``NestedMap``s of per-prefix tuples -- then, as
``FlaxCheckpointHandler.async_save`` (``paxml/checkpoints.py``) does, flattened with
``jax.tree_util.tree_flatten`` and written with ``str(treedef)`` by Orbax's
``aggregate_handlers.MsgpackHandler``; the older PaxML path writes the same payload with
``flax.training.checkpoints.save_checkpoint`` (prefix ``checkpoint_``).
"""

from __future__ import annotations

import json
import re

import flax
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from etils import epath
from flax.training import checkpoints
from hypothesis import given, settings, strategies as st

import ckptshim  # noqa: F401  (hooks on)
from ckptshim.cli import main
from ckptshim.errors import ShimError
from ckptshim.formats.detect import open_checkpoint
from ckptshim.formats.paxml_flax import leaf_names, parse
from ckptshim.inventory import flatten, unflatten
from support.fixtures import FIXTURES
from support.paxml_flax_writer import NestedMap, TrainState, pax_payload, write_with_orbax

PAX_STATE = FIXTURES / "paxml_runs/TinySpmdRepeat/checkpoints/checkpoint_00000001/state"


@pytest.fixture(scope="module")
def stored():
    checkpoint = open_checkpoint(PAX_STATE)
    try:
        return {key: (entry, checkpoint.read(entry).copy()) for key, entry in checkpoint.inventory.items()}
    finally:
        checkpoint.close()


@pytest.fixture(scope="module")
def run(tmp_path_factory, stored):
    root = tmp_path_factory.mktemp("pax_flax") / "checkpoints"
    write_with_orbax(root / "checkpoint_1" / "state", pax_payload({k: v for k, (_, v) in stored.items()}))
    return root


@pytest.fixture(scope="module")
def old_flax_file(tmp_path_factory, stored):
    folder = tmp_path_factory.mktemp("pax_flax_old")
    before = flax.config.flax_use_orbax_checkpointing
    flax.config.update("flax_use_orbax_checkpointing", False)
    try:
        return checkpoints.save_checkpoint(folder, pax_payload({k: v for k, (_, v) in stored.items()}),
                                           1, prefix="checkpoint_")
    finally:
        flax.config.update("flax_use_orbax_checkpointing", before)


@pytest.mark.parametrize("where", ["root", "step", "state", "file", "old_flax_file"])
def test_inspect_lists_the_tensorstore_layouts_keys_and_reads_are_bit_exact(capsys, run, old_flax_file, stored, where):
    path = {"root": run, "step": run / "checkpoint_1", "state": run / "checkpoint_1/state",
            "file": run / "checkpoint_1/state/checkpoint", "old_flax_file": old_flax_file}[where]
    assert main(["inspect", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["format"] == "paxml-flax" and info["complete"] is True
    listed = {tuple(e["key"].split("/")): (e["shape"], e["dtype"]) for e in info["entries"]}
    assert listed == {key: (list(entry.shape), entry.dtype) for key, (entry, _) in stored.items()}
    checkpoint = open_checkpoint(path)
    try:
        for key, entry in checkpoint.inventory.items():
            assert checkpoint.read(entry).tobytes() == stored[key][1].tobytes(), key
    finally:
        checkpoint.close()


def test_orbax_restores_into_an_unrepeated_model(run, stored):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    expected = {}
    for key, (_, value) in stored.items():
        if "repeat" in key:
            at = key.index("repeat")
            for layer in range(value.shape[0]):
                expected[key[:at] + (f"x_layers_{layer}",) + key[at + 3:]] = np.take(value, layer, axis=0)
        else:
            expected[key] = value
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=replicated) for k, v in expected.items()}
    restored = flatten(ocp.StandardCheckpointer().restore(run / "checkpoint_1/state", unflatten(target)))
    assert set(restored) == set(expected) and len(expected) > len(stored)
    for key, value in restored.items():
        assert np.asarray(value).tobytes() == expected[key].tobytes(), key


def _rewritten(tmp_path, stored, edit) -> epath.Path:
    payload = pax_payload({k: v for k, (_, v) in stored.items()})
    edit(payload)
    state = tmp_path / "checkpoint_1" / "state"
    write_with_orbax(state, payload)
    return state / "checkpoint"


@pytest.mark.parametrize(("edit", "says"), [
    (lambda p: p["flattened_state"].pop(), "has {n} leaves but flattened_state holds {m}"),
    (lambda p: p.update(str_pytree_state=p["str_pytree_state"].replace("*", "__import__('os')", 1)),
     "expected a treedef node"),
    (lambda p: p.update(str_pytree_state=p["str_pytree_state"].replace("NestedMap", "Opaque", 1)),
     "Opaque node"),
], ids=["count", "call", "unnamed_node"])
def test_refusals_name_the_file(tmp_path, stored, edit, says):
    payload_file = _rewritten(tmp_path, stored, edit)
    with pytest.raises(ShimError, match=re.escape(str(payload_file))) as error:
        open_checkpoint(tmp_path)
    assert says.format(n=len(stored), m=len(stored) - 1) in str(error.value)


def test_truncated_file_is_refused_naming_it(tmp_path, run):
    data = (run / "checkpoint_1/state/checkpoint").read_bytes()
    state = tmp_path / "checkpoint_1" / "state"
    state.mkdir(parents=True)
    (state / "checkpoint").write_bytes(data[:len(data) // 2])
    with pytest.raises(ShimError, match=re.escape(str(state / "checkpoint"))):
        open_checkpoint(tmp_path / "checkpoint_1")


_NAMES = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=6)
_TREES = st.recursive(
    st.just(0) | st.none(),
    lambda kids: (st.lists(kids, max_size=3) | st.lists(kids, max_size=3).map(tuple)
                  | st.dictionaries(_NAMES, kids, max_size=3) | st.dictionaries(_NAMES, kids, max_size=3).map(NestedMap)),
    max_leaves=12)


def paxml_spelling(path) -> tuple[str, ...]:
    """PaxML's tensorstore name of a jax key path: keys are components, positions ``_i`` suffixes."""
    out: tuple[str, ...] = ()
    for part in path:
        if isinstance(part, jax.tree_util.SequenceKey):
            out = out[:-1] + (f"{out[-1]}_{part.idx}",)
        else:
            out += (str(part.key if isinstance(part, jax.tree_util.DictKey) else part.name),)
    return out


@settings(max_examples=60, deadline=None, derandomize=True)
@given(mdl_vars=_TREES, opt_states=st.lists(_TREES, max_size=2))
def test_names_from_any_printed_treedef_are_jaxs_key_paths_in_paxml_spelling(mdl_vars, opt_states):
    state = TrainState(step=0, mdl_vars=mdl_vars, opt_states=opt_states)
    paths, treedef = jax.tree_util.tree_flatten_with_path(state)
    assert leaf_names(parse(str(treedef))) == [paxml_spelling(path) for path, _ in paths]
