"""The search: the fastest choices of strategy per unit whose predicted peak fits the budget (a choice is
any hashable key of a unit's options: the planner's ``Choice``, a strategy and rsdp's ring group size).

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
  buffers (forwards of rsdp units or below an rsdp root; backwards from the first such on, to the
  backward's end), and ``ring_forward``, ``ring``: the largest message pairs of a forward and of a
  backward, ``ring_forward_scratch``, ``ring_scratch``: the largest scratches, which they may hold (the
  buffers are sized apart, and a backward that left its pass's record trims none of them:
  ``_profile.Carried``);
- ``optimizer_step``: what the optimizer step allocates for their parameters (a foreach optimizer), and
  ``optimizer_step_floor``: the most it allocates for one of them (a for-loop one: the largest).

A partial plan no better than another in all of them can be dropped without losing the optimum
(dominance pruning), which makes this a multiple-choice knapsack solved over the memory timeline.

Pitfalls:
- The frontier of undominated partial plans of a model with many units outgrows any budget of time
  (tens of thousands of plans, compared pairwise, for each of 80 units). Its byte quantities are
  therefore compared on a grid (rounded up to multiples of ``grid_bytes``, seconds as they are) that
  doubles whenever more than ``max_partials`` plans remain; a plan then stands in for those whose
  quantities are within a grid step of its own. The figures the search keeps and returns are never
  rounded: a plan's predicted peak is its exact one, whatever grid chose it. What the grid costs is
  only plans not found (within a grid step per unit of a kept one), which is why the planner also
  considers every uniform plan itself (``_plan._search``).
- The partial plans are rows of tensors (``Partial``), extended all at once; the dominance check is
  a bit-set intersection (``_non_dominated``). It all runs on one intra-op thread: on a busy machine,
  waking threads for these small ops costs far more than the ops.
"""

import contextlib
import math
from typing import NamedTuple

import torch

from ..policy import Strategy
from ._profile import RootCost, UnitCost

# Kept partial plans at most (see the pitfalls): the search's time grows with the square of it.
MAX_PARTIALS = 512
_NONE = -math.inf  # a level no phase of the kind reached (yet)


def _max(*values):
    """The elementwise maximum of tensors and numbers (at least one of them a tensor)."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    numbers = [v for v in values if not isinstance(v, torch.Tensor)]
    result = tensors[0]
    for tensor in tensors[1:]:
        result = torch.maximum(result, tensor)
    return result.clamp(min=max(numbers)) if numbers else result


def _reached(level: torch.Tensor) -> torch.Tensor:
    return level > _NONE


class Partial(NamedTuple):
    """Plans of the units walked so far, one per row: every field a 1-D float64 tensor, so that the search
    extends and compares thousands of them in a few tensor operations."""

    forward_peak: torch.Tensor
    until_gathering: torch.Tensor
    gather: torch.Tensor
    ringed_forward: torch.Tensor
    activations: torch.Tensor
    backward_peak: torch.Tensor
    backward_delta: torch.Tensor
    retained: torch.Tensor
    since_gathering: torch.Tensor
    since_gathering_ringed: torch.Tensor
    ringed_backward: torch.Tensor
    ring: torch.Tensor
    ring_forward: torch.Tensor
    ring_scratch: torch.Tensor
    ring_forward_scratch: torch.Tensor
    static: torch.Tensor
    optimizer_step: torch.Tensor
    optimizer_step_floor: torch.Tensor
    seconds: torch.Tensor

    def extend(self, cost: UnitCost) -> "Partial":
        """Add the unit just before the ones walked so far (forward order), which is the unit just after
        them in backward, under the strategy ``cost`` is of."""
        forward, backward, carried = cost.forward, cost.backward, cost.carried
        gathers, reduces = carried.gather > 0, carried.reduce > 0
        # Forward: this unit's all-gather output lives until the next FSDP unit's all-gather (counted
        # with the ring's buffers too where any later phase holds them).
        later, later_ringed = self.forward_peak, self.ringed_forward
        if gathers:
            gathered = self.until_gathering + carried.gather
            later = _max(later, gathered)
            later_ringed = torch.where(_reached(later_ringed), _max(later_ringed, gathered), later_ringed)
        until_gathering = torch.full_like(later, carried.gather) if gathers else _max(forward.delta + self.until_gathering, forward.peak)
        ringed_forward = _max(forward.delta + later_ringed, forward.peak if carried.ringed else _NONE)
        # Backward: the reduce-scatter input the earlier backward left, and this unit's all-gather,
        # prefetched by the last FSDP2 module's backward.
        phase_peak = self.backward_delta + backward.peak + self.retained
        ringed_peak = phase_peak if carried.ringed else torch.where(_reached(self.ringed_backward), phase_peak, _NONE)
        backward_peak = _max(self.backward_peak, phase_peak)
        ringed_backward = _max(self.ringed_backward, ringed_peak)
        if gathers:
            backward_peak = _max(backward_peak, self.since_gathering + carried.gather)
            ringed_backward = _max(ringed_backward, self.since_gathering_ringed + carried.gather)
        return Partial(
            _max(forward.delta + later, forward.peak),
            until_gathering,
            _max(self.gather, carried.gather),
            ringed_forward,
            self.activations + forward.delta,
            backward_peak,
            self.backward_delta + backward.delta,
            torch.full_like(later, carried.reduce) if reduces else self.retained,
            phase_peak if reduces else _max(self.since_gathering, phase_peak),
            ringed_peak if reduces else _max(self.since_gathering_ringed, ringed_peak),
            ringed_backward,
            _max(self.ring, carried.ring),
            _max(self.ring_forward, carried.ring_forward),
            _max(self.ring_scratch, carried.ring_scratch),
            _max(self.ring_forward_scratch, carried.ring_forward_scratch),
            self.static + cost.static_bytes,
            self.optimizer_step + cost.optimizer_step_bytes,
            _max(self.optimizer_step_floor, cost.optimizer_step_floor_bytes),
            self.seconds + cost.seconds,
        )

    def rows(self, index: torch.Tensor) -> "Partial":
        return Partial(*(field[index] for field in self))

    def stacked(self) -> torch.Tensor:
        """One row per plan, one column per quantity."""
        return torch.stack(self, dim=1)


def _concatenated(partials: list[Partial]) -> Partial:
    return Partial(*(torch.cat(fields) for fields in zip(*partials)))


def _empty() -> Partial:
    none, zero = torch.tensor([_NONE], dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
    return Partial(none, none, zero, none, zero, none, zero, zero, none, none, none, zero, zero, zero, zero, zero, zero, zero, zero)


EMPTY = _empty()  # the plan of no unit


def predicted_peak(partial: Partial, root: RootCost) -> torch.Tensor:
    """Peak bytes of whole plans (one per row): the highest of the step's phases, each with the buffers
    carried into it, plus parameters and optimizer state."""
    carried = root.carried
    # The largest pair and the largest scratch of the plan's rings, sized apart.
    ring = _max(partial.ring, carried.ring) + _max(partial.ring_scratch, carried.ring_scratch)
    ring_forward = _max(partial.ring_forward, carried.ring_forward) + _max(partial.ring_forward_scratch, carried.ring_forward_scratch)
    # Below an rsdp root every unit's phases hold the ring's buffers, and the root's own do too; its
    # forward's end frees them, so the loss runs without them, the root's own head (a ring of its own:
    # ``carried.ring``) with the backward's, which its backward begins.
    root_ring = ring_forward if carried.ringed else 0
    middle_ring = _max(ring, root_ring) if carried.ring else root_ring
    start = root.before.delta
    after_forward = start + partial.activations
    before_backward = after_forward + root.middle.delta
    end_of_backward = before_backward + partial.backward_delta
    return root.static_bytes + partial.static + _max(
        start + _max(partial.forward_peak, partial.until_gathering + carried.gather, partial.ringed_forward + ring_forward),
        after_forward + root.middle.peak + _max(partial.gather, carried.gather) + middle_ring,
        # The plan's largest backward buffers (the root's head's and embedding's rings among them, the
        # first and the last of the backward) held by every unit's backward from the first ring on.
        before_backward + _max(partial.backward_peak, partial.ringed_backward + ring),
        # After the units' backwards the ring buffers are held to the backward's end: through the root's
        # own backward (its embedding's, the last) and its reduction, which an FSDP or replicate root
        # runs first (FSDP2 queues its root's post-backward as the backward begins, before any rsdp
        # module asks for its end of backward, which frees them).
        end_of_backward + root.after.peak + partial.retained + ring,
        end_of_backward + root.after.delta + _max(partial.optimizer_step + root.optimizer_step_bytes, partial.optimizer_step_floor, root.optimizer_step_floor_bytes),
        root.before.peak + root_ring,
    )


class Frontier(NamedTuple):
    """The plans a search kept: their figures, exact (never rounded), and each one's strategy per unit."""

    partial: Partial
    choices: torch.Tensor  # (plans, units) indices into ``strategies``, units in forward order
    strategies: tuple[Strategy, ...]

    def assignment(self, row: int) -> tuple[Strategy, ...]:
        return tuple(self.strategies[i] for i in self.choices[row].tolist())

    def joined(self, other: "Frontier") -> "Frontier":
        """Both frontiers' plans (of the same strategies)."""
        partial = _concatenated([self.partial, other.partial])
        return Frontier(partial, torch.cat([self.choices, other.choices]), self.strategies)


def uniform_plans(unit_costs: list[dict[Strategy, UnitCost]]) -> Frontier:
    """Each strategy every unit may take, for every unit: one plan per strategy."""
    strategies = _strategies(unit_costs)
    everywhere = [index for index, strategy in enumerate(strategies) if all(strategy in options for options in unit_costs)]
    plans = [EMPTY.rows(torch.zeros(0, dtype=torch.long))]  # none, where no strategy is every unit's
    for index in everywhere:
        partial = EMPTY
        for options in reversed(unit_costs):
            partial = partial.extend(options[strategies[index]])
        plans.append(partial)
    choices = torch.tensor(everywhere, dtype=torch.int8).reshape(-1, 1).expand(-1, len(unit_costs))
    return Frontier(_concatenated(plans), choices, strategies)


def _strategies(unit_costs: list[dict[Strategy, UnitCost]]) -> tuple[Strategy, ...]:
    """Every strategy some unit may take, in a fixed order (what a frontier's choices index)."""
    return tuple(dict.fromkeys(strategy for options in unit_costs for strategy in options))


def pareto_plans(unit_costs: list[dict[Strategy, UnitCost]], grid_bytes: float = 1, max_partials: int | None = None) -> Frontier:
    """The plans not dominated in the running quantities, their bytes compared on a grid of ``grid_bytes``
    (1: exact for byte counts), which doubles whenever more than ``max_partials`` remain; units in
    forward order."""
    max_partials = max_partials or MAX_PARTIALS
    strategies = _strategies(unit_costs)
    partial, choices = EMPTY, torch.zeros(1, 0, dtype=torch.int8)
    with _one_thread():
        for options in reversed(unit_costs):
            partial, choices, grid_bytes = _step(partial, choices, options, strategies, grid_bytes, max_partials)
    return Frontier(partial, choices, strategies)


def _step(partial: Partial, choices: torch.Tensor, options: dict[Strategy, UnitCost], strategies, grid_bytes: float, max_partials: int):
    """The frontier with one more unit (``options``), and the grid it was kept on."""
    taken = [index for index, strategy in enumerate(strategies) if strategy in options]
    partial = _concatenated([partial.extend(options[strategies[index]]) for index in taken])
    choices = torch.cat([
        torch.cat([torch.full((len(choices), 1), index, dtype=torch.int8), choices], dim=1) for index in taken
    ])
    quantities = partial.stacked()
    kept = _non_dominated(_on_grid(quantities, grid_bytes))
    while len(kept) > max_partials:
        grid_bytes *= 2
        kept = kept[_non_dominated(_on_grid(quantities[kept], grid_bytes))]
    return partial.rows(kept), choices[kept], grid_bytes


@contextlib.contextmanager
def _one_thread():
    """Intra-op threads off: the search's ops are small (at most a few million elements), and on a busy
    machine waking threads for each costs far more than the op (a 7B model's search: 18 s with two
    threads on two busy cores, 1 s with one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _on_grid(quantities: torch.Tensor, grid_bytes: float) -> torch.Tensor:
    """Byte columns rounded up to multiples of ``grid_bytes`` (in grid steps); seconds, the last, as they are."""
    if grid_bytes <= 1:
        return quantities
    return torch.cat([torch.ceil(quantities[:, :-1] / grid_bytes), quantities[:, -1:]], dim=1)


def _non_dominated(keys: torch.Tensor) -> torch.Tensor:
    """The rows of ``keys`` no other row is at most in every column, as indices (of equal rows one).

    Per column, the rows at most each row are a prefix of that column's sorted order: as bit sets
    (``_WORD_BITS`` rows a word), those prefixes are a cumulative sum of one bit per row (the bits are
    distinct, so the sum is their union). The intersection over the columns holds, for each row, the
    rows at most it everywhere; a row is dominated when that holds another than itself."""
    first = _first_of_equal(keys)
    distinct = keys[first]
    count = len(distinct)
    distinct = distinct[:, (distinct != distinct[:1]).any(dim=0)]  # a column equal in every row decides nothing
    rows = torch.arange(count)
    word, bit = rows // _WORD_BITS, torch.ones(count, dtype=torch.int64) << (rows % _WORD_BITS)
    at_most = None
    for values in distinct.T:
        order = torch.argsort(values)
        ordered = values[order]
        last_tie = torch.searchsorted(ordered, ordered, right=True) - 1  # equal values are at most each other
        added = torch.zeros(count, (count + _WORD_BITS - 1) // _WORD_BITS, dtype=torch.int64)
        added[rows, word[order]] = bit[order]
        position = torch.empty_like(order)
        position[order] = rows
        prefix = added.cumsum(dim=0)[last_tie[position]]
        at_most = prefix if at_most is None else at_most.bitwise_and_(prefix)
    if at_most is None:  # one distinct row
        return first
    at_most[rows, word] ^= bit  # a row is at most itself
    return first[~(at_most != 0).any(dim=1)]


def _first_of_equal(keys: torch.Tensor) -> torch.Tensor:
    """The index of the first of each set of equal rows (rows sorted lexicographically by stable sorts
    from the last column to the first, which leaves equal rows adjacent and in index order)."""
    order = torch.arange(len(keys))
    for values in keys.T.flip(0):
        order = order[torch.argsort(values[order], stable=True)]
    ordered = keys[order]
    repeated = torch.cat([torch.zeros(1, dtype=torch.bool), (ordered[1:] == ordered[:-1]).all(dim=1)])
    return order[~repeated]


_WORD_BITS = 32  # of an int64 word: a sum of distinct bits below 2**32 cannot overflow
