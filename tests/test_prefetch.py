"""Prefetch across ring layers (``_prefetch.py``): once the order of rings is known, each forward
ring's first exchange, and each planned sub-block's backward one, rides the previous ring's last one.
Counted, not timed: how many exchanges were prefetched and taken, the sends per pass, and exactness
against the fp64 reference when the order changes from one step to the next.
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from models import (
    HF_PLAN,
    LlamaBlock,
    LlamaLM,
    TinyLM,
    assert_param_grads_match,
    full,
    lm_loss,
    local_rows,
    planned_llama,
    rank_and_world,
    rsdp_lm,
    train_and_compare,
    twin,
)
from rsdp import MixedPrecisionPolicy, rsdp_shard
from rsdp._compat import fully_shard
from rsdp.memory import CommCounter


def forward_prefetch(model):
    """The forward ``RingPrefetch`` of ``model``'s ``RingContext`` (its prefetch counts)."""
    return model._get_rsdp_state().ring.context.forward_prefetch


def backward_prefetch(model):
    return model._get_rsdp_state().ring.context.backward_prefetch


def steady_state_case():
    """TinyLM: the embedding, then q+k+v, o, up and down per block, then the head, the largest
    message (and the down projection's larger than q+k+v's). Per step: the prefetched exchanges
    taken, the forward's sends and the backward's."""
    rank, world = rank_and_world()
    torch.manual_seed(0)
    model = TinyLM(vocab=61, dim=8, heads=2, hidden=40, layers=2)
    for layer in model.layers:
        rsdp_shard(layer)
    rsdp_shard(model)
    tokens = local_rows(torch.randint(0, 61, (world * 2, 5)), rank, world)
    counts = []
    for _ in range(5):
        used = forward_prefetch(model).used
        with CommCounter() as forward:
            loss = lm_loss(model(tokens), tokens)
        with CommCounter() as backward:
            loss.backward()
        counts.append((forward_prefetch(model).used - used, forward.calls["c10d::send"], backward.calls["c10d::send"]))
    return counts


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_ring_after_the_first_rides_the_last_exchange_of_the_one_before(ranks, world):
    """From the fourth step on (the first records which Linears share an input, the second runs the
    fused rings and learns their order, the third finds the ring buffers too small for the down
    projection's ring to carry the head's message, and grows them for the next) each ring's first
    message travels on the ring before's last exchange: a forward of R rings costs (W-1) + (R-1)(W-2)
    exchanges instead of R(W-1). On 2 and 3 ranks a prefetched ring's last exchange is not one it can
    make carry more (on 2 it has none of its own, on 3 it sends the message prefetched, which lies
    behind the message that carried it): every other ring is prefetched. The backward is unchanged."""
    rings = 1 + 2 * 4 + 1  # embedding, 4 rings per block, head
    for counts in ranks.run(world, steady_state_case):
        _, second, third, *steady = counts
        assert second == (0, rings * (world - 1), rings * (world - 1)), counts
        prefetched = rings // 2 if world < 4 else rings - 1
        expected = (prefetched, rings * (world - 1) - prefetched, rings * (world - 1))
        assert steady == [expected] * 2, counts
        assert third[0] >= prefetched - (world >= 4), counts


class SometimesSkipped(nn.Module):
    """Runs its middle layer only when asked: the order of rings changes between steps."""

    def __init__(self, dim):
        super().__init__()
        self.first, self.middle, self.last = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.skip_middle = False

    def forward(self, x):
        x = torch.tanh(self.first(x))
        if not self.skip_middle:
            x = torch.tanh(self.middle(x))
        return self.last(x)


def changing_order_case():
    """A prefetched ring that is not called next has its exchange completed and runs as usual."""
    rank, world = rank_and_world()
    torch.manual_seed(1)
    model = SometimesSkipped(5).double()
    reference = SometimesSkipped(5).double()
    reference.load_state_dict(model.state_dict())
    rsdp_shard(model)
    used = []
    for step, skip in enumerate([False, False, False, True, False, True, True, False]):
        model.skip_middle = reference.skip_middle = skip
        before = forward_prefetch(model).used
        x = torch.randn(world * 2, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        out = model(x[2 * rank : 2 * rank + 2])
        used.append(forward_prefetch(model).used - before)
        out.pow(2).sum().backward()
        expected = reference(x)
        expected.pow(2).sum().div(world).backward()
        torch.testing.assert_close(out, expected[2 * rank : 2 * rank + 2], rtol=1e-9, atol=1e-11)
        for param, reference_param in zip(model.parameters(), reference.parameters()):
            if reference_param.grad is None:  # the skipped layer
                assert param.grad is None
                continue
            torch.testing.assert_close(param.grad.full_tensor(), reference_param.grad, rtol=1e-9, atol=1e-11)
            param.grad, reference_param.grad = None, None
    return used


def test_a_changed_order_of_rings_stays_exact(ranks):
    # Prefetched rings taken per step: the order of the step before is the guess; a wrong guess is
    # dropped (its exchange is done), and no guess is made past the first ring that differs. On 4
    # ranks, where a prefetched ring carries the next one's first message too.
    for used in ranks.run(4, changing_order_case):
        assert used == [0, 2, 2, 0, 0, 0, 1, 0], used


def trajectory_case():
    model, reference = rsdp_lm(2, vocab=13, dim=6, heads=2, hidden=9, layers=3)
    train_and_compare(model, reference, steps=5, rows=1, seq=5)
    return forward_prefetch(model).used


def test_training_with_prefetched_rings_matches_reference(ranks):
    assert all(used > 0 for used in ranks.run(4, trajectory_case))


def planned_backward_case(steps, ring_group_size=1):
    """A planned 2-block Llama (the Hugging Face plan; rings in groups of ``ring_group_size``) trained
    ``steps`` steps against the fp64 reference; per step the backward's prefetched exchanges taken and
    its sends (between groups)."""
    torch.manual_seed(5)
    model, reference = planned_llama(vocab=211, ring_group_size=ring_group_size)  # the head's ring much the largest, as in a language model
    counts = []

    def count_backward(loss):
        used = backward_prefetch(model).used
        with CommCounter() as backward:
            loss.backward()
        counts.append((backward_prefetch(model).used - used, backward.calls["c10d::send"]))

    train_and_compare(model, reference, steps=steps, rows=1, seq=5, backward=count_backward)
    return counts


@pytest.mark.parametrize("world", [3, 4])
def test_planned_backward_rings_take_their_first_exchange_from_the_ring_before(ranks, world):
    """Backward rings: the head, then per block the MLP and the attention, then the Embedding. A planned
    sub-block's first exchange sends its weights alone, so from the third step (the first shows the
    order of rings, the second the ring buffers' sizes) it rides the last exchange of the ring before
    it, and the deferred last hop of each sub-block's partials rides the next ring's third exchange
    (the attention's, beside the next MLP's first message) or the Embedding's first. The head's ring,
    the backward's largest, carries nothing (that would make the ring buffers larger): 3 of the 4
    sub-blocks are prefetched. On 3 ranks a prefetched ring's one exchange of its own sends the
    message prefetched, with no room behind it for the hop deferred by the ring before: nothing is
    prefetched. The gradients are exact either way (``train_and_compare``)."""
    rings = 6
    for counts in ranks.run(world, planned_backward_case, 4):
        first, _, *steady = counts
        assert first == (0, rings * (world - 1)), counts
        expected = (3, rings * (world - 1) - 3) if world >= 4 else (0, rings * (world - 1))
        assert steady == [expected] * 2, counts


class SometimesShallowLlama(LlamaLM):
    """Skips its first block when asked: the order of backward rings changes between steps."""

    skip_first = False

    def forward(self, tokens):
        x = self.embed(tokens)
        for index, layer in enumerate(self.layers):
            if not (index == 0 and self.skip_first):
                x = layer(x)
        return self.lm_head(self.norm(x))


def changing_backward_order_case():
    """A backward ring prefetched for a sub-block that does not come next (its block was skipped) is
    dropped, and the rings stay exact."""
    rank, world = rank_and_world()
    torch.manual_seed(6)
    model, reference = planned_llama(SometimesShallowLlama, vocab=211)
    used = []
    for step, skip in enumerate([False, False, False, False, True, False, False, False, True, True, False]):
        model.skip_first = reference.skip_first = skip
        tokens = torch.randint(0, 211, (world, 5), generator=torch.Generator().manual_seed(step))
        before = backward_prefetch(model).used
        lm_loss(model(local_rows(tokens, rank, world)), local_rows(tokens, rank, world)).backward()
        used.append(backward_prefetch(model).used - before)
        lm_loss(reference(tokens), tokens).backward()
        assert_param_grads_match(model, reference, 1.0)
        for param in (*model.parameters(), *reference.parameters()):
            param.grad = None
    return used


def test_a_changed_order_of_backward_rings_stays_exact(ranks):
    # Prefetched backward rings taken per step on 4 ranks. All blocks: the second block's attention and
    # the first block's two sub-blocks (the head carries nothing, see above), once the first step has
    # shown the order and the second the buffers' sizes (a prefetched ring carries nothing where they
    # are too small). First block skipped: the second block's attention only. A guess made from the
    # step before fails at the first ring that differs (its exchange is dropped) and none is made
    # past it.
    for used in ranks.run(4, changing_backward_order_case):
        assert used == [0, 2, 3, 3, 1, 1, 3, 3, 1, 1, 1], used


def bf16_planned_case():
    """A planned Llama under a bf16 policy, and FSDP2 with the same policy, four backwards on the same
    parameters: a prefetched backward message holds fp32 partials and bf16 weights. Each gradient's
    distance from the exact float64 one is at most FSDP2's (1.5x, plus 1% of its scale, at least
    1e-3, as in ``test_autocast.py``: a gradient that is zero in exact arithmetic, a key bias's, is
    noise for both). Returns the backward prefetches taken."""
    rank, world = rank_and_world()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    torch.manual_seed(7)
    exact = LlamaLM(vocab=211, dim=10, heads=2 * world, kv_heads=world, head_dim=3, hidden=5 * world, layers=2)
    models = {}
    for name, shard in (("rsdp", rsdp_shard), ("fsdp", fully_shard)):
        models[name] = model = copy.deepcopy(exact)
        for layer in model.layers:
            if name == "rsdp":
                rsdp_shard(layer, mp_policy=policy, ring_plan=HF_PLAN)
            else:
                fully_shard(layer, mp_policy=policy)
        shard(model, mp_policy=policy)
    exact = exact.double()
    used = backward_prefetch(models["rsdp"]).used
    for step in range(4):
        tokens = torch.randint(0, 211, (world * 2, 6), generator=torch.Generator().manual_seed(step))
        lm_loss(exact(tokens), tokens).backward()
        mine = local_rows(tokens, rank, world)
        exact_grads = {n: p.grad for n, p in exact.named_parameters()}
        errors = {}
        for name, model in models.items():
            lm_loss(model(mine).float(), mine).backward()
            errors[name] = {n: (full(p.grad).double() - exact_grads[n]).abs().max().item() for n, p in model.named_parameters()}
            model.zero_grad(set_to_none=True)
        for name, grad in exact_grads.items():
            rsdp_error, fsdp_error = errors["rsdp"][name], errors["fsdp"][name]
            allowed = 1.5 * fsdp_error + 1e-2 * max(grad.abs().max().item(), 1e-3)
            assert rsdp_error <= allowed, f"step {step}, {name}: rsdp {rsdp_error:.3g} from exact, FSDP2 {fsdp_error:.3g}"
        exact.zero_grad(set_to_none=True)
    return backward_prefetch(models["rsdp"]).used - used


def test_prefetched_backward_messages_of_mixed_dtypes_match_fsdp2(ranks):
    assert all(used >= 3 for used in ranks.run(4, bf16_planned_case))


class TaperedLlama(LlamaLM):
    """A planned Llama whose second block is much wider than its first: after the second block's
    attention ring, which carries the first block's MLP message, the rest of the backward needs far
    smaller ring buffers, so they are trimmed while they hold that prefetched message."""

    def __init__(self, world):
        super().__init__(vocab=401, dim=6, heads=2 * world, kv_heads=world, head_dim=2, hidden=world, layers=2)
        self.layers[1] = LlamaBlock(6, 2 * world, world, 6, 30 * world)


def tapered_case():
    _, world = rank_and_world()
    torch.manual_seed(8)
    model = TaperedLlama(world).double()
    reference = twin(model)
    for layer in model.layers:
        rsdp_shard(layer, ring_plan=HF_PLAN)
    rsdp_shard(model)
    used = backward_prefetch(model).used
    train_and_compare(model, reference, steps=4, rows=1, seq=5)
    return backward_prefetch(model).used - used


def test_ring_buffers_trimmed_while_they_hold_a_prefetched_message_keep_it(ranks):
    assert all(used >= 4 for used in ranks.run(4, tapered_case))
