"""Planning: what to do with each key, decided from metadata alone (no torch, no jax)."""

from ckptshim.planner.explain import explain, summary
from ckptshim.planner.match import plan
from ckptshim.planner.plan import Mismatch, Plan

__all__ = ["Mismatch", "Plan", "explain", "plan", "summary"]
