"""Fork W gloo ranks on this host for a benchmark, collect what they report, and read the load average
around the run (timings on a shared host mean little without it).

Pitfall: ranks are forked, so the target must be a module-level function and the parent must not have
a process group of its own.
"""

import socket

import torch.multiprocessing as mp


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(nproc: int, target, args, reports: int) -> tuple[list, str, str]:
    """Run ``target(rank, args, port, results)`` on ``nproc`` forked ranks; return the ``reports`` items
    they put on ``results``, and the load average before and after."""
    before = loadavg()
    context = mp.get_context("fork")
    results = context.SimpleQueue()
    port = _free_port()
    processes = [context.Process(target=target, args=(rank, args, port, results)) for rank in range(nproc)]
    for process in processes:
        process.start()
    reported = [results.get() for _ in range(reports)]
    for process in processes:
        process.join()
    return reported, before, loadavg()
