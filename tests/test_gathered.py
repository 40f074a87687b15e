"""The parameters rsdp gathers instead of rotating (vectors: norm weights, biases) behave like FSDP2's
unsharded parameters, next to matrices that rotate op by op (a Conv1D).

Leaf ``nn.Parameter``s while installed (torch's ``MemTracker`` works), optionally resharded after
forward and gathered again for backward, ``None`` gradients for what no rank used, replacements honoured
or refused, and methods other than ``forward``.
"""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from models import assert_close, assert_param_grads_match, local_rows, rank_and_world, twin
from rsdp import register_rsdp_forward_method, rsdp_shard
from rsdp.memory import CommCounter, MemoryTracker

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from host_overhead import OpCounter  # noqa: E402


class Conv1D(nn.Module):
    """Hugging Face GPT-2's Conv1D: weight ``[in, out]`` used by ``torch.addmm`` (rotates op by op)."""

    def __init__(self, out_features: int, in_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(in_features, out_features) * 0.3)
        self.bias = nn.Parameter(torch.randn(out_features) * 0.1)

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], -1)


class MixedBlock(nn.Module):
    """Gathered parameters of every kind (norm, Conv1D bias, a free scale, an unused norm) around a
    rotating Conv1D weight and Linear. ``use_scale`` may differ per rank: the scale is then used on some ranks only."""

    def __init__(self, dim: int = 6, hidden: int = 10):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.proj = Conv1D(hidden, dim)
        self.out = nn.Linear(hidden, dim)
        self.scale = nn.Parameter(torch.rand(dim) + 0.5)
        self.unused = nn.LayerNorm(dim)
        self.use_scale = True

    def encode(self, x):
        return F.gelu(self.proj(self.norm(x)))

    def forward(self, x):
        y = self.out(self.encode(x))
        return x + (y * self.scale if self.use_scale else y)


def _global_batch(world, rows=2, seq=3, dim=6):
    torch.manual_seed(1)
    return torch.randn(world * rows, seq, dim, dtype=torch.float64)


def _reference_loss(reference, x, world, use_scale_on):
    """Sum over ranks of each rank's ``out.sum()``, divided by W: what rsdp's mean reduction gives."""
    total = 0
    for rank in range(world):
        reference.use_scale = rank in use_scale_on
        total = total + reference(local_rows(x, rank, world)).sum()
    return total / world


def reshard_case(reshard_after_forward):
    """Exact gradients over two steps; which full tensors are alive between forward and backward."""
    rank, world = rank_and_world()
    torch.manual_seed(0)
    block = MixedBlock().double()
    reference = twin(block)
    rsdp_shard(block, reshard_after_forward=reshard_after_forward)
    x = _global_batch(world)
    alive_between = []
    for _ in range(2):
        with MemoryTracker() as tracker:
            out = block(local_rows(x, rank, world).requires_grad_())
            alive_between.append(tracker.current_bytes)
            out.sum().backward()
        _reference_loss(reference, x, world, range(world)).backward()
        assert_param_grads_match(block, reference, 1.0)
    gathered = block._get_rsdp_state().gathered
    return gathered.reshard_after_forward, alive_between[1], gathered.full_nbytes


@pytest.mark.parametrize("world", [2, 3])
def test_gathered_parameters_resharded_after_forward_on_request_and_exact(ranks, world):
    """``reshard_after_forward=True`` frees the full tensors after forward (exactly their bytes fewer
    alive until backward, padding rows included) and gathers them again for backward; gradients are exact either way."""
    for kept, resharded in zip(ranks.run(world, reshard_case, False), ranks.run(world, reshard_case, True)):
        assert kept[0] is False and resharded[0] is True
        assert kept[1] - resharded[1] == kept[2], (kept, resharded)


def frozen_case(reshard_after_forward):
    """Frozen gathered parameters (a LoRA base) still serve the input gradient: autograd saved them, so
    they are gathered again for backward when resharded, and kept when not."""
    rank, world = rank_and_world()
    torch.manual_seed(0)
    block = MixedBlock().double()
    for param in block.parameters():
        param.requires_grad_(False)
    reference = twin(block)
    rsdp_shard(block, reshard_after_forward=reshard_after_forward)
    x = _global_batch(world).requires_grad_()
    mine = local_rows(x.detach(), rank, world).requires_grad_()
    for _ in range(2):
        block(mine).sum().backward()
    _reference_loss(reference, x, world, range(world)).backward()
    assert_close(mine.grad, 2 * world * local_rows(x.grad, rank, world), what="input gradient")
    assert all(param.grad is None for param in block.parameters())
    return block._get_rsdp_state().gathered.is_gathered


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_frozen_gathered_parameters_serve_the_input_gradient(ranks, reshard_after_forward):
    assert ranks.run(2, frozen_case, reshard_after_forward) == [False, False]


def vectors_are_kept_case():
    torch.manual_seed(0)
    block = nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 4))
    rsdp_shard(block)
    with CommCounter() as comm:
        block(torch.randn(2, 4)).sum().backward()
    return block._get_rsdp_state().gathered.reshard_after_forward, comm.calls


def test_vectors_are_kept_until_backward_by_default(ranks):
    """Norm weights and biases (1-D) are not resharded: one all-gather per step, not two."""
    for reshard, calls in ranks.run(2, vectors_are_kept_case):
        assert reshard is False
        gathers = sum(n for op, n in calls.items() if "allgather" in op or "all_gather" in op)
        assert gathers == 1, calls


class Stack(nn.Module):
    def __init__(self, blocks: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList(MixedBlock() for _ in range(blocks))
        self.norm = nn.LayerNorm(6)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def one_collective_case(reshard_last):
    """Collectives per step of a 3-block stack (rsdp per block, then the root) and exact gradients over
    two SGD steps; then the first block called on its own, with the updated parameters."""
    rank, world = rank_and_world()
    torch.manual_seed(0)
    model = Stack().double()
    reference = twin(model)
    for index, block in enumerate(model.blocks):
        rsdp_shard(block, reshard_after_forward=reshard_last and index == 2)
    rsdp_shard(model)
    optimizer, reference_optimizer = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    x = _global_batch(world)
    calls = []
    for _ in range(2):
        with CommCounter() as comm:
            model(local_rows(x, rank, world)).sum().backward()
        calls.append({op: n for op, n in comm.calls.items() if "send" not in op})
        (sum(reference(local_rows(x, r, world)).sum() for r in range(world)) / world).backward()
        assert_param_grads_match(model, reference, 1.0)
        for opt in (optimizer, reference_optimizer):
            opt.step()
            opt.zero_grad()
    with torch.no_grad():
        assert_close(model.blocks[0](local_rows(x, rank, world)), reference.blocks[0](local_rows(x, rank, world)), what="block 0 alone")
    return calls


@pytest.mark.parametrize("world", [2, 3])
def test_every_modules_vectors_travel_in_one_collective_per_pass(ranks, world):
    """The outermost forward gathers the vectors of every rsdp module under it in one all-gather, and
    the backward reduce-scatters their gradients in one when it ends: 2 collectives per step, not 2 per
    module. A module resharded after forward gathers its own (forward and backward); gradients stay
    exact, and a module called on its own after an optimizer step gathers its updated parameters."""
    gather, scatter = "c10d::_allgather_base_", "c10d::_reduce_scatter_base_"
    for reshard_last, gathers in [(False, 1), (True, 3)]:
        for first, second in ranks.run(world, one_collective_case, reshard_last):
            assert second == {gather: gathers, scatter: 1}, second
            # The first step also agrees on which Linears share an input (_fusion.py), once per module.
            assert first == {**second, "c10d::allreduce_": 3}, first


class NormThenLinear(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm, self.linear = nn.LayerNorm(dim), nn.Linear(dim, dim)

    def forward(self, x):
        return self.linear(self.norm(x))


class BlockFirstOrNot(nn.Module):
    """A root whose Linear (its ring, the forward's carrier) runs first, or after the first block
    (``block_first``): then that block's forward, and its norm, start before any ring."""

    def __init__(self, dim=5):
        super().__init__()
        self.entry = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(NormThenLinear(dim) for _ in range(2))
        self.block_first = False

    def forward(self, x):
        first, second = self.blocks
        if self.block_first:
            return second(self.entry(first(x)))
        return second(first(self.entry(x)))


def left_to_the_carrier_case(orders):
    """All-gathers per forward, each step checked against the fp64 reference (output, input gradient,
    every parameter gradient), as the order of the blocks and the root's ring changes."""
    rank, world = rank_and_world()
    torch.manual_seed(0)
    model = BlockFirstOrNot().double()
    reference = twin(model)
    for block in model.blocks:
        rsdp_shard(block)
    rsdp_shard(model)
    gathers = []
    for step, block_first in enumerate(orders):
        model.block_first = reference.block_first = block_first
        x = torch.randn(world * 2, 3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        mine = local_rows(x, rank, world).requires_grad_()
        with CommCounter() as comm:
            out = model(mine)
        gathers.append(comm.calls["c10d::_allgather_base_"])
        out.pow(2).sum().backward()
        full = x.clone().requires_grad_()
        expected = reference(full)
        (expected.pow(2).sum() / world).backward()
        assert_close(out, local_rows(expected, rank, world), what=f"output at step {step}")
        assert_close(mine.grad, local_rows(full.grad, rank, world) * world, what=f"input grad at step {step}")
        assert_param_grads_match(model, reference, 1.0)
        model.zero_grad()
        reference.zero_grad()
    return gathers


@pytest.mark.parametrize("world", [2, 3])
def test_gathers_are_left_to_the_ring_the_forwards_record_says_carries_them(ranks, world):
    """The blocks' norms ride the forward's first ring able to carry them (the carrier) when the
    record of the last forward says their forwards began after it; a block that began before it is
    gathered at the start. A forward whose order differs from its record gathers what it finds
    pending when a module needs it (never a wrong number) and is recorded for the next: all-gathers
    per forward for the steps normal, normal, block first, block first, normal, normal."""
    orders = [False, False, True, True, False, False]
    for gathers in ranks.run(world, left_to_the_carrier_case, orders):
        # 1: no record yet (all at the start); 0: both ride; 1: both pending, gathered at the first
        # block's start; 1: that block at the start, the other rides its Linear's ring; 1: that block
        # at the start, the other rides the root's ring; 0: both ride again.
        assert gathers == [1, 0, 1, 1, 1, 0], gathers


def vector_ops_case():
    """The aten ops of a training step of a module whose parameters are all gathered (vectors)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(12), nn.LayerNorm(12, bias=False))
    rsdp_shard(model)
    x = torch.randn(3, 12, requires_grad=True)
    model(x).sum().backward()  # warm-up: the persistent full tensors are made
    with OpCounter() as ops:
        model(x).sum().backward()
    return ops.by_op


def test_gathered_vectors_cost_the_same_ops_at_any_world_size(ranks):
    """Unpacking the gathered vectors and laying out their gradients takes a few copies per parameter,
    whatever the number of ranks (not one per rank: each op is a host dispatch, a kernel on a GPU)."""
    counts = {world: ranks.run(world, vector_ops_case)[0] for world in (2, 4)}
    assert counts[2] == counts[4], counts


class TwoWidths(nn.Module):
    """Vectors of two widths: a norm's weight and bias and a bias-free norm's weight (12), a norm's (7)."""

    def __init__(self):
        super().__init__()
        self.wide, self.wide_no_bias, self.narrow = nn.LayerNorm(12), nn.LayerNorm(12, bias=False), nn.LayerNorm(7)

    def forward(self, x):
        return self.wide_no_bias(self.wide(x)).sum() + self.narrow(x[:, :7]).sum()


def refill_case():
    """The aten ops of refilling a module's full vectors from a gather (``[W, segment]``), and what
    they hold then."""
    _, world = rank_and_world()
    model = TwoWidths()
    rsdp_shard(model)
    model(torch.randn(3, 12)).backward()  # the full tensors exist
    gathered = model._get_rsdp_state().gathered
    received = torch.arange(world * gathered.segment_numel, dtype=torch.float32).view(world, -1)
    with OpCounter() as ops:
        gathered._unpack(received)
    for full, start, stop in zip(gathered.full, gathered._offsets, gathered._offsets[1:]):
        expected = received[:, start:stop].reshape(-1)[: full.numel()]  # every rank's rows, in rank order
        assert torch.equal(full.detach(), expected), (full, expected)
    return ops.by_op


@pytest.mark.parametrize("world", [2, 3])
def test_gathered_vectors_are_refilled_by_one_copy_per_run_of_equal_widths(ranks, world):
    """The wide norms' three vectors are refilled by one copy, the narrow norm's two by a second (the
    last rank's rows short at W=3): not one copy, and a few views, per parameter."""
    by_op = ranks.run(world, refill_case)[0]
    assert by_op["aten.copy_"] == 2 and sum(by_op.values()) <= 10, by_op


def unused_case():
    """``unused`` is used by no rank, ``scale`` by rank 0 only."""
    rank, world = rank_and_world()
    torch.manual_seed(0)
    block = MixedBlock().double()
    reference = twin(block)
    rsdp_shard(block)
    x = _global_batch(world)
    block.use_scale = rank == 0
    block(local_rows(x, rank, world)).sum().backward()
    _reference_loss(reference, x, world, {0}).backward()
    assert reference.unused.weight.grad is None and reference.scale.grad is not None
    assert_param_grads_match(block, reference, 1.0)
    return block.unused.weight.grad is None


@pytest.mark.parametrize("world", [2, 3])
def test_parameters_no_rank_used_get_none_and_one_rank_suffices(ranks, world):
    assert all(ranks.run(world, unused_case))


def leaf_and_mem_tracker_case():
    from torch.distributed._tools.mem_tracker import MemTracker

    rank, world = rank_and_world()
    torch.manual_seed(0)
    block = MixedBlock().double()
    reference = twin(block)
    rsdp_shard(block)
    seen = []
    block.norm.register_forward_pre_hook(lambda module, args: seen.append(module.weight.is_leaf and isinstance(module.weight, nn.Parameter)))
    optimizer = torch.optim.AdamW(block.parameters(), lr=1e-2)
    tracker = MemTracker()
    tracker.track_external(block, optimizer)
    x = _global_batch(world)
    with tracker:
        block(local_rows(x, rank, world)).sum().backward()
        optimizer.step()
    _reference_loss(reference, x, world, range(world)).backward()
    assert_param_grads_match(block, reference, 1.0)
    return seen, tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def test_installed_parameters_are_leaves_and_torch_mem_tracker_works(ranks):
    for seen, peak in ranks.run(2, leaf_and_mem_tracker_case):
        assert seen == [True]
        assert peak > 0


def replaced_case():
    rank, world = rank_and_world()
    torch.manual_seed(0)
    block = MixedBlock().double()
    reference = twin(block)
    rsdp_shard(block)
    new_values = {name: value * 2 if name.startswith(("norm.", "proj.")) else value for name, value in block.state_dict().items()}
    block.load_state_dict(new_values, assign=True)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if name.startswith(("norm.", "proj.")):
                param.mul_(2)
    x = _global_batch(world)
    out = block(local_rows(x, rank, world))
    assert_close(out, reference(local_rows(x, rank, world)), what="output after load_state_dict(assign=True)")
    out.sum().backward()
    _reference_loss(reference, x, world, range(world)).backward()
    assert_param_grads_match(block, reference, 1.0)

    sharded_weight = block.norm.weight
    block.norm.weight = nn.Parameter(torch.ones(6, dtype=torch.float64))
    with pytest.raises(RuntimeError, match=r"LayerNorm.weight is no longer the sharded DTensor parameter .* not a DTensor parameter sharded like it"):
        block(local_rows(x, rank, world))
    # The forward that raised was closed: the next one is an outermost forward again, which frees the
    # ring buffers as it ends.
    block.norm.weight = sharded_weight
    with torch.no_grad():
        block(local_rows(x, rank, world))
    held = block._get_rsdp_state().ring.context.buffers.nbytes
    assert held == 0, held
    return True


def test_replaced_gathered_parameters_are_honoured_or_refused(ranks):
    """``load_state_dict(assign=True)`` with the module's own (sharded) state dict takes effect; a
    plain full tensor assigned in its place raises instead of being silently undone."""
    assert all(ranks.run(2, replaced_case))


def forward_method_case():
    rank, world = rank_and_world()
    torch.manual_seed(0)
    block = MixedBlock().double()
    reference = twin(block)
    rsdp_shard(block)
    x = _global_batch(world)
    mine = local_rows(x, rank, world)
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
        block.encode(mine)
    register_rsdp_forward_method(block, "encode")
    register_rsdp_forward_method(block, "forward")
    encoded = block.encode(mine)
    assert_close(encoded, reference.encode(mine), what="encode")
    encoded.sum().backward()
    sum(reference.encode(local_rows(x, r, world)).sum() for r in range(world)).div(world).backward()
    assert_param_grads_match(block, reference, 1.0)
    with CommCounter() as comm:
        direct = block.forward(mine)
        called = block(mine)
    assert_close(direct, called, what="forward() against __call__")
    gathers = sum(n for op, n in comm.calls.items() if "allgather" in op or "all_gather" in op)
    return gathers


def test_methods_registered_like_fsdp2_forward_methods(ranks):
    """``register_rsdp_forward_method`` (FSDP2's ``register_fsdp_forward_method``): ``encode`` and a
    direct ``forward()`` gather like a call; ``module(x)`` still gathers once."""
    assert ranks.run(2, forward_method_case) == [2, 2]


def test_register_forward_method_on_a_plain_module_says_what_to_do():
    with pytest.raises(ValueError, match="not an rsdp module; call it on the module you passed to rsdp_shard"):
        register_rsdp_forward_method(nn.Linear(2, 2), "forward")
