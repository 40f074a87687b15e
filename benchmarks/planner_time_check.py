"""The cost model's step time against a measured one, on CPU ranks (gloo), for each strategy everywhere.

The model is the planner's benchmark LM (``rsdp plan --model benchmark``'s shape flags). For each of
FSDP, rsdp and replicate applied to every unit and the root, it times forward + backward (what the cost
model's step time covers; the optimizer step is timed beside it, since the model leaves it out) over
``--rounds`` rounds of ``--steps`` steps, the strategies alternating within each round (timings on a
shared machine drift), the median round per strategy, slowest rank; and prints it beside
``predict_uniform``'s step time under the profile given (``rsdp calibrate`` writes one), with
``/proc/loadavg`` before and after.

    torchrun --nproc-per-node 2 -m rsdp calibrate --model benchmark ... --out profile.json
    python benchmarks/planner_time_check.py --nproc 2 --hardware profile.json ...   # the same shape flags
    python benchmarks/planner_time_check.py ... --profile    # and where each strategy's time goes

``--profile`` runs one more round per strategy under ``torch.profiler`` and prints, per strategy, rank
0's time per step by kind: GEMMs, copies and fills (memory traffic the cost model does not count), and
communication (the collectives' and ring functions' own time, which is mostly waiting on gloo).
"""

import argparse
import copy
import os
import statistics
import time

import torch
import torch.distributed as dist

from forked_ranks import run_ranks
from rsdp import Strategy, parallelize
from rsdp.planner import _hardware, _models
from rsdp.planner._cost_model import count
from rsdp.planner._plan import predict_uniform
from rsdp.planner._profile import find_units

STRATEGIES = (Strategy.FSDP, Strategy.RSDP, Strategy.REPLICATE)


def _model(args):
    return _models._benchmark_model(args.vocab_size, args.ninp, args.nhid, args.nhead, args.num_decoder_layers, args.seq_len)


def _rank(rank: int, args: argparse.Namespace, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.nproc))
    dist.init_process_group("gloo", rank=rank, world_size=args.nproc)
    model, loss_fn = _model(args)
    units = find_units(model)
    torch.manual_seed(rank)
    batch = torch.randint(args.vocab_size, (args.batch_size, args.seq_len + 1))
    runs = {}
    for strategy in STRATEGIES:
        sharded = parallelize(copy.deepcopy(model), {name: strategy for name in units}, default=strategy)
        runs[strategy] = (sharded, torch.optim.AdamW(sharded.parameters(), lr=1e-4))
    times = {strategy: {"step": [], "optimizer": []} for strategy in STRATEGIES}
    for round_index in range(args.rounds + 1):  # round 0 warms up
        for strategy, (sharded, optimizer) in runs.items():
            step = optimizer_time = 0.0
            for _ in range(args.steps):
                dist.barrier()
                start = time.perf_counter()
                loss_fn(sharded, batch).backward()
                middle = time.perf_counter()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                step += middle - start
                optimizer_time += time.perf_counter() - middle
            slowest = torch.tensor([step, optimizer_time], dtype=torch.float64) / args.steps
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            if round_index:
                times[strategy]["step"].append(slowest[0].item())
                times[strategy]["optimizer"].append(slowest[1].item())
    if rank == 0:
        results.put(times)
    if args.profile:
        breakdown = {strategy: _profiled(*runs[strategy], loss_fn, batch, args.steps) for strategy in STRATEGIES}
        if rank == 0:
            results.put(breakdown)
    dist.destroy_process_group()


# Rank 0's self time per step, by kind of op (names as torch.profiler reports them).
KINDS = {
    "GEMMs": ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm"),
    "copies and fills": ("aten::copy_", "aten::cat", "aten::fill_", "aten::zero_", "aten::div_", "aten::_chunk_cat"),
    "collectives, ring ops, hooks": ("FSDP::", "rsdp::", "c10d::", "gloo:"),
}


def _profiled(sharded, optimizer, loss_fn, batch, steps: int) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            loss_fn(sharded, batch).backward()
            optimizer.zero_grad(set_to_none=True)
    totals = dict.fromkeys([*KINDS, "other"], 0.0)
    for event in prof.key_averages():
        kind = next((k for k, prefixes in KINDS.items() if event.key.startswith(prefixes)), "other")
        totals[kind] += event.self_cpu_time_total / 1e6 / steps
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--hardware", required=True, help="a preset or a profile JSON (rsdp calibrate)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="per strategy and round")
    parser.add_argument("--batch-size", type=int, default=2, help="per rank")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--profile", action="store_true", help="also print where each strategy's step time goes")
    for name, default in (("vocab_size", 8192), ("ninp", 512), ("nhid", 2048), ("nhead", 8), ("num_decoder_layers", 2)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args()

    model, loss_fn = _model(args)
    units = find_units(model)
    counts = count(model, units, torch.zeros(args.batch_size, args.seq_len + 1, dtype=torch.long), loss_fn)
    cost_model = _hardware.load(args.hardware).cost_model(args.nproc)
    predicted = {strategy: predict_uniform(counts, units, strategy, cost_model)[1] for strategy in STRATEGIES}

    reports, before, after = run_ranks(args.nproc, _rank, args, reports=2 if args.profile else 1)
    times = reports[0]
    print(f"{args.nproc} gloo ranks, benchmark LM vocab {args.vocab_size}, ninp {args.ninp}, nhid {args.nhid}, "
          f"nhead {args.nhead}, {args.num_decoder_layers} layers, batch {args.batch_size} x {args.seq_len} per rank; "
          f"profile {args.hardware}; {args.rounds} rounds x {args.steps} steps, alternating; loadavg {before} -> {after}")
    print("| strategy | predicted ms | measured forward+backward ms (median; rounds) | measured / predicted | optimizer step ms |")
    print("| --- | --- | --- | --- | --- |")
    for strategy in STRATEGIES:
        rounds = times[strategy]["step"]
        measured = statistics.median(rounds)
        print(f"| {strategy.value} | {predicted[strategy] * 1e3:.1f} | {measured * 1e3:.1f} "
              f"({', '.join(f'{t * 1e3:.1f}' for t in rounds)}) | {measured / predicted[strategy]:.2f} | "
              f"{statistics.median(times[strategy]['optimizer']) * 1e3:.1f} |")
    if args.profile:
        kinds = list(reports[1][STRATEGIES[0]])
        print(f"\nrank 0's self time per forward+backward step under torch.profiler, ms\n| strategy | {' | '.join(kinds)} |")
        print("| --- |" + " --- |" * len(kinds))
        for strategy, totals in reports[1].items():
            print(f"| {strategy.value} | " + " | ".join(f"{totals[k] * 1e3:.1f}" for k in kinds) + " |")


if __name__ == "__main__":
    main()
