"""Prefetch across ring layers: the next ring's first exchange rides this ring's last one.

A ring's first message is often nothing but this rank's own shards, packed from the parameters:

- **forward**, every ring but an Embedding's: it does not depend on the input;
- **backward**, a planned sub-block's (``_sub_block.py``): its first exchange sends the weights alone
  (the partials start at the second), so it does not depend on the gradient arriving.

So it can travel before its ring is called. The last exchange of a ring, which overlaps its
second-to-last step's computation, carries it behind the ring's own message (a ``Passenger``), to the
same neighbour: the next ring then starts with its first exchange done and costs one exchange fewer.
A forward pass of R rings on W >= 4 ranks costs R(W-2)+1 exchanges instead of R(W-1); a backward
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

Which ring comes next is learned from the last pass of the same kind that began with the same ring
(forward: the rings between the start of the outermost rsdp forward and its end; backward: the rings
of one backward, forward rings recomputed by activation checkpointing included, which take no
prefetch and make none; each model learns from its own, in its ``RingContext``), and a ring is
prefetched as its previous call made its first message: the same layout, packed from the same
tensors. A prefetched ring that is not called next (control flow changed, or a different layout) runs
as usual, its own first exchange and all; the next pass learns the new order.

Pitfalls:
- The ring buffers are a passenger's length longer during the carrying ring (each of the two holds
  its message and the next ring's first one), and the next ring starts in the part of them behind
  the message, which the carrying ring no longer reads. In backward, where rsdp's memory peaks, a
  ring whose message and passengers would need more than the pass's largest message (in the previous
  pass) carries nothing, so that the ring buffers' peak is not raised: the head's backward ring, the
  largest, carries no passenger. A prefetched ring must not make them larger (that would lose its own
  message): if they are too small it carries nothing, and the next pass makes them large enough from
  its start (``RingBuffers.hold``). When the backward's ring buffers are trimmed
  (``RingBuffers.trim``) a prefetched message is kept.
- An Embedding's forward first message carries the rank's "index out of range" flag, known only once
  it is called; a Linear group's backward first message carries partials: neither is prefetched.
- Only on the carrying ring's own group and device: the passenger travels on its exchange.
- Not under selective activation checkpointing, whose replay needs fresh buffers.
- NCCL matches point-to-point operations by order, gloo by tag and size: the decisions depend only on
  the sequence of rings, which every rank runs alike, as the rings themselves require.
"""

import collections
import dataclasses
import math

import torch

from .._compat import in_backward, in_selective_checkpoint
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
        return self.message.offsets[self.first]

    def signature(self) -> tuple:
        return (self.message.segments, self.first, _where(self.tensors))


def _where(tensors: list[torch.Tensor]) -> tuple:
    # Views made afresh each call (a transposed weight) are the same data if they start, look and
    # step alike.
    return tuple((t.data_ptr(), t.shape, t.stride(), t.dtype) for t in tensors)


class _NextFirstMessage:
    """The next ring's first message as a ``Passenger`` of this ring's last exchange. ``room``: the
    most bytes the ring buffers may hold for the carrying ring's message and its passengers."""

    def __init__(self, order: "RingOrder", tag: int, first: _FirstMessage, room: float):
        self.order, self.tag, self.first, self.room = order, tag, first, room
        self.lead = first.lead
        self.nbytes = first.message.nbytes - self.lead

    def board(self, region: torch.Tensor) -> None:
        first = self.first
        as_is = first.message.as_is(first.tensors) if first.first == 0 else None
        if as_is is None:
            first.message.pack(region, first.ring.rank, first.tensors, first.first)
        else:
            region.copy_(as_is)

    def alight(self, sent: torch.Tensor, received: torch.Tensor, received_in: int) -> None:
        self.order.arrived(self.tag, self.first.signature(), Prefetched(sent, received, received_in))


# Predictions kept per order, one per ring that begins a pass: a model's passes may begin with
# different rings (a call that skips its first layers). One no longer seen is forgotten after as many others.
_KEPT_PREDICTIONS = 8


class RingOrder:
    """The rings of the pass of one kind (forward or backward) now running, those of the last pass of
    that kind that began with each first ring, and the first exchange done ahead for the ring expected
    next."""

    def __init__(self, context, backward: bool):
        self._context = context
        self.backward = backward
        # (tag, (message layout, first segment its first exchange sends)) of each ring, in call order:
        # a ring's layout changes when Linears start sharing its ring, and then it is another ring.
        self._previous_pass: list[tuple] = []
        # The first ring's tag -> (the rings of the last pass that began with it, its largest message):
        # two models whose passes alternate (DPO's policy and reference) each predict from their own.
        self._predictions: collections.OrderedDict[int, tuple[list[tuple], int]] = collections.OrderedDict()
        self._this_pass: list[tuple] = []
        self._first_messages: dict[int, _FirstMessage | None] = {}  # None: not prefetchable
        self._prefetched: tuple[int, tuple, Prefetched] | None = None  # (tag, signature, exchange)
        self._largest = self._largest_previous = 0  # the largest message of the pass, of the previous one
        self._forget = False
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
        """A ring of this order's kind begins, with ``message``; ``tensors`` are its segments ``first:``,
        which its first exchange sends, or None when that cannot be prefetched. Returns its first
        exchange if the ring before did it, or None (then it makes its own)."""
        if self.backward:
            self._context.end_with_backward(self)
        if not self._this_pass:
            self._previous_pass, self._largest_previous = self._predictions.get(tag, ([], 0))
            self._context.buffers.begin_pass(self.backward, tag)
        prefetched = self._take()
        prefetchable = tensors is not None and ring.size > 1 and not in_selective_checkpoint()
        first_message = _FirstMessage(ring, message, tensors, first) if prefetchable else None
        self._first_messages[tag] = first_message
        self._this_pass.append((tag, (message.segments, first)))
        self._largest = max(self._largest, message.nbytes)
        if prefetched is None:
            return None
        expected_tag, signature, exchange = prefetched
        if first_message is None or expected_tag != tag or signature != first_message.signature():
            return None
        self.used += 1
        return exchange

    def next_first(self, ring: Ring) -> _NextFirstMessage | None:
        """The next ring's first message, for ``ring``'s last exchange to carry (``Ring.circulate``'s
        ``carry_next``), if the previous pass says which ring that is and it shares ``ring``'s group
        and device. Called as a ring of this order's kind starts."""
        if in_backward() != self.backward or in_selective_checkpoint():
            return None
        if self.backward and ring.size < 4:  # the deferred hop the next ring would carry has no place
            return None
        position = len(self._this_pass)
        if position >= len(self._previous_pass) or self._this_pass != self._previous_pass[:position]:
            return None
        tag, layout = self._previous_pass[position]
        first = self._first_messages.get(tag)
        if first is None or (first.message.segments, first.first) != layout:
            return None
        if first.ring.group is not ring.group or first.ring.device != ring.device:
            return None
        # In backward, where rsdp's memory peaks (gradients pile up), no larger than the pass's largest
        # message: its first ring, a head's, is often the largest, and carries nothing then.
        room = self._largest_previous if self.backward else math.inf
        return _NextFirstMessage(self, tag, first, room)

    def forget_this_pass(self) -> None:
        """The rings change after this pass (Linears start sharing one): do not predict from it."""
        self._forget = True

    def end_pass(self) -> None:
        """The pass ended: drop an exchange no ring took, remember the order."""
        self._take()
        if self._this_pass:
            first_tag = self._this_pass[0][0]
            self._predictions[first_tag] = ([] if self._forget else self._this_pass, self._largest)
            self._predictions.move_to_end(first_tag)
            while len(self._predictions) > _KEPT_PREDICTIONS:
                self._predictions.popitem(last=False)
        self._previous_pass, self._largest = [], 0
        # Only the predicted rings can be prefetched next: the others' tensors (a model no longer
        # trained, perhaps) are not kept alive here.
        predicted = {tag for rings, _ in self._predictions.values() for tag, _ in rings}
        self._first_messages = {tag: first for tag, first in self._first_messages.items() if tag in predicted}
        self._this_pass, self._forget = [], False

    def abandon(self) -> None:
        """Drop what a pass that raised left (called as a forward starts): its end never came."""
        if self._this_pass or self._prefetched is not None:
            self._take()
            self._this_pass, self._forget, self._largest = [], False, 0

    def end_of_backward(self) -> None:
        """The backward whose rings this pass records ended."""
        self.end_pass()



def ring_begins(
    ring: Ring, phase: Phase, tag: int, message: Message, tensors: list[torch.Tensor] | None = None, first: int = 0
) -> Prefetched | None:
    """A ring of ``phase`` begins (see ``RingOrder.begin``): it is one of the pass running, and a
    forward ring recomputed in backward (activation checkpointing) is one of the backward's, which
    takes no prefetch (it would overwrite one made for the ring after it)."""
    if not in_backward():
        return ring.context.forward_order.begin(ring, tag, message, tensors, first)
    return ring.context.backward_order.begin(ring, tag, message, tensors if phase is Phase.BACKWARD else None, first)
