"""Every JAX checkpoint the suite has, through every JAX restore ckptshim hooks, into the tree it
was written from, compared with the restore alone (see ``compare_loads``).

The tree a checkpoint was written from is the one its framework restores as stored, or -- where
today's framework cannot read it -- the one its manifest lists. What each array must hold is the
fixture manifest's hash of its bytes (for a Flax step the manifest does not list, Flax's own
read), so no value is taken on ckptshim's word.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import cache
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from compare_loads import Load, compare, prints
from support.fixtures import copy_fixture, expected_arrays
from support.native import natively
from support.trees import flat

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning",
                                        "ignore::DeprecationWarning")

ORBAX_NEW, ORBAX_OLD = "orbax_0.12.8_scanned", "orbax_0.2.3_unscanned"
FLAX, T5X, PAX = "flax_0.6.11_legacy_msgpack", "t5x_tiny_decoder", "paxml_runs/TinySpmdRepeat"


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory) -> Path:
    """Writable copies (Orbax managers may write beside a checkpoint)."""
    root = tmp_path_factory.mktemp("jax_fixtures")
    for name in (ORBAX_NEW, ORBAX_OLD, FLAX, T5X, "maxtext_runs", f"{PAX}/checkpoints/checkpoint_00000001"):
        copy_fixture(name, root)
    return root


def hashes(folder: str, prefix: str = "", key: Callable[[str], str] = lambda k: k) -> dict[str, str]:
    """The manifest's sha256 of each array whose key starts with ``prefix``, keyed as restored."""
    return {key(k[len(prefix):]): item["sha256"] for k, item in expected_arrays(folder).items() if k.startswith(prefix)}


def abstract(tree: Any) -> Any:
    """Shapes and dtypes only (typed PRNG keys keep their key dtype)."""
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), getattr(x, "dtype", None)
                                                                 or np.asarray(x).dtype), tree)


def restore(name: str, target: Callable[[], Any], call: Callable[[Any], Any], truth: Mapping[str, Any],
            key: Callable[[Any], Mapping[str, Any]] = flat) -> Load:
    """A restore into ``target()`` (a fresh tree each time) returning a new tree, keyed by ``key``."""
    def own(tree: Any) -> Mapping[str, Any]:
        """The caller's concrete arrays (an abstract leaf holds nothing to overwrite)."""
        leaves = flat(tree) if tree is not None else {}
        return {k: v for k, v in leaves.items() if not isinstance(v, jax.ShapeDtypeStruct)}
    return Load(name, target, call, own, lambda _, result: key(result), truth, complete=True)


# -- Orbax: today's format and the pre-OCDBT one -------------------------------------------------------


@cache
def stored(path: Path) -> Any:
    """The tree a current Orbax checkpoint was written from: Orbax's own restore as stored."""
    def read() -> Any:
        with ocp.StandardCheckpointer() as checkpointer:
            return checkpointer.restore(path)
    return natively(read)


def old_orbax_tree() -> dict:
    """The tree the orbax 0.2.3 fixture was written from, as its manifest lists it."""
    leaves: dict = {}
    for key, item in expected_arrays(ORBAX_OLD).items():
        node = leaves
        *parents, leaf = key.split("/")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = jax.ShapeDtypeStruct(tuple(item["shape"]), np.dtype(item["dtype"]))
    return leaves


def orbax_calls(name: str, path: Path, tree: Callable[[], Any], truth: Mapping[str, str]) -> list[Load]:
    """StandardCheckpointer and PyTreeCheckpointer (partial restore both ways) into ``tree``."""
    def standard(target: Any) -> Any:
        with ocp.StandardCheckpointer() as checkpointer:
            return checkpointer.restore(path, target)

    def pytree(partial: bool) -> Callable[[Any], Any]:
        def call(target: Any) -> Any:
            with ocp.PyTreeCheckpointer() as checkpointer:
                return checkpointer.restore(path, args=ocp.args.PyTreeRestore(target, partial_restore=partial))
        return call
    return [restore(f"{name}: StandardCheckpointer.restore", tree, standard, truth),
            *(restore(f"{name}: PyTreeCheckpointer.restore(partial_restore={p})", tree, pytree(p), truth)
              for p in (False, True))]


@pytest.mark.parametrize("item, scanned", [("standard_checkpointer_scanned", "[scanned] "),
                                           ("standard_checkpointer_unscanned", "[unscanned] ")])
def test_orbax_standard_checkpointer_folders(fixtures, item, scanned):
    path = fixtures / ORBAX_NEW / item
    for load in orbax_calls(item, path, lambda: abstract(stored(path)), hashes(ORBAX_NEW, scanned)):
        compare(load)


@pytest.mark.parametrize("root, step, item", [("checkpoint_manager_scanned", 2, "state"),
                                              ("checkpoint_manager_scanned", 1, "state"),
                                              ("checkpoint_manager_default_item_scanned", 1, "default")])
def test_orbax_checkpoint_managers(fixtures, root, step, item):
    folder = fixtures / ORBAX_NEW / root
    tree = lambda: abstract(stored(folder / str(step) / item))  # noqa: E731

    def composite(target: Any) -> Any:
        with ocp.CheckpointManager(folder) as manager:
            return manager.restore(step, args=ocp.args.Composite(**{item: ocp.args.StandardRestore(target)}))[item]

    def single(target: Any) -> Any:
        with ocp.CheckpointManager(folder) as manager:
            return manager.restore(step, args=ocp.args.StandardRestore(target))
    truth = hashes(ORBAX_NEW, "[scanned] ")
    compare(restore(f"{root}/{step}: CheckpointManager.restore(Composite)", tree, composite, truth))
    compare(restore(f"{root}/{step}: CheckpointManager.restore(StandardRestore)", tree, single, truth))


def test_old_orbax_folders(fixtures):
    truth = hashes(ORBAX_OLD)
    for load in orbax_calls("orbax 0.2.3 pytree_checkpointer", fixtures / ORBAX_OLD / "pytree_checkpointer",
                            old_orbax_tree, truth):
        compare(load)

    def manager(target: Any) -> Any:
        with ocp.CheckpointManager(fixtures / ORBAX_OLD / "checkpoint_manager") as checkpoints:
            return checkpoints.restore(2, args=ocp.args.StandardRestore(target))
    compare(restore("orbax 0.2.3 checkpoint_manager: CheckpointManager.restore", old_orbax_tree, manager, truth))


# -- targets no rule fits: the framework's own outcome ------------------------------------------------


def the_frameworks(verdict: str) -> bool:
    """Whether a load's verdict is the framework's own outcome: its return value, or its very
    error (with or without ckptshim's note on it)."""
    return verdict == "identical" or verdict.startswith("left to the framework, identically")


def unfit(tree: Any, how: str) -> Any:
    """``tree`` with one change no rule mends: a leaf's shape (in a sharding, so that Orbax checks
    it), a leaf the checkpoint lacks, or a leaf skipped with ``ocp.PLACEHOLDER``."""
    tree = jax.tree_util.tree_map(lambda x: x, tree)  # a copy of the containers
    node = tree
    while isinstance(node, dict) and not isinstance(next(iter(node.values())), jax.ShapeDtypeStruct):
        node = next(iter(node.values()))
    name, leaf = next((k, v) for k, v in node.items() if isinstance(v, jax.ShapeDtypeStruct) and v.ndim)
    if how == "shape":
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        node[name] = jax.ShapeDtypeStruct((leaf.shape[0] + 1, *leaf.shape[1:]), leaf.dtype, sharding=device)
    elif how == "extra leaf":
        node[f"{name}_extra"] = leaf
    else:
        node[name] = ocp.PLACEHOLDER
    return tree


@pytest.mark.parametrize("how", ["shape", "extra leaf", "placeholder"])
@pytest.mark.parametrize("folder, item", [(ORBAX_NEW, "standard_checkpointer_unscanned"), (ORBAX_OLD, "pytree_checkpointer"),
                                          ("maxtext_runs", "tiny_scanned/checkpoints/1/items")])
def test_targets_no_rule_fits_are_the_frameworks_to_restore_or_refuse(fixtures, folder, item, how):
    """Whatever Orbax does with them -- restore, refuse with its own error -- it does with
    ckptshim too, type, text and values (ckptshim's reading rides on the error as a note)."""
    path = fixtures / folder / item
    tree = old_orbax_tree() if folder == ORBAX_OLD else abstract(stored(path))
    truth = hashes(ORBAX_OLD) if folder == ORBAX_OLD else {}
    for load in orbax_calls(f"{item} ({how})", path, lambda: unfit(tree, how), truth):
        assert the_frameworks(compare(load)), load.name


# -- MaxText runs --------------------------------------------------------------------------------------


@pytest.mark.parametrize("step", [0, 1])
@pytest.mark.parametrize("run", ["tiny_scanned", "tiny_unscanned"])
def test_maxtext_runs(fixtures, run, step):
    path = fixtures / "maxtext_runs" / run / "checkpoints" / str(step) / "items"
    truth = hashes(f"maxtext_runs/{run}", f"step{step}::")
    for load in orbax_calls(f"maxtext {run} step {step}", path, lambda: abstract(stored(path)), truth):
        compare(load)


# -- Flax ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("folder, step", [("legacy_msgpack", 2), ("legacy_msgpack", 1),
                                          ("flax_default_orbax_backend", 2)])
def test_flax_restore_checkpoint(fixtures, folder, step):
    from flax import serialization
    from flax.training import checkpoints

    directory = fixtures / FLAX / folder
    as_stored = natively(lambda: checkpoints.restore_checkpoint(directory, target=None, step=step))

    def call(target: Any) -> Any:
        return checkpoints.restore_checkpoint(directory, target=target, step=step)
    truth = hashes(FLAX) if step == 2 else prints(flat(as_stored))  # the manifest lists step 2 only
    target = lambda: jax.tree_util.tree_map(np.zeros_like, as_stored)  # noqa: E731
    compare(restore(f"flax {folder} step {step}: restore_checkpoint", target, call, truth,
                    key=lambda tree: flat(serialization.to_state_dict(tree))))
    # Flax restores what the file holds whatever the target's shapes: no plan of ckptshim's stands in
    smaller = lambda: jax.tree_util.tree_map(lambda x: np.zeros((1,) * np.ndim(x), np.asarray(x).dtype),  # noqa: E731
                                             as_stored)
    assert compare(restore(f"flax {folder} step {step}: restore_checkpoint into a smaller target", smaller,
                           call, truth, key=lambda tree: flat(serialization.to_state_dict(tree)))) == "identical"


# -- T5X (the stand-in t5x.checkpoints) and PaxML --------------------------------------------------------


def test_t5x_load_t5x_checkpoint(fixtures, tmp_path):
    from support.t5x_site import standin_t5x

    truth = hashes(T5X, "legacy/checkpoint_0::optimizer/")
    with standin_t5x() as t5x:
        for folder in ("legacy_checkpointer", "orbax_checkpoint_manager"):
            path = fixtures / T5X / folder / "checkpoint_0"
            compare(restore(f"t5x {folder}: load_t5x_checkpoint", lambda: None,
                            lambda _, path=path: t5x.load_t5x_checkpoint(str(path)), truth))


@pytest.mark.parametrize("checkpointer", [ocp.StandardCheckpointer, ocp.PyTreeCheckpointer])
def test_paxml_state_as_stored(fixtures, checkpointer):
    from ckptshim.inventory import flatten

    state = fixtures / PAX / "checkpoints" / "checkpoint_00000001" / "state"

    def call(_: Any) -> Any:
        with checkpointer() as reader:
            return reader.restore(state)
    truth = hashes(PAX, "checkpoint_00000001::")
    compare(restore(f"paxml state: {checkpointer.__name__}.restore", lambda: None, call, truth,
                    key=lambda tree: {".".join(k): v for k, v in flatten(tree).items()}))
