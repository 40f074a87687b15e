"""``rsdp calibrate``: the cost model's time constants, measured on this machine and process group, as
a profile that ``rsdp plan --hardware profile.json`` loads (its fields: ``_hardware``).

What it measures, each rank at once (ranks share the host's cores and links as they do in training):

- GEMM FLOP/s at the model's Linear shapes (``tokens x in -> out``, every Linear as often as the model
  has it): a Linear's three GEMMs (forward, input gradient, weight gradient) whole and with 1/W of the
  weight's rows, as each RSDP ring step computes them. ``flops_per_s`` is the whole GEMMs' rate and
  ``partial_gemm_efficiency[W]`` the partial ones' rate over it. With ``--model benchmark`` (a model
  this host can run) ``flops_per_s`` is instead one unsharded training step's rate, counted as the cost
  model counts it (GEMMs, attention, norms, loss), the GEMM rate is kept beside it
  (``gemm_flops_per_s``: the rate the Linears' FLOPs and the per-shard penalty are charged at), and the
  step's time less its Linears' at that rate gives the rate of its other FLOPs (``other_flops_per_s``);
- the rates of the work outside the matrix products by kind (``_cost_model.Work``; ``work_rates``):
  causal attention (``scaled_dot_product_attention``, the device's own kernel, counted as flash
  attention's executed FLOPs), ``rms_norm``, an elementwise ``silu(a) * b`` and an fp32 cross-entropy
  at the run's tokens, width, heads and vocabulary, each its work as the count charges it (bytes read
  and written, counted on meta) over its median time. With them the cost model charges each kind at its
  own rate (``other_flops_per_s`` is then not used);
- per op (point-to-point ring exchange, all-gather, reduce-scatter, all-reduce), ``t = hops x latency
  + bytes / bandwidth`` fitted by least squares over message sizes (bytes as nccl-tests' busbw counts
  them, the slowest rank's time per size). Where the ranks span machines (``machines_of_ranks``: by
  host name, or every ``--gpus-per-node`` consecutive ranks), two levels (``measure_levels``): within
  a machine, each machine's ranks at once as a group of their own, and between machines, the same ops
  over every rank (what FSDP's collectives and a ring's exchanges across a machine boundary do; the
  slowest rank's time, which the boundary sets). On one machine, one level, and the profile says so;
- FSDP2's own work per stored parameter byte beside the wire, forward and backward, for FSDP and
  replicate (its copies into and out of the collectives' buffers, into memory just allocated; the
  pre-division; its hooks): the same shapes as units on torch's fake process group over unsharded;
- host time per ring step, on torch's fake process group at W (every message returns at once, so
  what is left over an unsharded run of the same tiny model is rsdp's own host work), divided by the
  ring steps the cost model charges (W per Linear and phase).

Pitfalls: the GEMM rate depends on the shapes (small partial GEMMs are launch- or cache-bound, large
ones reach the peak), so a profile holds for the shapes it measured. On one process with ``--world-size``
(the fake process group) no link can be measured: the links are the ``--hardware`` preset's, and the
profile says so in its ``source``. Times are medians of rounds; a loaded host shifts them all.
"""

import collections
import contextlib
import operator
import copy
import dataclasses
import json
import os
import math
import socket
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from .._compat import (
    MixedPrecisionPolicy, all_gather_flat, fake_store, flash_attention_op, reduce_scatter_flat, send_and_receive,
)
from .._fully_shard._ring import WaitedWorks, wait_for
from ._cost_model import Link
from ..policy import Strategy, parallelize
from . import _hardware, _models
from ._cost_model import count, work_of
from ._hardware import LINK_OPS, Hardware
from ._profile import find_units

MESSAGE_BYTES = (2**12, 2**16, 2**20, 2**22)  # whole tensor per op (a ring exchange moves 1/W of it)
HOPS = {"send_recv": lambda w: 1, "all_gather": lambda w: w - 1, "reduce_scatter": lambda w: w - 1,
        "all_reduce": lambda w: 2 * (w - 1)}
BUS_FRACTION = {"send_recv": lambda w: 1 / w, "all_gather": lambda w: (w - 1) / w,
                "reduce_scatter": lambda w: (w - 1) / w, "all_reduce": lambda w: 2 * (w - 1) / w}


def median_seconds(fn: Callable[[], None], rounds: int = 3, min_seconds: float = 0.02, sync=lambda: None,
                   calls: int = 1) -> float:
    """Median over ``rounds`` of the mean time of ``fn`` (called ``calls`` times, then until ``min_seconds``
    have passed)."""
    fn()  # warm-up: first-call allocations and kernel selection
    sync()
    times = []
    for _ in range(rounds):
        done, start = 0, time.perf_counter()
        while True:
            fn()
            done += 1
            sync()
            if done >= calls and time.perf_counter() - start >= min_seconds:
                break
        times.append((time.perf_counter() - start) / done)
    return statistics.median(times)


def linear_shapes(model: nn.Module) -> collections.Counter:
    """``(in_features, out_features)`` of every Linear, with how often the model has it."""
    return collections.Counter((m.in_features, m.out_features) for m in model.modules() if isinstance(m, nn.Linear))


@dataclasses.dataclass(frozen=True)
class GemmRates:
    flops_per_s: float  # whole GEMMs
    partial_gemm_efficiency: dict[int, float]  # W: 1/W-row GEMMs' FLOP/s over the whole ones'


def gemm_rates(shapes: collections.Counter, tokens: int, world_sizes: list[int], dtype: torch.dtype,
               device: torch.device, sync=lambda: None) -> GemmRates:
    """A Linear's forward, input-gradient and weight-gradient GEMMs at each shape, whole and with
    ceil(out / W) weight rows, weighted by how often the model has the shape."""

    def three_gemms(tokens_in: torch.Tensor, weight: torch.Tensor) -> float:
        grad_out = torch.randn(tokens, weight.shape[0], dtype=dtype, device=device)
        return median_seconds(lambda: (tokens_in @ weight.t(), grad_out @ weight, grad_out.t() @ tokens_in), sync=sync)

    flops = whole_seconds = 0.0
    partial_seconds = collections.Counter()
    for (fan_in, fan_out), times in shapes.items():
        x = torch.randn(tokens, fan_in, dtype=dtype, device=device)
        weight = torch.randn(fan_out, fan_in, dtype=dtype, device=device)
        flops += times * 6 * tokens * fan_in * fan_out
        whole_seconds += times * three_gemms(x, weight)
        for world in world_sizes:
            rows = math.ceil(fan_out / world)
            # Each of W ring steps computes one shard; W shards do the whole GEMM's work.
            partial_seconds[world] += times * world * three_gemms(x, weight[:rows].contiguous()) * fan_out / (rows * world)
    return GemmRates(flops / whole_seconds, {w: whole_seconds / partial_seconds[w] for w in world_sizes})


def fit_link(sizes: list[float], seconds: list[float], hops: int) -> Link:
    """Least-squares ``seconds = intercept + bytes / bandwidth``; latency is the intercept per hop."""
    mean_x, mean_y = statistics.fmean(sizes), statistics.fmean(seconds)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(sizes, seconds)) / sum((x - mean_x) ** 2 for x in sizes)
    if slope <= 0:
        raise ValueError(
            f"rsdp calibrate: transfer time did not grow with size ({dict(zip(sizes, seconds))}); the host is "
            "too loaded to fit a bandwidth: rerun it on a quieter machine."
        )
    intercept = max(mean_y - slope * mean_x, 0.0)
    return Link(intercept / hops, 1 / slope)


def measure_links(group, device: torch.device, message_bytes=MESSAGE_BYTES, sync=lambda: None, slowest_of=None) -> dict[str, Link]:
    """Each op's fitted Link on ``group``, from the slowest rank's median time per size (of ``slowest_of``'s
    ranks, default ``group``'s: several groups measured at once take their slowest)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    kept = WaitedWorks()  # the works of the last exchange, as a ring keeps them (see WaitedWorks)
    links = {}
    for op in LINK_OPS:
        sizes, times = [], []
        for nbytes in message_bytes:
            shard = torch.zeros(max(nbytes // 4 // world, 1), device=device)
            whole = torch.zeros(shard.numel() * world, device=device)
            received = torch.zeros_like(shard)
            run = {
                "send_recv": lambda: wait_for(send_and_receive(group, shard, (rank - 1) % world, received, (rank + 1) % world, 0), kept),
                "all_gather": lambda: all_gather_flat(whole, shard, group=group),
                "reduce_scatter": lambda: reduce_scatter_flat(shard, whole, group=group),
                "all_reduce": lambda: dist.all_reduce(whole, group=group),
            }[op]
            # A fixed number of calls on every rank: a collective called until a time has passed would
            # be called a different number of times on each rank, and hang.
            dist.barrier(group)
            slowest = torch.tensor([median_seconds(run, sync=sync, min_seconds=0.0, calls=5)], dtype=torch.float64,
                                   device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=slowest_of or group)
            sizes.append(whole.numel() * whole.element_size() * BUS_FRACTION[op](world))
            times.append(float(slowest))
        links[op] = fit_link(sizes, times, HOPS[op](world))
    return links


def machines_of_ranks(gpus_per_node: int | None = None) -> list[int]:
    """Each rank's machine (0, 1, ...) in the default process group: every ``gpus_per_node`` consecutive
    ranks, else the ranks that share a host name. A machine's ranks must be consecutive and every
    machine must have as many (rsdp's ring groups are consecutive ranks of one machine)."""
    world = dist.get_world_size()
    if gpus_per_node:
        if world % gpus_per_node:
            raise ValueError(f"rsdp calibrate: --gpus-per-node {gpus_per_node} does not divide the {world} ranks into "
                             "machines; pass a divisor of the world size.")
        return [rank // gpus_per_node for rank in range(world)]
    hosts: list[str] = [""] * world
    dist.all_gather_object(hosts, socket.gethostname())
    numbers = {host: number for number, host in enumerate(dict.fromkeys(hosts))}
    machines = [numbers[host] for host in hosts]
    sizes = collections.Counter(machines)
    if machines != sorted(machines) or len(set(sizes.values())) != 1:
        raise ValueError(
            f"rsdp calibrate: the ranks' machines are {machines} (by host name); each machine's ranks must be "
            "consecutive and as many on every machine, as torchrun starts them; pass --gpus-per-node to say otherwise."
        )
    return machines


@dataclasses.dataclass(frozen=True)
class Levels:
    """The links ``measure_levels`` fitted: within a machine, and between machines (empty: one machine)."""

    within: dict[str, Link]
    between: dict[str, Link]
    gpus_per_node: int | None  # None: one machine


def measure_levels(machines: list[int], device: torch.device, message_bytes=MESSAGE_BYTES, sync=lambda: None) -> Levels:
    """Each op's link within a machine and, where ``machines`` (each rank's) are more than one, between
    machines: within, on a group per machine (every machine at once, the slowest rank's time); between,
    on every rank."""
    if len(set(machines)) == 1:
        return Levels(measure_links(dist.group.WORLD, device, message_bytes, sync), {}, None)
    ranks_of = [[rank for rank, machine in enumerate(machines) if machine == m] for m in sorted(set(machines))]
    mine, groups = dist.new_subgroups_by_enumeration(ranks_of)
    try:
        within = measure_links(mine, device, message_bytes, sync, slowest_of=dist.group.WORLD)
    finally:
        for group in groups:
            dist.destroy_process_group(group)
    between = measure_links(dist.group.WORLD, device, message_bytes, sync)
    return Levels(within, between, len(ranks_of[0]))


@contextlib.contextmanager
def _fake_group(world: int, what: str):
    """torch's fake process group of ``world`` ranks (every collective returns at once and moves
    nothing) with a CPU mesh over it, destroyed on exit: call it with no other group initialised."""
    store = fake_store()
    if store is None:
        raise ValueError(f"rsdp calibrate: this torch has no fake process group; {what} cannot be measured.")
    dist.init_process_group("fake", store=store, rank=0, world_size=world)
    try:
        yield init_device_mesh("cpu", (world,))
    finally:
        dist.destroy_process_group()


def _training_step(model: nn.Module, loss: Callable[[], torch.Tensor]) -> Callable[[], None]:
    """A step to time: ``loss()``'s backward, then the gradients dropped (as the optimizer's zero_grad)."""

    def step() -> None:
        loss().backward()
        for param in model.parameters():
            param.grad = None

    return step


def ring_step_host_seconds(world: int, width: int = 16, layers: int = 8) -> float:
    """Host time per ring step at ``world`` ranks: an rsdp step of ``layers`` tiny Linears on the fake
    process group, less the same model's unsharded step, over the 2 x W x layers steps of its rings."""
    torch.manual_seed(0)
    plain = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers)))
    x = torch.randn(4, width)
    with _fake_group(world, "the host time per ring step") as mesh:
        sharded = parallelize(copy.deepcopy(plain), {str(i): Strategy.RSDP for i in range(layers)}, mesh=mesh)
        steps = [_training_step(model, lambda model=model: model(x).sum()) for model in (sharded, plain)]
        rounds = [tuple(median_seconds(step, rounds=1) for step in steps) for _ in range(3)]
    extra = statistics.median(r - p for r, p in rounds)
    return max(extra, 0.0) / (2 * world * layers)


class _SideBySide(nn.Module):
    """One Linear per shape, each on its own input (shapes need not chain), each a unit."""

    def __init__(self, shapes):
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(fan_in, fan_out, bias=False) for fan_in, fan_out in shapes)

    def forward(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        return sum(linear(x).sum() for linear, x in zip(self.linears, inputs))


def gathered_overhead_seconds_per_byte(world: int, shapes: collections.Counter, mp_policy=None) -> dict[str, tuple[float, float]]:
    """FSDP2's own work per stored parameter byte, forward and backward, for FSDP and replicate: its
    copies into and out of the collectives' buffers (into memory just allocated), the pre-division and
    its hooks. A step of one Linear per shape (each a unit) at 2 tokens on the fake process group at
    ``world``, whose collectives move nothing, less the unsharded step, over the parameters' bytes.
    On the host's memory: what CPU ranks pay (a GPU's copies run on the device)."""
    torch.manual_seed(0)
    plain = _SideBySide(shapes)
    inputs = [torch.randn(2, fan_in) for fan_in, _ in shapes]
    nbytes = sum(p.numel() * p.element_size() for p in plain.parameters())
    units = [f"linears.{i}" for i in range(len(shapes))]

    def seconds(model: nn.Module) -> tuple[float, float]:
        forward = median_seconds(lambda: model(inputs), rounds=1)
        return forward, median_seconds(_training_step(model, lambda: model(inputs)), rounds=1) - forward

    overhead = {}
    with _fake_group(world, "FSDP2's copies") as mesh:
        for strategy in (Strategy.FSDP, Strategy.REPLICATE):
            sharded = parallelize(copy.deepcopy(plain), dict.fromkeys(units, strategy), mesh=mesh, mp_policy=mp_policy)
            rounds = [(seconds(sharded), seconds(plain)) for _ in range(3)]
            overhead[strategy.value] = tuple(
                max(statistics.median(r[phase] - p[phase] for r, p in rounds), 0.0) / nbytes for phase in (0, 1)
            )
    return overhead


def work_rates(tokens: int, width: int, heads: int, vocab: int, dtype: torch.dtype, device: torch.device,
               sync=lambda: None) -> dict[str, float]:
    """The rates of the work outside the matrix products (``_cost_model.Work``), each a kernel of its
    kind at ``tokens x width`` (attention over ``heads``; the loss over ``vocab``): its work as the
    count charges it (``work_of``, on meta) over its median time here. Attention is timed through
    ``scaled_dot_product_attention`` (the device's own kernel), counted as flash attention."""
    x, other = (torch.randn(tokens, width, dtype=dtype, device=device) for _ in range(2))
    weight = torch.ones(width, dtype=dtype, device=device)
    logits = torch.randn(tokens, vocab, dtype=dtype, device=device)
    targets = torch.randint(vocab, (tokens,), device=device)
    q, k, v = (torch.randn(1, heads, tokens, width // heads, dtype=dtype, device=device) for _ in range(3))
    kernels = {  # rate: (the call timed, the call counted, its inputs, the counted work it is charged for)
        "attention_flops_per_s": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                                  lambda q, k, v: flash_attention_op(q, k, v, is_causal=True), (q, k, v),
                                  operator.attrgetter("attention_executed_flops")),
        "norm_bytes_per_s": (lambda x, w: F.rms_norm(x, (width,), w), None, (x, weight), operator.attrgetter("elementwise_bytes")),
        "elementwise_bytes_per_s": (lambda a, b: F.silu(a) * b, None, (x, other), operator.attrgetter("elementwise_bytes")),
        "loss_bytes_per_s": (lambda z, t: F.cross_entropy(z.float(), t), None, (logits, targets), operator.attrgetter("elementwise_bytes")),
    }
    rates = {}
    for rate, (timed, counted, inputs, charged) in kernels.items():
        work = charged(work_of(counted or timed, *inputs))
        rates[rate] = work / median_seconds(lambda: timed(*inputs), sync=sync)
    return rates


# Linear shapes measured without --model: a 1024-wide Llama-style block (q, k, v, o; gate, up; down).
DEFAULT_SHAPES = collections.Counter({(1024, 1024): 4, (1024, 2816): 2, (2816, 1024): 1})


def step_rates(model: nn.Module, loss_fn: Callable, batch: torch.Tensor, gemm_flops_per_s: float) -> tuple[float, float]:
    """One unsharded forward and backward of ``model`` on this host: the FLOPs the cost model counts
    for it (backward twice forward) over its median time; and the rate of those outside the Linears'
    GEMMs over the rest of the time, the Linears' FLOPs taking what they take at ``gemm_flops_per_s``
    (0.0 where they would take the whole step: the two timings disagree, and no split is made)."""
    counts = count(model, find_units(model), batch, loss_fn)
    parts = [part for part in (*counts.units.values(), counts.before, counts.after) if part.forward_flops]
    flops = sum(3 * part.forward_flops + part.recomputed_flops for part in parts)
    linear = sum(part.linear_flops * (3 * part.forward_flops + part.recomputed_flops) / part.forward_flops for part in parts)

    seconds = median_seconds(_training_step(model, lambda: loss_fn(model, batch)), min_seconds=0.2)
    other_seconds = seconds - linear / gemm_flops_per_s
    return flops / seconds, (flops - linear) / other_seconds if other_seconds > 0 and flops > linear else 0.0


def calibrate(args) -> tuple[Hardware, dict]:
    """The profile of this process group (under torchrun) or of ``args.world_size`` ranks on the fake
    process group (one process), and what was measured, for the report."""
    distributed = "RANK" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if distributed else args.world_size
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if distributed and device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    host = ring_step_host_seconds(world)  # before the real group: the fake one must be the only one
    benchmark_shape = dict(vocab_size=args.vocab_size, ninp=args.ninp, nhid=args.nhid, nhead=args.nhead,
                           num_decoder_layers=args.num_decoder_layers, seq_len=args.seq_len)
    model, loss_fn, vocab = _models.build(args.model, benchmark_shape) if args.model else (None, None, 0)
    shapes = linear_shapes(model) if model is not None else DEFAULT_SHAPES
    tokens = args.seq_len * args.local_batch_size
    world_sizes = sorted({2, 4, 8, world} - {1})
    dtype = torch.bfloat16 if args.mixed_precision == "bf16" else torch.float32
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if dtype == torch.bfloat16 else None
    # Also before the real group. On a GPU FSDP2's copies run on the device, not the host measured here:
    # not charged there, as in the GPU presets.
    not_measured = {strategy: (0.0, 0.0) for strategy in ("fsdp", "replicate")}
    gathered = gathered_overhead_seconds_per_byte(world, shapes, mp_policy) if device.type == "cpu" else not_measured
    if distributed:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        levels = measure_levels(machines_of_ranks(args.gpus_per_node), device, sync=sync) if distributed else None
        gemms = gemm_rates(shapes, tokens, world_sizes, dtype, device, sync)
        step_rate = other_rate = 0.0
        if args.model == "benchmark":
            batch = torch.randint(vocab, (args.local_batch_size, args.seq_len + 1))
            step_rate, other_rate = step_rates(model.to(device), loss_fn, batch.to(device), gemms.flops_per_s)
        kinds = work_rates(tokens, args.ninp, args.nhead, args.vocab_size, dtype, device, sync)
        overheads = [*gathered["fsdp"], *gathered["replicate"]]
        measured = [gemms.flops_per_s, step_rate, other_rate, host, *overheads, *kinds.values(),
                    *(gemms.partial_gemm_efficiency[w] for w in world_sizes)]
        if distributed:  # every rank measured its own: the mean
            mean = torch.tensor(measured, dtype=torch.float64, device=device)
            dist.all_reduce(mean, group=dist.group.WORLD)
            measured = (mean / world).tolist()
    finally:
        if distributed:
            dist.destroy_process_group()
    gemm_rate, step_rate, other_rate, host = measured[0], measured[1] or None, measured[2] or None, measured[3]
    fsdp_overhead, replicate_overhead = tuple(measured[4:6]), tuple(measured[6:8])
    kinds = dict(zip(_hardware.WORK_RATES, measured[8:12]))
    efficiency = dict(zip(world_sizes, measured[12:]))
    what = f"{args.model or 'default shapes'} at {tokens} tokens, {dtype}, {device.type}"
    if distributed:
        links, between, gpus_per_node = levels.within, levels.between, levels.gpus_per_node
        default = links["send_recv"]
        link_source = f"links fitted over {list(MESSAGE_BYTES)} B on {world} {dist.Backend.GLOO if device.type == 'cpu' else 'nccl'} ranks"
        if gpus_per_node is None:
            link_source += " on one machine (one level: no link between machines measured)"
        else:
            how = f"every {gpus_per_node} consecutive ranks taken as one machine (--gpus-per-node)" if args.gpus_per_node \
                else "machines by host name"
            link_source += (f" in two levels, {world // gpus_per_node} machines of {gpus_per_node} ({how}): within a "
                            "machine on a group per machine, between machines over every rank")
    else:
        preset = _hardware.load(args.hardware)
        default, links = Link(preset.latency_s, preset.bandwidth_bytes_per_s), dict(preset.links)
        between, gpus_per_node = dict(preset.inter_node_links), preset.gpus_per_node
        link_source = f"links not measured (fake process group): {args.hardware}'s ({preset.source})"
    hardware = Hardware(
        step_rate or gemm_rate, default.bandwidth_bytes_per_s, default.latency_s,
        f"rsdp calibrate: {'one training step' if step_rate else 'whole GEMMs'} of {what}; partial GEMMs at "
        f"W = {world_sizes}; host per ring step on the fake process group at W = {world}; FSDP2's own work per byte "
        f"{'on the fake process group' if device.type == 'cpu' else 'not charged (a GPU copies on the device)'}; {link_source}",
        partial_gemm_efficiency=efficiency, ring_step_host_s=host, host_overlaps_compute=device.type != "cpu",
        links=links, gemm_flops_per_s=gemm_rate, other_flops_per_s=other_rate,
        fsdp_overhead_s_per_byte=fsdp_overhead, replicate_overhead_s_per_byte=replicate_overhead, **kinds,
        gpus_per_node=gpus_per_node, inter_node_links=between,
    )
    report = {"world_size": world, "gemm_flops_per_s": gemm_rate, "step_flops_per_s": step_rate, "other_flops_per_s": other_rate, **kinds,
              "linear_shapes": {f"{i}x{o}": n for (i, o), n in shapes.items()}, "tokens": tokens}
    return hardware, report


def write(hardware: Hardware, report: dict, path: str) -> None:
    with open(path, "w") as out:
        json.dump({**hardware.to_json(), "measured": report}, out, indent=2)
