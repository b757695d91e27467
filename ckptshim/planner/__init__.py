"""Planning: what to do with each key, decided from metadata alone (no torch, no jax)."""

from ckptshim.planner.diagnosis import headline
from ckptshim.planner.explain import explain, summary, table
from ckptshim.planner.match import plan
from ckptshim.planner.plan import Mismatch, Plan

__all__ = ["Mismatch", "Plan", "explain", "headline", "plan", "summary", "table"]
