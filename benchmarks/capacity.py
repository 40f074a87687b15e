"""How much bigger a model can you train? The largest Llama of one family whose training step fits a
per-rank memory budget, under DDP, FSDP2, rsdp, the planner, and LoRA under FSDP2 and rsdp; or, with
``--family moe``, the largest mixture-of-experts model (experts per layer growing) under DDP, FSDP2, rsdp.

    python benchmarks/capacity.py --nproc 4 --budget 512MiB                  # every strategy, CPU ranks (gloo)
    python benchmarks/capacity.py --family moe --nproc 4 --budget 48MiB --plot img/capacity_moe.png
    python benchmarks/capacity.py --nproc 2 --budget 256MiB --strategies fsdp rsdp --json capacity.json
    python benchmarks/capacity.py --device cuda --nproc 8 --budget 20GiB     # NCCL; one rank per GPU

The family
----------
A Llama-2-style decoder (pre-norm RMSNorm, rotary positions, SwiGLU MLP, no biases, an LM head not tied
to the embedding; the module names and parameter count of Hugging Face's ``LlamaForCausalLM``), with a
large vocabulary (``--vocab``, default Llama 2's 32000) and two knobs: the width ``k`` sets hidden
``64k``, ``k`` heads of 64 (as many key/value heads) and feed-forward ``64 * ceil(8k / 3)`` (Llama's 8/3
of hidden, rounded up to a multiple of 64); the depth is the number of layers. The search walks the
ladder ``(k, layers) = (2, 2), (2, 3), (3, 3), (3, 4), ...``: depth about width / 64, GPT-2 small's aspect
ratio (it is the rung ``(12, 12)``), each rung adding one layer or 64 of width. Every rung is at least as
large as the one before in every dimension, so what a training step holds grows along the ladder and
"fits the budget" is true up to some rung and false after it.

The MoE family (``--family moe``)
--------------------------------
Hugging Face's Mixtral (``benchmarks/rtp/moe_lm.py``, built from a config): 2 layers of hidden 128, 4
heads, and at rung i ``4 (i + 1)`` experts of feed-forward 256 each (a token takes 2), vocabulary
``--vocab``. Only the experts grow, so they soon are nearly all the weights: the regime where FSDP2
gathers whole layers of experts and rsdp rotates them in blocks of whole experts (``rsdp_shard(layer)``
needs nothing more). Its strategies are ddp, fsdp and rsdp (the planner and the LoRA recipes are the
Llama family's).

The model is built on the meta device and materialised on each rank after sharding (``to_empty``), so
a rank only ever allocates its own shards; its values are random (every rank fills its local tensors
from the same seed: the figures depend on shapes, not values).

What a probe measures
---------------------
One probe is one rung under one strategy: build, parallelise, materialise, build AdamW, one warm-up step
(lazy initialisation, optimizer state, DDP's bucket rebuild), then one measured step (forward, backward,
``optimizer.step()``, ``zero_grad(set_to_none=True)``) on a ``--batch-size`` x ``--seq-len`` batch of
random tokens. Its peak is the most memory the rank held at any moment of the measured step, counting
everything the probe allocated since before the model existed: its parameter shards, gradients,
optimizer state, whatever the strategy keeps between steps (DDP's gradient buckets, rsdp's ring buffers
should they outlive a pass), and the step's transients (FSDP2's gathered layers and unsharded gradients,
rsdp's ring messages, activations, logits). ``rsdp.memory.MemoryTracker`` is entered before the model is
built: on CUDA it reads the caching allocator's allocated bytes (``max_memory_allocated``), on CPU it
counts the storages that ops create and ``UntypedStorage.resize_`` grows; the same count for every
strategy. Not counted: the backend's own buffers (gloo's, NCCL's) and the CUDA allocator's cached but
unallocated blocks. The figure is the maximum over ranks, and a rung fits when it is within the budget.
On CUDA the budget is measured by the allocator, not enforced by it (``set_per_process_memory_fraction``):
an enforced budget turns a probe above it into an out-of-memory error on one rank in the middle of a
collective, with the other ranks waiting in NCCL until its timeout, and the search needs the measured
peak of the rung after the answer.

Pitfalls this file handles:
- rsdp's ring buffers are shared by the whole process and keep their size from pass to pass: left by
  an earlier probe, they would spare the next one allocating (and counting) them, or come back at the
  earlier model's size. ``release_ring_buffers()`` before each probe frees them, and sharding the
  probe's model makes them forget their sizes.
- Autograd graphs form reference cycles; the cyclic collector is held off during the measured step
  (after collecting the warm-up's garbage) so that the peak does not depend on when it happens to run.
- ``auto`` plans as torchtitan's ``dp_strategy=auto`` does: ``rsdp.plan`` with a ``CostModel`` on the
  meta-device model (no copy of the model is materialised, no step is run to plan; the cost model's
  peak is an upper bound of a measured one), then the probe measures the plan's training step like any
  other. A rung fits under ``auto`` when the planner finds a plan for it *and* that plan's measured peak
  is within the budget; a plan that exceeds it is reported (``auto_exceeded``): the end-to-end check
  that the planner holds its budget.
- A rung whose parameters, gradients and AdamW moments alone exceed the budget (they all coexist when
  ``optimizer.step()`` begins) cannot fit and is not run: its "peak" is that lower bound.
"""

import argparse
import bisect
import dataclasses
import gc
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "rtp"))

import matplotlib  # noqa: E402  (the launcher and charts are shared with benchmarks/rtp)

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import common  # noqa: E402
from compare import loadavg  # noqa: E402
from moe_lm import MixtureLM  # noqa: E402

import rsdp  # noqa: E402
from rsdp.memory import MemoryTracker  # noqa: E402
from rsdp.planner._profile import without_cyclic_gc  # noqa: E402
from rsdp.planner.cli import parse_bytes  # noqa: E402

HEAD_DIM = 64
# The MoE family: a fixed backbone, experts per layer growing by MOE_EXPERTS_STEP a rung.
MOE_BACKBONE = {"layers": 2, "hidden": 128, "heads": 4, "ffn": 256}
MOE_EXPERTS_STEP = 4
MOE_STRATEGIES = ("ddp", "fsdp", "rsdp")
FAMILIES = ("llama", "moe")
FIRST_WIDTH = 2  # k of the ladder's first rung
LADDER_RUNGS = 200  # up to k = 101: hidden 6464, 102 layers (~60 B parameters), beyond any budget here
ROPE_THETA = 10000.0
NORM_EPS = 1e-5
INIT_STD = 0.02
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MODEL_SEED = 0
DATA_SEED = 1234
LEARNING_RATE = 1e-4
# auto's cost model. Its memory figures come from counting a meta-device step, not from these rates;
# the rates (of the order of one CPU rank) only order the plans that fit by predicted speed.
AUTO_FLOPS_PER_S = 50e9
AUTO_BANDWIDTH = 5e9
AUTO_LATENCY_S = 50e-6


# ---------------------------------------------------------------------------------------------------
# The model family


@dataclasses.dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    ffn: int  # the MLP's width, or each expert's
    vocab: int
    experts: int = 0  # per layer; 0: a dense MLP (the Llama family)

    @property
    def parameters(self) -> int:
        """Per layer: attention 4h², the MLP 3·h·ffn (or E experts of it and the router's h·E), two
        norms; then the embedding and the head (V·h each) and the final norm. Hugging Face's
        LlamaForCausalLM (MixtralForCausalLM) has the same count."""
        mlp = 3 * self.hidden * self.ffn if not self.experts else self.experts * (3 * self.hidden * self.ffn + self.hidden)
        per_layer = 4 * self.hidden**2 + mlp + 2 * self.hidden
        return self.layers * per_layer + 2 * self.vocab * self.hidden + self.hidden


def rung(index: int, vocab: int, family: str = "llama") -> Shape:
    """The ladder's ``index``-th shape: width k = FIRST_WIDTH + index // 2, depth k or k + 1; in the
    MoE family, the backbone with MOE_EXPERTS_STEP (index + 1) experts."""
    if family == "moe":
        return Shape(**MOE_BACKBONE, vocab=vocab, experts=MOE_EXPERTS_STEP * (index + 1))
    width = FIRST_WIDTH + index // 2
    return Shape(
        layers=width + index % 2,
        hidden=HEAD_DIM * width,
        heads=width,
        ffn=HEAD_DIM * math.ceil(8 * width / 3),
        vocab=vocab,
    )


def rotary_cos_sin(seq_len: int, head_dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # Computed per forward rather than held in a buffer: buffers built on the meta device would come
    # out of to_empty uninitialised.
    inv_freq = ROPE_THETA ** -(torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, shape: Shape):
        super().__init__()
        self.heads = shape.heads
        self.q_proj = nn.Linear(shape.hidden, shape.hidden, bias=False)
        self.k_proj = nn.Linear(shape.hidden, shape.hidden, bias=False)
        self.v_proj = nn.Linear(shape.hidden, shape.hidden, bias=False)
        self.o_proj = nn.Linear(shape.hidden, shape.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        q, k, v = (
            proj(x).view(batch, seq_len, self.heads, -1).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = F.scaled_dot_product_attention(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq_len, -1))


class MLP(nn.Module):
    def __init__(self, shape: Shape):
        super().__init__()
        self.gate_proj = nn.Linear(shape.hidden, shape.ffn, bias=False)
        self.up_proj = nn.Linear(shape.hidden, shape.ffn, bias=False)
        self.down_proj = nn.Linear(shape.ffn, shape.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, shape: Shape):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(shape.hidden, eps=NORM_EPS)
        self.self_attn = Attention(shape)
        self.post_attention_layernorm = nn.RMSNorm(shape.hidden, eps=NORM_EPS)
        self.mlp = MLP(shape)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """Token ids ``(batch, seq)`` -> logits ``(batch, seq, vocab)``. The root calls its units directly
    (embedding, each layer, final norm, head), each returning one tensor: the units ``rsdp.plan`` needs."""

    def __init__(self, shape: Shape):
        super().__init__()
        self.head_dim = shape.hidden // shape.heads
        self.embed_tokens = nn.Embedding(shape.vocab, shape.hidden)
        self.layers = nn.ModuleList(DecoderLayer(shape) for _ in range(shape.layers))
        self.norm = nn.RMSNorm(shape.hidden, eps=NORM_EPS)
        self.lm_head = nn.Linear(shape.hidden, shape.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        cos, sin = rotary_cos_sin(tokens.shape[1], self.head_dim, tokens.device)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


def build_on_meta(shape: Shape, lora_rank: int | None) -> nn.Module:
    """The rung's model on the meta device; with ``lora_rank``, peft LoRA adapters on the attention
    projections and the base frozen."""
    with torch.device("meta"):
        if shape.experts:
            return MixtureLM(shape.vocab, shape.hidden, shape.heads, shape.ffn, shape.layers, 2048, shape.experts, batch_first=True)
        model = Llama(shape)
        if lora_rank is None:
            return model
        import peft  # only the LoRA strategies need it (imported before the ranks fork: see main)

        config = peft.LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, lora_dropout=0.0, target_modules=list(LORA_TARGETS))
        return peft.get_peft_model(model, config)


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device) -> nn.Module:
    """Allocate this rank's part of every parameter on ``device`` and fill it: norm weights with ones,
    matrices (and experts' 3-D weights) with N(0, 0.02), from the same seed on every rank; the MoE
    model's rotary frequencies are computed again."""
    model.to_empty(device=device)
    torch.manual_seed(MODEL_SEED)
    for param in model.parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        if local.dim() == 1:
            local.fill_(1.0)
        else:
            local.normal_(std=INIT_STD)
    if isinstance(model, MixtureLM):
        model.reset_rotary()
    return model


def next_token_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor) -> None:
    next_token_loss(model, tokens).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


# ---------------------------------------------------------------------------------------------------
# Strategies


@dataclasses.dataclass(frozen=True)
class Recipe:
    description: str
    # Turns the meta-device model into this rank's part, materialised on the worker's device. Gets the
    # planner's Plan for ``planned`` recipes, None otherwise.
    parallelize: Callable[[nn.Module, common.Worker, "rsdp.Plan | None"], nn.Module]
    replicated: bool = False  # every rank holds every parameter (DDP)
    lora: bool = False
    planned: bool = False  # rsdp.plan chooses a strategy per module first


def _ddp(model: nn.Module, worker: common.Worker, plan: None) -> nn.Module:
    return DistributedDataParallel(materialize(model, worker.device))


def _sharded(shard: Callable) -> Callable:
    def parallelize(model: nn.Module, worker: common.Worker, plan: None) -> nn.Module:
        return materialize(common.shard_layers_then_root(shard, model, worker), worker.device)

    return parallelize


def _planned(model: nn.Module, worker: common.Worker, plan: "rsdp.Plan") -> nn.Module:
    return materialize(rsdp.parallelize(model, plan, mesh=worker.mesh), worker.device)


# FSDP2's blocks reshard after forward by default, its root does not; fsdp_reshard_root asks it to.
_fsdp_reshard_root = _sharded(lambda module, **kwargs: fully_shard(module, reshard_after_forward=True, **kwargs))

RECIPES = {
    "ddp": Recipe("torch DistributedDataParallel", _ddp, replicated=True),
    "fsdp": Recipe("FSDP2 fully_shard per layer and root, torch's defaults", _sharded(fully_shard)),
    "fsdp_reshard_root": Recipe("FSDP2, the root also resharded after forward", _fsdp_reshard_root),
    "rsdp": Recipe("rsdp_shard per layer and root", _sharded(rsdp.rsdp_shard)),
    "auto": Recipe("rsdp.plan(memory_budget=budget, cost_model=...), then rsdp.parallelize", _planned, planned=True),
    "fsdp_lora": Recipe("LoRA on the attention projections, FSDP2", _sharded(fully_shard), lora=True),
    "rsdp_lora": Recipe("LoRA on the attention projections, rsdp", _sharded(rsdp.rsdp_shard), lora=True),
}
# The order they run in: each baseline before what is compared with it, neighbours on nearby rungs.
STRATEGY_ORDER = tuple(RECIPES)


def baseline_of(strategy: str) -> str:
    """Full fine-tuning is compared with FSDP2's, LoRA with FSDP2's LoRA."""
    return "fsdp_lora" if RECIPES[strategy].lora else "fsdp"


# ---------------------------------------------------------------------------------------------------
# Probing and searching


@dataclasses.dataclass
class Probe:
    index: int
    shape: Shape
    parameters: int
    trainable_parameters: int
    peak_bytes: int | None  # measured, max over ranks; the resident lower bound when not run
    fits: bool
    measured: bool  # False: not run, the lower bound or the planner ruled it out
    step_seconds: float | None = None  # the measured step, slowest rank
    plan: dict[str, str] | None = None  # auto: module -> strategy
    predicted_peak_bytes: int | None = None  # auto: the cost model's peak for its plan
    note: str = ""


def _nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def _free_memory(device: torch.device) -> None:
    gc.collect()
    rsdp.release_ring_buffers()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def probe(strategy: str, index: int, worker: common.Worker) -> Probe:
    """Run rung ``index`` under ``strategy`` for a warm-up and a measured training step on every rank."""
    args, recipe = worker.args, RECIPES[strategy]
    shape = rung(index, args.vocab, args.family)
    model = build_on_meta(shape, args.lora_rank if recipe.lora else None)
    trainable = [p for p in model.parameters() if p.requires_grad]
    counts = dict(
        index=index,
        shape=shape,
        parameters=sum(p.numel() for p in model.parameters()),
        trainable_parameters=sum(p.numel() for p in trainable),
    )
    resident = (_nbytes(model.parameters()) + 3 * _nbytes(trainable)) // (1 if recipe.replicated else worker.world_size)
    if resident > args.budget:
        return Probe(**counts, peak_bytes=resident, fits=False, measured=False, note="parameters, gradients and AdamW state alone")

    generator = torch.Generator().manual_seed(DATA_SEED + worker.rank)
    tokens = torch.randint(shape.vocab, (args.batch_size, args.seq_len), generator=generator).to(worker.device)
    plan = None
    if recipe.planned:
        try:
            plan = _plan_for(shape, tokens, worker)
        except ValueError as infeasible:  # every rank agrees: the planner's figures are maxima over ranks
            return Probe(**counts, peak_bytes=None, fits=False, measured=False, note=str(infeasible))

    _free_memory(worker.device)  # nothing of an earlier probe may be reused uncounted, nor inflate this one
    with MemoryTracker(worker.device) as tracker:
        model = recipe.parallelize(model, worker, plan)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LEARNING_RATE)
        train_step(model, optimizer, tokens)
        with without_cyclic_gc():
            tracker.mark()
            start = time.perf_counter()
            train_step(model, optimizer, tokens)
            _, peak = tracker.mark()  # on CUDA mark() synchronises, so the time below includes the kernels
            seconds = time.perf_counter() - start
    del model, optimizer
    _free_memory(worker.device)

    worst = torch.tensor([float(peak), seconds], dtype=torch.float64, device=worker.device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    peak, seconds = int(worst[0].item()), worst[1].item()
    return Probe(
        **counts,
        peak_bytes=peak,
        fits=peak <= args.budget,
        measured=True,
        step_seconds=seconds,
        plan=None if plan is None else {name or "(root)": s.value for name, s in plan.strategies.items()},
        predicted_peak_bytes=None if plan is None else plan.predicted_peak_bytes,
    )


def _plan_for(shape: Shape, tokens: torch.Tensor, worker: common.Worker) -> "rsdp.Plan":
    """The planner's choice for the rung, planned on the meta device with the cost model, for the AdamW
    the probe runs (torch's default implementation: the for-loop one on CPU ranks, foreach on GPUs)."""
    strategies = tuple(rsdp.Strategy(name) for name in worker.args.auto_strategies)
    cost_model = rsdp.CostModel(
        world_size=worker.world_size, flops_per_s=AUTO_FLOPS_PER_S, bandwidth_bytes_per_s=AUTO_BANDWIDTH, latency_s=AUTO_LATENCY_S
    ).with_optimizer("adamw-for-loop" if worker.device.type == "cpu" else "adamw-foreach")
    return rsdp.plan(
        build_on_meta(shape, lora_rank=None), memory_budget=worker.args.budget, sample_input=tokens,
        loss_fn=next_token_loss, strategies=strategies, cost_model=cost_model,
    )


def largest_fitting(try_rung: Callable[[int], tuple[bool, int | None]], sizes: list[int], budget: int, hint: int) -> int:
    """The largest index of the ladder for which ``try_rung`` fits (-1 if none), for rungs that fit up to
    some index and not after it. ``try_rung(index)`` returns (fits, measured peak or None); ``sizes`` are
    the rungs' parameter counts, increasing.

    Every probe lies strictly inside the bracket (largest rung known to fit, smallest known not to), so
    each narrows it, and the search ends with the rung after the answer tried (unless the ladder ends
    there). The first probe is ``hint``; each next one is the largest rung that the measured peaks,
    read as a straight line in parameters, predict to fit; the bracket's middle while nothing is
    measured. Peaks grow about linearly with parameters, so this takes three or four probes where
    bisection takes six or more, and the probes it saves are of large rungs, the expensive ones.
    """
    known_fit, known_unfit = -1, len(sizes)
    measured: dict[int, int] = {}  # rung -> peak
    candidate = min(max(hint, 0), len(sizes) - 1)
    while known_unfit - known_fit > 1:
        fits, peak = try_rung(candidate)
        if peak is not None:
            measured[candidate] = peak
        if fits:
            known_fit = candidate
        else:
            known_unfit = candidate
        guess = _predicted_largest_fit(measured, sizes, budget)
        candidate = (known_fit + known_unfit) // 2 if guess is None else min(max(guess, known_fit + 1), known_unfit - 1)
    return known_fit


def _predicted_largest_fit(measured: dict[int, int], sizes: list[int], budget: int) -> int | None:
    """Interpolates between the nearest measured rungs on either side of the budget; while all lie on
    one side, extrapolates through the two nearest the budget (or the origin and the only one), by at
    most a doubling of parameters."""
    below = [index for index, peak in measured.items() if peak <= budget]
    above = [index for index, peak in measured.items() if peak > budget]
    if below and above:
        first, second = max(below), min(above)
    elif len(measured) >= 2:
        first, second = sorted(sorted(measured, key=lambda index: abs(measured[index] - budget))[:2])
    elif measured:
        first, second = None, next(iter(measured))
    else:
        return None
    size_0, peak_0 = (0, 0) if first is None else (sizes[first], measured[first])
    size_1, peak_1 = sizes[second], measured[second]
    if peak_1 <= peak_0:
        return None  # no usable slope (peaks equal within noise): bisect
    size_at_budget = size_0 + (budget - peak_0) * (size_1 - size_0) / (peak_1 - peak_0)
    if not above:
        size_at_budget = min(size_at_budget, 2 * size_1)
    return bisect.bisect_right(sizes, size_at_budget) - 1


def _format_params(count: int) -> str:
    return f"{count / 1e6:.1f} M"


def _describe(shape: Shape) -> str:
    return f"{shape.layers} x {shape.hidden}" + (f", {shape.experts} experts" if shape.experts else "")


def search(strategy: str, worker: common.Worker, hint: int) -> dict:
    """The largest rung that fits under ``strategy``, with every probe that found it."""
    probes: dict[int, Probe] = {}

    def try_rung(index: int) -> tuple[bool, int | None]:
        result = probes[index] = probe(strategy, index, worker)
        if worker.rank == 0:
            peak = "no plan" if result.peak_bytes is None else common.format_bytes(result.peak_bytes)
            how = f"{result.step_seconds:.2f} s step" if result.measured else f"not run: {result.note}"
            print(
                f"[{strategy}] rung {index} ({_describe(result.shape)}, {_format_params(result.parameters)} params): "
                f"{peak} -> {'fits' if result.fits else 'does not fit'} ({how})",
                flush=True,
            )
        return result.fits, result.peak_bytes if result.measured else None

    start = time.perf_counter()
    sizes = [rung(index, worker.args.vocab, worker.args.family).parameters for index in range(LADDER_RUNGS)]
    best = largest_fitting(try_rung, sizes, worker.args.budget, hint)
    found = probes.get(best)
    after = probes.get(best + 1)
    ordered = sorted(probes.values(), key=lambda p: p.index)
    return {
        "description": RECIPES[strategy].description,
        "ladder_index": best,
        "max_params": found.parameters if found else 0,
        "trainable_params": found.trainable_parameters if found else 0,
        "shape": dataclasses.asdict(found.shape) if found else None,
        "peak_bytes": found.peak_bytes if found else None,
        "step_seconds": found.step_seconds if found else None,
        "plan": found.plan if found else None,
        "predicted_peak_bytes": found.predicted_peak_bytes if found else None,
        # Planned rungs whose plan measured above the budget: the planner did not hold it (auto only).
        "exceeded": [
            {"index": p.index, "params": p.parameters, "peak_bytes": p.peak_bytes, "predicted_peak_bytes": p.predicted_peak_bytes}
            for p in ordered
            if p.predicted_peak_bytes is not None and not p.fits
        ],
        # The search's maximality: the next rung, tried and refused (None at the end of the ladder).
        "next_shape": dataclasses.asdict(after.shape) if after else None,
        "next_params": after.parameters if after else None,
        "next_peak_bytes": after.peak_bytes if after else None,
        "next_measured": after.measured if after else None,
        "next_note": after.note if after else None,
        "probes": [
            {"index": p.index, "params": p.parameters, "peak_bytes": p.peak_bytes, "fits": p.fits, "measured": p.measured,
             "step_seconds": p.step_seconds}
            for p in ordered
        ],
        "search_seconds": time.perf_counter() - start,
    }


# ---------------------------------------------------------------------------------------------------
# Running, reporting


def run_all(worker: common.Worker) -> None:
    # What the rank inherited (torch, transformers, peft) lives as long as it: frozen, it is left out of
    # the collections each probe runs (_free_memory), which would otherwise scan it (~0.25 s each).
    gc.freeze()
    args = worker.args
    loads = [loadavg()]
    start = time.perf_counter()
    results, hint = {}, 0
    for strategy in args.strategies:
        results[strategy] = search(strategy, worker, hint)
        hint = max(results[strategy]["ladder_index"], 0)  # neighbouring strategies land on nearby rungs
    loads.append(loadavg())
    if worker.rank != 0:
        return
    report = {
        "results": results,
        "budget_bytes": args.budget,
        "nproc": worker.world_size,
        "device": args.device,
        "family": {
            "name": args.family, "vocab": args.vocab, "head_dim": HEAD_DIM, "first_width": FIRST_WIDTH,
            "rule": "rung i: k = first_width + i // 2, hidden 64k, k heads (and kv heads), ffn 64 * ceil(8k / 3), k + i % 2 layers",
        } if args.family == "llama" else {
            "name": args.family, "vocab": args.vocab, **MOE_BACKBONE,
            "rule": f"rung i: Mixtral, {MOE_EXPERTS_STEP} (i + 1) experts of ffn {MOE_BACKBONE['ffn']} a layer, 2 per token",
        },
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "lora_rank": args.lora_rank,
        "auto_strategies": args.auto_strategies,
        "wall_seconds": time.perf_counter() - start,
        "loadavg": loads,
        "torch": torch.__version__,
    }
    print(f"\n{markdown_table(report)}\n")
    if "auto" in results:
        print(auto_check(results["auto"], args.budget))
    print(f"searched in {report['wall_seconds']:.0f} s; /proc/loadavg before and after: {' | '.join(loads)}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    if args.plot:
        draw_chart(report, args.plot)
        print(f"chart: {args.plot}")


def auto_check(auto: dict, budget: int) -> str:
    """Whether every plan the planner accepted stayed within the budget when it trained."""
    if auto["peak_bytes"] is None and not auto["exceeded"]:
        return f"auto: the planner found no plan for any rung within {common.format_bytes(budget)}"
    lines = [
        f"auto: the plan for rung {p['index']} ({_format_params(p['params'])} params) EXCEEDED the budget: measured "
        f"{common.format_bytes(p['peak_bytes'])}, predicted {common.format_bytes(p['predicted_peak_bytes'])}"
        for p in auto["exceeded"]
    ]
    if auto["peak_bytes"] is not None:
        lines.append(
            f"auto: the plan for the largest rung that fits ({_format_params(auto['max_params'])} params) measured "
            f"{common.format_bytes(auto['peak_bytes'])} of {common.format_bytes(budget)}, predicted "
            f"{common.format_bytes(auto['predicted_peak_bytes'])}; "
            + ("every plan accepted stayed within the budget" if not auto["exceeded"] else "see above")
        )
    return "\n".join(lines)


def markdown_table(report: dict) -> str:
    results = report["results"]
    moe = report["family"]["name"] == "moe"
    dimensions = ("layers", "hidden", "heads", "ffn", "vocab") + (("experts",) if moe else ())
    header = ["strategy", "max params", "× FSDP2", *dimensions, "trainable",
              "measured peak", "step time", "next rung: params, peak", "probes"]
    rows = [header, ["---"] * len(header)]
    for name, result in results.items():
        baseline = results.get(baseline_of(name))
        ratio = f"{result['max_params'] / baseline['max_params']:.2f}" if baseline and baseline["max_params"] else "-"
        shape = result["shape"] or dict.fromkeys(dimensions, "-")
        peak = common.format_bytes(result["peak_bytes"]) if result["peak_bytes"] is not None else "-"
        step = f"{result['step_seconds']:.2f} s" if result["step_seconds"] is not None else "-"
        if result["next_shape"] is None:
            after = "end of ladder"
        elif result["next_peak_bytes"] is None:
            after = f"{_format_params(result['next_params'])}, no plan"
        else:
            bound = "" if result["next_measured"] else " (lower bound, not run)"
            after = f"{_format_params(result['next_params'])}, {common.format_bytes(result['next_peak_bytes'])}{bound}"
        rows.append([name, _format_params(result["max_params"]), ratio, *(str(shape[k]) for k in dimensions),
                     _format_params(result["trainable_params"]), peak, step, after, str(len(result["probes"]))])
    title = (f"Largest {'MoE (Mixtral)' if moe else 'Llama'} rung within {common.format_bytes(report['budget_bytes'])} per rank, {report['nproc']} ranks, "
             f"{report['device']}, batch {report['batch_size']} x {report['seq_len']} tokens"
             + (" (× FSDP2: LoRA rows against fsdp_lora)" if any(RECIPES[name].lora for name in results) else ""))
    return title + "\n\n" + "\n".join("| " + " | ".join(row) + " |" for row in rows)


def draw_chart(report: dict, path: Path) -> None:
    results = report["results"]
    names = list(results)
    colors = ["tab:red" if "rsdp" in name or name == "auto" else "tab:gray" for name in names]
    figure, (params_axis, peak_axis) = plt.subplots(1, 2, figsize=(11, 3.8), constrained_layout=True)
    bars = params_axis.bar(names, [results[n]["max_params"] / 1e6 for n in names], color=colors)
    labels = []
    for name in names:
        baseline = results.get(baseline_of(name))
        ok = baseline and baseline["max_params"]
        labels.append(f"{results[name]['max_params'] / baseline['max_params']:.2f}×" if ok else "")
    params_axis.bar_label(bars, labels=labels, padding=2)
    params_axis.set_title("largest model that fits (higher is better; × its FSDP2 row)")
    params_axis.set_ylabel("parameters (millions)")
    params_axis.margins(y=0.15)
    peak_axis.bar(names, [(results[n]["peak_bytes"] or 0) / 2**20 for n in names], color=colors)
    peak_axis.axhline(report["budget_bytes"] / 2**20, color="black", linestyle="--", label="budget")
    peak_axis.set_title("its measured peak per rank")
    peak_axis.set_ylabel("MiB")
    peak_axis.legend(loc="lower right")
    for axis in (params_axis, peak_axis):
        plt.setp(axis.get_xticklabels(), rotation=30, ha="right", rotation_mode="anchor")
    figure.suptitle(
        f"{report['nproc']} ranks ({report['device']}), {common.format_bytes(report['budget_bytes'])} per rank, "
        f"{'MoE (Mixtral, experts growing)' if report['family']['name'] == 'moe' else 'Llama'} family with vocab "
        f"{report['family']['vocab']}, batch {report['batch_size']} x {report['seq_len']}",
        fontsize=10,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--budget", type=parse_bytes, default=parse_bytes("512MiB"), help="bytes per rank, e.g. 512MiB, 8GiB")
    parser.add_argument("--nproc", type=int, help="local ranks to start when not under torchrun [4 on CPU, one per GPU]")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu: gloo ranks; cuda: NCCL, one GPU per rank")
    parser.add_argument("--family", choices=FAMILIES, default="llama", help="the models searched (module docstring)")
    parser.add_argument("--strategies", nargs="+", choices=STRATEGY_ORDER, help=f"[all; {' '.join(MOE_STRATEGIES)} for moe]")
    parser.add_argument("--vocab", type=int, help="the family's vocabulary size [32000; 1024 for moe]")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--batch-size", type=int, default=1, help="sequences per rank")
    parser.add_argument("--lora-rank", type=int, default=8, help="LoRA rank of the *_lora strategies")
    parser.add_argument(
        "--auto-strategies", nargs="+", choices=[s.value for s in rsdp.Strategy], default=["fsdp", "rsdp"],
        help="what rsdp.plan may choose per module (replicate doubles its profiling time and memory, and cannot win "
        "a capacity search)",
    )
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    parser.add_argument("--plot", type=Path, default=HERE.parent / "img" / "capacity.png", help="where to draw the chart")
    parser.add_argument("--no-plot", dest="plot", action="store_const", const=None, help="draw no chart")
    # fp32 throughout: common.mixed_precision() then gives FSDP2 and rsdp their default policy.
    parser.set_defaults(dtype="fp32")
    args = parser.parse_args(argv)
    if args.budget <= 0:
        parser.error(f"--budget must be positive, got {args.budget} bytes; pass e.g. --budget 512MiB")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible; run on a GPU machine or pass --device cpu")
    if args.nproc is None:
        args.nproc = torch.cuda.device_count() if args.device == "cuda" else 4
    if args.nproc < 1:
        parser.error(f"--nproc must be at least 1, got {args.nproc}")
    if args.device == "cuda" and args.nproc > torch.cuda.device_count():
        parser.error(f"--nproc {args.nproc}: only {torch.cuda.device_count()} GPUs are visible and each rank needs its own; pass --nproc {torch.cuda.device_count()}")
    if args.seq_len < 2 or args.batch_size < 1:
        parser.error("--seq-len must be at least 2 (next-token targets) and --batch-size at least 1")
    moe = args.family == "moe"
    if args.vocab is None:
        args.vocab = 1024 if moe else 32000
    if args.strategies is None:
        args.strategies = list(MOE_STRATEGIES if moe else STRATEGY_ORDER)
    unsupported = [name for name in args.strategies if moe and name not in MOE_STRATEGIES]
    if unsupported:
        parser.error(f"--family moe runs {' '.join(MOE_STRATEGIES)}; {' '.join(unsupported)} are the Llama family's (drop them)")
    if args.vocab < 2 or args.lora_rank < 1:
        parser.error("--vocab must be at least 2 and --lora-rank at least 1")
    args.strategies = [name for name in STRATEGY_ORDER if name in args.strategies]  # baselines first, hints in order
    return args


def main() -> None:
    args = parse_args()
    if any(RECIPES[name].lora for name in args.strategies):
        import peft  # noqa: F401  (imported once here, so that forked CPU ranks do not each import it)
    common.launch(run_all, args)


if __name__ == "__main__":
    main()
