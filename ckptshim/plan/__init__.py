"""Planning: what to do with each key, decided from metadata alone (no torch, no jax)."""

from ckptshim.plan.explain import explain, summary
from ckptshim.plan.match import plan
from ckptshim.plan.ops import Cast, Drop, Op, Rename, Stack, Synthesize, Unstack
from ckptshim.plan.plan import Mismatch, Plan

__all__ = ["Cast", "Drop", "Mismatch", "Op", "Plan", "Rename", "Stack", "Synthesize", "Unstack",
           "explain", "plan", "summary"]
