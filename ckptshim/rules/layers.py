"""Layer lists: per-layer keys (``layers_3``, ``layers.3``, ``x_layers_3``) and stacked keys.

A per-layer key names one list component and an index; its *stacked* form drops the index:
``decoder/layers_3/mlp/wi`` and ``layers.3.mlp.wi`` both stack into ``.../layers/mlp/wi``.
Only components named in ``LAYER_LIST_NAMES`` (or a rule's own set) count as layer lists, so a
``wi_0``/``wi_1`` pair of projections is never mistaken for two layers.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from ckptshim.inventory import KeyPath

LAYER_LIST_NAMES: frozenset[str] = frozenset(
    {"layers", "layer", "x_layers", "h", "blocks", "block", "experts", "decoder_layers",
     "encoder_layers"}
)


@dataclass(frozen=True, slots=True)
class ScanAxis:
    """Stacked keys that contain ``component`` are stacked along ``axis``.

    MaxText stacks params and optimizer moments on axis 1 (``param_scan_axis``) and NNX rng
    state on axis 0; PaxML stacks on axis 0. Used only when shapes leave more than one axis open.
    """

    component: str
    axis: int


#: torch modules keep a stacked layer list on axis 0 (``experts.w1`` is ``[E, ...]``) unless a
#: rule says otherwise; used where shapes leave the axis open.
TORCH_SCAN_AXES: tuple[ScanAxis, ...] = tuple(ScanAxis(name, 0) for name in sorted(LAYER_LIST_NAMES))


def layer_splits(key: KeyPath, names: frozenset[str]) -> Iterator[tuple[KeyPath, int]]:
    """Every way to read ``key`` as one layer of a list: ``(stacked key, layer index)``.

    ``("layers", "3", "w")`` and ``("layers_3", "w")`` both yield ``(("layers", "w"), 3)``.
    A key with two list components (layers inside experts) yields one split per component.
    """
    leaf = key[-1:]
    for stacked, index in parent_splits(key[:-1], names):
        yield stacked + leaf, index


def parent_splits(parent: KeyPath, names: frozenset[str]) -> Iterator[tuple[KeyPath, int]]:
    """:func:`layer_splits` of every key under ``parent``, without the leaf.

    A key's last component is never a list component, so keys that share a parent path share
    their splits: ``("decoder", "layers_3", "mlp")`` yields ``(("decoder", "layers", "mlp"), 3)``
    for every key under it, and the planner works them out once per parent.
    """
    for pos, part in enumerate(parent):
        if part.isdigit() and pos > 0 and parent[pos - 1] in names:
            yield parent[:pos] + parent[pos + 1:], int(part)
        else:
            base, sep, index = part.rpartition("_")
            if sep and index.isdigit() and base in names:
                yield parent[:pos] + (base,) + parent[pos + 1:], int(index)


def stack_root(stacked: KeyPath, names: frozenset[str]) -> KeyPath:
    """The subtree a stacked key belongs to (up to its list component): siblings share an axis."""
    for pos in range(len(stacked) - 2, -1, -1):
        if stacked[pos] in names:
            return stacked[: pos + 1]
    return stacked[:-1]
