"""What a ZeRO rank's flat partitions hold after a resume at another world size: the resume
tests' reference, from what the saving ranks held.

Under ZeRO-1/2 a flat group's ranks' partitions, in rank order, are the group's flat vector
(only the last one's padding depends on the world size). Under ZeRO-3 every parameter is padded
to a multiple of the world size and cut into equal pieces, ``ceil(numel / world)`` each; rank
``r``'s flat partition of a sub-group is its parameters' ``r``-th pieces, one after another, and
its sub-groups follow each other. The records are those ``tests/workers/deepspeed_engine_worker.py``
writes (``<state>/<group>``, ``full/<state>/<name>``, ``layout``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

#: The flat states a ZeRO rank holds per sub-group: its fp32 master and Adam's moments.
STATES = ("fp32", "exp_avg", "exp_avg_sq")
#: How far the second training step's loss after a resume may move with the world size (relative):
#: every rank computes the same gradient, and its average over 3 ranks rounds (in bf16 training,
#: at bf16's precision) where over 1 or 2 it is exact. The first step's loss is bit for bit.
AVERAGING = {"fp32": 1e-6, "bf16": 1e-4}


def records(folder: Path, world: int) -> list[np.lib.npyio.NpzFile]:
    """What each of ``world`` ranks recorded in ``folder`` (``<rank>.npz``)."""
    return [np.load(folder / f"{rank}.npz") for rank in range(world)]


def own_elements(numel: int, piece: int, rank: int) -> int:
    """How many of a parameter's ``numel`` elements rank ``rank``'s ``piece`` holds (the rest is padding)."""
    return max(0, min(numel - rank * piece, piece))


def groups(record: Mapping[str, np.ndarray], state: str) -> list[np.ndarray]:
    """A rank's flat partitions of ``state``, one per flat group (sub-group)."""
    found = []
    while f"{state}/{len(found)}" in record:
        found.append(record[f"{state}/{len(found)}"])
    return found


def flat(record: Mapping[str, np.ndarray], state: str) -> np.ndarray:
    """A rank's flat partitions of ``state``, its sub-groups one after another."""
    return np.concatenate(groups(record, state))


def assert_recut(before: Sequence[Mapping[str, np.ndarray]], after: Sequence[Mapping[str, np.ndarray]],
                 stage: int, names: Sequence[str]) -> None:
    """After a resume, each rank of ``after`` holds the state the ranks of ``before`` held, re-cut
    for its world size, bit for bit: every parameter whole (fp32 master, moments, training-dtype
    weight), and each rank's partitions (at an unchanged world size: as saved, padding included)."""
    for record in after:
        for key in before[0].files:
            if key.startswith("full/"):
                assert record[key].tobytes() == before[0][key].tobytes(), key
    for state in STATES:
        if len(after) == len(before):
            assert all(flat(new, state).tobytes() == flat(old, state).tobytes() for old, new in zip(before, after))
        elif stage < 3:  # a group's partitions in rank order; only the tail padding differs
            for index, _ in enumerate(groups(before[0], state)):
                old = np.concatenate([record[f"{state}/{index}"] for record in before])
                new = np.concatenate([record[f"{state}/{index}"] for record in after])
                common = min(len(old), len(new))
                assert new[:common].tobytes() == old[:common].tobytes(), (state, index)
                assert not old[common:].any() and not new[common:].any(), (state, index)
    if stage == 3 and len(after) != len(before):
        assert_zero3_partitions(before[0], after, names)


def assert_zero3_partitions(whole: Mapping[str, np.ndarray], ranks: Sequence[Mapping[str, np.ndarray]],
                            names: Sequence[str]) -> None:
    """Each of ``ranks`` holds, bit for bit, its pieces of the parameters ``whole`` records in full
    (``full/<state>/<name>``), zero padded, in the order of ``names`` (its ``layout``)."""
    world = len(ranks)
    for state in STATES:
        for rank, record in enumerate(ranks):
            expected = []
            for name, (numel, piece) in zip(names, record["layout"], strict=True):
                assert piece == -(-numel // world)
                padded = np.zeros(piece * world, np.float32)
                padded[:numel] = whole[f"full/{state}/{name}"].reshape(-1)
                expected.append(padded[rank * piece:(rank + 1) * piece])
            assert flat(record, state).tobytes() == np.concatenate(expected).tobytes(), (state, rank)
