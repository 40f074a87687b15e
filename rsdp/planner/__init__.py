"""OSDP-style planning: choose replicate, FSDP or RSDP per module to fit a memory budget, fastest per sample."""

from ._cost_model import CostModel
from ._plan import Plan, PlanRow, plan

__all__ = ["CostModel", "Plan", "PlanRow", "plan"]
