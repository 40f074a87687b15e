"""Multi-step training of a small transformer LM against the single-process fp64 reference."""

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh

from models import (
    TinyLM,
    assert_close,
    assert_param_grads_match,
    full,
    lm_loss,
    local_rows,
    rank_and_world,
    rsdp_lm,
    shard_lm,
    train_and_compare,
    twin,
)
from rsdp import MixedPrecisionPolicy, rsdp_shard
from rsdp.memory import CommCounter
from rsdp._compat import fully_shard

def lm_training_case(seed, layers, dim, vocab, strategies, checkpointing=False, checkpoint_wrapped=False, final_norm=True, **train):
    torch.manual_seed(seed)
    model = TinyLM(vocab=vocab, dim=dim, heads=2, hidden=dim + 3, layers=layers, checkpointing=checkpointing, final_norm=final_norm)
    model = model.double()
    reference = twin(model)
    if checkpoint_wrapped:  # torchtitan's way: wrap each block, then shard the wrapper
        for lm in (model, reference):  # both, so parameter names match
            for i, layer in enumerate(lm.layers):
                lm.layers[i] = checkpoint_wrapper(layer)
    shard_lm(model, strategies)
    rsdp_shard(model)
    train_and_compare(model, reference, **train)


@given(
    world=st.sampled_from([1, 2, 3, 4]), dim=st.sampled_from([6, 10]), vocab=st.integers(5, 23), final_norm=st.booleans()
)
def test_lm_trajectory_10_adamw_steps(ranks, world, dim, vocab, final_norm):
    """Without the final norm the blocks' norm gradients reduce-scatter on the last backward ring from
    the second step on (``_collectives.py``); with it, in a collective at the end."""
    ranks.run(world, lm_training_case, 3, 2, dim, vocab, ["rsdp", "rsdp"], final_norm=final_norm, steps=10, rows=2, seq=5, clip=1.0)


@pytest.mark.parametrize("world,final_norm", [(2, True), (3, False)])
def test_gradient_accumulation_two_micro_batches(ranks, world, final_norm):
    ranks.run(world, lm_training_case, 4, 2, 6, 11, ["rsdp", "rsdp"], final_norm=final_norm, steps=3, rows=1, seq=4, micro_batches=2)


@pytest.mark.parametrize("world,final_norm", [(2, False), (4, True)])
def test_accumulation_without_sync_until_last_micro_batch(ranks, world, final_norm):
    ranks.run(
        world, lm_training_case, 5, 2, 6, 13, ["rsdp", "rsdp"], final_norm=final_norm,
        steps=3, rows=1, seq=4, micro_batches=3, sync_last_only=True,
    )


@pytest.mark.parametrize("world,final_norm", [(2, True), (3, False)])
def test_activation_checkpointing(ranks, world, final_norm):
    ranks.run(world, lm_training_case, 6, 2, 6, 9, ["rsdp", "rsdp"], final_norm=final_norm, checkpointing=True, steps=3, rows=1, seq=4)


@pytest.mark.parametrize("world", [2, 3])
def test_checkpoint_wrapped_blocks(ranks, world):
    """rsdp_shard on a checkpoint_wrapper shards the wrapped block, whose hooks run again in the
    recomputation (they would not on the wrapper: its norms would meet sharded weights)."""
    ranks.run(world, lm_training_case, 6, 2, 6, 9, ["rsdp", "fsdp"], checkpoint_wrapped=True, steps=3, rows=1, seq=4)


def mixed_with_fully_shard_case(seed):
    """rsdp blocks next to fully_shard blocks, under a fully_shard root."""
    torch.manual_seed(seed)
    model = TinyLM(vocab=19, dim=8, heads=2, hidden=11, layers=3).double()
    reference = twin(model)
    shard_lm(model, ["rsdp", "fsdp", "rsdp"])
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    train_and_compare(model, reference, steps=4, rows=1, seq=5)


@pytest.mark.parametrize("world", [2, 3])
def test_rsdp_blocks_under_fully_shard_root(ranks, world):
    ranks.run(world, mixed_with_fully_shard_case, 7)


def hsdp_case(seed):
    """A 2x2 (replicate x shard) mesh: ring within each pair, all-reduce across pairs; two micro-batches,
    so a backward's all-reduce must not sum the gradient an earlier one left in ``.grad`` again."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model, reference = rsdp_lm(seed, mesh=mesh, vocab=15, dim=6, heads=2, hidden=7, layers=2)
    train_and_compare(model, reference, steps=3, rows=1, seq=4, micro_batches=2)


def test_hsdp_two_by_two(ranks):
    ranks.run(4, hsdp_case, 8)


def hsdp_all_reduce_count_case(seed):
    model, _ = rsdp_lm(seed, mesh=init_device_mesh("cpu", (2, 2)), vocab=15, dim=6, heads=2, hidden=7, layers=2)
    tokens = torch.randint(0, 15, (1, 4))
    lm_loss(model(tokens), tokens).backward()  # warm-up: the shared-input groups form
    with CommCounter() as comm:
        lm_loss(model(tokens), tokens).backward()
    return comm.calls["c10d::allreduce_"]


def test_hsdp_all_reduces_once_per_module(ranks):
    """Under HSDP a module's backward ends in one all-reduce over the replicas of everything it produced
    (ring and gathered gradients in one flat tensor), not one per ring: 3 per backward for 2 blocks and
    the root, where one per ring and one per module for the gathered norms made 13."""
    assert ranks.run(4, hsdp_all_reduce_count_case, 8) == [3] * 4


def gradient_hooks_case(seed):
    """A ring weight's hooks run as on a leaf: ``register_hook`` on each backward's gradient (a DTensor)
    before it is accumulated, ``register_post_accumulate_grad_hook`` after."""
    rank, world = rank_and_world()
    model, reference = rsdp_lm(seed, vocab=9, dim=6, layers=1)
    weight = model.layers[0].up.weight
    seen = []
    weight.register_hook(lambda grad: seen.append(type(grad).__name__) or grad * 2)
    weight.register_post_accumulate_grad_hook(lambda param: seen.append(param.grad is not None))
    tokens = torch.randint(0, 9, (world, 4))
    mine = local_rows(tokens, rank, world)
    for _ in range(2):
        lm_loss(model(mine), mine).backward()
    lm_loss(reference(tokens), tokens).backward()
    assert seen == ["DTensor", True] * 2, seen
    assert_close(weight.grad.full_tensor(), 2 * 2 * reference.layers[0].up.weight.grad, what="hooked gradient")


def test_ring_weight_gradient_hooks(ranks):
    ranks.run(2, gradient_hooks_case, 12)


def divide_factor_case(seed):
    """Factor 1 keeps the sum over ranks (torchtitan normalises the loss itself)."""
    rank, world = rank_and_world()
    model, reference = rsdp_lm(seed, vocab=9, dim=6, layers=1)
    for module in model.modules():
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(1.0)
    tokens = torch.randint(0, 9, (world, 4))
    lm_loss(model(local_rows(tokens, rank, world)), local_rows(tokens, rank, world)).backward()
    lm_loss(reference(tokens), tokens).backward()
    assert_param_grads_match(model, reference, float(world))


def test_gradient_divide_factor(ranks):
    ranks.run(3, divide_factor_case, 9)


def eval_and_idle_forward_case(seed):
    """A forward under no_grad and a forward whose graph is dropped leave nothing behind."""
    rank, world = rank_and_world()
    model, reference = rsdp_lm(seed, vocab=11, dim=6, layers=2)
    tokens = torch.randint(0, 11, (world * 2, 4))
    mine = local_rows(tokens, rank, world)
    with torch.no_grad():
        assert_close(model(mine), local_rows(reference(tokens), rank, world), what="no_grad output")
    model(mine).sum()  # graph dropped without backward
    train_and_compare(model, reference, steps=2, rows=1, seq=4)
    assert {type(p).__name__ for p in model.state_dict().values()} == {"DTensor"}
    assert list(model.state_dict()) == list(reference.state_dict())


def test_no_grad_and_abandoned_forward_then_training(ranks):
    ranks.run(2, eval_and_idle_forward_case, 10)


def bf16_case(seed, rsdp=rsdp_shard):
    """The same bf16 policy under rsdp (``rsdp``: how it shards) and under FSDP2: outputs and gradients
    agree within bf16 tolerance, and sharded parameters and gradients stay fp32."""
    rank, world = rank_and_world()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mesh = init_device_mesh("cpu", (world,))
    models = {}
    for name, shard in (("rsdp", rsdp), ("fsdp", fully_shard)):
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


def meta_device_init_case(seed):
    """torchtitan's order: build on meta, shard, ``to_empty``, initialise; ties and identities survive."""
    from torch.distributed.tensor import distribute_tensor

    torch.manual_seed(seed)
    reference = twin(TinyLM(vocab=13, dim=6, layers=2))
    with torch.device("meta"):
        model = TinyLM(vocab=13, dim=6, layers=2).double()
    shard_lm(model, ["rsdp", "rsdp"])
    rsdp_shard(model)
    params_before = {name: id(param) for name, param in model.named_parameters()}
    model.to_empty(device="cpu")
    assert {name: id(param) for name, param in model.named_parameters()} == params_before
    assert model.lm_head.weight is model.embed.weight
    reference_params = dict(reference.named_parameters())
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(distribute_tensor(reference_params[name].detach(), param.device_mesh, param.placements))
    train_and_compare(model, reference, steps=2, rows=1, seq=4)


def test_meta_device_init_then_to_empty(ranks):
    ranks.run(3, meta_device_init_case, 12)


def compiled_case(seed):
    """torch.compile (inductor) around a model of rsdp blocks: same losses, gradients and parameters
    as eager over two AdamW steps; each ring layer is a graph break, the rest compiles."""
    rank, world = rank_and_world()
    runs = {}
    for mode in ("eager", "compiled"):
        torch.manual_seed(seed)
        model = TinyLM(vocab=17, dim=8, heads=2, hidden=12, layers=2)
        shard_lm(model, ["rsdp", "rsdp"])
        rsdp_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        forward = torch.compile(model) if mode == "compiled" else model
        losses = []
        for step in range(2):
            tokens = torch.randint(0, 17, (world * 2, 6), generator=torch.Generator().manual_seed(step))
            mine = local_rows(tokens, rank, world)
            loss = lm_loss(forward(mine), mine)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
        runs[mode] = (torch.stack(losses), [full(p.detach()) for p in model.parameters()])
    assert_close(runs["compiled"][0], runs["eager"][0], what="compiled losses", rtol=1e-5, atol=1e-6)
    for compiled, eager in zip(runs["compiled"][1], runs["eager"][1]):
        assert_close(compiled, eager, what="compiled parameters", rtol=1e-5, atol=1e-6)


def test_torch_compile_matches_eager(ranks):
    ranks.run(2, compiled_case, 13)
