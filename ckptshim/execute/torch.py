"""The torch executor: check a whole plan against live tensors, then write it in place.

A load is split in two so that it is transactional: :func:`prepare` fetches every source,
checks every shape, dtype and destination and works out, for each target key, a tensor that
already holds its value -- the source itself, a view of a source (one layer of a stacked
source, one part of a fused one, its axes permuted), or the destination's own value -- without
writing anything or copying any tensor bytes. Only a :class:`Prepared` load writes: targets
assembled from several sources (stacked layers, fused experts) or whose indices a permutation
scatters, source by source into views of the destination (``select``, ``narrow``, ``permute``,
axes split into factors; never ``torch.stack`` or ``torch.cat``, which would build a second
full copy), everything else copied in (casting where the plan casts), each write into the plain
tensor behind its destination -- a DTensor's shard, a float8 training weight's high-precision
tensor -- through :func:`ckptshim.execute.destinations.write`. Anything wrong raises before the
first write, so a failed load leaves the destination as it was.

Every layout op runs through one primitive over its pieces (:meth:`_Preparer._moved`, see
:mod:`ckptshim.geometry`): which target is a view of its source and which is assembled, and
from which views, is read off the pieces, not off the op's kind. The other kinds it runs are
those in :data:`HANDLERS`; a plan with any other kind is refused before anything is fetched.

Callers that hand the values to the framework's own loader (the ``load_state_dict`` hook) use
:attr:`Prepared.values` and :meth:`Prepared.write_assembled`; others call :meth:`Prepared.write`.

A ``DropIfDerived`` source is fetched and dropped only when its value is what its rule derives
(:meth:`ckptshim.targets.derived.OwnBuffers.problem`); otherwise it is an unexpected key, like any other
the target has no place for: a strict load has no plan then (:class:`~ckptshim.errors.NoPlan`),
a non-strict one lists it in :attr:`Prepared.unexpected`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from ckptshim.errors import NoPlan, PlanError
from ckptshim.execute.destinations import write
from ckptshim.geometry import View, inverse_perm
from ckptshim.inventory import Entry, KeyPath, dtype_name, join_key
from ckptshim.ops import (NOT_PERSISTENT, Cast, Drop, DropIfDerived, LayoutOp, Op, Synthesize, Tie, is_layout,
                          pieces_by_target, require_kinds)
from ckptshim.planner import Plan
from ckptshim.targets.derived import NO_OWN_BUFFERS, REBUILDABLE, OwnBuffers
from ckptshim.targets.tensors import is_dtensor, values_of

#: Returns the source tensor for a source key (from a state dict, or a lazy view of a file).
Fetch = Callable[[KeyPath], torch.Tensor]


@dataclass
class Prepared:
    """A load that has passed every check; nothing has been written yet.

    ``values`` maps each target key the plan provides to a tensor holding its value: for an
    assembled target that is the destination itself (filled by :meth:`write_assembled`), or a
    new tensor, filled the same way, when the destination cannot take writes through views (on
    the meta device, or a DTensor that the framework's loader distributes). ``fills`` are those
    writes: each a view of an assembled target, in its source's shape, and the source.
    ``unexpected`` are the ``DropIfDerived`` sources whose value is not what their rule derives
    (see the module docstring): the plan, as run, has them unexpected (:meth:`Plan.undropped`).
    """

    values: dict[KeyPath, torch.Tensor]
    destinations: Mapping[KeyPath, torch.Tensor]
    fills: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    unexpected: list[KeyPath] = field(default_factory=list)

    def write_assembled(self) -> None:
        """Write every source of an assembled target into its view of the target."""
        for view, value in self.fills:
            write(view, value)

    def write(self) -> None:
        """Write every value into its destination (refused up front if one is on meta)."""
        on_meta = [join_key(key) for key in self.values if self.destinations[key].is_meta]
        if on_meta:
            raise PlanError(
                f"{len(on_meta)} destination tensor(s) are on the meta device and cannot be "
                f"written in place (first: {on_meta[0]}). Materialize the model first "
                "(module.to_empty(device=...)), or load through load_state_dict(..., assign=True).")
        self.write_assembled()
        for key, value in self.values.items():
            destination = self.destinations[key]
            if value is not destination:
                write(destination, value)


def prepare(plan: Plan, fetch: Fetch, destinations: Mapping[KeyPath, torch.Tensor], *,
            allow_missing: bool = False, allow_unexpected: bool = False,
            own_buffers: OwnBuffers = NO_OWN_BUFFERS, lenient: str = "") -> Prepared:
    """Check ``plan`` against the real tensors and work out every value; write nothing.

    ``destinations`` maps target keys to the live tensors to load into. Missing and unexpected
    keys are errors unless allowed (a non-strict load); a shape mismatch always is.
    ``own_buffers`` are the target's buffers that it computes itself and does not load (a
    module's non-persistent buffers): a checkpoint's ``inv_freq`` is dropped only where they
    say it is one of the target's own. ``lenient`` names the caller's non-strict load, for the
    advice of a refusal.
    """
    plan.require_complete(allow_missing=allow_missing, allow_unexpected=allow_unexpected, lenient=lenient)
    require_kinds(plan.ops, HANDLERS, "torch executor")
    return _Preparer(plan, fetch, destinations, allow_unexpected, own_buffers).run()


class _Preparer:
    def __init__(self, plan: Plan, fetch: Fetch, destinations: Mapping[KeyPath, torch.Tensor],
                 allow_unexpected: bool, own_buffers: OwnBuffers) -> None:
        self.plan, self.fetch, self.destinations = plan, fetch, destinations
        self.allow_unexpected = allow_unexpected
        self.own_buffers = own_buffers
        self.casts = plan.casts()
        self.missing = frozenset(plan.missing)
        self.sources: dict[KeyPath, torch.Tensor] = {}
        self.prepared = Prepared({}, destinations)
        self.recompute: list[tuple[KeyPath, str]] = []  # synthesized buffers on the meta device
        self.ties: list[Tie] = []  # filled once their twins have values

    def run(self) -> Prepared:
        for op in self.plan.ops:
            if is_layout(op):
                self._moved(op)
            else:
                HANDLERS[op.kind](self, op)
        prepared = self.prepared
        for tie in self.ties:
            if tie.twin in self.casts:  # one storage: the twin's cast is the tied key's too
                self.casts.setdefault(tie.target, self.casts[tie.twin])
            self._check_value(tie.twin, tie.target, prepared.values[tie.twin], self._destination(tie.target))
            prepared.values[tie.target] = prepared.values[tie.twin]
        device = next((t.device for t in self.sources.values()), torch.device("cpu"))
        for key, rule in self.recompute:
            prepared.values[key] = _recompute(key, rule, self.destinations[key], device)
        unaccounted = [key for key in self.plan.target
                       if key not in prepared.values and key not in self.missing]
        if unaccounted:
            raise PlanError(f"the plan gives {join_key(unaccounted[0])!r} (and {len(unaccounted) - 1} "
                            "more) no value; it is not a complete plan for this target. Re-plan "
                            "against the current model.")
        return prepared

    # -- the one primitive every layout op runs through, and a handler per other kind ---------------

    def _moved(self, op: LayoutOp) -> None:
        """Each target of a layout op from its pieces (:mod:`ckptshim.geometry`): a target that is
        one piece of the whole target is a view of its source (the source itself, a layer of it,
        its axes permuted); any other is assembled -- each piece's source view copied into the
        matching view of the target, in the source's factor order (see :class:`Prepared`)."""
        plan, values = self.plan, self.prepared.values
        sources = [self._source(key) for key in op.sources]
        # the planned shapes, which _source and _destination check the tensors have
        grouped = pieces_by_target(op, [plan.source[key].shape for key in op.sources],
                                   [plan.target[key].shape for key in op.targets])
        try:
            for key, pieces in zip(op.targets, grouped):
                destination = self._destination(key)
                if len(pieces) == 1 and pieces[0].target.is_whole(plan.target[key].shape):
                    piece = pieces[0]
                    value = _viewed(sources[piece.source.array], piece.source)
                    if not piece.ordered:
                        value = value.permute(piece.perm)
                    self._check_value(op.sources[piece.source.array], key, value, destination)
                    values[key] = value
                    continue
                whole = self._assembly(key, sources[0])
                for piece in pieces:
                    view = _viewed(values_of(whole), piece.target).permute(inverse_perm(piece.perm))
                    value = _viewed(sources[piece.source.array], piece.source)
                    self._check_value(op.sources[piece.source.array], key, value, view)
                    self.prepared.fills.append((view, value))
                values[key] = whole
        except (IndexError, RuntimeError) as error:  # a view the tensors' strides or shapes do not allow
            raise PlanError(f"`{op.describe()}` cannot be laid out on these tensors ({error}).") from None

    def _assembly(self, key: KeyPath, like: torch.Tensor) -> torch.Tensor:
        """What an assembled target is filled in: its destination, or a new tensor (of the
        sources' dtype and device) where the destination takes no writes through views."""
        destination = self._destination(key)
        if _writable_in_place(destination):
            return destination
        return torch.empty(destination.shape, dtype=like.dtype, device=like.device)

    def _tie(self, op: Tie) -> None:
        self.ties.append(op)

    def _synthesize(self, op: Synthesize) -> None:
        destination = self._destination(op.target)
        if destination.is_meta:
            self.recompute.append((op.target, op.rule))
        else:
            self.prepared.values[op.target] = destination

    def _drop_if_derived(self, op: DropIfDerived) -> None:
        problem = self.own_buffers.problem(op.rule, op.source, self._source(op.source))
        if problem is None:
            return
        if not self.allow_unexpected:
            what = "the target's own non-persistent buffer" if op.rule == NOT_PERSISTENT \
                else f"the derivable buffer {op.rule!r}"
            raise NoPlan(
                f"checkpoint key {join_key(op.source)!r} is named like {what}, which the target "
                f"computes itself, but its value is {problem}: it is not that buffer, and the "
                "target has no place for it. Load into a model that has a place for it, or with "
                "strict=False to leave it out.")
        self.prepared.unexpected.append(op.source)

    def _nothing(self, op: Op) -> None:
        """``Drop`` reads nothing; a ``Cast`` is done by the write (checked in :meth:`_check_value`)."""

    # -- checks -----------------------------------------------------------------------------------

    def _destination(self, key: KeyPath) -> torch.Tensor:
        destination = self.destinations.get(key)
        if destination is None:
            raise PlanError(f"no destination tensor for {join_key(key)!r}; the target changed "
                            "after planning. Re-plan against the current model.")
        _require_entry(destination, self.plan.target[key], "target")
        return destination

    def _source(self, key: KeyPath) -> torch.Tensor:
        tensor = self.sources.get(key)
        if tensor is None:
            tensor = self.fetch(key)
            if not isinstance(tensor, torch.Tensor):
                raise PlanError(f"checkpoint value {join_key(key)!r} is a {type(tensor).__name__}, "
                                "not a tensor; only tensors can be loaded into parameters and buffers.")
            _require_entry(tensor, self.plan.source[key], "checkpoint")
            self.sources[key] = tensor
        return tensor

    def _check_value(self, source_key: KeyPath, target_key: KeyPath, value: torch.Tensor,
                     destination: torch.Tensor) -> None:
        if value.shape != destination.shape:
            raise PlanError(f"{join_key(source_key)!r} gives shape {tuple(value.shape)} but "
                            f"{join_key(target_key)!r} needs {tuple(destination.shape)}.")
        if value.dtype == destination.dtype:
            return
        if target_key not in self.casts:
            raise PlanError(f"{join_key(source_key)!r} is {value.dtype} but {join_key(target_key)!r} "
                            f"is {destination.dtype}, and the plan has no cast for it.")
        if value.is_complex() and not destination.is_complex():
            raise PlanError(f"{join_key(source_key)!r} is complex but {join_key(target_key)!r} is "
                            f"{destination.dtype}; copying would drop the imaginary part. Convert "
                            "the checkpoint value explicitly if that is what you want.")


#: Op kind -> the preparer's handler for a kind that is not a layout op (those all run through
#: :meth:`_Preparer._moved`); every other kind is refused by :func:`prepare`.
HANDLERS: Mapping[str, Callable[[_Preparer, Op], None]] = {
    Tie.kind: _Preparer._tie,
    Synthesize.kind: _Preparer._synthesize,
    DropIfDerived.kind: _Preparer._drop_if_derived,
    Drop.kind: _Preparer._nothing,
    Cast.kind: _Preparer._nothing,
}


def _viewed(tensor: torch.Tensor, view: View) -> torch.Tensor:
    """The part of ``tensor`` that ``view`` names, as a view: its axes split into the view's
    factors, then indexed (a fixed index selects, a range narrows)."""
    if tuple(tensor.shape) != view.factors:
        tensor = tensor.view(view.factors)
    if view.shape == view.factors:  # every factor whole
        return tensor
    return tensor[tuple(part if type(part) is int else slice(part.start, part.stop) for part in view.index)]


def _writable_in_place(tensor: torch.Tensor) -> bool:
    """Whether layers can be copied into ``select`` views of ``tensor``.

    Not on the meta device (no storage) and not a DTensor (a view of a sharded tensor takes no
    plain layer; the framework's own loader distributes a whole value instead).
    """
    return not tensor.is_meta and not is_dtensor(tensor)


def _require_entry(tensor: torch.Tensor, entry: Entry, side: str) -> None:
    """The live tensor must be what the inventory the plan was made from said it is."""
    if tuple(tensor.shape) != entry.shape or dtype_name(tensor.dtype) != entry.dtype:
        raise PlanError(
            f"{side} tensor {join_key(entry.key)!r} is {dtype_name(tensor.dtype)}"
            f"{list(tensor.shape)} but was planned as {entry.dtype}{list(entry.shape)}; it "
            "changed after planning. Re-plan against the current tensors.")


def _recompute(key: KeyPath, rule: str, destination: torch.Tensor, device: torch.device) -> torch.Tensor:
    build = REBUILDABLE.get(rule)
    if build is None:
        raise PlanError(
            f"{join_key(key)!r} is a buffer on the meta device, so it has no value to keep, and "
            f"the checkpoint lacks it; a {rule!r} buffer cannot be rebuilt from its shape alone "
            f"(ckptshim rebuilds {', '.join(sorted(REBUILDABLE))}). Materialize and initialise "
            "the model before loading (module.to_empty(device=...), then its init), or load a "
            "checkpoint that carries this buffer.")
    return build(destination.shape, destination.dtype, device)
