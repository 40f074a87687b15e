"""Ring plans: a whole attention or MLP sub-block rotates as one ring, against the fp64 reference."""

import collections
import gc

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.utils.checkpoint import checkpoint

from models import (
    Attention,
    LlamaBlock,
    MLP,
    ScaledMLP,
    TITAN_PLAN,
    assert_param_grads_match,
    check_against_reference,
    local_rows,
    planned_llama,
    rank_and_world,
    train_and_compare,
    twin,
)
from rsdp import rsdp_shard
from rsdp._compat import in_backward
from rsdp.memory import CommCounter, MemoryTracker
from test_ring_ops import OpCounter


def block_case(seed, kv_heads, head_dim, hidden_per_rank, rows):
    torch.manual_seed(seed)
    _, world = rank_and_world()
    heads = 2 * world
    dim = 5  # the model width need not divide: only the planned features must
    block = LlamaBlock(dim, heads, kv_heads * world, head_dim, hidden_per_rank * world).double()
    reference = twin(block)
    rsdp_shard(block, ring_plan=TITAN_PLAN)
    assert type(block.self_attn).__qualname__.startswith("RingSub")
    assert block.self_attn.o_proj.weight.placements[-1].dim == 1
    check_against_reference(
        block,
        reference,
        torch.randn(world * rows, 4, dim, dtype=torch.float64),
        torch.randn(world * rows, 4, dim, dtype=torch.float64),
    )


@given(world=st.sampled_from([1, 2, 3, 4]), kv_heads=st.sampled_from([1, 2]), head_dim=st.integers(1, 3),
       hidden_per_rank=st.integers(1, 3), rows=st.integers(1, 2))
def test_planned_block_matches_reference(ranks, world, kv_heads, head_dim, hidden_per_rank, rows):
    ranks.run(world, block_case, 20, kv_heads, head_dim, hidden_per_rank, rows)


def lm_case(seed, sync_last_only):
    torch.manual_seed(seed)
    model, reference = planned_llama()
    micro = 2 if sync_last_only else 1
    train_and_compare(model, reference, steps=3, rows=1, seq=5, micro_batches=micro, sync_last_only=sync_last_only, clip=1.0)


@pytest.mark.parametrize("world, sync_last_only", [(2, False), (3, True), (4, False)])
def test_planned_lm_trajectory_with_hugging_face_plan(ranks, world, sync_last_only):
    ranks.run(world, lm_case, 21, sync_last_only)


def hsdp_case(seed):
    """Replicas of 2 shards: a deferred hop's gradients arrive after their module's post-backward and
    join the end-of-backward all-reduce over the replicas."""
    torch.manual_seed(seed)
    model, reference = planned_llama(mesh=init_device_mesh("cpu", (2, 2)))
    train_and_compare(model, reference, steps=3, rows=1, seq=5, micro_batches=2)


def test_planned_lm_trajectory_under_hsdp(ranks):
    ranks.run(4, hsdp_case, 22)


def exchanges_case():
    torch.manual_seed(0)
    _, world = rank_and_world()
    block = LlamaBlock(16, 8, 4, 2, 24)
    rsdp_shard(block, ring_plan=TITAN_PLAN)
    x = torch.randn(2, 5, 16, requires_grad=True)
    for _ in range(2):  # the first learns the order of the rings, the second the ring buffers' sizes
        block(x).sum().backward()
    with CommCounter() as forward:
        out = block(x)
    with CommCounter() as backward:
        out.sum().backward()
    return forward.calls, backward.calls


def test_llama_block_with_a_plan_rotates_2_rings_per_pass(ranks):
    """W-1 exchanges per ring and pass, less what rides another ring's exchange. Forward: the MLP's
    first message rides the attention's last exchange. Backward: a partial starts below its owner and
    ends one hop from it; the MLP's last hop rides the attention's first exchange, and the
    attention's, with no ring after it, goes alone at the end of the backward. (The attention's first
    message, its weights alone, is not prefetched here: the MLP's ring is the backward's largest, and
    carrying it would make the ring buffers larger; in a model the head's is, see
    ``test_prefetch.py``.) Besides them, the gathered norms' all-gather and reduce-scatter."""
    world = 4
    for forward, backward in ranks.run(world, exchanges_case):
        assert forward["c10d::send"] == 2 * (world - 1) - 1, forward
        assert backward["c10d::send"] == 2 * (world - 1) + 1, backward


def separate_groups_case(same_group):
    """Two planned blocks, the second on the same ranks' default group or on a process group of its
    own: gradients against the reference, then one backward's sends."""
    torch.manual_seed(4)
    _, world = rank_and_world()
    model = nn.Sequential(*(LlamaBlock(5, 2 * world, world, 2, 3 * world) for _ in range(2))).double()
    reference = twin(model)
    first = init_device_mesh("cpu", (world,))
    second = first if same_group else DeviceMesh.from_group(dist.new_group(list(range(world))), "cpu")
    rsdp_shard(model[0], mesh=first, ring_plan=TITAN_PLAN)
    rsdp_shard(model[1], mesh=second, ring_plan=TITAN_PLAN)
    rsdp_shard(model, mesh=first)  # the root (no parameters of its own): both blocks on its context
    inputs = torch.randn(world * 2, 4, 5, dtype=torch.float64)
    check_against_reference(model, reference, inputs, torch.randn_like(inputs))
    out = model(local_rows(inputs, *rank_and_world()))
    with CommCounter() as backward:
        out.sum().backward()
    return backward.calls["c10d::send"]


@pytest.mark.parametrize("world", [2, 3])
def test_a_deferred_hop_goes_alone_where_the_next_ring_cannot_carry_it(ranks, world):
    """The last hop of a sub-block's backward partials rides the next ring's first exchange only on the
    same process group; before a ring on another one it goes alone (one exchange more), and the
    gradients are the same."""
    rings = 4 * (world - 1)
    assert ranks.run(world, separate_groups_case, True) == [rings + 1] * world
    assert ranks.run(world, separate_groups_case, False) == [rings + 2] * world


class CountedMLP(MLP):
    """Counts its forward's runs, in forward passes and in backward (recomputations)."""

    runs = {"forward": 0, "backward": 0}

    def forward(self, x):
        CountedMLP.runs["backward" if in_backward() else "forward"] += 1
        return super().forward(x)


class CheckpointedBlock(LlamaBlock):
    def __init__(self, *args, checkpointing):
        super().__init__(*args)
        self.checkpointing = checkpointing

    def forward(self, x):
        if self.checkpointing == "none":
            return super().forward(x)
        return checkpoint(super().forward, x, use_reentrant=self.checkpointing == "reentrant")


def kept_graphs_case(checkpointing, backwards):
    """The MLP sub-block's runs per pass, and its gradients against the reference (after ``backwards``
    backwards through one retained graph)."""
    torch.manual_seed(3)
    _, world = rank_and_world()
    block = CheckpointedBlock(5, 2 * world, world, 2, 3 * world, checkpointing=checkpointing).double()
    block.mlp = CountedMLP(5, 3 * world).double()
    reference = twin(block)
    reference.checkpointing = "none"
    rsdp_shard(block, ring_plan=TITAN_PLAN)
    inputs = torch.randn(world * 2, 4, 5, dtype=torch.float64)
    upstream = torch.randn_like(inputs)
    reference_loss = (reference(inputs) * upstream).sum()
    for _ in range(backwards):
        reference_loss.backward(retain_graph=True)
    CountedMLP.runs.update(forward=0, backward=0)
    local_inputs = local_rows(inputs, *rank_and_world()).clone().requires_grad_(True)
    loss = (block(local_inputs) * local_rows(upstream, *rank_and_world())).sum()
    runs = [CountedMLP.runs["forward"]]
    for _ in range(backwards):
        before = CountedMLP.runs["backward"]
        loss.backward(retain_graph=True)
        runs.append(CountedMLP.runs["backward"] - before)
    assert_param_grads_match(block, reference, 1 / world)
    return runs


@pytest.mark.parametrize("world", [2, 3])
def test_planned_backward_reuses_the_forwards_graphs_unless_checkpointing_recomputes(ranks, world):
    """Each forward step's graph is kept (its weights resolved from the backward's ring buffer), so the
    backward runs the sub-block no more. Under activation checkpointing the forward keeps nothing: a
    non-reentrant recomputation runs the ring (W steps) under checkpointing's hooks, so the backward
    recomputes each step again; a reentrant one runs it under no hooks, so it keeps its graphs. A second
    backward through a retained graph recomputes. Gradients match the reference in every case."""
    expected = {
        ("none", 2): [world, 0, world],
        ("non-reentrant", 1): [world, 2 * world],
        ("reentrant", 1): [world, world],
    }
    for (checkpointing, backwards), runs in expected.items():
        for got in ranks.run(world, kept_graphs_case, checkpointing, backwards):
            assert got == runs, (checkpointing, got)


def planned_mlp_ops_case():
    """The aten ops of one steady-state training step of a planned SwiGLU MLP, by op."""
    torch.manual_seed(0)
    _, world = rank_and_world()
    mlp = MLP(8, 4 * world)
    rsdp_shard(mlp, ring_plan={"gate_proj": "colwise", "up_proj": "colwise", "down_proj": "rowwise"})
    x = torch.randn(3, 8, requires_grad=True)
    for _ in range(3):  # the ring buffers' sizes and the views cached of them settle
        mlp(x).sum().backward()
    with OpCounter() as ops:
        mlp(x).sum().backward()
    return ops.by_op


def test_a_planned_step_backpropagates_its_linears_by_their_formulas(ranks):
    """A kept step's Linears are backpropagated by their formulas (``_ExplicitStep``): autograd runs only
    what lies between them, from gate's and up's outputs as the MLP sees them (its leaves) to down's
    input (its output), so it has no view of its own to run. A rank more adds, per step, in forward:
    gate's and up's products and their views, silu, mul, down's input detached and flattened, and down's
    product added into the total in place (9); in backward: down's input transposed and its weight
    gradient added into the partial, ``dy·W_down``, silu's backward and two muls, then per colwise Linear
    its weight gradient added into the partial and its input gradient added (10). No weight is
    transposed (the backward reads cached views of them as held) and no gradient copied."""
    by2 = collections.Counter(ranks.run(2, planned_mlp_ops_case)[0])
    by4 = collections.Counter(ranks.run(4, planned_mlp_ops_case)[0])
    per_step = {op: (by4[op] - by2[op]) / 2 for op in by4 | by2 if by4[op] != by2[op]}
    expected = {"aten.mm": 3, "aten.view": 3, "aten.silu": 1, "aten.mul": 3, "aten.detach": 1, "aten.t": 1,
                "aten.addmm_": 6, "aten.silu_backward": 1}  # fmt: skip
    assert per_step == expected, str(sorted(per_step.items()))


class StridedMLP(MLP):
    """Planned Linears fed non-contiguous inputs, and 2-D ones: a ring step's products flatten their
    input as ``linear`` does; inputs other than the sub-block's own arguments have their input gradient
    backpropagated by autograd, which saves the step's own weight tensors."""

    def forward(self, x):
        batch, seq, dim = x.shape
        gate = self.gate_proj(x.transpose(0, 1)).transpose(0, 1)  # input [seq, batch, dim], non-contiguous
        tokens = x.reshape(batch * seq, dim).t().contiguous().t()  # 2-D, column-major
        hidden = F.silu(gate) * self.up_proj(tokens).view(batch, seq, -1)
        return self.down_proj(hidden.transpose(0, 1).contiguous().transpose(0, 1))  # non-contiguous


def strided_inputs_case():
    torch.manual_seed(4)
    _, world = rank_and_world()
    mlp = StridedMLP(5, 2 * world).double()
    reference = twin(mlp)
    rsdp_shard(mlp, ring_plan={"gate_proj": "colwise", "up_proj": "colwise", "down_proj": "rowwise"})
    assert "RingSub" in type(mlp).__qualname__
    for _ in range(2):  # the second step's graphs read the weights of buffers the first left behind
        mlp.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        check_against_reference(
            mlp, reference, torch.randn(world * 2, 3, 5, dtype=torch.float64), torch.randn(world * 2, 3, 5, dtype=torch.float64)
        )


@pytest.mark.parametrize("world", [1, 3])
def test_planned_linears_on_strided_and_2d_inputs_match_reference(ranks, world):
    ranks.run(world, strided_inputs_case)


def discarded_forwards_case():
    """Bytes held after each of 4 forwards whose outputs were dropped without a backward, and while
    an output is alive."""
    torch.manual_seed(0)
    block = LlamaBlock(16, 8, 4, 2, 24)
    rsdp_shard(block, ring_plan=TITAN_PLAN)
    x = torch.randn(2, 5, 16, requires_grad=True)
    gc.disable()  # what reference counting frees, not what a collection would find later
    try:
        with MemoryTracker() as memory:
            held = []
            for _ in range(4):
                block(x)
                held.append(memory.current_bytes)
            alive = block(x)  # noqa: F841  (held while measuring)
            return held, memory.current_bytes
    finally:
        gc.enable()


def test_a_forward_without_backward_leaves_no_kept_graph_behind(ranks):
    """The kept graphs are freed with the output, by reference counting: nothing they hold may reach back
    to a node of theirs, a cycle through autograd's C++ nodes that no collection breaks (it grew by every
    forward's activations when a saved-tensor hook kept undetached tensors). What stays is the same after
    every forward (the gathered norms, kept for a backward, as FSDP2's
    reshard_after_forward=False keeps its parameters)."""
    for held, with_output in ranks.run(2, discarded_forwards_case):
        # From the second forward on: the first may differ by what a previous test left to be freed.
        assert held[1:] == [held[1]] * 3, held
        assert with_output > held[1]  # the graphs live as long as the output


def uneven_case():
    block = LlamaBlock(6, 3, 3, 2, 9)  # 3 heads over 2 ranks
    with pytest.raises(ValueError, match="must divide by the 2 ranks"):
        rsdp_shard(block, ring_plan=TITAN_PLAN)


def test_plan_with_features_that_do_not_divide_is_refused(ranks):
    ranks.run(2, uneven_case)


class NormedAttention(Attention):
    """q/k norms inside the sub-block (Qwen3-style): parameters besides the plan's Linears."""

    def __init__(self, *args):
        super().__init__(*args)
        self.q_norm = nn.RMSNorm(self.head_dim)


class TwiceMLP(MLP):
    """An MLP that calls its rowwise Linear twice and returns the second output."""

    def forward(self, x):
        hidden = F.silu(self.gate_proj(x)) * self.up_proj(x)
        self.down_proj(hidden)
        return self.down_proj(hidden)


def misuse_case():
    block = LlamaBlock(6, 2, 2, 3, 4)
    block.self_attn = NormedAttention(6, 2, 2, 3)
    with pytest.raises(ValueError, match=r"holds parameters or Linears besides its plan's \(\['q_norm.weight'\]\).* Drop these ring_plan entries: \['self_attn.k_proj', 'self_attn.o_proj', 'self_attn.q_proj', 'self_attn.v_proj'\]"):
        rsdp_shard(block, ring_plan=TITAN_PLAN)
    with pytest.raises(ValueError, match="rowwise Linear 'mlp.down_proj' but no colwise sibling"):
        rsdp_shard(LlamaBlock(6, 2, 2, 3, 4), ring_plan={"mlp.down_proj": "rowwise"})

    block = LlamaBlock(6, 2, 2, 3, 4)
    block.mlp = ScaledMLP(6, 4)
    rsdp_shard(block, ring_plan=TITAN_PLAN)
    with pytest.raises(ValueError, match="must return its rowwise Linear's output"):
        block(torch.randn(1, 3, 6))
    block = LlamaBlock(6, 2, 2, 3, 4)
    block.mlp = TwiceMLP(6, 4)  # a step's rowwise products are summed into the output as they run
    rsdp_shard(block, ring_plan=TITAN_PLAN)
    with pytest.raises(ValueError, match="calls its rowwise Linear more than once"):
        block(torch.randn(1, 3, 6))
    # A step installs each planned Linear's shard product as its instance forward; a step that raised
    # leaves none behind, so the Linear is the ring Linear again.
    assert not any("forward" in linear.__dict__ for linear in block.mlp.modules())
    with pytest.raises(RuntimeError, match="rowwise Linear of ring sub-block 'mlp'; its columns are sharded"):
        block.mlp.down_proj(torch.randn(1, 4))

    # Forward hooks on a planned Linear run at every step, around its product with the shard held.
    block = LlamaBlock(6, 2, 2, 3, 4)
    rsdp_shard(block, ring_plan=TITAN_PLAN)
    features = []
    block.mlp.up_proj.register_forward_hook(lambda module, args, output: features.append(output.shape[-1]))
    block(torch.randn(1, 3, 6))
    _, world = rank_and_world()
    assert features == [4 // world] * world, features


def test_plans_that_cannot_rotate_as_one_ring_say_why(ranks):
    ranks.run(2, misuse_case)
