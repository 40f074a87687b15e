"""OSDP-style planning: choose replicate, FSDP or RSDP per module to fit a memory budget, fastest per sample."""

from ._cost_model import CostModel
from ._plan import Plan, Planner, PlanRow, plan
from ._profile import measure_peak

__all__ = ["CostModel", "Plan", "Planner", "PlanRow", "measure_peak", "plan"]
