"""The exact search: the fastest choice of strategy per unit whose predicted peak fits the budget.

A plan's peak is not a sum over units: it is the highest point of the step's timeline, so each unit's
choice moves every later level. Walking the units from the innermost (last in forward, first in
backward) outwards, six running quantities describe a partial plan completely, and the final peak grows
with each of them:

- ``forward_peak``: the highest forward level reached from this unit on, above the level where it starts;
- ``activations``: the bytes its forward and the later ones leave alive;
- ``backward_peak``: the highest backward level from the last unit down to this one, above the level
  where the last unit's backward starts;
- ``backward_delta``: how much those backwards changed the live bytes (gradients made, activations freed);
- ``static``: parameters and optimizer state;
- ``seconds``.

A partial plan no better than another in all six can be dropped without losing the optimum (dominance
pruning), which makes this a multiple-choice knapsack solved exactly over the memory timeline. Byte
figures are first rounded up to a grid (``grid_bytes``, the planner uses 1/4096 of the budget): the
search is exact for the rounded figures, which overstate a plan's peak by at most one grid step per
unit, and the rounding keeps the number of distinct partial plans small for models with many layers.
"""

import dataclasses
import math

import torch

from ..policy import Strategy
from ._profile import Phase, RootCost, UnitCost


@dataclasses.dataclass(frozen=True)
class Partial:
    forward_peak: float
    activations: float
    backward_peak: float
    backward_delta: float
    static: float
    seconds: float
    choices: tuple[Strategy, ...]  # for the units walked so far, in forward order

    def key(self) -> tuple[float, ...]:
        return (self.forward_peak, self.activations, self.backward_peak, self.backward_delta, self.static, self.seconds)

    def extend(self, strategy: Strategy, cost: UnitCost) -> "Partial":
        """Add the unit just before the ones walked so far."""
        return Partial(
            max(cost.forward.peak, cost.forward.delta + self.forward_peak),
            self.activations + cost.forward.delta,
            max(self.backward_peak, self.backward_delta + cost.backward.peak),
            self.backward_delta + cost.backward.delta,
            self.static + cost.static_bytes,
            self.seconds + cost.seconds,
            (strategy, *self.choices),
        )


def predicted_peak(partial: Partial, root: RootCost) -> float:
    """Peak bytes of a whole plan: the highest of the step's phases, plus parameters and optimizer state."""
    start = root.before.delta
    after_forward = start + partial.activations
    before_backward = after_forward + root.middle.delta
    return root.static_bytes + partial.static + max(
        root.before.peak,
        start + partial.forward_peak,
        after_forward + root.middle.peak,
        before_backward + partial.backward_peak,
        before_backward + partial.backward_delta + root.after.peak,
    )


class FrontierTooLarge(Exception):
    """More non-dominated partial plans than ``max_partials``: search again on a coarser grid."""


def _without_dominated(partials: list[Partial]) -> list[Partial]:
    unique = sorted({partial.key(): partial for partial in partials}.values(), key=Partial.key)
    keys = torch.tensor([partial.key() for partial in unique], dtype=torch.float64)
    kept: list[int] = []
    kept_keys = keys[:0]
    for index in range(len(unique)):
        # Sorted lexicographically, a partial can only be dominated by one that comes before it.
        if kept and bool((kept_keys <= keys[index]).all(dim=1).any()):
            continue
        kept.append(index)
        kept_keys = keys[kept]
    return [unique[index] for index in kept]


def _rounded_up(cost: UnitCost, grid: int) -> UnitCost:
    def up(value: int) -> int:
        return math.ceil(value / grid) * grid

    def phase(p: Phase) -> Phase:
        return Phase(up(p.delta), up(p.peak), p.seconds)

    return UnitCost(up(cost.static_bytes), phase(cost.forward), phase(cost.backward), cost.optimizer_seconds)


def pareto_plans(
    unit_costs: list[dict[Strategy, UnitCost]], grid_bytes: int = 1, max_partials: int = 4096
) -> list[Partial]:
    """Every plan not dominated in (peak-relevant quantities, static bytes, time); units in forward order.

    Raises:
        FrontierTooLarge: when more than ``max_partials`` remain after some unit.
    """
    partials = [Partial(-math.inf, 0.0, -math.inf, 0.0, 0.0, 0.0, ())]
    for options in reversed(unit_costs):
        partials = _without_dominated(
            [
                partial.extend(strategy, _rounded_up(cost, grid_bytes))
                for partial in partials
                for strategy, cost in options.items()
            ]
        )
        if len(partials) > max_partials:
            raise FrontierTooLarge(len(partials))
    return partials
