"""``rsdp.plan``: profile, search, and report a per-module plan that fits a memory budget."""

import collections
import dataclasses
import math
import numbers
import warnings
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from .._compat import MixedPrecisionPolicy
from ..policy import Strategy, _default_mesh
from ._cost_model import CostModel, Counts, count_folded, estimate_root, estimate_units
from ._profile import RootCost, UnitCost, find_units, profile
from ._search import EMPTY, Frontier, pareto_plans, predicted_peak, uniform_plans

MiB = 2**20
# How many of the fastest plans are run to check them (each run is one training step).
MAX_VERIFICATIONS = 8
SMALLEST_VERIFIED = 3  # plans of least predicted peak run before a budget is declared too small
# A plan whose measured peak is within this fraction of its prediction is preferred.
PREDICTION_TOLERANCE = 0.1
# The search compares byte figures on a grid of at first 1 / SEARCH_GRID_STEPS of the smallest plan's
# bytes, coarser where its frontier needs it (see _search).
SEARCH_GRID_STEPS = 2**16


class Choice(NamedTuple):
    """What a module may take: a strategy, and for rsdp the size of its ring's groups (``rsdp_shard``'s
    ``ring_group_size``: W/g steps of g/W of the layer; 1 is the flat ring)."""

    strategy: Strategy
    ring_group_size: int = 1

    def __str__(self) -> str:
        return self.strategy.value if self.ring_group_size == 1 else f"{self.strategy.value} g={self.ring_group_size}"


def choices_of(strategies: Sequence[Strategy], ring_group_sizes: Sequence[int] = (1,)) -> tuple[Choice, ...]:
    """Every strategy, rsdp once per ring group size."""
    return tuple(
        Choice(strategy, size) for strategy in strategies
        for size in (ring_group_sizes if strategy is Strategy.RSDP else (1,))
    )


@dataclasses.dataclass(frozen=True)
class PlanRow:
    module: str  # "" is the root: every parameter no unit holds
    strategy: Strategy
    static_bytes: int  # parameters and optimizer state on one rank
    activation_bytes: int  # what its forward leaves alive for backward
    seconds: float  # forward, backward and its share of the optimizer step
    ring_group_size: int = 1  # rsdp's ring in groups of this many ranks (1: the flat ring)
    # Applied inside the root (``Planner``'s ``replicated_in_root``): its figures are the root's row's.
    in_root: bool = False


@dataclasses.dataclass(frozen=True)
class Plan:
    """A strategy per module, the per-rank batch size, and what they are predicted to cost.

    Pass it to :func:`rsdp.parallelize` as the policy.
    """

    rows: tuple[PlanRow, ...]
    batch_size: int
    data_parallel_size: int
    predicted_peak_bytes: int
    predicted_step_seconds: float
    memory_budget: int
    verified_peak_bytes: int | None = None  # the chosen plan's peak, measured by running it once
    verified_step_seconds: float | None = None  # and its step time in that run
    # The prediction is what the caching allocator reserves, not what tensors hold: a cost model whose
    # hardware has a reserved-per-allocated factor (GPU presets).
    peak_is_reserved: bool = False

    @property
    def strategies(self) -> dict[str, Strategy]:
        return {row.module: row.strategy for row in self.rows}

    @property
    def ring_group_sizes(self) -> dict[str, int]:
        """Each module's ring group size (1 for the flat ring and for modules that are not rsdp), which
        :func:`rsdp.parallelize` passes to ``rsdp_shard`` where it is not 1."""
        return {row.module: row.ring_group_size for row in self.rows}

    @property
    def samples_per_second(self) -> float:
        return self.batch_size * self.data_parallel_size / self.predicted_step_seconds

    def __str__(self) -> str:
        lines = [
            "| module | strategy | params + optimizer state | activations | time |",
            "| --- | --- | --- | --- | --- |",
        ]
        for row in self.rows:
            if row.in_root:
                lines.append(f"| {row.module} | {row.strategy.value}, in the root | (the root's) | (the root's) | (the root's) |")
                continue
            lines.append(
                f"| {row.module or '(root)'} | {Choice(row.strategy, row.ring_group_size)} | {row.static_bytes / MiB:.1f} MiB | "
                f"{row.activation_bytes / MiB:.1f} MiB | {row.seconds * 1e3:.1f} ms |"
            )
        verified = "" if self.verified_peak_bytes is None else f" (measured {self.verified_peak_bytes / MiB:.2f} MiB)"
        lines.append(
            f"\nbatch {self.batch_size} per rank: predicted peak {self.predicted_peak_bytes / MiB:.2f} MiB"
            f"{' reserved' if self.peak_is_reserved else ''}{verified} "
            f"of a {self.memory_budget / MiB:.2f} MiB budget, step {self.predicted_step_seconds * 1e3:.1f} ms, "
            f"{self.samples_per_second:.2f} samples/s"
        )
        return "\n".join(lines)


def _next_token_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    _check_next_token_batch(model, tokens)
    logits = model(tokens)
    if not (
        isinstance(logits, torch.Tensor)
        and logits.is_floating_point()
        and logits.dim() == 3
        and logits.shape[:2] == tokens.shape
    ):
        raise _not_a_language_model(model, f"returned {_describe(logits)}")
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())


def _check_next_token_batch(model: nn.Module, tokens: torch.Tensor) -> None:
    if not (isinstance(tokens, torch.Tensor) and tokens.dtype in (torch.int32, torch.int64) and tokens.dim() == 2):
        raise _not_a_language_model(model, f"was given {_describe(tokens)}")


def _not_a_language_model(model: nn.Module, what: str) -> ValueError:
    return ValueError(
        f"rsdp.plan: the default loss_fn is next-token cross-entropy, for a language model that takes token "
        f"ids (batch, seq) and returns logits (batch, seq, vocab); {type(model).__name__} {what}. Pass "
        "loss_fn=lambda model, batch: <your training loss> to rsdp.plan."
    )


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def _resize_batch(sample: torch.Tensor, batch_size: int) -> torch.Tensor:
    repeats = -(-batch_size // sample.shape[0])
    return sample.repeat(repeats, *([1] * (sample.dim() - 1)))[:batch_size]


def plan(model: nn.Module, *, memory_budget: int, **planner_args) -> Plan:
    """The fastest plan per sample whose peak memory per rank fits ``memory_budget`` bytes.

    Every rank must call it, with the unsharded ``model`` (it is not modified: every measurement runs
    on a copy). Units are the modules the root calls (containers expanded); the root keeps the rest.
    ``plan(model, memory_budget=b, ...)`` is ``Planner(model, ...).plan(b)``; a :class:`Planner` profiles
    once and plans for any number of budgets.

    1. Profile: for each batch size, root strategy and unit strategy, one training step of the model
       with that root and every unit under that strategy is measured on the actual ranks (memory with
       :class:`rsdp.memory.MemoryTracker`, time with the clock), phase by phase. With ``cost_model``,
       the phases are estimated instead, from a meta-device step and the stated FLOP/s, bandwidth and
       latency, for a cluster of ``cost_model.world_size`` devices; no process group is needed.
    2. Search: a mixed plan is predicted by replaying the measured phases; the search over plans is
       exact for that prediction (see ``_search``), and minimises step time per sample.
    3. Verify (measured plans only): the chosen plan itself is run once (a uniform plan was, in step 1).
       Parallelisms interact at module boundaries in ways a replay of uniform runs does not see (FSDP2
       frees a module's all-gather buffers at the next module's unshard), so the fastest plans (up to
       8) are run: the first that
       fits and whose measured peak is within 10% of its prediction is returned; failing that, the
       first that fits (its table shows prediction and measurement, and a warning says that its
       prediction does not hold); failing that, the fastest that fits of the three plans predicted
       smallest (run) and the uniform plans (measured in step 1).
    4. Never slower than a uniform plan: phase times are noisy, so a uniform plan (measured outright in
       step 1) that fits and ran faster per sample than the chosen plan's verification run wins.

    Args:
        memory_budget: bytes per rank for parameters, optimizer state, gradients, activations and
            every transient buffer of one training step.
        planner_args: :class:`Planner`'s (``sample_input``, ``batch_sizes``, ``loss_fn``, ...).

    Raises:
        ValueError: no plan fits (the message gives the smallest budget that would); a batch size is
            not positive; the default ``loss_fn`` meets a model that does not map token ids to logits.
    """
    return Planner(model, **planner_args).plan(memory_budget)


class Planner:
    """:func:`plan`'s profile and search, made once when the planner is built; :meth:`plan` then
    chooses for a budget. Every rank builds it and calls :meth:`plan` with the same budgets: measured
    plans run collectives (the profile when built, a verification run when a budget needs one).

    Args:
        sample_input: one rank's batch; its first dimension is resized to each of ``batch_sizes``.
        mesh: the ranks the plan trains on (default: every rank, on one dimension).
        batch_sizes: per-rank batch sizes to consider (default: the sample's).
        loss_fn: ``loss_fn(model, batch) -> loss`` (default: next-token cross-entropy on token ids).
        optimizer_fn: builds the optimizer from parameters (its state is part of the budget).
        mp_policy: the mixed precision policy the plan trains with.
        strategies: the strategies a module may take.
        cost_model: estimate for another cluster instead of measuring on this one.
        replicated_in_root: units that are applied inside the root when they are replicated, as
            ``rsdp.torchtitan`` applies a replicated ``lm_head`` (torchtitan's chunked loss cannot call a
            replicate module). Such a plan is counted as it runs: the unit's parameters in a replicate
            root's group, copied when the step starts and their gradients held to the backward's end,
            where the root reduces them (``_cost_model.estimate_root``); its row says it is in the root.
            Cost model only.
        root_strategies: the strategies the root may take (default: every one of ``strategies``), as
            ``rsdp.torchtitan`` makes the root that holds a tied head FSDP or replicate.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        sample_input: torch.Tensor,
        mesh: DeviceMesh | None = None,
        batch_sizes: Sequence[int] | None = None,
        loss_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor] = _next_token_loss,
        optimizer_fn: Callable = torch.optim.AdamW,
        mp_policy: MixedPrecisionPolicy | None = None,
        strategies: Sequence[Strategy] = tuple(Strategy),
        cost_model: CostModel | None = None,
        replicated_in_root: Sequence[str] = (),
        root_strategies: Sequence[Strategy] | None = None,
    ):
        batch_sizes = _checked_batch_sizes(batch_sizes, sample_input)
        root_strategies = _checked_root_strategies(root_strategies, strategies)
        if loss_fn is _next_token_loss:
            _check_next_token_batch(model, sample_input)
        units = find_units(model)
        if not units:
            raise ValueError(f"rsdp.plan: {type(model).__name__} has no submodule with parameters to plan for.")
        in_root = _checked_in_root(replicated_in_root, units, cost_model)
        if cost_model is not None:
            counted, folded = count_steps(model, units, sample_input, batch_sizes, loss_fn, cost_model.param_dtype,
                                          in_root if Strategy.REPLICATE in root_strategies else ())
            self._choice = _EstimatedChoice(counted, units, cost_model, strategies, in_root, folded, root_strategies)
            return
        mesh = mesh or _default_mesh()

        def measure(batch_size: int, assignment: dict[str, Strategy]) -> tuple[dict[str, UnitCost], RootCost, int]:
            batch = _resize_batch(sample_input, batch_size)
            return profile(model, assignment, batch, loss_fn, optimizer_fn, mesh, mp_policy, sample_input.device)

        self._choice = _MeasuredChoice(measure, units, batch_sizes, strategies, mesh.size(), root_strategies)

    def plan(self, memory_budget: int) -> Plan:
        """The fastest plan per sample whose peak memory per rank fits ``memory_budget`` bytes (see
        :func:`plan`)."""
        return dataclasses.replace(self._choice.choose(memory_budget), memory_budget=memory_budget)


def count_steps(
    model: nn.Module, units: list[str], sample_input: torch.Tensor, batch_sizes: Sequence[int], loss_fn: Callable,
    param_dtype: torch.dtype | None, replicated_in_root: Sequence[str] = (),
) -> tuple[dict[int, Counts], dict[int, Counts] | None]:
    """The training step counted on the meta device per batch size (``sample_input`` resized), every unit
    a unit; and with units of ``replicated_in_root``, the same step with them the root's (``None``
    without; ``_cost_model.fold``, from the one count): the step of a replicate root that holds them,
    which a unit replicated inside the root is part of."""
    both = {
        size: count_folded(model, units, _resize_batch(sample_input, size), loss_fn, param_dtype, replicated_in_root)
        for size in batch_sizes
    }
    counted = {size: whole for size, (whole, _) in both.items()}
    return counted, {size: folded for size, (_, folded) in both.items()} if replicated_in_root else None


def _checked_in_root(names: Sequence[str], units: list[str], cost_model: CostModel | None) -> tuple[str, ...]:
    if names and cost_model is None:
        raise ValueError("rsdp.plan: replicated_in_root is counted by the cost model; pass cost_model= or drop replicated_in_root.")
    unknown = [name for name in names if name not in units]
    if unknown:
        raise ValueError(f"rsdp.plan: replicated_in_root names {', '.join(unknown)}, which are not units ({', '.join(units)}); name units.")
    return tuple(names)


def _checked_root_strategies(root_strategies: Sequence[Strategy] | None, strategies: Sequence[Strategy]) -> tuple[Strategy, ...]:
    if root_strategies is None:
        return tuple(strategies)
    if not root_strategies or not set(root_strategies) <= set(strategies):
        raise ValueError(f"rsdp.plan: root_strategies {[s.value for s in root_strategies]} must be some of strategies "
                         f"{[s.value for s in strategies]}; name at least one of those.")
    return tuple(root_strategies)


def _checked_batch_sizes(batch_sizes: Sequence[int] | None, sample_input: torch.Tensor) -> list[int]:
    source = "batch_sizes" if batch_sizes else "sample_input's first dimension"
    batch_sizes = list(batch_sizes or [sample_input.shape[0]])
    if not all(isinstance(size, numbers.Integral) and size > 0 for size in batch_sizes):
        raise ValueError(
            f"rsdp.plan: batch sizes must be positive, got {batch_sizes} from {source}: a plan minimises "
            "the step time per sample, which an empty batch does not have. (A plan, once chosen, also "
            "runs ranks with different or empty batches.)"
        )
    return batch_sizes


@dataclasses.dataclass(frozen=True)
class _Candidate:
    """A plan the search found, with the two numbers plans are compared by."""

    seconds_per_sample: float
    peak: float
    plan: Plan


class _EstimatedChoice:
    """Plans from the cost model's estimates: the fastest predicted to fit is chosen, unverified. rsdp is
    tried in rings of every group size the cost model allows. A unit of ``in_root`` is never a replicate
    unit: replicated, it is part of a replicate root, whose plans are counted from ``folded`` (the step
    counted without those units). The root takes one of ``root_strategies`` (default: ``strategies``)."""

    def __init__(self, counted: dict[int, Counts], units: list[str], cost_model: CostModel, strategies: Sequence[Strategy],
                 in_root: tuple[str, ...] = (), folded: dict[int, Counts] | None = None,
                 root_strategies: Sequence[Strategy] | None = None):
        self._peak_is_reserved = cost_model.peak_is_reserved
        choices = choices_of(strategies, cost_model.ring_group_sizes())
        roots = [c for c in choices if c.strategy in (root_strategies or strategies)]
        world = cost_model.world_size
        found = _found(
            units, list(counted), choices, lambda size, root: _estimated_costs(counted[size], choices, root, cost_model), world,
            roots=roots, not_replicated=in_root,
        )
        if folded is not None:
            kept = [name for name in units if name not in in_root]
            found += _found(
                kept, list(folded), choices, lambda size, root: _estimated_costs(folded[size], choices, root, cost_model), world,
                roots=(Choice(Strategy.REPLICATE),), in_root=in_root,
            )
        self._candidates = _useful(found, units)

    def choose(self, memory_budget: int) -> Plan:
        fitting = [c for c in self._candidates if c.peak <= memory_budget]
        if fitting:
            return self._as_counted(min(fitting, key=lambda c: (c.seconds_per_sample, c.peak)).plan)
        smallest = self._as_counted(min(self._candidates, key=lambda c: c.peak).plan)
        _raise_infeasible(memory_budget, smallest, smallest.predicted_peak_bytes)

    def _as_counted(self, plan_: Plan) -> Plan:
        return dataclasses.replace(plan_, peak_is_reserved=self._peak_is_reserved)


class _MeasuredChoice:
    """Plans from uniform runs measured on the ranks, the chosen one verified by running it (steps 1, 3
    and 4 of :func:`plan`). Verification runs are kept, so a second budget reruns no plan; a uniform
    plan's verification is its profile run (the same plan, batch and step), so it is not run again."""

    def __init__(self, measure: Callable, units: list[str], batch_sizes: list[int], strategies: Sequence[Strategy], world: int,
                 root_strategies: Sequence[Strategy]):
        self._measure = measure
        self._uniform: list[Plan] = []  # every uniform run, as a plan whose numbers are facts
        self._runs: dict[tuple, tuple[int, float]] = {}  # plan key -> measured (peak, seconds)

        def costs(batch_size: int, root: Choice) -> tuple[dict[Choice, dict[str, UnitCost]], RootCost]:
            """Every unit's cost under every strategy, and the root's, with the root under ``root``
            (measured runs use flat rings)."""
            runs = {s: measure(batch_size, {"": root.strategy, **dict.fromkeys(units, s)}) for s in strategies}
            unit_costs, root_cost, peak = runs[root.strategy]
            seconds = sum(c.seconds for c in unit_costs.values()) + root_cost.seconds
            rows = _rows(root, root_cost, [(name, root, cost) for name, cost in unit_costs.items()])
            uniform = Plan(rows, batch_size, world, peak, seconds, 0, verified_peak_bytes=peak, verified_step_seconds=seconds)
            self._uniform.append(uniform)
            self._runs[_key(uniform)] = (peak, seconds)
            return {Choice(s): runs[s][0] for s in strategies}, root_cost

        self._candidates = _useful(_found(units, batch_sizes, choices_of(strategies), costs, world, roots=choices_of(root_strategies)), units)

    def choose(self, memory_budget: int) -> Plan:
        fitting = [c.plan for c in sorted(self._candidates, key=lambda c: (c.seconds_per_sample, c.peak)) if c.peak <= memory_budget]
        unconfirmed = None  # the fastest that fits though running it did not confirm its prediction
        for candidate in map(self._verified, fitting[:MAX_VERIFICATIONS]):
            if candidate.verified_peak_bytes <= memory_budget:
                if _confirmed(candidate):
                    return self._no_slower_than_uniform(candidate, memory_budget)
                unconfirmed = unconfirmed or candidate
        if unconfirmed is not None:
            return _said_if_unconfirmed(self._no_slower_than_uniform(unconfirmed, memory_budget))
        # The plans of least predicted peak, run: several, because plans a few kilobytes apart swap places
        # from run to run (the search keeps the faster of near-equal peaks, and times are noisy), and the
        # budget an error names must be one a second call finds a plan for.
        # The uniform runs are measured plans too: one a mixed plan's low prediction pushed off the
        # candidates may fit where that plan's run did not.
        by_peak = sorted((c.plan for c in self._candidates), key=lambda p: (p.predicted_peak_bytes, _key(p)))
        measured = [self._verified(candidate) for candidate in by_peak[:SMALLEST_VERIFIED]] + self._uniform
        fits = [p for p in measured if p.verified_peak_bytes <= memory_budget]
        if fits:
            return _said_if_unconfirmed(min(fits, key=lambda p: p.verified_step_seconds / p.batch_size))
        needed = min(measured, key=lambda p: max(p.predicted_peak_bytes, p.verified_peak_bytes))
        _raise_infeasible(memory_budget, needed, max(needed.predicted_peak_bytes, needed.verified_peak_bytes))

    def _verified(self, candidate: Plan) -> Plan:
        if _key(candidate) not in self._runs:
            unit_costs, root, peak = self._measure(candidate.batch_size, candidate.strategies)
            self._runs[_key(candidate)] = (peak, sum(c.seconds for c in unit_costs.values()) + root.seconds)
        peak, seconds = self._runs[_key(candidate)]
        return dataclasses.replace(candidate, verified_peak_bytes=peak, verified_step_seconds=seconds)

    def _no_slower_than_uniform(self, chosen: Plan, memory_budget: int) -> Plan:
        """Phase times are noisy; a uniform plan that fits and ran faster per sample wins."""
        best = chosen
        for uniform in self._uniform:
            per_sample = uniform.verified_step_seconds / uniform.batch_size
            if uniform.verified_peak_bytes <= memory_budget and per_sample < best.verified_step_seconds / best.batch_size:
                best = uniform
        return best


def _estimated_costs(counts: Counts, choices: Sequence[Choice], root: Choice, cost_model: CostModel):
    return (
        {c: estimate_units(counts, c.strategy, root.strategy, cost_model, c.ring_group_size) for c in choices},
        estimate_root(counts, root.strategy, cost_model, root.ring_group_size),
    )


def _found(
    units: list[str], batch_sizes, choices: Sequence[Choice], costs: Callable, world: int, *,
    roots: Sequence[Choice] | None = None, not_replicated: Sequence[str] = (), in_root: tuple[str, ...] = (),
) -> list["_Found"]:
    """The search's plans and the uniform ones per (batch size, root choice: each of ``roots``, default
    every choice), with their exact peaks; the units of ``not_replicated`` take every choice but
    replicate, and those of ``in_root`` (not among ``units``) are the root's."""
    found = []
    # The units' costs depend on the root's strategy only through whether it rotates (the cost model's
    # FSDP and replicate roots give the same ones): a search already made is reused.
    frontiers: dict[tuple, Frontier] = {}
    for batch_size in batch_sizes:
        for root_choice in roots or choices:
            by_choice, root = costs(batch_size, root_choice)
            unit_costs = [
                {c: by_choice[c][name] for c in choices if not (name in not_replicated and c.strategy is Strategy.REPLICATE)}
                for name in units
            ]
            if not all(unit_costs):  # a unit with no choice left (replicate alone, and it must not be)
                continue
            searched = tuple(tuple(options.items()) for options in unit_costs)
            if searched not in frontiers:
                frontiers[searched] = _search(unit_costs)
            frontier = frontiers[searched]
            peaks = predicted_peak(frontier.partial, root).tolist()
            per_sample = ((frontier.partial.seconds + root.seconds) / (batch_size * world)).tolist()
            found += [
                _Found(seconds, peak, frontier, row, root_choice, root, batch_size, units, unit_costs, in_root, world)
                for row, (seconds, peak) in enumerate(zip(per_sample, peaks))
            ]
    return found


def _useful(found: list["_Found"], units: list[str]) -> list[_Candidate]:
    """Of the plans ``found``, those faster per sample than every plan of smaller or equal peak, each
    with its rows in the order of ``units``."""
    useful, fastest = [], math.inf
    for f in sorted(found, key=lambda f: (f.peak, f.seconds_per_sample)):
        if f.seconds_per_sample < fastest:
            chosen = f.frontier.assignment(f.row)
            assignments = [(name, s, costs[s]) for name, s, costs in zip(f.units, chosen, f.unit_costs)]
            rows = _rows(f.root_choice, f.root, assignments, f.in_root, units)
            plan_ = Plan(rows, f.batch_size, f.world, int(f.peak), f.seconds_per_sample * f.batch_size * f.world, 0)
            useful.append(_Candidate(f.seconds_per_sample, f.peak, plan_))
            fastest = f.seconds_per_sample
    return useful


class _Found(NamedTuple):
    """A plan the search found (row ``row`` of ``frontier``), before it is known to be worth building."""

    seconds_per_sample: float
    peak: float
    frontier: Frontier
    row: int
    root_choice: Choice
    root: RootCost
    batch_size: int
    units: list[str]  # the units searched (``unit_costs``' order)
    unit_costs: list[dict[Choice, UnitCost]]
    in_root: tuple[str, ...]  # units replicated inside the root
    world: int


def plan_from_counts(
    counted: dict[int, Counts], units: list[str], *, memory_budget: int, cost_model: CostModel,
    strategies: Sequence[Strategy] = tuple(Strategy), replicated_in_root: Sequence[str] = (),
    folded: dict[int, Counts] | None = None, root_strategies: Sequence[Strategy] | None = None,
) -> Plan:
    """:func:`plan` with a cost model, from meta-device counts already made (batch size -> counts;
    ``replicated_in_root`` and ``root_strategies`` as :class:`Planner`'s, with ``folded`` the step
    counted without those units, as :func:`count_steps` gives both)."""
    in_root = _checked_in_root(replicated_in_root, units, cost_model)
    root_strategies = _checked_root_strategies(root_strategies, strategies)
    if in_root and Strategy.REPLICATE in root_strategies and folded is None:
        raise ValueError("rsdp.plan: plan_from_counts with replicated_in_root needs folded=, the step counted without "
                         "those units (count_steps gives both).")
    chosen = _EstimatedChoice(counted, units, cost_model, strategies, in_root,
                              folded if Strategy.REPLICATE in root_strategies else None, root_strategies)
    return dataclasses.replace(chosen.choose(memory_budget), memory_budget=memory_budget)


def predict_uniform(counts: Counts, units: list[str], strategy: Strategy, cost_model: CostModel,
                    ring_group_size: int = 1) -> tuple[float, float]:
    """Predicted peak bytes per device and step seconds of ``strategy`` everywhere, root included (rsdp:
    in rings of groups of ``ring_group_size``)."""
    names = ["", *units]
    return predict_policy(counts, units, dict.fromkeys(names, strategy), cost_model, dict.fromkeys(names, ring_group_size))


def predict_policy(counts: Counts, units: list[str], policy: dict[str, Strategy], cost_model: CostModel,
                   ring_group_sizes: dict[str, int] | None = None) -> tuple[float, float]:
    """Predicted peak bytes per device and step seconds of one plan (``policy``: a strategy per unit and
    for the root ``""``; ``ring_group_sizes``: rsdp's group size per unit, default 1), walked unit by unit
    from the cost model's exact figures, as the search reports it."""
    sizes = ring_group_sizes or {}
    chosen = {name: Choice(strategy, sizes.get(name, 1) if strategy is Strategy.RSDP else 1) for name, strategy in policy.items()}
    by_choice, root = _estimated_costs(counts, tuple(set(chosen.values())), chosen[""], cost_model)
    partial = EMPTY
    for name in reversed(units):
        partial = partial.extend(by_choice[chosen[name]][name])
    return predicted_peak(partial, root).item(), partial.seconds.item() + root.seconds


def _said_if_unconfirmed(chosen: Plan) -> Plan:
    """``chosen``, with a warning when running it did not confirm its predicted peak (step 4's last
    resorts): a plan the planner returns holds its prediction, or the planner says so."""
    if not _confirmed(chosen):
        warnings.warn(
            f"rsdp.plan: no plan verified confirmed its predicted peak within {PREDICTION_TOLERANCE:.0%}; the plan "
            f"returned ({_summary(chosen)}, batch size {chosen.batch_size}) fits the budget as run, "
            f"{chosen.verified_peak_bytes / MiB:.2f} MiB measured against {chosen.predicted_peak_bytes / MiB:.2f} MiB "
            "predicted: budget with the measured figure (Plan.verified_peak_bytes).",
            stacklevel=3,
        )
    return chosen


def _confirmed(candidate: Plan) -> bool:
    error = abs(candidate.verified_peak_bytes - candidate.predicted_peak_bytes)
    return error <= PREDICTION_TOLERANCE * candidate.predicted_peak_bytes


def _key(plan_: Plan) -> tuple:
    return (plan_.batch_size, tuple(plan_.strategies.items()), tuple(plan_.ring_group_sizes.items()))


class NoPlanFits(ValueError):
    """No plan fits the budget: ``needed_bytes`` is the smallest budget that fits, ``smallest`` that plan."""

    def __init__(self, message: str, needed_bytes: int, smallest: Plan):
        super().__init__(message)
        self.needed_bytes, self.smallest = needed_bytes, smallest


def _raise_infeasible(budget: int, smallest: Plan, needed: int) -> None:
    counted = " (reserved by the caching allocator, as the cost model's hardware counts it)" if smallest.peak_is_reserved else ""
    raise NoPlanFits(
        f"rsdp.plan: no plan fits {budget / MiB:.2f} MiB per rank{counted}; the smallest budget that fits is "
        f"{needed / MiB:.2f} MiB ({needed} bytes, batch size {smallest.batch_size} per rank: {_summary(smallest)}).",
        needed, smallest,
    )


def _summary(plan_: Plan) -> str:
    """A plan's strategies in a few words: the root's, and how many modules take each."""
    modules = collections.Counter(s.value for name, s in plan_.strategies.items() if name)
    per_strategy = ", ".join(f"{number} {strategy}" for strategy, number in modules.most_common())
    return f"root {plan_.strategies[''].value}, modules {per_strategy}" if modules else f"root {plan_.strategies[''].value}"


def _search(unit_costs: list[dict[Choice, UnitCost]]) -> Frontier:
    """The search's plans and the uniform ones, with exact figures.

    The search's grid starts at a fraction of what the smallest choice of every unit holds, not of the
    budget: the plans found and their predicted peaks are then the same whatever the budget, so a
    budget that an infeasible call names is one a second call finds that plan for. The uniform plans
    are there whatever the grid let the search find: a budget a uniform plan fits gets a plan no
    slower than it.
    """
    smallest = sum(
        min(cost.static_bytes + max(cost.forward.peak, cost.forward.delta + cost.backward.peak, 0) for cost in options.values())
        for options in unit_costs
    )
    return pareto_plans(unit_costs, max(1, smallest // SEARCH_GRID_STEPS)).joined(uniform_plans(unit_costs))


def _rows(root_choice: Choice, root: RootCost, assignments: list[tuple[str, Choice, UnitCost]], in_root: tuple[str, ...] = (),
          units: list[str] | None = None) -> tuple[PlanRow, ...]:
    """The root's row, then the units' in the order of ``units`` (default: ``assignments``'), those of
    ``in_root`` replicated inside the root."""
    rows = [PlanRow(name, c.strategy, cost.static_bytes, cost.forward.delta, cost.seconds, c.ring_group_size)
            for name, c, cost in assignments]
    rows += [PlanRow(name, Strategy.REPLICATE, 0, 0, 0.0, in_root=True) for name in in_root]
    order = {name: index for index, name in enumerate(units or [row.module for row in rows])}
    root_row = PlanRow("", root_choice.strategy, root.static_bytes, root.before.delta + root.middle.delta, root.seconds,
                       root_choice.ring_group_size)
    return (root_row, *sorted(rows, key=lambda row: order[row.module]))
