"""Synchronising exchanges per block and host synchronisations on the ring path, counted (not timed);
and the ring passes' profiler ranges.

Every ring step and every collective synchronises a rank with its peers; on GPUs a host sync stalls the
stream. Both are counted with dispatch modes, so these tests are deterministic.
"""

import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from models import TinyLM, lm_loss
from rsdp import rsdp_shard
from rsdp.memory import CommCounter

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path[:0] = [str(BENCHMARKS), str(BENCHMARKS / "rtp")]
from host_overhead import LlamaBlock  # noqa: E402
from transformer_lm import DECODER_LAYER_PLAN, DecoderLayer  # noqa: E402


def exchanges_case(block_kind, ring_plan=None, steps_before=2):
    """Sends and collectives of one forward and one backward of an rsdp block after ``steps_before``
    steps: the first finds the Linears that share an input, the second learns the order of the rings
    and the ring buffers' sizes (from the third on, rings are prefetched)."""
    torch.manual_seed(0)
    if block_kind == "llama":
        block, x = LlamaBlock(16, 4, 24), torch.randn(2, 5, 16)
    else:
        block, x = DecoderLayer(16, 4, 24), torch.randn(5, 2, 16)
    rsdp_shard(block, ring_plan=ring_plan)
    for _ in range(steps_before):
        block(x.requires_grad_()).sum().backward()
    counts = {}
    with CommCounter() as forward:
        out = block(x)
    with CommCounter() as backward:
        out.sum().backward()
    for phase, counter in (("forward", forward), ("backward", backward)):
        counts[phase] = {
            "sends": counter.calls["c10d::send"],
            "collectives": sum(n for op, n in counter.calls.items() if op != "c10d::send"),
        }
    return counts


def test_llama_block_without_a_plan_rotates_at_most_4_rings_per_pass(ranks):
    """q/k/v share one ring and gate/up another (found on the first step), o and down one each; counted
    on the second step, before any is prefetched, so that each ring costs W-1 exchanges."""
    world = 4
    for counts in ranks.run(world, exchanges_case, "llama", None, 1):
        rings = {phase: c["sends"] / (world - 1) for phase, c in counts.items()}
        assert rings == {"forward": 4, "backward": 4}, counts


def test_benchmark_decoder_layer_needs_no_more_exchanges_than_rtp(ranks):
    """RTP's code issues 27 sends per decoder layer and step at W=4 (``benchmarks/rtp/``); rsdp needs no
    more, with Linears sharing an input fused and the weights and gradient partials of backward in
    one message. Counted before any ring is prefetched."""
    for counts in ranks.run(4, exchanges_case, "benchmark", None, 1):
        total = sum(c["sends"] + c["collectives"] for c in counts.values())
        assert counts["forward"]["sends"] == counts["backward"]["sends"] == 4 * 3, counts  # q+k+v, out, linear1, linear2
        assert total == 26 <= 27, counts


def test_benchmark_decoder_layer_with_its_tensor_parallel_plan(ranks):
    """Attention and FFN one ring each: W-1 exchanges per ring and pass, less the FFN's first in
    forward, which rides the attention's last, and plus the backward's last hop of the attention's
    partials (the FFN's rides the attention's first exchange), plus the norms' two collectives: 14 at
    W=4. (The FFN's ring is the largest of this block's backward, so it does not carry the attention's
    first message, which would make the ring buffers larger: ``test_prefetch.py``.)"""
    for counts in ranks.run(4, exchanges_case, "benchmark", DECODER_LAYER_PLAN):
        assert counts["forward"]["sends"] == 2 * 3 - 1 and counts["backward"]["sends"] == 2 * 3 + 1, counts
        assert sum(c["sends"] + c["collectives"] for c in counts.values()) == 14, counts


def vector_collectives_case(final_norm):
    """Sends and collectives of the forwards and backwards of three steps of a TinyLM (root and blocks
    sharded)."""
    torch.manual_seed(0)
    model = TinyLM(vocab=23, dim=8, heads=2, hidden=12, layers=2, final_norm=final_norm)
    for layer in model.layers:
        rsdp_shard(layer)
    rsdp_shard(model)
    tokens = torch.randint(0, 23, (2, 6))
    counts = []
    for _ in range(3):
        with CommCounter() as forward:
            loss = lm_loss(model(tokens), tokens)
        with CommCounter() as backward:
            loss.backward()
        counts.append({"forward": dict(forward.calls), "backward": dict(backward.calls)})
    return counts


@pytest.mark.parametrize("world", [2, 3])
def test_norms_gather_on_the_first_ring_and_reduce_scatter_on_the_last(ranks, world):
    """The blocks' norms are all-gathered in one collective per forward and their gradients
    reduce-scattered in one per backward. From the second step on, once the first has shown when they
    are needed, the first forward ring (the Embedding's) carries the gather and the last backward ring
    (the Embedding's) the reduce-scatter: no collective, no exchange more. A final norm in the root is
    needed before any ring and queues its gradients after the root's last ring: it keeps both
    collectives (for itself alone)."""
    gather, reduce = "c10d::_allgather_base_", "c10d::_reduce_scatter_base_"
    riding = ranks.run(world, vector_collectives_case, False)
    collective = ranks.run(world, vector_collectives_case, True)
    for steps, with_norm in zip(riding, collective):
        assert steps[0]["forward"][gather] == steps[0]["backward"][reduce] == 1, steps
        # The first step also finds which Linears share a ring, the second which ring follows which
        # (the third prefetches: fewer sends), so the sends are compared step by step.
        for step in (1, 2):
            for phase, collective_op in (("forward", gather), ("backward", reduce)):
                sends = with_norm[step][phase]["c10d::send"]
                assert steps[step][phase] == {"c10d::send": sends}, (step, phase, steps)
                assert with_norm[step][phase] == {"c10d::send": sends, collective_op: 1}, (step, with_norm)


class HostSyncCounter(TorchDispatchMode):
    """Counts the ops that make the host wait for the device (on CUDA): reading a value, or a result
    whose shape depends on the data."""

    SYNCING = ("aten::_local_scalar_dense", "aten::nonzero", "aten::item", "aten::is_nonzero", "aten::equal", "aten::unique")

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in self.SYNCING or func._schema.name.startswith("aten::masked_select"):
            self.seen.append(func._schema.name)
        return func(*args, **(kwargs or {}))


def host_syncs_case():
    with HostSyncCounter() as probe:  # the ruler sees what it must
        torch.tensor([1, 0]).nonzero()
        torch.tensor(1.0).item()
    assert probe.seen == ["aten::nonzero", "aten::_local_scalar_dense"], probe.seen
    torch.manual_seed(0)
    model = TinyLM(vocab=23, dim=8, heads=2, hidden=12, layers=2)
    for layer in model.layers:
        rsdp_shard(layer)
    rsdp_shard(model)
    tokens = torch.randint(0, 23, (2, 6))
    lm_loss(model(tokens), tokens).backward()  # the first step agrees on fusion groups (one sync, once)
    with HostSyncCounter() as syncs:
        lm_loss(model(tokens), tokens).backward()
    return syncs.seen


@pytest.mark.parametrize("world", [2, 3])
def test_no_host_syncs_in_ring_forward_and_backward(ranks, world):
    for seen in ranks.run(world, host_syncs_case):
        assert seen == [], seen


class _TrackedWork:
    """A ring exchange's work that logs when it is waited for and when it is dropped."""

    def __init__(self, work, log, exchange):
        self.work, self.log, self.exchange = work, log, exchange

    def wait(self):
        self.work.wait()
        self.log.append(("waited", self.exchange))

    def __del__(self):
        self.log.append(("dropped", self.exchange))


def works_lifetime_case():
    from rsdp._fully_shard import _ring

    torch.manual_seed(0)
    model = TinyLM(vocab=11, dim=8, heads=2, hidden=12, layers=1)
    rsdp_shard(model)
    tokens = torch.randint(0, 11, (2, 3))
    log, exchanges = [], iter(range(10**6))
    real = _ring.send_and_receive  # every ring exchange's (a ring step's and ``Ring.exchange``'s)

    def tracked(*args):
        number = next(exchanges)
        return [_TrackedWork(work, log, number) for work in real(*args)]

    _ring.send_and_receive = tracked
    try:
        lm_loss(model(tokens), tokens).backward()
        model._get_rsdp_state().ring.context.waited_works.clear()
    finally:
        _ring.send_and_receive = real
    return log


def test_ring_works_are_dropped_only_after_the_next_exchange_is_waited_for(ranks):
    """Dropping a gloo work right after ``wait()`` makes its buffer's destructor spin until gloo's
    event-loop thread lets go of it (``_ring.WaitedWorks``): 2.4 ms of system time per exchange, summed
    over 4 ranks sharing 2 cores. Each exchange's works must outlive the next exchange's wait."""
    for log in ranks.run(2, works_lifetime_case):
        last_wait, first_drop = {}, {}  # exchange -> position in the log (a send's work and a receive's)
        for position, (event, number) in enumerate(log):
            if event == "waited":
                last_wait[number] = position
            else:
                first_drop.setdefault(number, position)
        assert len(last_wait) > 4 and last_wait.keys() == first_drop.keys(), log
        for number in sorted(last_wait)[:-1]:
            assert first_drop[number] > last_wait[number + 1], (number, log)


def profile_ranges_case():
    """The ``rsdp::ring_*`` ranges of one step under ``torch.profiler``, and how many ``record_function``
    ranges the rings opened in a step without it."""
    from torch.profiler import profile

    from rsdp._fully_shard import _ring_driver

    torch.manual_seed(0)
    model = TinyLM(vocab=11, dim=8, heads=2, hidden=12, layers=1)
    rsdp_shard(model)
    tokens = torch.randint(0, 11, (2, 3))
    lm_loss(model(tokens), tokens).backward()  # the first step agrees on fusion groups
    opened, real = [], _ring_driver.record_function
    _ring_driver.record_function = lambda name: opened.append(name) or real(name)
    try:
        lm_loss(model(tokens), tokens).backward()
        unprofiled = len(opened)
        with profile() as prof:
            lm_loss(model(tokens), tokens).backward()
    finally:
        _ring_driver.record_function = real
    ranges = sorted({event.name for event in prof.events() if event.name.startswith("rsdp::")})
    return unprofiled, ranges, opened[unprofiled:]


def test_ring_passes_are_profiler_ranges_only_while_a_profiler_records(ranks):
    """Each ring pass is a ``record_function`` range, as FSDP2's hooks are, so a profile shows where the
    time goes; without a profiler none is opened (one costs ~15 µs of host time even then)."""
    layers = ["embed", "layers.0.q+layers.0.k+layers.0.v", "layers.0.o", "layers.0.up", "layers.0.down", "lm_head"]
    for unprofiled, ranges, opened in ranks.run(2, profile_ranges_case):
        assert unprofiled == 0, unprofiled
        assert ranges == sorted(set(opened)), (ranges, opened)
        # One range per ring and pass, in the order the rings run (backward: reversed).
        assert opened == [f"rsdp::ring_forward ({name})" for name in layers] + [
            f"rsdp::ring_backward ({name})" for name in reversed(layers)
        ], opened
