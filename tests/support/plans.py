"""Plans turned around: every op knows its inverse, so a plan A -> B inverts into B -> A."""

from __future__ import annotations

from ckptshim.inventory import KeyPath
from ckptshim.ops import Cast, Op
from ckptshim.planner import Mismatch, Plan


def inverse(plan: Plan) -> Plan:
    """The plan that maps ``plan``'s target back onto its source, op by op.

    Casts are the one op that is not simply inverted in place: the per-layer casts of an
    ``Unstack`` (one per target) invert into one cast of each source of its producer.
    """
    ops: list[Op] = []
    cast: set[KeyPath] = set()
    for op in plan.ops:
        if op.kind == Cast.kind:
            for key in plan.producer(op.target).sources:
                if key not in cast:
                    cast.add(key)
                    ops.append(Cast(key, op.target_dtype, op.source_dtype))
        else:
            ops.append(op.inverse())
    mismatched = tuple(Mismatch(m.target, m.source, m.target_shape, m.source_shape, m.why)
                       for m in plan.mismatched)
    return Plan(plan.target, plan.source, tuple(ops), missing=plan.unexpected,
                unexpected=plan.missing, mismatched=mismatched)
