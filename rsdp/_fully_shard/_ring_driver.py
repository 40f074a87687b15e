"""The ring driver: the one way a ring layer runs a pass of its ring.

Every ring pass follows one protocol, whichever layer runs it (a Linear group, an input-split product,
an Embedding, a planned sub-block or an experts block, forward or backward), and ``RingDriver`` owns
it, so that what every ring does is written once:

1. **Begins**: the pass's schedule learns which ring runs (``_prefetch.ring_begins``), and the ring
   takes its first exchange if the ring before did it (``RingRun.prefetched``). A backward's first ring
   says which record the pass follows, so a ring begins before it asks for buffers.
2. **Buffers**: the message pair and a backward's scratch, from the model's ring buffers, asked for as
   the pass begins (``RingRun``'s ``pair``, ``scratch``); ``Ring.circulate`` asks for the pair again
   at the size of its message and passengers.
3. **A profiler range** around the pass, ``rsdp::ring_forward (<name>)`` / ``rsdp::ring_backward
   (<name>)``, only while a profiler records (a ``record_function`` costs host time even then).
4. **Turn** (``RingRun.turn``, the only caller of ``Ring.circulate``): the next ring's first
   message rides the last exchange (the phase's prefetch, ``next_first``), and a pending collective
   rides every exchange where the ring carries one (``Rider``: the vectors' all-gather on a forward
   ring, their gradients' reduce-scatter on a backward one). A ring of groups turns the same way
   (``gathered`` and ``fill`` say which segments its group all-gathers and how a rank contributes to
   the partials it reduce-scatters, or ``own`` that the partials follow the weights, as a planned
   sub-block's do); a reduce-scatter rides it only with partials of its own dtype, with which its
   group sums it.
5. **Ends**: a planned sub-block defers its partials' last hop to the next ring (``defer_last_hop``),
   and a backward pass trims the ring buffers once its result is copied out (``RingBuffers.trim``).

A layer hands the driver what is its own (the message, its first message's tensors, what each step
computes) and gets the ring's last message back; the driver reads the model's shared services
(prefetch, pending collectives, deferred hops) through its ring's ``RingContext``, the one place a ring
layer's passes look them up, since ``rsdp_shard`` on a parent replaces a module's context
(``Ring.join``). A layer lays out its messages in its ring's buffers (``ring.buffers``).

Host time: a ring pass costs a few Python calls of bookkeeping, and a Llama block runs eight, so the
driver adds no call of its own where it can (``run`` is a ``functools.partial``, the buffers are asked
for inside ``RingRun``, the forward needs no context manager): ``benchmarks/host_overhead.py`` counts
the calls per block.

Pitfalls:
- A planned sub-block's rings carry no collective (its driver is made with
  ``carries_collectives=False``): its forward steps run the module's own code, which reads the gathered
  vectors an all-gather rider would bring, and its synchronised backward's first exchange sends the
  weights alone (a ``region``). A rider needs a whole message not yet sent (not prefetched, no
  ``region``).
- Every rank must make the same decisions (what rides, what is prefetched): they depend only on the
  order of rings, which every rank shares, never on data.
- The buffer the ring returns is reused by the next ring: copy out what is kept before the run ends
  (a backward's end trims the buffers).
"""

import functools
from collections.abc import Callable

import torch
from torch.profiler import record_function

from .._compat import profiler_enabled
from ._prefetch import ring_begins
from ._ring import DeferredHop, Phase, Prefetched, Ring
from ._wire import Message


class RingDriver:
    """What one ring layer runs its rings with: its ``ring`` (group, neighbours, and the model's
    ``RingContext`` behind it), its message ``tags`` per phase, a ``name`` for profiles, and whether its
    rings may carry a pending collective (``carries_collectives``; not a planned sub-block's).

    ``run(phase, message, tensors=None, first=0, pair=None, scratch=None)`` begins a pass (a ``RingRun``)."""

    def __init__(self, ring: Ring, tags: dict[Phase, int], name: str, carries_collectives: bool = True):
        self.ring, self.tags, self.name = ring, tags, name
        self.carries_collectives = carries_collectives
        self.range_names = {phase: f"rsdp::ring_{phase.name.lower()} ({name})" for phase in Phase}
        self.run = functools.partial(RingRun, self)  # no call of its own: each costs host time per ring

    def forward(
        self, message: Message, during: Callable[[int, torch.Tensor], None], tensors: list[torch.Tensor], prefetchable: bool = True,
        rank_major: bool = False,
    ) -> None:
        """One forward pass of this ring: its first message is ``tensors`` (this rank's shards, the
        message's segments), which the ring before may send ahead unless the call makes them
        (``prefetchable=False``). ``during(k, buffer)`` computes with the shards ``buffer`` holds at step k
        (on a ring of groups a block, laid out ``rank_major`` if asked: ``_wire.BlockRegions``)."""
        run = RingRun(self, Phase.FORWARD, message, tensors if prefetchable else None)
        members = message.members  # what travels: this rank's shards (the message itself on a ring of ranks)
        start = run.prefetched or members.as_is(tensors)  # as_is: a tensor or None, the last operand
        if start is None:
            start = functools.partial(_pack, members, self.ring.rank, tensors)
        turn = functools.partial(run.turn, start, during, rank_major=rank_major)
        if profiler_enabled():
            with record_function(self.range_names[Phase.FORWARD]):
                turn()
                return
        turn()


class RingRun:
    """One pass of one ring, begun (``RingDriver.run``; a context manager for the backward's: the
    profiler range, and the trim at its end); see the module docstring for its protocol.

    ``prefetched`` is its first exchange if the ring before did it, else None. ``tensors`` are the
    message's segments ``first:`` as this rank's first exchange sends them, when they can be sent ahead
    (``_prefetch.py``), else None. ``pair`` and ``scratch`` (bytes), where given, are asked for as the pass
    begins, in that order (the order of requests is the pass's): ``buffers`` are the two message
    buffers, ``scratch_buffer`` the one for what a step computes between two arrivals."""

    def __init__(
        self, driver: RingDriver, phase: Phase, message: Message, tensors: list[torch.Tensor] | None = None,
        first: int = 0, pair: int | None = None, scratch: int | None = None,
    ):
        self.driver, self.phase, self.message = driver, phase, message
        self.ring = ring = driver.ring
        self.tag = driver.tags[phase]
        self.prefetched: Prefetched | None = ring_begins(ring, phase, self.tag, message, tensors, first)
        if pair is not None:
            self.buffers = ring.buffers.pair(pair, ring.device)
        if scratch is not None:
            self.scratch_buffer = ring.buffers.scratch(scratch, ring.device)
        self._range = None

    def __enter__(self) -> "RingRun":
        if profiler_enabled():
            self._range = record_function(self.driver.range_names[self.phase])
            self._range.__enter__()
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if self._range is not None:
            self._range.__exit__(kind, error, traceback)
        if error is None and self.phase is Phase.BACKWARD:
            self.ring.buffers.trim()

    def turn(
        self,
        start: torch.Tensor | Callable[[torch.Tensor], None] | Prefetched,
        during: Callable[[int, torch.Tensor], None] | None,
        on_arrival: Callable[[int, torch.Tensor], None] | None = None,
        region: Callable[[int], slice] | None = None,
        gathered: range | None = None,
        fill: Callable[[int, torch.Tensor], None] | None = None,
        own: torch.Tensor | None = None,
        rank_major: bool = False,
    ) -> torch.Tensor:
        """The ring's exchanges of its message (``Ring.circulate``, whose arguments these are), with
        the next ring's first message as a passenger and a pending collective as a rider where they
        can ride. On a ring of groups a reduce-scatter rides only with partials of its dtype (it is
        summed with them within the group). Returns the message held last (``message.members``'
        layout: this rank's own shards)."""
        ring, context = self.ring, self.ring.context
        rider = None
        if self.phase is Phase.FORWARD:
            carry_next = context.forward_prefetch.next_first
            if self.driver.carries_collectives:
                rider = context.pending_gathers.ring_rider(ring, start)
        else:
            carry_next = context.backward_prefetch.next_first
            if self.driver.carries_collectives and region is None:
                if ring.group_size == 1:
                    rider = context.pending_reductions.ring_rider(ring)
                else:
                    dtype = self.message.block_regions(range(len(self.message.segments)) if gathered is None else gathered, rank_major).rider_dtype
                    if dtype is not False:
                        rider = context.pending_reductions.ring_rider(ring, dtype)
        return ring.circulate(
            self.message, self.tag, start, during, on_arrival, gathered=gathered, fill=fill, own=own, region=region, carry_next=carry_next, rider=rider,
            rank_major=rank_major,
        )

    def defer_last_hop(self, payload: torch.Tensor, arrived: Callable[[torch.Tensor], None]) -> None:
        """The partials' last hop (``payload``, bytes), to ride an exchange of the next ring
        (``_ring.DeferredHop``); ``arrived`` is given the bytes that came from up."""
        self.ring.context.deferred_hops.defer(DeferredHop(self.ring, self.tag, payload, arrived))


def _pack(message: Message, rank: int, tensors: list[torch.Tensor], buffer: torch.Tensor) -> None:
    """A forward's first message: this rank's ``tensors`` packed into ``buffer``."""
    message.pack(buffer, rank, tensors)
