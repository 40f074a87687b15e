"""The ring driver: the one way a ring layer runs a pass of its ring.

Every ring pass follows one protocol, whichever layer runs it (a Linear group, an input-split product,
an Embedding, a planned sub-block or an experts block, forward or backward), and ``RingDriver`` owns
it, so that what every ring does is written once:

1. **Begins**: the pass's schedule learns which ring runs (``_prefetch.ring_begins``), and the ring
   takes its first exchange if the ring before did it (``RingRun.prefetched``). A backward's first ring
   says which record the pass follows, so a ring begins before it asks for buffers.
2. **Buffers**: the message pair and a backward's scratch, from the model's ring buffers
   (``RingRun.pair``, ``RingRun.scratch``), in the order the layer asks for them.
3. **A profiler range** around the pass, ``rsdp::ring_forward (<name>)`` / ``rsdp::ring_backward
   (<name>)``, only while a profiler records (a ``record_function`` costs host time even then).
4. **Circulate** (``RingRun.circulate``, the only caller of ``Ring.circulate``): the next ring's first
   message rides the last exchange (the phase's prefetch, ``next_first``), and a pending collective
   rides every exchange where the ring carries one (``Rider``: the vectors' all-gather on a forward
   ring, their gradients' reduce-scatter on a backward one).
5. **Ends**: a planned sub-block defers its partials' last hop to the next ring (``defer_last_hop``),
   and a backward pass trims the ring buffers once its result is copied out (``RingBuffers.trim``).

A layer hands the driver what is its own (the message, its first message's tensors, what each step
computes) and gets the ring's last message back; the driver reads the model's shared services (buffers,
prefetch, pending collectives, deferred hops) through its ring's ``RingContext``, the one place they are
looked up, since ``rsdp_shard`` on a parent replaces a module's context.

Pitfalls:
- Riders ride only rings whose steps run no module code: a planned sub-block's steps run the module's
  own forward (or its backward), which reads the gathered vectors the rider would bring, so a
  sub-block's driver is made with ``carries_collectives=False``; a rider also needs a whole message not
  yet sent (not prefetched, no ``region``).
- Every rank must make the same decisions (what rides, what is prefetched): they depend only on the
  order of rings, which every rank shares, never on data.
- The buffer the ring returns is reused by the next ring: copy out what is kept before the run ends
  (a backward's end trims the buffers).
"""

import contextlib
from collections.abc import Callable

import torch
from torch.profiler import record_function

from .._compat import profiler_enabled
from ._buffers import RingBuffers
from ._prefetch import ring_begins
from ._ring import DeferredHop, Phase, Prefetched, Ring
from ._wire import Message, Segment


class RingDriver:
    """What one ring layer runs its rings with: its ``ring`` (group, neighbours, and the model's
    ``RingContext`` behind it), its message ``tags`` per phase, a ``name`` for profiles, and whether its
    rings may carry a pending collective (``carries_collectives``; not a planned sub-block's)."""

    def __init__(self, ring: Ring, tags: dict[Phase, int], name: str, carries_collectives: bool = True):
        self.ring, self.tags, self.name = ring, tags, name
        self.carries_collectives = carries_collectives
        self.range_names = {phase: f"rsdp::ring_{phase.name.lower()} ({name})" for phase in Phase}

    @property
    def buffers(self) -> RingBuffers:
        """The model's ring buffers (read at use: a parent's ``rsdp_shard`` replaces the context)."""
        return self.ring.context.buffers

    def message_of(self, segments: tuple[Segment, ...]) -> Message:
        """The one ``Message`` of these segments in the model's ring buffers."""
        return self.ring.context.buffers.message_of(segments)

    def run(self, phase: Phase, message: Message, tensors: list[torch.Tensor] | None = None, first: int = 0) -> "RingRun":
        """Begin a pass of this ring with ``message`` (a context manager: the profiler range, and a
        backward's trim at its end). ``tensors`` are the message's segments ``first:`` as this rank's
        first exchange sends them, when they can be sent ahead (``_prefetch.py``), else None."""
        return RingRun(self, phase, message, tensors, first)

    def forward(
        self, message: Message, during: Callable[[int, torch.Tensor], None], tensors: list[torch.Tensor] | None = None,
        start: Callable[[torch.Tensor], None] | None = None, on_arrival: Callable[[int, torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """One forward pass of this ring: its first message is ``tensors`` (this rank's shards, the
        message's segments; prefetchable) or, where it depends on the call, what ``start`` writes into
        the buffer it is given. Returns the message held last (a ring buffer: copy out what is kept)."""
        with RingRun(self, Phase.FORWARD, message, tensors if start is None else None, 0) as run:
            return run.circulate(run.first_message(tensors) if start is None else start, during, on_arrival)


class RingRun:
    """One pass of one ring, begun (``RingDriver.run``); see the module docstring for its protocol.
    ``prefetched`` is its first exchange if the ring before did it, else None."""

    def __init__(self, driver: RingDriver, phase: Phase, message: Message, tensors: list[torch.Tensor] | None, first: int):
        self.driver, self.phase, self.message = driver, phase, message
        self.ring = ring = driver.ring
        self.tag = driver.tags[phase]
        self.prefetched: Prefetched | None = ring_begins(ring, phase, self.tag, message, tensors, first)
        self._range: contextlib.AbstractContextManager | None = None

    def __enter__(self) -> "RingRun":
        if profiler_enabled():
            self._range = record_function(self.driver.range_names[self.phase])
            self._range.__enter__()
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if self._range is not None:
            self._range.__exit__(kind, error, traceback)
        if error is None and self.phase is Phase.BACKWARD:
            self.ring.context.buffers.trim()

    def first_message(self, tensors: list[torch.Tensor]):
        """The first message made of ``tensors`` (its segments), for ``circulate``: the exchange prefetched
        for it, else the tensors themselves when they are the message, else a function that packs them."""
        if self.prefetched is not None:
            return self.prefetched
        as_is = self.message.as_is(tensors)
        if as_is is not None:
            return as_is
        message, rank = self.message, self.ring.rank
        return lambda buffer: message.pack(buffer, rank, tensors)

    def pair(self, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The two message buffers, ``nbytes`` long (asked for ahead of the ring: the order of requests
        is the pass's)."""
        return self.ring.context.buffers.pair(nbytes, self.ring.device)

    def scratch(self, nbytes: int) -> torch.Tensor:
        """The buffer for what a step computes between two arrivals, ``nbytes`` long."""
        return self.ring.context.buffers.scratch(nbytes, self.ring.device)

    def circulate(
        self,
        start: torch.Tensor | Callable[[torch.Tensor], None] | Prefetched,
        during: Callable[[int, torch.Tensor], None] | None,
        on_arrival: Callable[[int, torch.Tensor], None] | None = None,
        region: Callable[[int], slice] | None = None,
    ) -> torch.Tensor:
        """The ring's W-1 exchanges of its message (``Ring.circulate``, whose arguments these are), with
        the next ring's first message as a passenger and a pending collective as a rider where they
        can ride. Returns the message held last."""
        ring, context = self.ring, self.ring.context
        rider = None
        if self.phase is Phase.FORWARD:
            carry_next = context.forward_prefetch.next_first
            if self.driver.carries_collectives:
                rider = context.pending_gathers.ring_rider(ring, start)
        else:
            carry_next = context.backward_prefetch.next_first
            if self.driver.carries_collectives and region is None:
                rider = context.pending_reductions.ring_rider(ring)
        return ring.circulate(self.message.nbytes, self.tag, start, during, on_arrival, region=region, carry_next=carry_next, rider=rider)

    def defer_last_hop(self, payload: torch.Tensor, arrived: Callable[[torch.Tensor], None]) -> None:
        """The partials' last hop (``payload``, bytes), to ride an exchange of the next ring
        (``_ring.DeferredHop``); ``arrived`` is given the bytes that came from up."""
        self.ring.context.deferred_hops.defer(DeferredHop(self.ring, self.tag, payload, arrived))
