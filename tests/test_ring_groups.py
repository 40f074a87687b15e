"""A ring of groups (``rsdp_shard(..., ring_group_size=g)``): exact against the fp64 reference for
every g dividing W on 4, 6 and 8 ranks (shapes that split unevenly, some shards empty), and the
exchanges it makes: W/g - 1 between groups per ring and pass (one fewer for a ring whose first
message rode the ring before's last exchange), one all-gather within the group per step and in
backward one reduce-scatter; the norms' all-gather and their gradients' reduce-scatter ride the
rings (docs/design.md, "A ring of groups")."""

import functools
import gc
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from models import (
    MLP,
    LlamaBlock,
    TITAN_PLAN,
    TinyLM,
    assert_param_grads_match,
    check_against_reference,
    lm_loss,
    local_rows,
    planned_llama,
    rank_and_world,
    train_and_compare,
    twin,
)
from rsdp import ring_checkpoint_context, rsdp_shard
from rsdp._compat import group_collectives
from rsdp.memory import CommCounter
from test_ring_ops import OpCounter
from test_sub_block import CheckpointedBlock
from test_nccl_semantics import under_nccl_semantics
from test_training import bf16_case
from test_two_models import exchanges_case, two_models_case


def groups_lm(seed, group, *, vocab=13, dim=6, hidden=7, layers=2, mesh=None, **config):
    """A TinyLM (tied embedding and head, q/k/v sharing a ring, norms; ``config``: its checkpointing)
    sharded with ``group`` (an int, or one per block and then the root's), and its fp64 reference."""
    torch.manual_seed(seed)
    model = TinyLM(vocab=vocab, dim=dim, heads=2, hidden=hidden, layers=layers, **config).double()
    reference = twin(model)
    groups = group if isinstance(group, tuple) else (group,) * (layers + 1)
    for layer, size in zip(model.layers, groups):
        rsdp_shard(layer, ring_group_size=size, mesh=mesh)
    rsdp_shard(model, ring_group_size=groups[-1], mesh=mesh)
    return model, reference


def trajectory_case(seed, group, steps=2, micro_batches=1, sync_last_only=False, **config):
    model, reference = groups_lm(seed, group, **config)
    train_and_compare(model, reference, steps=steps, rows=1, seq=5, micro_batches=micro_batches, sync_last_only=sync_last_only)


@pytest.mark.parametrize("world,group", [(4, 2), (4, 4), (6, 2), (6, 3), (8, 2), (8, 4), (8, 8)])
def test_trajectory_for_every_group_size(ranks, world, group):
    """13 vocabulary rows, 6 features and 7 hidden ones split unevenly over 4, 6 and 8 ranks (empty
    shards, so empty and short blocks); with no final norm, from the second step the blocks' norms
    ride the first forward ring (its group's all-gathers)."""
    ranks.run(world, trajectory_case, world + group, group, layers=1, final_norm=False)


@pytest.mark.parametrize("world,dim,micro_batches,checkpointing", [(4, 8, 1, False), (4, 8, 2, True), (8, 6, 1, False)])
def test_trajectory_with_blocks_read_rank_major(ranks, world, dim, micro_batches, checkpointing):
    """Bias-free q/k/v (one ring) read their block rank-major (``_wire.BlockRegions``), in groups of 2:
    exact with every rank's rows whole (8 features on 4 ranks: forward and backward rank-major), with
    activation checkpointing and micro-batches whose sync is off but the last's (whose backward adds
    what the others kept by segment, so reads its block by segment), and with short and empty shards
    (6 features on 8 ranks: the forward rank-major, the backward by segment)."""
    ranks.run(world, trajectory_case, world + dim, 2, micro_batches=micro_batches, sync_last_only=micro_batches > 1,
              dim=dim, layers=1, final_norm=False, biases=False, checkpointing=checkpointing)


def test_group_sizes_mixed_in_one_model(ranks):
    """Blocks on a ring of ranks and of groups of 2, the root (embedding and tied head) one group of 4:
    prefetch and riders are offered across them, and taken only where they may ride."""
    ranks.run(4, trajectory_case, 6, (1, 2, 4), steps=3, final_norm=False)


def test_trains_exactly_under_nccl_semantics(ranks):
    """Tag-blind exchanges, sends read and receives written (NaN until then) at ``wait()``
    (``tests/test_nccl_semantics.py``): a ring of groups reads no buffer before its exchange is
    waited for, and writes none while it is being sent."""
    for exchanges, _ in ranks.run(4, under_nccl_semantics, trajectory_case, 7, 2, final_norm=False):
        assert exchanges > 0


def test_activation_checkpointing_and_unsynced_micro_batches(ranks):
    """Checkpointed blocks recompute their rings of groups in backward; micro-batches without
    synchronisation keep full-size local gradients, added to the partials by the last."""
    ranks.run(4, trajectory_case, 3, 2, checkpointing=True, micro_batches=2, sync_last_only=True)


def test_ring_outputs_kept_under_selective_checkpointing(ranks):
    """rsdp's checkpoint context keeps the rings' outputs (fresh ring buffers for each request)."""
    ranks.run(4, trajectory_case, 4, 2, checkpointing=True, checkpoint_context=ring_checkpoint_context)


def hsdp_case(seed, replicas, group):
    """Groups within each replica's shard dimension; gradients all-reduced over the replicas."""
    mesh = init_device_mesh("cpu", (replicas, dist.get_world_size() // replicas))
    model, reference = groups_lm(seed, group, layers=1, mesh=mesh)
    train_and_compare(model, reference, steps=2, rows=1, seq=5, micro_batches=2)


def test_hsdp_mesh(ranks):
    """A 2 x 4 (replicate x shard) mesh with groups of 2 in each replica's shard dimension."""
    ranks.run(8, hsdp_case, 5, 2, 2)


def forward_exchanges_case(group):
    model, _ = groups_lm(1, group, final_norm=False)
    tokens = torch.randint(0, 13, (1, 5))
    for _ in range(2):  # the second records where the norms ride
        lm_loss(model(tokens), tokens).backward()
    with CommCounter() as forward:
        lm_loss(model(tokens), tokens)
    return dict(forward.calls), forward.between_groups.messages, forward.within_groups.messages


def test_norms_ride_the_forward_ring(ranks):
    """10 rings of 2 groups, one exchange between groups each: every other one is prefetched (its one
    exchange rode the ring before's, and it has none to carry the next), so 5 exchanges, 20
    all-gathers within the groups, and the blocks' norms' all-gather in none of its own: it rides the
    first ring's (the Embedding's, which is not prefetched)."""
    for calls, between, within in ranks.run(4, forward_exchanges_case, 2):
        assert calls == {"c10d::send": 5, "c10d::_allgather_base_": 20} and (between, within) == (5, 20), calls


def backward_collectives_case(group):
    """A step's backward, once the schedule says when the norms' gradients ride: its sends, and its
    collectives within the groups and over all ranks."""
    model, _ = groups_lm(1, group, final_norm=False)
    tokens = torch.randint(0, 13, (1, 5))
    for _ in range(2):  # the first records which modules queue their norms' gradients
        lm_loss(model(tokens), tokens).backward()
    loss = lm_loss(model(tokens), tokens)
    with CommCounter() as backward:
        loss.backward()
    collectives = sum(backward.calls.values()) - backward.calls["c10d::send"]
    return backward.between_groups.messages, backward.within_groups.messages, collectives


def test_norms_gradients_ride_the_backward_ring(ranks):
    """The blocks' norms' gradients are reduce-scattered on a backward ring of groups, summed with its
    partials within the groups: 10 rings of 2 groups make 10 exchanges and 20 reduce-scatters within
    the groups (two per ring) besides the weights' all-gathers, and no collective over all ranks."""
    for between, within, collectives in ranks.run(4, backward_collectives_case, 2):
        assert between == 10 and within == collectives and collectives > 20, (between, within, collectives)


def forward_prefetch_of(model):
    return model._get_rsdp_state().ring.context.forward_prefetch


def linear_stack_case(group, layers=4, steps=5):
    """Linears in rings of groups, the root sharded too (one ring context): per step the prefetched
    first exchanges taken and the forward's exchanges between groups and collectives within them; the
    gradients exact at every step."""
    rank, world = rank_and_world()
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(6, 6) for _ in range(layers))).double()
    reference = twin(model)
    for layer in model:
        rsdp_shard(layer, ring_group_size=group)
    rsdp_shard(model, ring_group_size=group)
    x = torch.randn(world * 2, 6, dtype=torch.float64)
    counts = []
    for _ in range(steps):
        model.zero_grad()
        reference.zero_grad()
        used = forward_prefetch_of(model).used
        with CommCounter() as forward:
            y = model(local_rows(x, rank, world))
        y.square().sum().backward()
        reference(x).square().sum().backward()
        assert_param_grads_match(model, reference, 1 / world)
        counts.append((forward_prefetch_of(model).used - used, forward.between_groups.messages, forward.within_groups.messages))
    return counts


def test_prefetch_across_layers(ranks):
    """Each ring's first message rides the last exchange of the ring before, between the same groups:
    4 rings of 4 groups of 2 (8 ranks) make 3 + 3 x 2 = 9 exchanges instead of 4 x 3 = 12, and the
    groups' all-gathers stay one per step."""
    for counts in ranks.run(8, linear_stack_case, 2):
        assert counts[0] == (0, 12, 16) and counts[-2:] == [(3, 9, 16)] * 2, counts


def test_hugging_face_llama_with_groups_per_decoder_layer(ranks):
    """A Llama causal LM built from its config, each decoder layer and the root in rings of groups
    of 2 on 4 ranks, with gradient checkpointing: two AdamW steps against the fp64 model."""
    from test_hf import checkpointed_training_case  # skips where transformers is missing

    assert all(ranks.run(4, checkpointed_training_case, "llama", False, ring_group_size=2))


def test_two_models_with_groups(ranks):
    """Two models in rings of groups, a frozen reference's forward between the policy's forward and
    backward (DPO): both exact, and the policy keeps the exchanges it makes alone (its own prefetch
    and riders)."""
    ranks.run(4, two_models_case, "dpo", False, True, group=2)
    assert ranks.run(4, exchanges_case, "dpo", 2) == ranks.run(4, exchanges_case, "alone", 2)


def test_bf16_policy_matches_fsdp2(ranks):
    ranks.run(4, bf16_case, 11, functools.partial(rsdp_shard, ring_group_size=2))


def linear_exchanges_case(group, bias):
    """The point-to-point exchanges and within-group collectives of one Linear's forward and backward."""
    rank, world = rank_and_world()
    torch.manual_seed(0)
    linear = nn.Linear(5, 11, bias=bias).double()
    reference = twin(linear)
    rsdp_shard(linear, ring_group_size=group)
    x = torch.randn(world * 2, 5, dtype=torch.float64)
    counts = []
    linear(local_rows(x, rank, world)).sum().backward()  # the first forward checks its callers (one all-reduce)
    linear.zero_grad()
    with CommCounter() as forward:
        y = linear(local_rows(x, rank, world).requires_grad_())  # its gradient rotates the weights in backward
    with CommCounter() as backward:
        y.square().sum().backward()
    reference(x).square().sum().backward()
    assert_param_grads_match(linear, reference, 1 / world)
    for comm in (forward, backward):
        counts.append((comm.between_groups.messages, comm.within_groups.messages, dict(comm.calls)))
    return counts, forward.between_groups.nbytes, backward.within_groups.nbytes


@pytest.mark.parametrize("world,group", [(4, 2), (6, 3), (8, 4)])
def test_exchanges_per_ring(ranks, world, group):
    """W/g - 1 exchanges between groups per ring and pass; one all-gather within the group per step
    (weight and bias together), and in backward one reduce-scatter per step (the two partials of one
    dtype together) after the first one."""
    owners = world // group
    (forward, backward), between_bytes, _ = ranks.run(world, linear_exchanges_case, group, True)[0]
    assert forward == (owners - 1, owners, {"c10d::send": owners - 1, "c10d::_allgather_base_": owners})
    assert backward == (
        owners - 1, 2 * owners, {"c10d::send": owners - 1, "c10d::_allgather_base_": owners, "c10d::_reduce_scatter_base_": owners}
    )
    chunk = -(-11 // world)  # rows per rank, padded
    assert between_bytes == (owners - 1) * chunk * (5 + 1) * 8  # this rank's shard of weight and bias


def test_group_of_every_rank_is_fsdp_pattern(ranks):
    """g = W: no exchange, one all-gather forward, one all-gather and one reduce-scatter backward."""
    (forward, backward), _, _ = ranks.run(4, linear_exchanges_case, 4, False)[0]
    assert forward[:2] == (0, 1) and backward[:2] == (0, 2)


def bad_group_size_case(size, hsdp, kwargs):
    if hsdp:
        kwargs = {**kwargs, "mesh": init_device_mesh("cpu", (2, 2))}
    try:
        rsdp_shard(nn.Linear(4, 4), ring_group_size=size, **kwargs)
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.parametrize(
    "size,hsdp,kwargs,expected",
    [
        (3, False, {}, "ring_group_size=3 must be a positive integer dividing the shard dimension's size 4"),
        (0, False, {}, "ring_group_size=0 must be a positive integer"),
        (3, True, {}, "ring_group_size=3 must be a positive integer dividing the shard dimension's size 2"),
    ],
)
def test_bad_group_size_errors_on_every_rank(ranks, size, hsdp, kwargs, expected):
    errors = ranks.run(4, bad_group_size_case, size, hsdp, kwargs)
    assert all(error is not None and expected in error for error in errors), errors


def group_step_copies_case(biased):
    """One steady-state training step of a SwiGLU MLP (gate/up share a ring, down is alone; gate/up
    ``biased`` or not) on a ring of groups of 2: its aten copies, its reduce-scatters within the group,
    and the copies one such reduce-scatter makes itself (gloo copies its result out at ``wait()``)."""
    torch.manual_seed(0)
    model = MLP(8, 12)
    if biased:
        model.gate_proj, model.up_proj = nn.Linear(8, 12), nn.Linear(8, 12)
    rsdp_shard(model, ring_group_size=2)
    x = torch.randn(3, 8, requires_grad=True)
    for _ in range(3):  # the ring buffers' sizes and the views cached of them settle
        model(x).sum().backward()
    with OpCounter() as ops, CommCounter() as comm:
        model(x).sum().backward()
    with OpCounter() as one:
        _, sum_scatter = group_collectives(model._get_rsdp_state().ring.within)
        sum_scatter(torch.zeros(2), torch.zeros(4)).wait()
    reduce_scatters = sum(count for op, count in comm.calls.items() if "reduce_scatter" in op)
    return ops.by_op["aten.copy_"], reduce_scatters, one.by_op.get("aten.copy_", 0)


@pytest.mark.parametrize("biased,copies_per_step", [(False, 0), (True, 6)])
def test_a_group_step_copies_only_where_its_block_is_laid_out_by_segment(ranks, biased, copies_per_step):
    """A step more per ring (6 ranks in groups of 2 against 4) costs gate/up's ring no copy where its
    block is rank-major (weights alone: the all-gather writes the matrix the GEMM reads, the GEMM the
    contributions the reduce-scatter reads), and with biases (a block laid out by segment) one copy
    between the block and the collectives' staging area per run of equal-width segments: the forward's
    weights and biases, the backward's weights, and its weight and bias contributions before their
    reduce-scatter (and the bias gradients' sums copied into their contributions). Down's ring, one
    segment, copies nothing per step. Each copy is a host dispatch, a kernel launch on a GPU."""
    (copies4, reduces4, per_reduce), (copies6, reduces6, _) = (ranks.run(world, group_step_copies_case, biased)[0] for world in (4, 6))
    assert copies6 - copies4 - (reduces6 - reduces4) * per_reduce == copies_per_step, (copies4, copies6, reduces4, reduces6, per_reduce)


def planned_block_case(seed, group, checkpointing):
    """A Llama block with its attention and MLP planned (grouped-query heads, biased q/k/v and o; the
    model width 5 splits over no rank count), in rings of groups: outputs, input and parameter
    gradients against the fp64 reference, with uneven rows per rank."""
    torch.manual_seed(seed)
    rank, world = rank_and_world()
    block = CheckpointedBlock(5, 2 * world, world, 2, 3 * world, checkpointing=checkpointing).double()
    reference = twin(block)
    reference.checkpointing = "none"
    rsdp_shard(block, ring_plan=TITAN_PLAN, ring_group_size=group)
    sizes = [1 + rank % 2 for rank in range(world)]
    inputs = torch.randn(sum(sizes), 4, 5, dtype=torch.float64)
    check_against_reference(block, reference, inputs, torch.randn_like(inputs), sizes)


@pytest.mark.parametrize("world,group,checkpointing", [(4, 2, "none"), (6, 2, "non-reentrant"), (6, 3, "reentrant"), (4, 4, "none")])
def test_planned_block_in_rings_of_groups_matches_reference(ranks, world, group, checkpointing):
    ranks.run(world, planned_block_case, 30 + world + group, group, checkpointing)


def planned_block_collectives_case(group):
    """One forward's and one backward's communication of a planned Llama block, once the schedule is
    known (the first pass records the order of rings, the second the ring buffers' sizes)."""
    torch.manual_seed(0)
    block = LlamaBlock(16, 8, 4, 2, 24)
    rsdp_shard(block, ring_plan=TITAN_PLAN, ring_group_size=group)
    x = torch.randn(2, 5, 16, requires_grad=True)
    for _ in range(2):
        block(x).sum().backward()
    with CommCounter() as forward:
        out = block(x)
    with CommCounter() as backward:
        out.sum().backward()
    return dict(forward.calls), dict(backward.calls)


def test_planned_block_exchanges_per_ring_of_groups(ranks):
    """A planned Llama block in G = 2 groups of 2 (4 groups on 8 ranks: the planned backward's prefetch
    test below): per ring and pass G - 1 exchanges between groups and G all-gathers within them, and
    in backward G reduce-scatters; the MLP's first forward
    message rides the attention's last exchange, the MLP's deferred hop the attention's first backward
    exchange, and the attention's, with no ring after it, goes alone. Besides them, the norms' all-gather
    and reduce-scatter (a planned ring carries no collective)."""
    world, owners = 4, 2
    for forward, backward in ranks.run(world, planned_block_collectives_case, 2):
        assert forward == {"c10d::send": 2 * (owners - 1) - 1, "c10d::_allgather_base_": 2 * owners + 1}, forward
        assert backward == {
            "c10d::send": 2 * (owners - 1) + 1, "c10d::_allgather_base_": 2 * owners, "c10d::_reduce_scatter_base_": 2 * owners + 1
        }, backward


def planned_lm_case(seed, group, sync_last_only, replicas=1):
    torch.manual_seed(seed)
    mesh = None if replicas == 1 else init_device_mesh("cpu", (replicas, dist.get_world_size() // replicas))
    model, reference = planned_llama(mesh=mesh, ring_group_size=group)
    micro = 2 if sync_last_only else 1
    train_and_compare(model, reference, steps=2, rows=1, seq=5, micro_batches=micro, sync_last_only=sync_last_only, clip=1.0)


@pytest.mark.parametrize("world,group,sync_last_only,replicas", [(4, 2, False, 1), (6, 2, True, 1), (6, 3, False, 1), (4, 2, False, 2)])
def test_planned_lm_trajectory_in_rings_of_groups(ranks, world, group, sync_last_only, replicas):
    """Hugging Face's Llama plan on a 2-block LM, the blocks and the root in rings of groups: two AdamW
    steps (clipped) against fp64 under NCCL's semantics (``test_nccl_semantics.py``: exchanges matched
    by order, buffers read and written at ``wait()``), once with micro-batches whose first skips
    synchronisation, once on a 2 x 2 (replicate x shard) mesh whose shard dimension is one group (its
    reduce-scatter makes the gradients, then the all-reduce over the replicas)."""
    for exchanges, all_reduces in ranks.run(world, under_nccl_semantics, planned_lm_case, 40 + world + group, group, sync_last_only, replicas):
        assert (exchanges > 0) if replicas == 1 else (exchanges == 0 and all_reduces > 0), (exchanges, all_reduces)


@pytest.mark.parametrize("model_type,checkpointing,lora", [("llama", True, True), ("qwen3", False, False)])
def test_hugging_face_plans_in_rings_of_groups(ranks, model_type, checkpointing, lora):
    """A Hugging Face causal LM's own plan, its decoder layers and root in rings of groups of 2 on 4
    ranks: Llama with LoRA on every planned Linear under gradient checkpointing (the adapters' parts per
    block of shards), Qwen3 with its per-head q/k norms; one step's loss and every gradient against fp64,
    both sub-blocks of each layer planned."""
    from test_hf_plans import plan_step_case  # skips where transformers is missing

    if lora:
        pytest.importorskip("peft")
    for dropped, sub_blocks in ranks.run(4, plan_step_case, model_type, checkpointing, lora, 2):
        assert dropped == [] and sub_blocks == 4, (dropped, sub_blocks)


@pytest.mark.parametrize("case", ["generate_case", "training_case"])
def test_planned_attention_with_a_kv_cache_in_rings_of_groups(ranks, case):
    """Qwen2 (grouped KV heads, a sliding-window layer, a tied head) with its plan in rings of groups of 2
    on 4 ranks: each group's block of heads reads and writes its heads of the cache (``generate()``,
    training with ``use_cache=True``), as the unsharded model does."""
    import test_hf_generate  # skips where transformers is missing

    assert all(ranks.run(4, getattr(test_hf_generate, case), "qwen2", 2))


def test_planned_backward_rings_of_groups_take_their_first_exchange_from_the_ring_before(ranks):
    """8 ranks in 4 groups of 2: a planned sub-block's backward weights ride the last exchange of the
    ring before, between the same groups, and its deferred hop the next ring's third exchange, as on a
    ring of 4 ranks (``test_prefetch.py``): 6 rings of 3 exchanges, 3 of them prefetched at the third
    step; the gradients exact at every step."""
    from test_prefetch import planned_backward_case

    for counts in ranks.run(8, planned_backward_case, 3, 2):
        assert counts[0] == (0, 18) and counts[2] == (3, 15), counts


def group_step_calls_case():
    """The Python functions one steady-state training step of a SwiGLU MLP on a ring of groups of 2
    calls (each generator step counted as a call, as the interpreter runs it)."""
    torch.manual_seed(0)
    model = MLP(8, 12)
    rsdp_shard(model, ring_group_size=2)
    x = torch.randn(3, 8, requires_grad=True)
    for _ in range(3):  # the ring buffers, their views and the pass's records settle
        model(x).sum().backward()
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        calls += event == "call"

    # A reused rank process holds earlier tests' garbage: a collection during the counted step would run
    # their finalizers (weakref callbacks, ``__del__``) and count them, so none runs then.
    gc.collect()
    gc.disable()
    sys.setprofile(count)
    try:
        model(x).sum().backward()
    finally:
        sys.setprofile(None)
        gc.enable()
    return calls


def test_a_group_ring_step_costs_few_python_calls(ranks):
    """What one more step of every ring costs the host (6 ranks in groups of 2 against 4; gate/up's
    ring and down's, forward and backward: four rings a step), in Python calls per ring step: the
    exchange, the all-gather within the group, the GEMMs' views and, in backward, the reduce-scatter and
    the contribution. On a GPU at small batch this host work, not the kernels, sets the step time
    (``benchmarks/host_overhead.py`` counts it per Llama block). 17.75 before the ring layers indexed
    their shards per step (``Ring.weight_shards``), a ring's wait kept its works as an attribute and a
    step ran its exchange itself (the whole step at 4 ranks: 869 calls then); 14.25 until the
    collectives within the group were called with no Python frame of their own
    (``_compat.group_collectives``); 12.75 (772 calls) until a ring pass ran its steps, the
    all-gather within the group among them, in one loop (``_RingPass.run``) and a Linear's backward
    contributed with no frames of its own (674 and 699: 6.25); 6.25 until a stacked Linear step read
    its weights' matrix from ``Views.known`` itself and a step reduce-scattered with nothing staged
    inline (668 and 688 now: 5.0, in a fresh rank pool; a clean-clone CI's reused one once counted
    two more, before the garbage of earlier tests was collected ahead of the count, hence the bound's
    half call of room); a regression shows here."""
    calls4, calls6 = (ranks.run(world, group_step_calls_case)[0] for world in (4, 6))
    assert (calls6 - calls4) / 4 <= 5.5, (calls4, calls6)
