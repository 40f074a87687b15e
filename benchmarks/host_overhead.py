"""Host time per training step of rsdp and FSDP2 at W ranks, on torch's fake process group.

The fake process group runs one rank in one process and makes every collective and point-to-point op
return at once with nothing sent (its collectives copy within the process what they would move: an
all-gather its input into each place of its output), so what is left is the host's own work: Python,
dispatch, autograd and issuing the communication. That is the cost that makes a ring host-bound on GPUs at small batch,
where kernels are short. The model is a stack of Llama-shaped blocks (RMSNorm, q/k/v/o attention,
SwiGLU gate/up/down), each sharded with ``fully_shard``, ``rsdp_shard``, or ``rsdp_shard`` with Hugging
Face's Llama tensor-parallel plan as its ring plan, tiny so that compute is negligible. Strategies
alternate over ``--repeats`` rounds; the table gives the median per strategy, the ratio to FSDP2, and
per block what one step issues: sends, collectives, aten ops and the interpreter's calls. The counts
do not depend on the machine's load, unlike the times: each op costs a dispatch on the host, and each
that is not a view (a view only makes a new tensor over the same memory) is a kernel launch on a GPU;
each Python function called (and each builtin, torch's bindings among them) is interpreter work.

Two references run alongside, unsharded and with no process group, to say what part of a strategy's
host time is its own: "unsharded" is the model itself, and "unsharded, split" computes what a ring
plan computes, each attention and MLP as W copies on 1/W of its heads and hidden units whose outputs
are summed (tensor parallelism's split, run serially in one process). A planned ring cannot issue fewer
ops than the split, however little it adds: the split's excess over the model is the cost of rotating
at this size, and rsdp+plan's excess over the split is the ring's own bookkeeping (packing, exchanges,
buffers, a backward per shard), to compare with FSDP2's excess over the model.

A ring of groups (``--ring-group-size G``, repeatable) adds rows "rsdp g=G" and "rsdp+plan g=G":
rsdp_shard with ``ring_group_size=G`` (without and with the ring plan), W/G steps per ring. The counts split a step's communication between groups (the ring's exchanges,
point-to-point) and within them (the collectives that assemble and reduce a group's block), in
messages and bytes per block (``rsdp.memory.CommCounter``).

``--free-ring-communication`` adds, per ring group size (g=1 if none is given), a row "rsdp g=G, free
ring comm": the same model, whose ring exchanges and collectives within groups return at once without
calling the process group (what is left is the ring's host work without its communication: a floor
for any change that makes a ring issue fewer or cheaper exchanges and collectives). The vectors'
collective (as FSDP2's) stays.

    python benchmarks/host_overhead.py                 # W=8, 4 blocks, 5 rounds of 20 steps
    python benchmarks/host_overhead.py --ring-group-size 2 --ring-group-size 4
    python benchmarks/host_overhead.py --world 16 --blocks 8 --json out.json
    python benchmarks/host_overhead.py --clock cpu     # this thread's CPU time: moves less with the load
    python benchmarks/host_overhead.py --clock cpu --ring-group-size 2 --free-ring-communication

On a shared machine the wall-clock times follow the load (other processes take the cores);
``--clock cpu`` times the thread's own CPU time instead (``time.thread_time``), which the load moves
much less, though caches and frequency still move with it.
"""

import argparse
import collections
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

from rsdp import rsdp_shard
from rsdp._compat import fake_store, fully_shard, send_and_receive
from rsdp._fully_shard import _ring
from rsdp._fully_shard._state import rsdp_states_under
from rsdp.memory import CommCounter


class Attention(nn.Module):
    """q/k/v/o attention; ``width`` (default ``dim``) is q/k/v's output and o's input, ``heads`` the
    head count at full width."""

    def __init__(self, dim: int, heads: int, width: int | None = None):
        super().__init__()
        self.head_dim, width = dim // heads, width or dim
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(dim, width, bias=False) for _ in range(3))
        self.o_proj = nn.Linear(width, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Heads from the shapes (-1), as tensor parallelism and ring plans need.
        q, k, v = (p(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.o_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Split(nn.Module):
    """W parts of a sub-block, each on 1/W of its heads or hidden units, their outputs summed: the W
    steps of a planned ring's pass, run serially with no ring."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(part(x) for part in self.parts)


class LlamaBlock(nn.Module):
    """RMSNorm, q/k/v/o attention and a SwiGLU MLP (gate/up/down), laid out like Hugging Face's; with
    ``split`` W, each sub-block is ``Split`` W ways."""

    def __init__(self, dim: int, heads: int, hidden: int, split: int = 1):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        if split == 1:
            self.self_attn, self.mlp = Attention(dim, heads), MLP(dim, hidden)
        else:
            self.self_attn = Split([Attention(dim, heads, dim // split) for _ in range(split)])
            self.mlp = Split([MLP(dim, hidden // split) for _ in range(split)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


# Hugging Face's Llama tensor-parallel plan (``base_model_tp_plan``), as an rsdp ring plan.
LLAMA_PLAN = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}
STRATEGIES = ("fsdp", "rsdp", "rsdp+plan")
REFERENCES = ("unsharded", "unsharded, split")


class OpCounter(TorchDispatchMode):
    """The aten ops dispatched while active: in all, how many of them are views, and by op."""

    def __init__(self):
        super().__init__()
        self.ops = self.views = 0
        self.by_op: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "aten":
            self.ops += 1
            self.views += func.is_view
            self.by_op[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


class CallCounter:
    """The Python functions called while active, and the builtins (C functions: torch's bindings
    included) they call: a count of the interpreter's work that, unlike a time, does not depend on the
    machine's load."""

    def __enter__(self) -> "CallCounter":
        self.python = self.builtin = 0
        sys.setprofile(self._count)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(None)

    def _count(self, frame, event: str, arg) -> None:
        if event == "call":
            self.python += 1
        elif event == "c_call":
            self.builtin += 1


FREE = ", free ring comm"


class _Done:
    """The work of an exchange or collective that is not made (``FREE``)."""

    def wait(self) -> bool:
        return True


_DONE = _Done()


def _free_exchange(*args) -> list:
    return [_DONE, _DONE]


def _free_collective(output: torch.Tensor, input: torch.Tensor) -> _Done:
    return _DONE


def build(strategy: str, args) -> nn.Module:
    """The model of ``strategy``: one of ``STRATEGIES``, ``REFERENCES``, "rsdp g=G" or "rsdp+plan g=G";
    "rsdp g=G" with ``FREE`` appended has its rings' collectives within groups made free here, their
    exchanges by ``free_step``."""
    torch.manual_seed(0)
    split = args.world if strategy == "unsharded, split" else 1
    model = nn.Sequential(*(LlamaBlock(args.dim, args.heads, args.hidden, split) for _ in range(args.blocks)))
    if strategy in REFERENCES:
        return model
    mesh = init_device_mesh("cpu", (args.world,))
    group = int(strategy.removesuffix(FREE).split("g=")[1]) if "g=" in strategy else 1
    # Every block, then the root (which holds no parameter), as FSDP2's and rsdp's docs advise.
    for block in model:
        if strategy == "fsdp":
            fully_shard(block, mesh=mesh, reshard_after_forward=True)
        else:
            rsdp_shard(block, mesh=mesh, ring_plan=LLAMA_PLAN if strategy.startswith("rsdp+plan") else None, ring_group_size=group)
    model = fully_shard(model, mesh=mesh) if strategy == "fsdp" else rsdp_shard(model, mesh=mesh, ring_group_size=group)
    if strategy.endswith(FREE):
        for state in rsdp_states_under(model):
            if state.ring.within_collectives is not None:  # read by a ring's first step, so set before it
                state.ring.within_collectives = (_free_collective, _free_collective)
    return model


def step(model: nn.Module, x: torch.Tensor) -> None:
    model(x).sum().backward()
    for param in model.parameters():
        param.grad = None


def free_step(model: nn.Module, x: torch.Tensor) -> None:
    """``step`` with the rings' exchanges (``_ring``'s, a global it calls) returning at once."""
    _ring.send_and_receive = _free_exchange
    try:
        step(model, x)
    finally:
        _ring.send_and_receive = send_and_receive


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=8, help="ranks simulated by the fake process group")
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=8, help="must divide by --world (the ring plan and the split)")
    parser.add_argument("--hidden", type=int, default=176)
    parser.add_argument("--tokens", type=int, default=16, help="sequence length (batch 1)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round")
    parser.add_argument("--repeats", type=int, default=5, help="rounds; strategies alternate within each")
    parser.add_argument("--ring-group-size", type=int, action="append", default=[], metavar="G",
                        help="add rows for rsdp, with and without the ring plan, on a ring of groups of G ranks (G divides --world); repeatable")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="time by the wall clock, or by this thread's CPU time (moves less with the machine's load)")
    parser.add_argument("--free-ring-communication", action="store_true",
                        help="add a row per ring group size whose ring exchanges and collectives within groups return at once (a floor)")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    for group in args.ring_group_size:
        if group < 1 or args.world % group:
            parser.error(f"--ring-group-size {group} must divide --world ({args.world})")
    if args.repeats < 3:
        parser.error("--repeats must be at least 3 (timings alternate over rounds)")
    if args.heads % args.world or args.hidden % args.world:
        parser.error(
            f"--heads ({args.heads}) and --hidden ({args.hidden}) must divide by --world ({args.world}): "
            "the ring plan and the split need it"
        )

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=args.world)
    x = torch.randn(1, args.tokens, args.dim, requires_grad=True)
    grouped = tuple(f"{strategy} g={group}" for group in args.ring_group_size for strategy in ("rsdp", "rsdp+plan"))
    free = tuple(f"rsdp g={group}{FREE}" for group in (args.ring_group_size or [1])) if args.free_ring_communication else ()
    models = {strategy: build(strategy, args) for strategy in STRATEGIES + grouped + free + REFERENCES}
    steps = {strategy: free_step if strategy.endswith(FREE) else step for strategy in models}
    counts = {}
    for strategy, model in models.items():
        run = steps[strategy]
        for _ in range(3):  # warm-up: rsdp's records (prefetch, riders) are followed from the fourth step
            run(model, x)
        with CommCounter() as comm:
            run(model, x)
        with OpCounter() as ops:
            run(model, x)
        with CallCounter() as calls:
            run(model, x)
        counts[strategy] = {
            "sends_per_block": comm.calls["c10d::send"] / args.blocks,
            "collectives_per_block": sum(n for op, n in comm.calls.items() if op != "c10d::send") / args.blocks,
            "between_groups_per_block": comm.between_groups.messages / args.blocks,
            "between_groups_kib_per_block": comm.between_groups.nbytes / args.blocks / 1024,
            "within_groups_per_block": comm.within_groups.messages / args.blocks,
            "within_groups_kib_per_block": comm.within_groups.nbytes / args.blocks / 1024,
            "ops_per_block": ops.ops / args.blocks,
            "views_per_block": ops.views / args.blocks,
            "python_calls_per_block": calls.python / args.blocks,
            "builtin_calls_per_block": calls.builtin / args.blocks,
        }
    loadavg_before = open("/proc/loadavg").read().split()[:3]
    rounds = {strategy: [] for strategy in models}
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    for _ in range(args.repeats):
        for strategy, model in models.items():
            run = steps[strategy]
            start = clock()
            for _ in range(args.steps):
                run(model, x)
            rounds[strategy].append((clock() - start) / args.steps)
    loadavg_after = open("/proc/loadavg").read().split()[:3]
    dist.destroy_process_group()

    median = {strategy: statistics.median(times) for strategy, times in rounds.items()}
    print(
        f"### host time per step ({'wall clock' if args.clock == 'wall' else 'CPU time of the thread'}), fake process group, W={args.world}, {args.blocks} Llama blocks "
        f"(dim {args.dim}, hidden {args.hidden}, {args.tokens} tokens); loadavg {' '.join(loadavg_before)} -> "
        f"{' '.join(loadavg_after)}\n"
    )
    print(
        "| strategy | host time per step | × fsdp | per block | per block over unsharded | sends per block | "
        "collectives per block | between groups per block (KiB) | within groups per block (KiB) | "
        "aten ops per block (views) | Python calls per block (builtins) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for strategy in models:
        print(
            f"| {strategy} | {median[strategy] * 1e3:.2f} ms | {median[strategy] / median['fsdp']:.2f} | "
            f"{median[strategy] / args.blocks * 1e6:.0f} µs | "
            f"{(median[strategy] - median['unsharded']) / args.blocks * 1e6:.0f} µs | "
            f"{counts[strategy]['sends_per_block']:.4g} | "
            f"{counts[strategy]['collectives_per_block']:.4g} | "
            f"{counts[strategy]['between_groups_per_block']:.4g} ({counts[strategy]['between_groups_kib_per_block']:.4g}) | "
            f"{counts[strategy]['within_groups_per_block']:.4g} ({counts[strategy]['within_groups_kib_per_block']:.4g}) | "
            f"{counts[strategy]['ops_per_block']:.0f} ({counts[strategy]['views_per_block']:.0f}) | "
            f"{counts[strategy]['python_calls_per_block']:.0f} ({counts[strategy]['builtin_calls_per_block']:.0f}) |"
        )
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"args": vars(args), "rounds_s": rounds, "median_s": median, "counts": counts,
                       "loadavg": [loadavg_before, loadavg_after]}, out, indent=2)


if __name__ == "__main__":
    main()
