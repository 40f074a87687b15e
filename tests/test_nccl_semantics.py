"""The rings under NCCL's semantics, emulated on gloo: the CUDA path is the same code, and no machine
with several GPUs has run it yet, so what NCCL does differently from gloo is played here on CPU ranks.

Where NCCL differs, and what the emulation (``NcclLikeExchanges``) does about it:

- NCCL matches sends and receives by the order ranks issue them in, not by tag: every exchange goes
  with tag 0, so ranks that issued exchanges in different orders would swap messages.
- A send reads its buffer on NCCL's stream at any time until ``wait()``: the emulation reads it at
  ``wait()``, so a write into a buffer that is being sent changes what arrives.
- A receive writes its buffer at any time until ``wait()``: the emulation fills the received region
  with 0xFF bytes (NaN in every floating dtype) when the receive is issued, and writes the message at
  ``wait()``. A read before the wait sees NaN; so does the send of a buffer received into before
  that send was waited for.
- An ``async_op`` all-reduce (HSDP's, ``_grad.py``) reads and writes its tensor until ``wait()``: the
  emulation runs it at ``wait()``, so a read before it sees the unreduced values.

The exchanges themselves go through ``batch_isend_irecv``, the GPU path's call (group ranks mapped
to global ones: HSDP's shard groups are subgroups). The first test shows the emulation catching each
hazard; the others train against the fp64 reference under it (a bf16 policy against FSDP2's): the
planned sub-block rings with their prefetched first messages and deferred hops, the norms riding the
rings, accumulation without sync, HSDP, and Linear and Embedding rings under activation checkpointing
that keeps their outputs.
"""

import pytest
import torch
import torch.distributed as dist

import test_prefetch
import test_sub_block
import test_training
from models import rank_and_world
from rsdp._compat import batched_send_and_receive
from rsdp._fully_shard import _ring


class _AtWait:
    """A work whose operation runs at its first ``wait()``, as late as NCCL may run it."""

    def __init__(self, run):
        self._run = run

    def wait(self, timeout=None) -> bool:
        if self._run is not None:
            run, self._run = self._run, None
            run()
        return True


def _exchange_now(group, send, to, receive, source) -> None:
    landing = torch.empty_like(receive)
    for work in batched_send_and_receive(group, send, to, landing, source, 0):
        work.wait()
    receive.copy_(landing)


class NcclLikeExchanges:
    """While entered, the rings' exchanges and async all-reduces on this rank follow NCCL's semantics
    as the module docstring describes; counts them."""

    def __init__(self):
        self.exchanges = self.all_reduces = 0

    def __enter__(self):
        self._send_and_receive, self._all_reduce = _ring.send_and_receive, dist.all_reduce
        _ring.send_and_receive, dist.all_reduce = self._exchange, self._async_all_reduce
        return self

    def __exit__(self, *exc):
        _ring.send_and_receive, dist.all_reduce = self._send_and_receive, self._all_reduce

    def _exchange(self, group, send, to, receive, source, tag):
        self.exchanges += 1
        receive.fill_(0xFF if receive.dtype == torch.uint8 else float("nan"))  # NaN in every float dtype
        return [_AtWait(lambda: _exchange_now(group, send, to, receive, source))]

    def _async_all_reduce(self, tensor, *args, async_op=False, **kwargs):
        if not async_op:
            return self._all_reduce(tensor, *args, **kwargs)
        self.all_reduces += 1
        return _AtWait(lambda: self._all_reduce(tensor, *args, **kwargs))


def hazards_case():
    rank, world = rank_and_world()
    group = dist.group.WORLD
    down, up = (rank - 1) % world, (rank + 1) % world
    with NcclLikeExchanges():
        # A read before the wait sees NaN; the message is there after it.
        send, receive = torch.full((3,), float(rank)), torch.zeros(3)
        (work,) = _ring.send_and_receive(group, send, down, receive, up, tag=5)
        read_early = receive.clone()
        work.wait()
        read_after_wait = receive.clone()
        # A write into a buffer being sent changes what arrives.
        (work,) = _ring.send_and_receive(group, send, down, receive, up, tag=5)
        send.fill_(-1.0)
        work.wait()
        written_while_sent = receive.clone()
        # Matched by order, not tag: rank 0 issues tag 1 then 2, the others tag 2 then 1.
        tags = (1, 2) if rank == 0 else (2, 1)
        first, second = torch.full((1,), 10.0 * rank + 1), torch.full((1,), 10.0 * rank + 2)
        got_first, got_second = torch.zeros(1), torch.zeros(1)
        works = _ring.send_and_receive(group, first, down, got_first, up, tags[0])
        works += _ring.send_and_receive(group, second, down, got_second, up, tags[1])
        for work in works:
            work.wait()
        # An async all-reduce has not run before its wait.
        total = torch.full((2,), float(rank + 1))
        work = dist.all_reduce(total, async_op=True)
        before = total.clone()
        work.wait()
    return read_early, read_after_wait, written_while_sent, got_first, got_second, before, total


def test_the_emulation_shows_each_hazard(ranks):
    world = 3
    for rank, (read_early, read_after_wait, written, got_first, got_second, before, total) in enumerate(ranks.run(world, hazards_case)):
        up = (rank + 1) % world
        assert read_early.isnan().all()
        assert torch.equal(read_after_wait, torch.full((3,), float(up)))
        assert torch.equal(written, torch.full((3,), -1.0))
        # Under gloo's tag matching rank 0 would get rank 1's tag-1 message (its second) first.
        assert (got_first.item(), got_second.item()) == (10.0 * up + 1, 10.0 * up + 2)
        assert torch.equal(before, torch.full((2,), float(rank + 1)))
        assert torch.equal(total, torch.full((2,), float(sum(range(1, world + 1)))))


def under_nccl_semantics(case, *args, **kwargs) -> tuple[int, int]:
    """``case`` run under the emulation; the exchanges and async all-reduces it made."""
    with NcclLikeExchanges() as emulated:
        case(*args, **kwargs)
    return emulated.exchanges, emulated.all_reduces


@pytest.mark.parametrize("world, sync_last_only", [(2, False), (3, True), (4, False)])
def test_planned_lm_trains_exactly_under_nccl_semantics(ranks, world, sync_last_only):
    """Sub-block rings, prefetched first messages, deferred hops, the norms riding the rings; with
    accumulation without sync on 3 ranks."""
    for exchanges, _ in ranks.run(world, under_nccl_semantics, test_sub_block.lm_case, 21, sync_last_only):
        assert exchanges > 0


def test_planned_lm_under_hsdp_trains_exactly_under_nccl_semantics(ranks):
    for exchanges, all_reduces in ranks.run(4, under_nccl_semantics, test_sub_block.hsdp_case, 22):
        assert exchanges > 0 and all_reduces > 0


def test_linear_and_embedding_rings_train_exactly_under_nccl_semantics(ranks):
    """Prefetched Linear and Embedding rings; on 3 ranks activation checkpointing that keeps the ring
    outputs, and bf16 messages (a bf16 policy, against FSDP2's)."""
    for exchanges, _ in ranks.run(4, under_nccl_semantics, test_prefetch.trajectory_case):
        assert exchanges > 0
    kept = ranks.run(3, under_nccl_semantics, test_training.lm_training_case, 6, 2, 6, 9, ["rsdp", "rsdp"],
                     checkpointing=True, steps=3, rows=1, seq=4)
    bf16 = ranks.run(3, under_nccl_semantics, test_training.bf16_case, 11)
    assert all(exchanges > 0 for exchanges, _ in kept + bf16)
