"""Check ``rsdp.plan`` on the benchmark model, measuring everything on the ranks:

1. for three budgets, the planned model's measured peak stays under the budget and within 10% of the
   planner's prediction;
2. under the budget at which FSDP everywhere just fits batch ``--batch_size``, the plan's measured
   throughput per sample is at least FSDP's (both timed in the same run, alternating).

    python benchmarks/rtp/planner_check.py --use_synthetic_data --nproc 4 --vocab_size 8192 --ninp 512 \\
        --nhid 2048 --nhead 8 --num_decoder_layers 2 --seq_len 64 --batch_size 2
"""

import copy
import time

import torch
import torch.distributed as dist

import common
from rsdp import Strategy, parallelize, plan
from rsdp.planner import measure_peak
from rsdp.planner._profile import find_units
from rsdp.planner._models import sequence_first_loss
from transformer_lm import TransformerLM

MiB = 2**20


def _train_step(model, optimizer, batch) -> None:
    sequence_first_loss(model, batch).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def samples_per_second(models: dict, batches: dict, rounds: int) -> dict[str, float]:
    """Throughput of each model, timed in alternation so that outside load hits all alike."""
    optimizers = {name: torch.optim.AdamW(m.parameters()) for name, m in models.items()}
    seconds = dict.fromkeys(models, 0.0)
    for round_ in range(rounds + 1):
        for name, model in models.items():
            dist.barrier()
            start = time.perf_counter()
            _train_step(model, optimizers[name], batches[name])
            dist.barrier()
            if round_:  # the first round is warm-up
                seconds[name] += time.perf_counter() - start
    world = dist.get_world_size()
    return {name: rounds * batches[name].shape[0] * world / seconds[name] for name in models}


def check(worker: common.Worker) -> None:
    args = worker.args
    torch.manual_seed(0)
    model = TransformerLM(args.vocab_size, args.ninp, args.nhead, args.nhid, args.num_decoder_layers, max_len=args.seq_len)
    tokens = torch.randint(args.vocab_size, (4 * args.batch_size, args.seq_len + 1), generator=torch.Generator().manual_seed(1))
    batch = tokens[: args.batch_size]
    fsdp_everywhere = {"": Strategy.FSDP, **dict.fromkeys(find_units(model), Strategy.FSDP)}
    fsdp_peak = measure_peak(parallelize(copy.deepcopy(model), fsdp_everywhere), batch, sequence_first_loss)
    say = print if worker.rank == 0 else (lambda *a, **k: None)
    say(f"FSDP everywhere, batch {args.batch_size}: measured peak {fsdp_peak / MiB:.2f} MiB\n")

    say("| budget | plan | batch | predicted peak | measured peak | measured / predicted | fits |")
    say("| --- | --- | --- | --- | --- | --- | --- |")
    plans = {}
    for factor in (1.5, 1.0, 0.8):
        budget = int(fsdp_peak * factor)
        try:
            chosen = plan(model, memory_budget=budget, sample_input=batch, batch_sizes=[args.batch_size, 2 * args.batch_size], loss_fn=sequence_first_loss)
        except ValueError as infeasible:
            say(f"| {budget / MiB:.2f} MiB | {infeasible} | | | | | |")
            continue
        plans[factor] = chosen
        peak = measure_peak(parallelize(copy.deepcopy(model), chosen), tokens[: chosen.batch_size], sequence_first_loss)
        assignment = ", ".join(f"{name or 'root'}={s.value}" for name, s in chosen.strategies.items())
        say(
            f"| {budget / MiB:.2f} MiB | {assignment} | {chosen.batch_size} | {chosen.predicted_peak_bytes / MiB:.2f} MiB | "
            f"{peak / MiB:.2f} MiB | {peak / chosen.predicted_peak_bytes:.3f} | {'yes' if peak <= budget else 'NO'} |"
        )

    chosen = plans[1.0]
    throughput = samples_per_second(
        {"fsdp": parallelize(copy.deepcopy(model), fsdp_everywhere), "plan": parallelize(copy.deepcopy(model), chosen)},
        {"fsdp": batch, "plan": tokens[: chosen.batch_size]},
        rounds=args.max_batch,
    )
    say(
        f"\nAt the budget where FSDP everywhere fits batch {args.batch_size} ({fsdp_peak / MiB:.2f} MiB): "
        f"FSDP {throughput['fsdp']:.2f} samples/s, plan {throughput['plan']:.2f} samples/s "
        f"(batch {chosen.batch_size}), ratio {throughput['plan'] / throughput['fsdp']:.2f}"
    )


if __name__ == "__main__":
    parser = common.build_parser(__doc__.split("\n\n")[0])
    common.launch(check, common.parse_args(parser))
