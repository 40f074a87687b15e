"""Prefetch across ring layers: the next ring's first exchange rides this ring's last one.

A ring's first message is often nothing but this rank's own shards, packed from the parameters:

- **forward**, every ring but an Embedding's: it does not depend on the input;
- **backward**, a planned sub-block's (``_sub_block.py``): its first exchange sends the weights alone
  (the partials start at the second), so it does not depend on the gradient arriving.

So it can travel before its ring is called. The last exchange of a ring, which overlaps its
second-to-last step's computation, carries it behind the ring's own message (a ``Passenger``), to the
same neighbour: the next ring then starts with its first exchange done and costs one exchange fewer.
A forward pass of R rings on W >= 4 ranks costs R(W-2)+1 exchanges instead of R(W-1) (on a ring of
groups, W counts the groups: ``Ring.owners``); a backward
saves one per planned sub-block after a ring that can carry it (below). A prefetched ring's own first
exchange sends the message prefetched, which lies behind the carrying ring's with nothing free behind
it, so only its later exchanges can carry anything: on 2 ranks (no exchange of its own) and 3 (one)
there is none, and every other forward ring is prefetched; a backward ring prefetches only on W >= 4,
where the hop deferred by the ring before it (``_ring.DeferredHop``), which would have ridden its
first exchange, rides its third instead, beside the next ring's first message at W = 4.

A backward message puts its partials first: the weights the first exchange sends start ``lead`` bytes
into it. Those bytes do not travel; the message prefetched starts that far before the weights, over
the carrying ring's own message, which that ring has copied out before the next one writes its
partials there.

Which ring comes next is read from the recorded schedule of the pass kind (``_schedule.py``: the
rings of the last pass of the same kind with the same key — a forward's outermost rsdp module, a
backward's first ring —, forward rings recomputed in backward by activation checkpointing included, which take no prefetch and make none; each model's
``RingContext`` has its own), while the pass running follows it; and a ring is prefetched as its
previous call made its first message: the same layout, packed from the same tensors. A prefetched
ring that is not called next (control flow changed, or a different layout) runs as usual, its own
first exchange and all; the pass leaves its schedule, which is recorded anew.

Pitfalls:
- The ring buffers are a passenger's length longer during the carrying ring (each of the two holds
  its message and the next ring's first one), and the next ring starts in the part of them behind
  the message, which the carrying ring no longer reads. In backward, where rsdp's memory peaks, a
  ring whose message and passengers would need more than the pass's largest message (in the record the
  pass follows) carries nothing, so that the ring buffers' peak is not raised: the head's backward ring, the
  largest, carries no passenger. A prefetched ring must not make them larger (that would lose its own
  message): if they are too small it carries nothing, and the next pass makes them large enough from
  its start (``RingBuffers.hold``). When the backward's ring buffers are trimmed
  (``RingBuffers.trim``) a prefetched message is kept.
- An Embedding's forward first message carries the rank's "index out of range" flag, known only once
  it is called; a Linear group's backward first message carries partials: neither is prefetched.
- Only on the carrying ring's own group, group size and device: the passenger travels on its exchange,
  to the carrying ring's neighbour (on a ring of groups the rank at this rank's place in the previous
  group), and what it carries is one rank's shards (``Message.members``).
- Not under selective activation checkpointing, whose replay needs fresh buffers.
- NCCL matches point-to-point operations by order, gloo by tag and size: the decisions depend only on
  the sequence of rings, which every rank runs alike, as the rings themselves require.
"""

import dataclasses
import math

import torch

from .._compat import current_graph_task_id, dispatch_modes, in_selective_checkpoint
from ._wire import Message
from ._ring import Phase, Prefetched, Ring


@dataclasses.dataclass
class _FirstMessage:
    """How a ring made its first message at its last call: ``tensors`` are its segments ``first:``,
    which its first exchange sends."""

    ring: Ring
    message: Message
    tensors: list[torch.Tensor]
    first: int

    @property
    def lead(self) -> int:
        return self.message.members.offsets[self.first]

    def signature(self) -> tuple:
        return (self.message.segments, self.first, _where(self.tensors))


def _where(tensors: list[torch.Tensor]) -> tuple:
    # Views made afresh each call (a transposed weight) are the same data if they start, look and
    # step alike.
    return tuple([(t.data_ptr(), t.shape, t.stride(), t.dtype) for t in tensors])  # a list: a generator's every step is a call


class _NextFirstMessage:
    """The next ring's first message as a ``Passenger`` of this ring's last exchange. ``room``: the
    most bytes the ring buffers may hold for the carrying ring's message and its passengers."""

    def __init__(self, prefetch: "RingPrefetch", tag: int, first: _FirstMessage, room: float):
        self.prefetch, self.tag, self.first, self.room = prefetch, tag, first, room
        self.lead = first.lead
        self.nbytes = first.message.members.nbytes - self.lead

    def board(self, region: torch.Tensor) -> None:
        first = self.first
        members = first.message.members  # what travels: this rank's shards, on a ring of groups too
        as_is = members.as_is(first.tensors) if first.first == 0 else None
        if as_is is None:
            members.pack(region, first.ring.rank, first.tensors, first.first)
        else:
            region.copy_(as_is)

    def alight(self, sent: torch.Tensor, received: torch.Tensor, received_in: int) -> None:
        self.prefetch.arrived(self.tag, self.first.signature(), Prefetched(sent, received, received_in))


class RingPrefetch:
    """The prefetch of one pass kind (forward or backward): how each ring made its first message at its
    last call, and the first exchange done ahead for the ring the pass's schedule (``_schedule.py``)
    says comes next."""

    def __init__(self, context, backward: bool):
        self._context = context
        self.backward = backward
        self.schedule = context.schedules[backward]
        self._first_messages: dict[int, _FirstMessage | None] = {}  # None: not prefetchable
        self._prefetched: tuple[int, tuple, Prefetched] | None = None  # (tag, signature, exchange)
        self.used = 0  # prefetched exchanges that their ring took (tests count them)

    def arrived(self, tag: int, signature: tuple, exchange: Prefetched) -> None:
        """The first exchange of the ring expected next is done (``_NextFirstMessage.alight``)."""
        self._prefetched = (tag, signature, exchange)
        self._context.buffers.keep(exchange.sent, exchange.received)

    def _take(self) -> tuple | None:
        prefetched, self._prefetched = self._prefetched, None
        if prefetched is not None:
            self._context.buffers.keep()
        return prefetched

    def begin(
        self, ring: Ring, tag: int, message: Message, tensors: list[torch.Tensor] | None, first: int = 0
    ) -> Prefetched | None:
        """A ring of this prefetch's kind begins, with ``message``; ``tensors`` are its segments ``first:``,
        which its first exchange sends, or None when that cannot be prefetched. Returns its first
        exchange if the ring before did it, or None (then it makes its own)."""
        if self.backward:
            self._context.end_with_backward(self)
        self.schedule.ring(tag, message.segments, first, message.members.nbytes)
        prefetched = self._take()
        prefetchable = tensors is not None and ring.owners > 1 and not (dispatch_modes() and in_selective_checkpoint())
        first_message = _FirstMessage(ring, message, tensors, first) if prefetchable else None
        self._first_messages[tag] = first_message
        if prefetched is None:
            return None
        expected_tag, signature, exchange = prefetched
        if first_message is None or expected_tag != tag or signature != first_message.signature():
            return None
        self.used += 1
        return exchange

    def next_first(self, ring: Ring) -> _NextFirstMessage | None:
        """The next ring's first message, for ``ring``'s last exchange to carry (``Ring.circulate``'s
        ``carry_next``), if the schedule says which ring that is and it shares ``ring``'s group and
        group size (the same neighbour) and device. Called as a ring of this prefetch's kind starts."""
        # (Builtins first: no Python frame in the common case, at every ring.)
        if (current_graph_task_id() != -1) != self.backward or (dispatch_modes() and in_selective_checkpoint()):
            return None
        if self.backward and ring.owners < 4:  # the deferred hop the next ring would carry has no place
            return None
        upcoming = self.schedule.next_ring()
        if upcoming is None:
            return None
        _, tag, segments, first_segment, _ = upcoming
        first = self._first_messages.get(tag)
        if first is None or first.message.segments != segments or first.first != first_segment:
            return None
        if first.ring.group is not ring.group or first.ring.group_size != ring.group_size or first.ring.device != ring.device:
            return None
        # In backward, where rsdp's memory peaks (gradients pile up), no larger than the pass's largest
        # message: its first ring, a head's, is often the largest, and carries nothing then.
        room = self.schedule.largest if self.backward else math.inf
        return _NextFirstMessage(self, tag, first, room)

    def end_pass(self) -> None:
        """The pass ended: drop an exchange no ring took."""
        self._take()

    def keep_expected(self) -> None:
        """The schedule was recorded anew: keep the first messages of the rings some record says come
        next, not the others' (their tensors, of a model no longer trained perhaps, are not kept alive here)."""
        expected = self.schedule.ring_tags()
        self._first_messages = {tag: first for tag, first in self._first_messages.items() if tag in expected}

    def abandon(self) -> None:
        """Drop what a pass that raised left (called as a forward starts): its end never came."""
        self._take()

    def end_of_backward(self) -> None:
        """The backward whose rings this prefetch served ended."""
        self.end_pass()



def ring_begins(
    ring: Ring, phase: Phase, tag: int, message: Message, tensors: list[torch.Tensor] | None = None, first: int = 0
) -> Prefetched | None:
    """A ring of ``phase`` begins (see ``RingPrefetch.begin``): it is one of the pass running, and a
    forward ring recomputed in backward (activation checkpointing) is one of the backward's, which
    takes no prefetch (it would overwrite one made for the ring after it)."""
    if current_graph_task_id() == -1:  # not in backward (a builtin: no frame, at every ring)
        return ring.context.forward_prefetch.begin(ring, tag, message, tensors, first)
    return ring.context.backward_prefetch.begin(ring, tag, message, tensors if phase is Phase.BACKWARD else None, first)
