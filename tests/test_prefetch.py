"""Prefetch across ring layers (``_prefetch.py``): once the order of forward rings is known, each
ring's first exchange rides the previous ring's last one. Counted, not timed: how many exchanges were
prefetched and taken, the sends per pass, and exactness against the fp64 reference when the order
changes from one step to the next.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from models import TinyLM, local_rows, lm_loss, rank_and_world
from rsdp import rsdp_shard
from rsdp._fully_shard._prefetch import FORWARD_RING_ORDER
from rsdp.memory import CommCounter
from test_training import rsdp_lm, train_and_compare


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
        used = FORWARD_RING_ORDER.used
        with CommCounter() as forward:
            loss = lm_loss(model(tokens), tokens)
        with CommCounter() as backward:
            loss.backward()
        counts.append((FORWARD_RING_ORDER.used - used, forward.calls["c10d::send"], backward.calls["c10d::send"]))
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
        before = FORWARD_RING_ORDER.used
        x = torch.randn(world * 2, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        out = model(x[2 * rank : 2 * rank + 2])
        used.append(FORWARD_RING_ORDER.used - before)
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
    return FORWARD_RING_ORDER.used


def test_training_with_prefetched_rings_matches_reference(ranks):
    assert all(used > 0 for used in ranks.run(4, trajectory_case))
