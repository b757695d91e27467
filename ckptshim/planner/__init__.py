"""Planning: what to do with each key, decided from metadata alone (no torch, no jax)."""

from ckptshim.planner.explain import explain, summary
from ckptshim.planner.match import plan
from ckptshim.planner.ops import Cast, Drop, Join, Op, Rename, Split, Stack, Synthesize, Transpose, Unstack
from ckptshim.planner.plan import Mismatch, Plan

__all__ = ["Cast", "Drop", "Join", "Mismatch", "Op", "Plan", "Rename", "Split", "Stack", "Synthesize",
           "Transpose", "Unstack", "explain", "plan", "summary"]
