"""Planning: what to do with each key, decided from metadata alone (no torch, no jax)."""

from ckptshim.plan.explain import explain, summary
from ckptshim.plan.match import plan
from ckptshim.plan.ops import Cast, Drop, Join, Op, Rename, Split, Stack, Synthesize, Transpose, Unstack
from ckptshim.plan.plan import Mismatch, Plan

__all__ = ["Cast", "Drop", "Join", "Mismatch", "Op", "Plan", "Rename", "Split", "Stack", "Synthesize",
           "Transpose", "Unstack", "explain", "plan", "summary"]
