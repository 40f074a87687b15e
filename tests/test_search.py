"""The planner's search on models whose units differ in size by orders of magnitude: the peak a plan
reports is its exact one, a budget any uniform plan fits gets a plan no slower than it, and the work the
search does stays within counts that keep planning a 70B model to seconds."""

import re

import pytest
import torch

from rsdp import CostModel, Strategy
from rsdp.planner import _search
from rsdp.planner._cost_model import count, estimate_units
from rsdp.planner._plan import _EstimatedChoice, _next_token_loss, predict_policy, predict_uniform
from rsdp.planner._profile import find_units
from rsdp.planner._search import EMPTY, MAX_PARTIALS, pareto_plans
from test_planner import untied_lm

# An embedding and a head of 50000 x 32, 40 blocks of about 8000 parameters, a norm of 64: each size
# two orders of magnitude from the next.
LAYERS, BATCH_SIZES = 40, (1, 4)
CLUSTER = CostModel(64, flops_per_s=300e12, bandwidth_bytes_per_s=100e9, latency_s=10e-6)


@pytest.fixture(scope="module")
def counted():
    model = untied_lm(vocab=50000, dim=32, hidden=64, layers=LAYERS)
    units = find_units(model)
    tokens = torch.zeros(1, 65, dtype=torch.long)
    return units, {size: count(model, units, tokens.expand(size, -1), _next_token_loss) for size in BATCH_SIZES}


@pytest.fixture(scope="module")
def searched(counted):
    """The search made once, and for each unit it walked, how many partial plans it compared and how
    many it kept. ``choose(budget)`` then picks among its plans, as ``Planner.plan`` does."""
    units, by_size = counted
    compared = []
    non_dominated = _search._non_dominated

    def counting(keys):
        kept = non_dominated(keys)
        compared.append((len(keys), len(kept)))
        return kept

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_search, "_non_dominated", counting)
        return _EstimatedChoice(by_size, units, CLUSTER, tuple(Strategy)), compared


@pytest.fixture(scope="module")
def planner(searched):
    return searched[0]


def exact_peak(counts, units: list[str], strategies: dict[str, Strategy]) -> int:
    """The plan's peak walked unit by unit from the cost model's unrounded figures."""
    return int(predict_policy(counts, units, strategies, CLUSTER)[0])


def test_a_plan_reports_its_exact_peak_and_a_uniform_plans_budget_finds_one_no_slower(counted, planner):
    units, by_size = counted
    parts = by_size[1].units
    embedding, block, norm = (parts[name].param_bytes for name in ("embed", "layers.0", "norm"))
    assert embedding > 100 * block > 100 * 100 * norm
    for size, counts in by_size.items():
        for strategy in Strategy:
            peak, seconds = predict_uniform(counts, units, strategy, CLUSTER)
            budget = int(peak)  # exactly the uniform plan's peak: no slack for rounding
            chosen = planner.choose(budget)
            assert chosen.predicted_peak_bytes == exact_peak(by_size[chosen.batch_size], units, chosen.strategies)
            assert chosen.predicted_peak_bytes <= budget
            per_sample = chosen.predicted_step_seconds / chosen.batch_size
            assert per_sample <= seconds / size * (1 + 1e-12), (size, strategy)


def test_the_smallest_budget_an_infeasible_call_names_finds_that_plan(counted, planner):
    units, by_size = counted
    with pytest.raises(ValueError, match="smallest budget that fits") as refused:
        planner.choose(1)
    needed = int(re.search(r"\(([0-9]+) bytes", str(refused.value)).group(1))
    chosen = planner.choose(needed)
    assert chosen.predicted_peak_bytes == needed == exact_peak(by_size[chosen.batch_size], units, chosen.strategies)


def test_every_kept_plan_carries_its_exact_figures_whatever_the_grid(counted):
    """A frontier squeezed to a few plans (its grid doubled many times) still holds, for every plan,
    the figures walking its choices gives."""
    units, by_size = counted
    options = [{s: estimate_units(by_size[1], s, Strategy.FSDP, CLUSTER)[name] for s in Strategy} for name in units]
    frontier = pareto_plans(options, max_partials=8)
    assert 1 < len(frontier.choices) <= 8
    for row in range(len(frontier.choices)):
        partial = EMPTY
        for choice, costs in reversed(list(zip(frontier.assignment(row), options))):
            partial = partial.extend(costs[choice])
        assert torch.equal(partial.stacked()[0], frontier.partial.stacked()[row])


def test_search_work_is_bounded(counted, searched):
    """Planning time, pinned by counts: per batch size two searches (the rotating root's unit costs
    differ), each comparing at most the extensions of the plans it kept per unit, and the grid doubling
    a bounded number of times in all."""
    units, _ = counted
    compared = searched[1]
    searches = 2 * len(BATCH_SIZES)
    doublings = len(compared) - searches * len(units)
    assert 0 <= doublings <= 64 * searches, compared
    assert max(rows for rows, _ in compared) <= len(Strategy) * MAX_PARTIALS
    assert max(kept for _, kept in compared) >= MAX_PARTIALS // 4  # the frontier is not trivially small
