"""MaxText's two tiny runs (``tests/fixtures/maxtext_runs``: ``scan_layers`` on and off) as the
Orbax restore tests use them, locally and from a bucket: the step-1 items, the train state a
restore asks for, and targets as shapes."""

from __future__ import annotations

from pathlib import Path

RUNS = ("tiny_scanned", "tiny_unscanned")
#: The decoder layers of both runs.
LAYERS = 3


def axis_of(key: str) -> int:
    """MaxText's scan axis of a flat key: NNX rng state stacks on axis 0, everything else on 1."""
    return 0 if "/rngs/" in key else 1


def items(root: Path) -> dict[str, Path]:
    """Each run's step-1 item folder below a copy of the fixture at ``root``."""
    return {name: root / name / "checkpoints" / "1" / "items" for name in RUNS}


def restored_natively(paths: dict) -> dict:
    """Each item as Orbax restores it itself (the layout matches: ckptshim steps aside)."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as checkpointer:
        return {name: checkpointer.restore(path) for name, path in paths.items()}


def train_state(state):
    """What the issue's target holds: params, optimizer state (mu/nu), step."""
    return {"params": state["params"], "opt_state": state["opt_state"], "step": state["step"]}


def key_data(tree):
    """Typed PRNG keys as their uint32 data (what Orbax stores), other leaves unchanged."""
    import jax

    return jax.tree_util.tree_map(
        lambda x: jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x, tree)


def abstract(tree):
    """Each leaf as a ``jax.ShapeDtypeStruct`` with its sharding."""
    import jax

    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
