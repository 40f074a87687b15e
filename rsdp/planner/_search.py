"""The exact search: the fastest choice of strategy per unit whose predicted peak fits the budget.

A plan's peak is not a sum over units: it is the highest point of the step's timeline, so each unit's
choice moves every later level. Walking the units from the innermost (last in forward, first in
backward) outwards, a few running quantities describe a partial plan completely, and the final peak grows
with each of them:

- ``forward_peak``: the highest forward level reached from this unit on, above the level where it starts;
- ``activations``: the bytes its forward and the later ones leave alive;
- ``backward_peak``: the highest backward level from the last unit down to this one, above the level
  where the last unit's backward starts;
- ``backward_delta``: how much those backwards changed the live bytes (gradients made, activations freed);
- ``static``: parameters and optimizer state;
- ``seconds``;

and, for the buffers a unit's parallelism leaves alive past its own phases (``_profile.Carried``: the
cost model's; measured phases contain them already and carry nothing), where they are:

- ``until_gathering``: the highest forward level from this unit's start up to the first FSDP unit's
  all-gather (the whole forward when there is none), through which an earlier FSDP unit's all-gather
  output lives; ``gather``: the largest FSDP unit's, which bounds what the last one leaves to the root;
- ``retained``: the reduce-scatter input the last unit reduced by FSDP2 leaves to the next one's
  backward;
- ``since_gathering``: the highest backward level since the last backward that all-gathers the
  previous FSDP module ahead of time (FSDP2's prefetch), which that all-gather output lives through
  (``since_gathering_ringed``: among those that hold the ring's buffers);
- ``ringed_forward``, ``ringed_backward``: the highest levels among the phases that hold the ring's
  buffers (forwards of rsdp units or below an rsdp root; backwards from the first such on), and
  ``ring_forward``, ``ring``: the largest buffers of a forward and of a backward, which they may hold;
- ``optimizer_step``: what the optimizer step allocates for their parameters.

A partial plan no better than another in all of them can be dropped without losing the optimum
(dominance pruning), which makes this a multiple-choice knapsack solved exactly over the memory
timeline. Byte figures are first rounded up to a grid (``grid_bytes``, the planner uses 1/4096 of what
the smallest choice of every unit holds): the search is exact for the rounded figures, which overstate a
plan's peak by at most one grid step per unit, and the rounding keeps the number of distinct partial
plans small for models with many layers.
"""

import dataclasses
import math
from typing import NamedTuple

import torch

from ..policy import Strategy
from ._profile import Phase, RootCost, UnitCost


class Partial(NamedTuple):
    """A plan of the units walked so far (a tuple: the search makes and compares millions of them)."""

    forward_peak: float
    until_gathering: float
    gather: float
    ringed_forward: float
    activations: float
    backward_peak: float
    backward_delta: float
    retained: float
    since_gathering: float
    since_gathering_ringed: float
    ringed_backward: float
    ring: float
    ring_forward: float
    static: float
    optimizer_step: float
    seconds: float
    choices: tuple[Strategy, ...]  # for the units walked so far, in forward order

    def key(self) -> tuple[float, ...]:
        """Every quantity but ``choices``, the last field."""
        return self[:-1]

    def extend(self, strategy: Strategy, cost: UnitCost) -> "Partial":
        """Add the unit just before the ones walked so far (forward order), which is the unit just after
        them in backward."""
        forward, backward, carried = cost.forward, cost.backward, cost.carried
        gathers, reduces = carried.gather > 0, carried.reduce > 0
        # Forward: this unit's all-gather output lives until the next FSDP unit's all-gather (counted
        # with the ring's buffers too where any later phase holds them).
        later, later_ringed = self.forward_peak, self.ringed_forward
        if gathers:
            later = max(later, self.until_gathering + carried.gather)
            later_ringed = max(later_ringed, self.until_gathering + carried.gather) if later_ringed > -math.inf else later_ringed
        until_gathering = carried.gather if gathers else max(forward.peak, forward.delta + self.until_gathering)
        ringed_forward = max(forward.peak if carried.ringed else -math.inf, forward.delta + later_ringed)
        # Backward: the reduce-scatter input the earlier backward left, and this unit's all-gather,
        # prefetched by the last FSDP2 module's backward.
        phase_peak = self.backward_delta + backward.peak + self.retained
        ringed_peak = phase_peak if carried.ringed or self.ringed_backward > -math.inf else -math.inf
        prefetched = self.since_gathering + carried.gather if gathers else -math.inf
        prefetched_ringed = self.since_gathering_ringed + carried.gather if gathers else -math.inf
        return Partial(
            max(forward.peak, forward.delta + later),
            until_gathering,
            max(self.gather, carried.gather),
            ringed_forward,
            self.activations + forward.delta,
            max(self.backward_peak, phase_peak, prefetched),
            self.backward_delta + backward.delta,
            carried.reduce if reduces else self.retained,
            phase_peak if reduces else max(self.since_gathering, phase_peak),
            ringed_peak if reduces else max(self.since_gathering_ringed, ringed_peak),
            max(self.ringed_backward, ringed_peak, prefetched_ringed),
            max(self.ring, carried.ring),
            max(self.ring_forward, carried.ring_forward),
            self.static + cost.static_bytes,
            self.optimizer_step + cost.optimizer_step_bytes,
            self.seconds + cost.seconds,
            (strategy, *self.choices),
        )


EMPTY = Partial(-math.inf, -math.inf, 0.0, -math.inf, 0.0, -math.inf, 0.0, 0.0, -math.inf, -math.inf, -math.inf, 0.0, 0.0, 0.0, 0.0, 0.0, ())


def predicted_peak(partial: Partial, root: RootCost) -> float:
    """Peak bytes of a whole plan: the highest of the step's phases, each with the buffers carried into
    it, plus parameters and optimizer state."""
    carried = root.carried
    ring = max(partial.ring, carried.ring)
    ring_forward = max(partial.ring_forward, carried.ring_forward)
    # Below an rsdp root every unit's phases hold the ring's buffers, and the root's own do too; its
    # forward's end frees them, so the loss runs without them, the root's own head (a ring of its own:
    # ``carried.ring``) with the backward's, which its backward begins.
    root_ring = ring_forward if carried.ringed else 0
    middle_ring = max(root_ring, ring if carried.ring else 0)
    backward_ring = ring if carried.ringed or partial.ringed_backward > -math.inf else 0
    start = root.before.delta
    after_forward = start + partial.activations
    before_backward = after_forward + root.middle.delta
    end_of_backward = before_backward + partial.backward_delta
    return root.static_bytes + partial.static + max(
        root.before.peak + root_ring,
        start + max(partial.forward_peak, partial.until_gathering + carried.gather, partial.ringed_forward + ring_forward),
        after_forward + root.middle.peak + max(partial.gather, carried.gather) + middle_ring,
        before_backward + max(partial.backward_peak, partial.ringed_backward + ring),
        end_of_backward + root.after.peak + partial.retained + backward_ring,
        end_of_backward + root.after.delta + max(root.optimizer_step_bytes + partial.optimizer_step, root.optimizer_step_floor_bytes),
    )


class FrontierTooLarge(Exception):
    """More non-dominated partial plans than ``max_partials``: search again on a coarser grid."""


def _without_dominated(partials: list[Partial]) -> list[Partial]:
    """The partials no other one is at most in every quantity, in key order (of equal keys the last)."""
    by_key = {partial.key(): partial for partial in partials}
    ordered = sorted(by_key)
    quantities = torch.tensor(ordered, dtype=torch.float64).T.contiguous()  # one row per quantity
    count = len(ordered)
    dominated = torch.zeros(count, dtype=torch.bool)
    # Keys are distinct, so a partial is dominated iff another key is <= its own everywhere (its own
    # always is). All against a block at a time, each comparison within torch's intra-op grain size,
    # so that it runs on one thread: on a busy machine, waking threads costs more than these small ops.
    block = max(1, _COMPARISONS_AT_ONCE // count)
    for start in range(0, count, block):
        columns = slice(start, start + block)
        at_most = quantities[0, :, None] <= quantities[0, None, columns]
        for values in quantities[1:]:
            at_most &= values[:, None] <= values[None, columns]
        dominated[columns] = at_most.sum(dim=0) > 1
    return [by_key[key] for key, out in zip(ordered, dominated.tolist()) if not out]


_COMPARISONS_AT_ONCE = 2**15  # at::internal::GRAIN_SIZE


def _rounded_up(cost: UnitCost, grid: int) -> UnitCost:
    def up(value: int) -> int:
        return math.ceil(value / grid) * grid

    def phase(p: Phase) -> Phase:
        return Phase(up(p.delta), up(p.peak), p.seconds)

    carried = dataclasses.replace(
        cost.carried, gather=up(cost.carried.gather), reduce=up(cost.carried.reduce), ring=up(cost.carried.ring),
        ring_forward=up(cost.carried.ring_forward),
    )
    return UnitCost(
        up(cost.static_bytes), phase(cost.forward), phase(cost.backward), cost.optimizer_seconds, carried,
        up(cost.optimizer_step_bytes),
    )


def pareto_plans(
    unit_costs: list[dict[Strategy, UnitCost]], grid_bytes: int = 1, max_partials: int = 4096
) -> list[Partial]:
    """Every plan not dominated in (peak-relevant quantities, static bytes, time); units in forward order.

    Raises:
        FrontierTooLarge: when more than ``max_partials`` remain after some unit.
    """
    partials = [EMPTY]
    for options in reversed(unit_costs):
        rounded = {strategy: _rounded_up(cost, grid_bytes) for strategy, cost in options.items()}
        partials = _without_dominated(
            [partial.extend(strategy, cost) for partial in partials for strategy, cost in rounded.items()]
        )
        if len(partials) > max_partials:
            raise FrontierTooLarge(len(partials))
    return partials
