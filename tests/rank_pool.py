"""Rank processes for multi-rank tests: forked once (after torch is imported), reused by every test.

A 4-rank ``mp.spawn`` costs ~15 s on 2 cores; a fork costs ~0.2 s, so each world size gets one pool of
forked gloo ranks for the whole session. Test functions are sent by reference (module-level functions
of the already-imported test modules) and run on every rank; a failure on any rank fails the test with
that rank's traceback. A pool whose ranks failed or hung is killed and replaced, so one broken test
cannot leave the next one waiting on a collective that will never complete.
"""

import gc
import multiprocessing
import os
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT_S = 60
TASK_TIMEOUT_S = 240
GRACE_AFTER_FAILURE_S = 5


def _worker(rank: int, world_size: int, store_path: str, timeout_s: float, conn) -> None:
    torch.set_num_threads(1)
    # Everything inherited from the parent (the imported libraries and test modules) lives as long as
    # the rank: frozen, it is left out of every cyclic collection, which would otherwise scan it each
    # time (the planner and memory measurements collect before every measured step).
    gc.freeze()
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
    )
    while True:
        task = conn.recv()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            conn.send(("ok", fn(*args, **kwargs)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
        # What a test leaves alive (functools.cache'd models, module-level state) stays for the rank's
        # life too: frozen after the test's garbage is collected, so that it is not scanned by every
        # later collection (the planner's and measure_peak's collect several times a step; unfrozen,
        # a rank late in the suite held ~260k objects and each collection took ~0.3 s).
        gc.collect()
        gc.freeze()
    dist.destroy_process_group()


class RankFailure(AssertionError):
    def __init__(self, message: str, results: list, errors: dict[int, str]):
        super().__init__(message)
        self.results = results
        self.errors = errors


class RankPool:
    def __init__(
        self,
        world_size: int,
        collective_timeout_s: float = COLLECTIVE_TIMEOUT_S,
        grace_after_failure_s: float = GRACE_AFTER_FAILURE_S,
    ):
        context = multiprocessing.get_context("fork")
        self.world_size = world_size
        self.grace_after_failure_s = grace_after_failure_s
        self._store_dir = tempfile.TemporaryDirectory(prefix="rsdp-ranks-")
        store_path = os.path.join(self._store_dir.name, "store")
        self._conns = []
        self.processes = []
        for rank in range(world_size):
            parent, child = context.Pipe()
            process = context.Process(
                target=_worker,
                args=(rank, world_size, store_path, collective_timeout_s, child),
                daemon=True,
            )
            process.start()
            child.close()
            self._conns.append(parent)
            self.processes.append(process)

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.processes)

    def run(self, fn, *args, timeout_s: float = TASK_TIMEOUT_S, **kwargs) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results."""
        for conn in self._conns:
            conn.send((fn, args, kwargs))
        results, errors = [None] * self.world_size, {}
        deadline = time.monotonic() + timeout_s
        for rank, conn in enumerate(self._conns):
            remaining = deadline - time.monotonic()
            if errors:
                remaining = min(remaining, self.grace_after_failure_s)
            try:
                ready = conn.poll(max(remaining, 0))
                status, payload = conn.recv() if ready else ("error", f"no answer after {remaining:.0f} s more")
            except (EOFError, ConnectionError):
                status, payload = "error", f"rank process died (exit code {self.processes[rank].exitcode})"
            if status == "ok":
                results[rank] = payload
            else:
                errors[rank] = payload
        if errors:
            self.close()
            report = "\n".join(f"--- rank {rank} ---\n{text}" for rank, text in sorted(errors.items()))
            raise RankFailure(f"{fn.__name__} failed on ranks {sorted(errors)}:\n{report}", results, errors)
        return results

    def close(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.kill()
        for process in self.processes:
            process.join(timeout=5)
        for conn in self._conns:
            conn.close()
        self._store_dir.cleanup()
        self.processes = []


class RankPools:
    """One live pool per world size, created on first use and replaced when broken."""

    def __init__(self):
        self._pools: dict[int, RankPool] = {}

    def run(self, world_size: int, fn, *args, **kwargs) -> list:
        pool = self._pools.get(world_size)
        if pool is None or not pool.processes or not pool.alive:
            pool = self._pools[world_size] = RankPool(world_size)
        return pool.run(fn, *args, **kwargs)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
