"""Peak memory against FSDP2 (deterministic on CPU), and mixed precision against FSDP2's."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from models import TinyLM, assert_close, full, lm_loss, local_rows, rank_and_world
from rsdp import MixedPrecisionPolicy, rsdp_shard
from rsdp._compat import fully_shard
from rsdp.memory import MemoryTracker


def linear_stack_peak(strategy, dim, layers, rows):
    """Peak bytes above the sharded parameters in one forward+backward of a stack of Linears,
    after a warm-up step, with gradients freed as ``zero_grad()`` does."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(dim, dim, bias=False) for _ in range(layers)))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    shard = rsdp_shard if strategy == "rsdp" else fully_shard
    for layer in model:
        shard(layer, mesh=mesh)
    shard(model, mesh=mesh)
    x = torch.randn(rows, dim, requires_grad=True)
    model(x).sum().backward()
    for param in model.parameters():
        param.grad = None
    x.grad = None
    with MemoryTracker() as tracker:
        model(x).sum().backward()
    return tracker.peak_bytes


def memory_case(dim, layers, rows):
    return {strategy: linear_stack_peak(strategy, dim, layers, rows) for strategy in ("fsdp", "rsdp")}


def test_peak_memory_at_most_half_of_fsdp2_on_4_ranks(ranks):
    peaks = ranks.run(4, memory_case, 512, 6, 8)
    for rank, peak in enumerate(peaks):
        ratio = peak["rsdp"] / peak["fsdp"]
        print(f"rank {rank}: fsdp {peak['fsdp'] / 2**20:.2f} MiB, rsdp {peak['rsdp'] / 2**20:.2f} MiB, ratio {ratio:.3f}")
        assert ratio <= 0.5, f"rank {rank}: rsdp peak {peak['rsdp']} B is {ratio:.2f} of fsdp's {peak['fsdp']} B"


def tracker_counts_what_it_should_case():
    """The tracker's figures for a known sequence of allocations (a test of the ruler itself)."""
    mib = 2**20
    existing = torch.zeros(mib // 4)
    with MemoryTracker() as tracker:
        a = torch.empty(mib // 4)
        b = a + 1
        existing.add_(1)  # in place: not an allocation
        del a
        buffer = torch.empty(0)
        buffer.untyped_storage().resize_(2 * mib)  # FSDP2 allocates this way
        peak_then = tracker.current_bytes
        buffer.untyped_storage().resize_(0)
        del b
    assert peak_then == 3 * mib
    assert tracker.peak_bytes == 3 * mib
    assert tracker.current_bytes == 0


def test_memory_tracker_counts_allocations_views_and_resizes(ranks):
    ranks.run(1, tracker_counts_what_it_should_case)


def bf16_case(seed):
    """The same bf16 policy under rsdp and under FSDP2: outputs and gradients agree within bf16
    tolerance, and sharded parameters and gradients stay fp32."""
    rank, world = rank_and_world()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mesh = init_device_mesh("cpu", (world,))
    models = {}
    for name, shard in (("rsdp", rsdp_shard), ("fsdp", fully_shard)):
        torch.manual_seed(seed)
        model = TinyLM(vocab=33, dim=16, heads=2, hidden=24, layers=2)
        for layer in model.layers:
            shard(layer, mesh=mesh, mp_policy=policy)
        models[name] = shard(model, mesh=mesh, mp_policy=policy)
    tokens = torch.randint(0, 33, (world * 2, 8))
    mine = local_rows(tokens, rank, world)
    losses = {}
    for name, model in models.items():
        logits = model(mine)
        assert logits.dtype == torch.bfloat16
        losses[name] = lm_loss(logits.float(), mine)
        losses[name].backward()
    assert_close(losses["rsdp"], losses["fsdp"], what="bf16 loss", rtol=2e-2, atol=2e-2)
    fsdp_params = dict(models["fsdp"].named_parameters())
    for name, param in models["rsdp"].named_parameters():
        assert param.dtype == torch.float32 and param.grad.dtype == torch.float32, name
        expected = full(fsdp_params[name].grad)
        scale = expected.abs().max().clamp_min(1e-3)
        assert_close(full(param.grad) / scale, expected / scale, what=f"bf16 grad of {name}", rtol=0, atol=3e-2)


def test_bf16_policy_matches_fsdp2(ranks):
    ranks.run(2, bf16_case, 11)
