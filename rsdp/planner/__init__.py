"""OSDP-style planning: choose replicate, FSDP or RSDP per module to fit a memory budget, fastest per sample."""

from ._plan import Plan, PlanRow, plan

__all__ = ["Plan", "PlanRow", "plan"]
