"""Everything the RTP benchmark scripts share; each script only says how to parallelise the model.

A script calls ``main(Strategy(...))``. That parses the RTP flags, starts ``--nproc`` local ranks (fork on
CPU, spawn on CUDA) unless torchrun already started them, and on every rank builds the same model,
parallelises it, and trains it on synthetic data:

- ``--warmup`` batches, untimed;
- ``--max_batch`` measured batches, timed on every rank (the slowest rank's time counts), and within
  each its forward (with the loss), backward and optimizer step (CUDA events on GPUs, no extra sync);
- one more batch under ``rsdp.memory.MemoryTracker`` and ``CommCounter``, both of which slow a CPU run
  down (they are dispatch modes there), which is why they stay out of the timed batches. Its peak is
  the steady-state peak of one batch above the sharded parameters and optimizer state.

Rank 0 prints a progress line per batch and a summary, and writes the results to ``--json``.
"""

import argparse
import contextlib
import dataclasses
import json
import os
import resource
import socket
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from rsdp import release_ring_buffers
from rsdp.memory import CommCounter, MemoryTracker
from moe_lm import MixtureLM
from transformer_lm import TransformerLM

# The RTP benchmarks' model flags and their defaults.
MODEL_FLAGS = {
    "vocab_size": (10240, "vocabulary size"),
    "ninp": (2048, "embedding (model) width"),
    "nhid": (2048, "feed-forward hidden width"),
    "nhead": (32, "attention heads"),
    "num_decoder_layers": (5, "decoder layers"),
    "seq_len": (128, "tokens per sequence"),
    "batch_size": (1, "sequences per rank and batch"),
    "experts": (0, "experts per layer: 0 for the dense model, more for a Mixtral MoE (moe_lm.py; nhid is each expert's)"),
}
# The other flags every script takes and compare.py forwards to them.
RUN_FLAGS = ("max_batch", "warmup", "nproc", "device", "dtype", "ring_group_size")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LEARNING_RATE = 1e-4
MODEL_SEED = 0  # every rank builds the same initial model
DATA_SEED = 1234
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


@dataclasses.dataclass(frozen=True)
class Worker:
    """What a strategy's ``parallelize`` gets: the flags and this process's place in the world."""

    args: argparse.Namespace
    rank: int
    world_size: int
    device: torch.device
    mesh: DeviceMesh  # 1-D, over all ranks

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.args.dtype]


def _no_config_limits(args: argparse.Namespace, world_size: int) -> None:
    pass


@dataclasses.dataclass(frozen=True)
class Strategy:
    name: str
    # Turns the full model (identical on every rank, on this rank's device) into this rank's part.
    parallelize: Callable[[nn.Module, Worker], nn.Module]
    # Tensor parallelism: the ranks of the group compute one batch together, so all must see the same
    # batch and the global batch is one rank's.
    same_batch_on_every_rank: bool = False
    # The context forward, loss and backward run in (tensor parallelism's loss_parallel).
    loss_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    # Raises ValueError, before any rank starts, for a config the strategy cannot run.
    check_config: Callable[[argparse.Namespace, int], None] = _no_config_limits


def mixed_precision(worker: Worker) -> MixedPrecisionPolicy:
    """The policy for the sharded strategies: compute in ``--dtype``, reduce gradients in fp32."""
    if worker.dtype == torch.float32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=worker.dtype, reduce_dtype=torch.float32)


def shard_layers_then_root(shard: Callable, model: nn.Module, worker: Worker) -> nn.Module:
    """Apply ``shard`` (``fully_shard`` or ``rsdp_shard``) to every decoder layer, then to the root."""
    policy = mixed_precision(worker)
    for layer in model.layers:
        shard(layer, mesh=worker.mesh, mp_policy=policy)
    return shard(model, mesh=worker.mesh, mp_policy=policy)


# ---------------------------------------------------------------------------------------------------
# Flags and launching


def build_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    model = parser.add_argument_group("model (fairscale's transformer LM; defaults are RTP's)")
    for name, (default, help_text) in MODEL_FLAGS.items():
        model.add_argument(f"--{name}", type=int, default=default, help=help_text)
    run = parser.add_argument_group("run")
    run.add_argument("--max_batch", type=int, default=10, help="measured batches")
    run.add_argument("--warmup", type=int, default=2, help="batches run before timing starts")
    run.add_argument(
        "--use_synthetic_data", action="store_true", help="random tokens from a fixed seed (the only data source)"
    )
    run.add_argument("--nproc", type=int, help="local ranks to start when not under torchrun [4, or one per GPU]")
    run.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    run.add_argument("--dtype", choices=tuple(DTYPES), default="fp32")
    run.add_argument("--ring_group_size", type=int, default=1,
                     help="rtp (rsdp): a ring of groups of this many ranks (rsdp_shard's ring_group_size)")
    run.add_argument("--json", metavar="PATH", help="write the results here")
    return parser


def parse_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
    args = parser.parse_args()
    if not args.use_synthetic_data:
        parser.error("no dataset is bundled (nothing is downloaded); pass --use_synthetic_data")
    if args.nproc is None:
        args.nproc = torch.cuda.device_count() if args.device == "cuda" else 4
    if args.device == "cuda" and not _launched_by_torchrun() and args.nproc > torch.cuda.device_count():
        # NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), after every rank has started.
        parser.error(f"--nproc {args.nproc} needs one GPU per rank; this machine has {torch.cuda.device_count()}")
    if args.max_batch < 1 or args.warmup < 0 or args.nproc < 1 or args.experts < 0:
        parser.error("--max_batch and --nproc must be at least 1, --warmup and --experts at least 0")
    if args.ring_group_size < 1 or args.nproc % args.ring_group_size:
        parser.error(f"--ring_group_size {args.ring_group_size} must divide --nproc ({args.nproc})")
    return args


def forwarded_flags(args: argparse.Namespace) -> list[str]:
    """``args``' model and run flags as a command line for a benchmark script."""
    return [f"--{name}={getattr(args, name)}" for name in (*MODEL_FLAGS, *RUN_FLAGS)]


def _launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main(strategy: Strategy) -> None:
    parser = build_parser(
        f"Train fairscale's transformer LM with {strategy.name}; report speed, peak memory and bytes sent."
    )
    args = parse_args(parser)
    try:
        strategy.check_config(args, world_size(args))
    except ValueError as error:
        parser.error(f"{strategy.name}: {error}")
    launch(_run_benchmark, args, strategy)


def world_size(args: argparse.Namespace) -> int:
    return int(os.environ["WORLD_SIZE"]) if _launched_by_torchrun() else args.nproc


def launch(run: Callable[..., None], args: argparse.Namespace, *extra) -> None:
    """Call ``run(worker, *extra)`` on every rank: torchrun's, or ``--nproc`` local ones started here."""
    if _launched_by_torchrun():
        _run_rank(int(os.environ["LOCAL_RANK"]), run, args, extra)
        return
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(_free_port())
    # fork is ~0.2 s a rank where spawn re-imports torch (~3 s); CUDA cannot be forked, so GPUs spawn.
    start_method = "spawn" if args.device == "cuda" else "fork"
    mp.start_processes(_run_rank, args=(run, args, extra), nprocs=args.nproc, start_method=start_method)


def _run_rank(local_rank: int, run: Callable[..., None], args: argparse.Namespace, extra: tuple) -> None:
    rank, world = int(os.environ.get("RANK", local_rank)), world_size(args)
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        # Ranks share the cores: one each would leave cores idle, more would oversubscribe them.
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", args.nproc))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))
        device = torch.device("cpu")
    dist.init_process_group(
        "nccl" if args.device == "cuda" else "gloo",
        rank=rank,
        world_size=world,
        timeout=COLLECTIVE_TIMEOUT,
    )
    try:
        run(Worker(args, rank, world, device, init_device_mesh(args.device, (world,))), *extra)
    finally:
        dist.destroy_process_group()


def _run_benchmark(worker: Worker, strategy: Strategy) -> None:
    results = _benchmark(strategy, worker)
    if worker.rank == 0:
        _print_summary(results)
        if worker.args.json:
            with open(worker.args.json, "w") as out:
                json.dump(results, out, indent=2)


# ---------------------------------------------------------------------------------------------------
# Training and measurement


def _synthetic_batches(args: argparse.Namespace, data_rank: int, count: int, device: torch.device):
    """``count`` (input, target) pairs of ``[seq_len, batch_size]`` tokens, the target shifted by one."""
    generator = torch.Generator().manual_seed(DATA_SEED + data_rank)
    for _ in range(count):
        tokens = torch.randint(args.vocab_size, (args.seq_len + 1, args.batch_size), generator=generator)
        yield tokens[:-1].to(device), tokens[1:].to(device)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


PHASES = ("forward", "backward", "optimizer")


def _mark(device: torch.device):
    """A point in a step to time its phases from: a recorded CUDA event (no sync), or the clock."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _seconds_between(marks: list) -> list[float]:
    """The seconds between consecutive ``_mark``s (on CUDA, once the step has synchronised)."""
    if isinstance(marks[0], float):
        return [end - start for start, end in zip(marks, marks[1:])]
    return [start.elapsed_time(end) / 1e3 for start, end in zip(marks, marks[1:])]


def build_model(args: argparse.Namespace) -> nn.Module:
    """The benchmark's model: fairscale's dense transformer LM, or with ``--experts`` a Mixtral MoE."""
    shape = (args.vocab_size, args.ninp, args.nhead, args.nhid, args.num_decoder_layers)
    if args.experts:
        return MixtureLM(*shape, max_len=args.seq_len, experts=args.experts)
    return TransformerLM(*shape, max_len=args.seq_len)


def _benchmark(strategy: Strategy, worker: Worker) -> dict:
    args, device = worker.args, worker.device
    torch.manual_seed(MODEL_SEED)
    model = build_model(args).to(device)
    parameter_count = sum(p.numel() for p in model.parameters())
    model = strategy.parallelize(model, worker)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)

    data_parallel_size = 1 if strategy.same_batch_on_every_rank else worker.world_size
    data_rank = 0 if strategy.same_batch_on_every_rank else worker.rank
    total_batches = args.warmup + args.max_batch + 1
    batches = list(_synthetic_batches(args, data_rank, total_batches, device))

    def train_step(inputs: torch.Tensor, targets: torch.Tensor) -> tuple[float, list[float]]:
        """The loss, and the seconds of the step's phases (``PHASES``)."""
        marks = [_mark(device)]
        with strategy.loss_context():
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
            marks.append(_mark(device))
            loss.backward()
        marks.append(_mark(device))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        marks.append(_mark(device))
        return loss.item(), _seconds_between(marks)  # item() waits for the step

    def log(label: str, loss: float, seconds: float) -> None:
        if worker.rank == 0:
            print(f"[{strategy.name}] {label} | loss {loss:.4f} | {seconds * 1e3:8.1f} ms", flush=True)

    step_times, phase_totals = [], [0.0] * len(PHASES)
    cpu_at_start = cpu_at_end = resource.getrusage(resource.RUSAGE_SELF)
    for index, batch in enumerate(batches[:-1]):
        _synchronize(device)
        if index == args.warmup:
            cpu_at_start = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        loss, phases = train_step(*batch)
        _synchronize(device)
        seconds = time.perf_counter() - start
        if index < args.warmup:
            log(f"warm-up {index + 1}/{args.warmup}", loss, seconds)
        else:
            step_times.append(seconds)
            phase_totals = [total + phase for total, phase in zip(phase_totals, phases)]
            log(f"batch {len(step_times)}/{args.max_batch}", loss, seconds)
    if step_times:
        cpu_at_end = resource.getrusage(resource.RUSAGE_SELF)

    # rsdp's ring buffers stay allocated between steps; freeing them first counts them in the peak.
    release_ring_buffers()
    with MemoryTracker(device) as memory, CommCounter() as comm:
        start = time.perf_counter()
        final_loss, _ = train_step(*batches[-1])
        log("memory+comm", final_loss, time.perf_counter() - start)

    per_rank = [None] * worker.world_size
    mine = {
        "measured_s": sum(step_times),
        "phases_s": phase_totals,
        # The process's CPU time over the measured batches, all its threads (communication's too).
        "user_s": cpu_at_end.ru_utime - cpu_at_start.ru_utime,
        "system_s": cpu_at_end.ru_stime - cpu_at_start.ru_stime,
        "peak_bytes": memory.peak_bytes,
        "bytes_sent": comm.bytes_sent,
        "comm_by_op": dict(comm.by_op),
        "exchanges": sum(comm.calls.values()),
        "between_groups": (comm.between_groups.messages, comm.between_groups.nbytes),
        "within_groups": (comm.within_groups.messages, comm.within_groups.nbytes),
        "final_loss": final_loss,
    }
    dist.all_gather_object(per_rank, mine)

    slowest = max(per_rank, key=lambda r: r["measured_s"])
    measured_s = slowest["measured_s"]
    sequences = args.batch_size * data_parallel_size * args.max_batch
    return {
        "strategy": strategy.name,
        "world_size": worker.world_size,
        "data_parallel_size": data_parallel_size,
        "device": args.device,
        "dtype": args.dtype,
        "config": {name: getattr(args, name) for name in (*MODEL_FLAGS, "max_batch", "warmup")},
        "parameters": parameter_count,
        "step_time_s": measured_s / args.max_batch,
        # Where the slowest rank's step goes (the rest is waiting for the loss).
        "phase_times_s": {name: total / args.max_batch for name, total in zip(PHASES, slowest["phases_s"])},
        # Host CPU time per step, summed over the ranks: on ranks that share cores the step time
        # follows it; on GPUs it is the host work that bounds small batches.
        "cpu_per_step_s": sum(r["user_s"] + r["system_s"] for r in per_rank) / args.max_batch,
        "system_cpu_per_step_s": sum(r["system_s"] for r in per_rank) / args.max_batch,
        "rank0_step_times_s": step_times,
        "tokens_per_s": sequences * args.seq_len / measured_s,
        "sequences_per_s": sequences / measured_s,
        "peak_memory_bytes": max(r["peak_bytes"] for r in per_rank),
        "peak_memory_bytes_per_rank": [r["peak_bytes"] for r in per_rank],
        "bytes_sent_per_step": max(r["bytes_sent"] for r in per_rank),
        "bytes_sent_per_step_per_rank": [r["bytes_sent"] for r in per_rank],
        "rank0_bytes_sent_by_op": per_rank[0]["comm_by_op"],
        # Sends plus collectives one rank issues per step: each synchronises it with its peers.
        "exchanges_per_step": max(r["exchanges"] for r in per_rank),
        # Rank 0's, as (messages, bytes): point-to-point sends (a ring's exchanges, between groups on a
        # ring of groups) and the collectives within a ring's groups (rsdp.memory.CommCounter).
        "rank0_between_groups_per_step": per_rank[0]["between_groups"],
        "rank0_within_groups_per_step": per_rank[0]["within_groups"],
        # Mean over ranks: the data-parallel mean of each rank's own batch (tp's ranks all agree).
        "final_loss": sum(r["final_loss"] for r in per_rank) / worker.world_size,
    }


def format_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if abs(count) < 1024:
            return f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.2f} GiB"


def _print_summary(results: dict) -> None:
    config = results["config"]
    shape = " ".join(f"{name} {config[name]}" for name in MODEL_FLAGS)
    per_rank = ", ".join(format_bytes(b) for b in results["peak_memory_bytes_per_rank"])
    phases = ", ".join(f"{name} {seconds * 1e3:.1f} ms" for name, seconds in results["phase_times_s"].items())
    print(
        f"\n== {results['strategy']}: {results['world_size']} ranks, {results['device']}, {results['dtype']}, "
        f"{results['parameters']:,} parameters | {shape}\n"
        f"  step time      {results['step_time_s'] * 1e3:.1f} ms (mean of {config['max_batch']} measured batches, "
        f"slowest rank; {config['warmup']} warm-up batches excluded)\n"
        f"  phases         {phases} (the slowest rank's, mean per step)\n"
        f"  throughput     {results['tokens_per_s']:.1f} tokens/s, {results['sequences_per_s']:.2f} sequences/s "
        f"(global: {results['data_parallel_size']} data-parallel ranks)\n"
        f"  host CPU       {results['cpu_per_step_s'] * 1e3:.1f} ms per step, all ranks together "
        f"({results['system_cpu_per_step_s'] * 1e3:.1f} ms of it in the kernel)\n"
        f"  peak memory    {format_bytes(results['peak_memory_bytes'])} above parameters and optimizer state "
        f"(max over ranks; per rank: {per_rank})\n"
        f"  sent per step  {format_bytes(results['bytes_sent_per_step'])} per rank (max over ranks), in "
        f"{results['exchanges_per_step']} exchanges (sends + collectives)\n"
        f"  rank 0's       {results['rank0_between_groups_per_step'][0]} sends between groups "
        f"({format_bytes(results['rank0_between_groups_per_step'][1])}), "
        f"{results['rank0_within_groups_per_step'][0]} collectives within groups "
        f"({format_bytes(results['rank0_within_groups_per_step'][1])})\n"
        f"  final loss     {results['final_loss']:.4f}",
        flush=True,
    )
