"""What one small message costs on CPU ranks with gloo: a ring exchange against the collectives.

rsdp's step is a sequence of ring exchanges (one send down, one receive from up) and, for the vectors
(norm weights, biases), collectives. At small batch their cost is latency, not bytes, and on gloo a
collective is several rounds of messages run on a worker thread, so rsdp issues the vectors' all-gather
and reduce-scatter once per pass for the whole model rather than once per module (docs/design.md). This
measures the figures behind that choice: each op ``--ops`` times per round, the ops alternating over
``--repeats`` rounds, the median per op in ms, and ``/proc/loadavg`` before and after.

It also shows why a ring keeps an exchange's works referenced until the next exchange has been waited
for (``rsdp._fully_shard._ring.WaitedWorks``): "ring exchange" is rsdp's, "ring exchange, works dropped
at once" drops them right after ``wait()``, whose gloo buffers then spin in their destructors until
gloo's event-loop thread lets go of them. The system CPU time per op, summed over the ranks
(``getrusage``), is the cost that shows on ranks that share cores.

    python benchmarks/collective_latency.py                 # 4 ranks, 1 KB
    python benchmarks/collective_latency.py --nproc 2 --bytes 131072
"""

import argparse
import os
import resource
import statistics
import time

import torch
import torch.distributed as dist

from forked_ranks import run_ranks
from rsdp._compat import all_gather_flat, reduce_scatter_flat, send_and_receive
from rsdp._fully_shard._ring import WaitedWorks, wait_for


def _rank(rank: int, args: argparse.Namespace, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.nproc)
    world, group = args.nproc, dist.group.WORLD
    mine = torch.zeros(args.bytes // 4)
    received, full = torch.zeros_like(mine), torch.zeros(mine.numel() * world)

    kept = WaitedWorks()

    def start_exchange() -> list:
        return send_and_receive(group, mine, (rank - 1) % world, received, (rank + 1) % world, 0)

    def exchange_dropping_works():
        for work in start_exchange():
            work.wait()

    ops = {
        "ring exchange": lambda: wait_for(start_exchange(), kept),
        "ring exchange, works dropped at once": exchange_dropping_works,
        "all-gather": lambda: all_gather_flat(full, mine),
        "reduce-scatter": lambda: reduce_scatter_flat(mine, full),
        "all-reduce": lambda: dist.all_reduce(mine),
    }
    times = {name: [] for name in ops}
    system = {name: [] for name in ops}
    for _ in range(args.repeats):
        for name, op in ops.items():
            dist.barrier()
            start, start_system = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_stime
            for _ in range(args.ops):
                op()
            times[name].append((time.perf_counter() - start) / args.ops * 1e3)
            system[name].append((resource.getrusage(resource.RUSAGE_SELF).ru_stime - start_system) / args.ops * 1e3)
    kept.clear()
    results.put((rank, times, system))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--bytes", type=int, default=1024, help="per rank and message")
    parser.add_argument("--ops", type=int, default=100, help="of each op per round")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; the ops alternate within each")
    args = parser.parse_args()
    reports, before, after = run_ranks(args.nproc, _rank, args, reports=args.nproc)
    by_rank = {rank: (times, system) for rank, times, system in reports}
    times = by_rank[0][0]
    # Per round: the system time of all ranks (their rounds are the same barrier-separated windows).
    system = {name: [sum(by_rank[r][1][name][i] for r in by_rank) for i in range(args.repeats)] for name in times}
    print(f"{args.nproc} gloo ranks, {args.bytes} B per rank; loadavg {before} -> {after}")
    print("| op | ms per op (median of rounds) | rounds | system CPU ms per op, all ranks (median) |\n| --- | --- | --- | --- |")
    for name, rounds in times.items():
        print(
            f"| {name} | {statistics.median(rounds):.2f} | {', '.join(f'{t:.2f}' for t in rounds)} "
            f"| {statistics.median(system[name]):.2f} |"
        )


if __name__ == "__main__":
    main()
