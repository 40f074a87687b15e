"""The planner: exact search, predictions against measured peaks, budgets, and plans that train."""

import copy
import itertools

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from models import TinyLM, twin
from rsdp import CostModel, Strategy, parallelize, plan
from rsdp.planner._plan import _next_token_loss
from rsdp.planner import measure_peak
from rsdp.planner._cost_model import count
from rsdp.planner._profile import Phase, RootCost, UnitCost, find_units
from rsdp.planner._search import Partial, pareto_plans, predicted_peak
from test_training import train_and_compare

MiB = 2**20

phases = st.builds(Phase, st.integers(-50, 50), st.integers(0, 80), st.floats(0.1, 5.0))
unit_costs = st.builds(UnitCost, st.integers(0, 60), phases, phases, st.floats(0.0, 1.0))
roots = st.builds(RootCost, st.integers(0, 30), phases, phases, phases, st.floats(0.0, 1.0))


def brute_force_best(options, root, budget):
    best = None
    for choice in itertools.product(*(list(o.items()) for o in options)):
        partial = Partial(float("-inf"), 0.0, float("-inf"), 0.0, 0.0, 0.0, ())
        for strategy, cost in reversed(choice):
            partial = partial.extend(strategy, cost)
        if predicted_peak(partial, root) <= budget and (best is None or partial.seconds < best):
            best = partial.seconds
    return best


def exactness_case(options, root, budget):
    fitting = [p.seconds for p in pareto_plans(options) if predicted_peak(p, root) <= budget]
    expected = brute_force_best(options, root, budget)
    assert (min(fitting) if fitting else None) == pytest.approx(expected)


@given(
    options=st.lists(st.dictionaries(st.sampled_from(list(Strategy)), unit_costs, min_size=1), min_size=1, max_size=5),
    root=roots,
    budget=st.integers(0, 400),
)
def test_search_is_exact(ranks, options, root, budget):
    """The dominance-pruned search finds the fastest fitting plan that enumerating all plans finds."""
    ranks.run(1, exactness_case, options, root, budget)


def cost_model_case():
    """Plans for clusters this machine cannot run, from a meta-device step and a cost model."""
    model = TinyLM(vocab=32000, dim=256, heads=4, hidden=1024, layers=6)
    tokens = torch.randint(0, 32000, (1, 256))
    for world in (8, 1024):
        cluster = CostModel(world, flops_per_s=300e12, bandwidth_bytes_per_s=100e9, latency_s=10e-6)
        plans = [
            plan(model, memory_budget=budget * MiB, sample_input=tokens, batch_sizes=[1, 4], cost_model=cluster)
            for budget in (1000, 400, 200)
        ]
        per_sample = [p.predicted_step_seconds / (p.batch_size * world) for p in plans]
        assert per_sample == sorted(per_sample), "a larger budget gave a slower plan"
        assert all(p.predicted_peak_bytes <= p.memory_budget and p.verified_peak_bytes is None for p in plans)
        assert set(plans[0].strategies.values()) != {Strategy.RSDP}  # plenty of memory: not the lightest
        with pytest.raises(ValueError, match="smallest budget that fits"):
            plan(model, memory_budget=MiB, sample_input=tokens, cost_model=cluster)


def test_cost_model_plans_for_8_and_1024_gpus(ranks):
    ranks.run(1, cost_model_case)


def test_cost_model_counts_saved_activations_not_parameters():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    per_unit, _, _ = count(model, ["0", "1"], torch.zeros(3, 8), lambda m, x: m(x).sum())
    # Each Linear saves its input for the weight gradient; the weight it also saves is a parameter.
    assert (per_unit["0"].saved_bytes, per_unit["1"].saved_bytes) == (3 * 8 * 4, 3 * 16 * 4)


def test_units_keep_tied_modules_with_the_root():
    model = TinyLM(layers=2)  # embed and lm_head share their weight
    assert find_units(model) == ["layers.0", "layers.1", "norm"]


def lm():
    torch.manual_seed(0)
    return TinyLM(vocab=512, dim=64, heads=4, hidden=256, layers=4)


def budgets_case(budgets_mib):
    model, tokens = lm(), torch.randint(0, 512, (4, 32))
    results = []
    for budget in budgets_mib:
        chosen = plan(model, memory_budget=int(budget * MiB), sample_input=tokens)
        peak = measure_peak(parallelize(copy.deepcopy(model), chosen), tokens[: chosen.batch_size], _next_token_loss)
        results.append((budget, chosen.predicted_peak_bytes, peak, str(chosen)))
    return results


def test_planned_peak_fits_budget_and_prediction_on_4_ranks(ranks):
    for budget, predicted, measured, table in ranks.run(4, budgets_case, [8.0, 4.0, 3.6])[0]:
        print(f"budget {budget} MiB: predicted {predicted / MiB:.3f} MiB, measured {measured / MiB:.3f} MiB\n{table}")
        assert measured <= budget * MiB, table
        assert abs(measured - predicted) <= 0.1 * predicted, table


def infeasible_case():
    model, tokens = lm(), torch.randint(0, 512, (4, 32))
    with pytest.raises(ValueError, match="smallest budget that fits is") as error:
        plan(model, memory_budget=MiB, sample_input=tokens)
    smallest = int(str(error.value).split("(")[1].split(" bytes")[0])
    assert plan(model, memory_budget=smallest, sample_input=tokens).verified_peak_bytes <= smallest


def test_infeasible_budget_names_the_smallest_that_fits(ranks):
    ranks.run(2, infeasible_case)


def planned_training_case():
    """A plan is a policy: the planned model trains like the single-process reference, and larger
    batches are considered."""
    model = TinyLM(vocab=31, dim=8, heads=2, hidden=12, layers=3).double()
    reference = twin(model)
    chosen = plan(model, memory_budget=64 * MiB, sample_input=torch.randint(0, 31, (1, 6)), batch_sizes=[1, 2])
    assert set(chosen.strategies) == {"", "layers.0", "layers.1", "layers.2", "norm"}
    assert chosen.batch_size in (1, 2) and "(root)" in str(chosen)
    train_and_compare(parallelize(model, chosen), reference, steps=2, rows=1, seq=5)


def test_plan_trains_like_reference(ranks):
    ranks.run(2, planned_training_case)


def cli_case():
    import contextlib
    import io

    from rsdp.planner.cli import main, parse_bytes

    assert parse_bytes("1.5GiB") == 3 * 2**29 and parse_bytes("2048") == 2048
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["plan", "--budget", "64MiB", "--world-size", "64", "--vocab_size", "2048", "--ninp", "128",
              "--nhid", "256", "--nhead", "4", "--num_decoder_layers", "2", "--seq_len", "32", "--batch-sizes", "1", "2"])
    with pytest.raises(SystemExit, match="smallest budget that fits"):
        main(["plan", "--budget", "1KiB", "--vocab_size", "2048", "--ninp", "128", "--nhid", "256", "--nhead", "4",
              "--num_decoder_layers", "2", "--seq_len", "32"])
    return out.getvalue()


def test_rsdp_plan_command(ranks):
    printed = ranks.run(1, cli_case)[0]
    assert "plan for 64 devices (cost model)" in printed and "| layers.1 |" in printed, printed
