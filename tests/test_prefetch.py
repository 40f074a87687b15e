"""Prefetch across ring layers (``_prefetch.py``): once the order of forward rings is known, each
ring's first exchange starts during the previous ring's last step. Counted, not timed: how many
exchanges were prefetched and taken, that the sends per step do not change, and exactness against
the fp64 reference when the order changes from one step to the next.
"""

import torch
import torch.distributed as dist
import torch.nn as nn

from models import TinyLM, local_rows, lm_loss, rank_and_world
from rsdp import rsdp_shard
from rsdp._fully_shard._prefetch import FORWARD_RING_ORDER
from rsdp.memory import CommCounter
from test_training import rsdp_lm, train_and_compare


def steady_state_case():
    """TinyLM: the embedding, then q+k+v, o, up and down per block, then the head. Every ring after
    the embedding is prefetched from the third step on (the first records which Linears share an
    input, the second runs the fused rings and learns their order)."""
    rank, world = rank_and_world()
    torch.manual_seed(0)
    model = TinyLM(vocab=19, dim=8, heads=2, hidden=12, layers=2)
    for layer in model.layers:
        rsdp_shard(layer)
    rsdp_shard(model)
    tokens = local_rows(torch.randint(0, 19, (world * 2, 5)), rank, world)
    counts = []
    for _ in range(4):
        used = FORWARD_RING_ORDER.used
        with CommCounter() as comm:
            lm_loss(model(tokens), tokens).backward()
        counts.append((FORWARD_RING_ORDER.used - used, comm.calls["c10d::send"]))
    return counts


def test_every_ring_after_the_first_is_prefetched_without_extra_exchanges(ranks):
    world = 3
    for counts in ranks.run(world, steady_state_case):
        (_, first_sends), (second_used, sends), *steady = counts
        assert second_used == 0, counts
        rings = 1 + 2 * 4 + 1  # embedding, 4 rings per block, head
        assert sends == rings * 2 * (world - 1), counts  # W-1 exchanges per ring and pass, prefetched or not
        assert steady == [(rings - 1, sends)] * 2, counts


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
    # completed and dropped, and no guess is made past the first ring that differs.
    for used in ranks.run(3, changing_order_case):
        assert used == [0, 2, 2, 0, 0, 0, 1, 0], used


def trajectory_case():
    model, reference = rsdp_lm(2, vocab=13, dim=6, heads=2, hidden=9, layers=3)
    train_and_compare(model, reference, steps=5, rows=1, seq=5)
    return FORWARD_RING_ORDER.used


def test_training_with_prefetched_rings_matches_reference(ranks):
    assert all(used > 0 for used in ranks.run(4, trajectory_case))
