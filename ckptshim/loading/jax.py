"""Restore a checkpoint into a JAX pytree target: plan with the JAX rules, check, then build.

The Orbax, Flax and T5X loads share this: :func:`open_item` picks the format that reads what a
restore call names; :func:`prepare` refuses an incomplete checkpoint, plans its inventory
against the caller's tree, and -- where no plan makes it fit, or the tree asks for what
ckptshim does not do (placeholders, padding restore args) -- raises
:class:`~ckptshim.errors.NoPlan`, which leaves the call to the framework; all before a tensor
byte is read. The caller then asks :func:`native_fits` whether the framework's own restore
would do the same, and only if not runs :meth:`Prepared.run` (the JAX executor).

Rules for JAX trees come from :func:`~ckptshim.rules.profiles.rules_for`, given the load's one
:class:`~ckptshim.rules.context.LoadContext`: Linen/NNX spellings are aliases; trees laid out like
MaxText's decoder get its scan axes; rng state may be kept from the target by the opt-in MaxText
profile; PaxML GPT-3 variables MaxText has no place for are its profile's warning. Checkpoint
keys that the target does not ask for are left on disk (a restore fills the target; the
checkpoint may hold more, e.g. rng state or a data iterator) and counted in the log line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptshim import progress
from ckptshim.errors import NoPlan, UnknownFormatError
from ckptshim.execute import jax as executor
from ckptshim.formats import hf_dir, safetensors
from ckptshim.formats.base import Checkpoint
from ckptshim.formats.orbax import orbax_readers
from ckptshim.formats.detect import open_checkpoint
from ckptshim.inventory import join_key, unflatten
from ckptshim.keytext import ranges
from ckptshim.loading import agreement
from ckptshim.loading.report import report_load
from ckptshim.ops import Cast, Synthesize
from ckptshim.planner import Plan, plan as make_plan
from ckptshim.rules import Rules
from ckptshim.rules.context import LoadContext
from ckptshim.rules.layers import layer_splits
from ckptshim.rules.profiles import maxtext, rules_for
from ckptshim.storage import Location
from ckptshim.targets.jax_tree import TargetTree

SEP = "/"


#: Formats whose ``config.json`` (in the folder, or beside the file) describes the model.
HF_FORMATS = frozenset({hf_dir.NAME, safetensors.NAME})


@dataclass(frozen=True)
class Prepared:
    """A checked plan from one checkpoint into one target tree, ready to run."""

    checkpoint: Checkpoint
    target: TargetTree
    plan: Plan
    where: str

    def run(self) -> Any:
        """Read what the plan needs and return the caller's tree filled with it (on every process
        of a multi-process job, or on none: see :mod:`~ckptshim.loading.agreement`)."""
        report_load(self.where, self.plan, SEP,
                    read_as=f"{self.checkpoint.format} ({self.checkpoint.version})")
        targets = self.target.targets
        with agreement.agreeing(self.where, "reading"), \
                progress.load_bar(executor.local_bytes(self.plan, targets), "ckptshim: restoring"):
            built = executor.build(self.checkpoint, self.plan, targets, SEP)
        return self.target.rebuild(built)


def open_item(path: Path | Location) -> Checkpoint | None:
    """The checkpoint a JAX restore call names, if ckptshim reads its layout (metadata only).

    In object storage, ``None`` too where ckptshim cannot reach it: what the client raises
    asking for the item's first file (missing, unreachable, without credentials) comes before
    any byte of it is parsed, and the framework's own restore then reports it in its words."""
    if isinstance(path, Location) and path.is_remote and not reachable(path):
        return None
    try:
        return open_checkpoint(path, backend="jax")
    except UnknownFormatError:
        return None


def reachable(root: Location) -> bool:
    """Whether the client of ``root``'s scheme finds something there (one request)."""
    try:
        root.stat()
    except Exception:  # noqa: BLE001 - the client's own failure: see open_item
        return False
    return True


def prepare(checkpoint: Checkpoint, tree: Any, where: str, restore_args: Any = None) -> Prepared:
    """Plan ``checkpoint`` into ``tree`` (``None``: the checkpoint as stored) and check the plan.

    ``where`` names the call (``"orbax StandardCheckpointer.restore(...)"``) in messages and logs.
    """
    checkpoint.require_complete()
    target = TargetTree(as_stored(checkpoint) if tree is None else tree, restore_args)
    _require_understood(target, where, own_tree=tree is not None)
    _require_divisible(target, where)
    target_inv = target.inventory(f"given to {where}")
    config = hf_dir.config_of(checkpoint) if checkpoint.format in HF_FORMATS else None
    rules = rules_for(LoadContext(checkpoint.inventory, target_inv, "jax", model_config=config))
    plan = make_plan(checkpoint.inventory, target_inv, rules)
    _require_fit(plan, rules)
    for op in plan.ops:
        if op.kind == Synthesize.kind and not target.targets[op.target].concrete:
            raise NoPlan(
                f"{join_key(op.target, SEP)}: the checkpoint cannot provide it and the rule "
                f"{op.rule!r} keeps the target's own value, but the target gives only a shape "
                "(jax.ShapeDtypeStruct). Pass concrete arrays for it (an initialised state).")
    return Prepared(checkpoint, target, plan, where)


def _require_understood(target: TargetTree, where: str, *, own_tree: bool) -> None:
    """Leave to the framework a restore that asks for what ckptshim does not do: restore args
    that pad, truncate or pick another type handler, and (in the caller's own tree) leaves that
    are no array or number -- ``ocp.PLACEHOLDER`` (skip this leaf), a string, an object."""
    asks = list(target.unsupported)
    if own_tree:
        asks += [f"{join_key(key, SEP)}: {'ocp.PLACEHOLDER' if leaf is Ellipsis else type(leaf).__name__}"
                 for key, leaf in target.others.items()]
    if asks:
        listed = "; ".join(asks[:5]) + ("; ..." if len(asks) > 5 else "")
        raise NoPlan(f"{where} asks for what ckptshim leaves to the framework ({listed}); "
                     "ckptshim did not plan this restore")


def _require_divisible(target: TargetTree, where: str) -> None:
    """Leave to the framework a target sharding that does not divide its array's shape: JAX
    raises its own error for it, with ckptshim's reading as a note."""
    for leaf in target.targets.values():
        if leaf.kind != "jax":
            continue
        try:
            leaf.sharding.shard_shape(leaf.shape)
        except ValueError as error:  # jax's IndivisibleError
            raise NoPlan(
                f"{join_key(leaf.key, SEP)} given to {where}: its sharding cannot split shape "
                f"{leaf.shape} evenly ({error}). Shard that array only along axes the mesh axis "
                "size divides (None in the PartitionSpec for the others).") from None


def native_fits(prepared: Prepared, *, readable: bool, partial: bool) -> bool:
    """Whether the framework's own restore reads this checkpoint into this target unaided.

    ``readable``: the framework reads this layout at all; ``partial``: the caller allowed a
    checkpoint with more keys than the target. True only when the keys also match the target's
    one to one (dtype casts are the framework's own business).
    """
    plan = prepared.plan
    if not readable or (plan.unexpected and not partial):
        return False
    return all(op.kind == Cast.kind or op.tally() is None for op in plan.ops)


def as_stored(checkpoint: Checkpoint) -> dict:
    """A target tree that asks for every entry as stored.

    Layouts today's Orbax reads come back as ``jax.Array`` (as Orbax restores them); older ones
    as numpy arrays and plain numbers, as Orbax's ``PyTreeCheckpointer`` and Flax restored them.
    (Sequences come back as dicts keyed ``"0"``, ``"1"``, ...; keys as their stored key data.)
    """
    import jax
    import numpy as np

    from ckptshim.formats.msgpack_tree import Inline
    from ckptshim.formats.base import numpy_dtype

    current = "standard" in orbax_readers(checkpoint)

    def leaf(entry):
        if isinstance(entry.location, Inline) and entry.location.ref is None:
            return entry.location.scalar
        dtype = numpy_dtype(entry.dtype)
        if current:
            return jax.ShapeDtypeStruct(entry.shape, dtype)
        return np.broadcast_to(np.zeros((), dtype), entry.shape)  # a shape, no memory

    return unflatten({key: leaf(entry) for key, entry in checkpoint.inventory.items()})


def _require_fit(plan: Plan, rules: Rules) -> None:
    gaps = _layer_gaps(plan, rules)
    if gaps:
        rng = any(maxtext.is_rng_state(m.target) for m in plan.mismatched)
        raise NoPlan("\n".join(
            [f"checkpoint {plan.source.source} does not fit target {plan.target.source}: "
             "the two stack different numbers of layers:"] + [f"  {line}" for line in gaps]
            + (["MaxText keeps NNX rng state for layer 0 only when layers are not scanned. To "
                "keep the target's own rng state instead, set CKPTSHIM_RNG_FROM_TARGET=1 "
                "and pass the target as concrete arrays."] if rng else [])
            + ["Restore into a target with the checkpoint's layer count, or leave those keys out "
               "of the target."]))
    plan.require_complete(SEP, allow_unexpected=True)


def _layer_gaps(plan: Plan, rules: Rules) -> list[str]:
    """Shape mismatches that are really a stacked side holding more layers than the other names."""
    names = rules.layer_lists
    lines = []
    for m in plan.mismatched:
        stacking = any(layer_splits(m.source, names)) and not any(layer_splits(m.target, names))
        unstacking = any(layer_splits(m.target, names)) and not any(layer_splits(m.source, names))
        if not (stacking or unstacking):
            continue
        per_layer, per_side = (m.source, plan.source) if stacking else (m.target, plan.target)
        layer_shape, whole = (m.source_shape, m.target_shape) if stacking else (m.target_shape, m.source_shape)
        stacked = next(s for s, _ in layer_splits(per_layer, names))
        present = sorted({i for key in per_side for s, i in layer_splits(key, names) if s == stacked})
        counts = [whole[a] for a in range(len(whole))
                  if whole[a] > len(present) and whole[:a] + whole[a + 1:] == layer_shape]
        if not counts:
            continue
        absent = [i for i in range(max(counts)) if i not in present]
        whole_key, whole_side = (m.target, "target") if stacking else (m.source, "checkpoint")
        lines.append(f"{whole_side} key {join_key(whole_key, SEP)} stacks {max(counts)} layers, but "
                     f"the {'checkpoint' if stacking else 'target'} has only layer(s) "
                     f"{{{ranges(present)}}} ({join_key(per_layer, SEP)}): layers "
                     f"{{{ranges(absent)}}} are missing")
    return lines
