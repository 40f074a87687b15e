"""Prefetch across ring layers: the next forward ring's first exchange rides this ring's last one.

A forward ring's first message is this rank's own shards, packed from the parameters: it does not
depend on the input, so it can travel before its layer is called. The last exchange of a ring, which
overlaps its second-to-last GEMMs, carries it behind the ring's own message (a ``Passenger``), to the
same neighbour: the next ring then starts with its first exchange done and costs W-2 exchanges of
its own instead of W-1, and a forward pass of R rings on W >= 4 ranks costs R(W-2)+1 exchanges
instead of R(W-1). On 2 ranks a ring whose one exchange was done ahead has no exchange to carry the
next one's, and on 3 its one exchange sends the prefetched message, which lies behind the carrying
ring's and has nothing free behind it: there every other ring is prefetched.

Which ring comes next is learned from the previous forward pass (the rings between the start of the
outermost rsdp forward and its end), and a ring is prefetched as its previous call made its first
message: the same layout, packed from the same tensors. A prefetched ring that is not called next
(control flow changed, or a different layout) runs as usual, its own first exchange and all; the
next pass learns the new order.

Pitfalls:
- The ring buffers are a passenger's length longer during the carrying ring (each of the two holds
  its message and the next ring's first one), and the next ring starts in the part of them behind
  the message, which the carrying ring no longer reads. A prefetched ring must not make them larger
  (that would lose its own message): if they are too small it carries nothing, and the next pass
  makes them large enough from its start (``RingBuffers.hold``).
- Only forward rings of a weights-only first message are prefetched (Linear groups, ring plans'
  sub-blocks, input-split products); an Embedding's first message carries the rank's "index out of
  range" flag, known only once it is called. Backward messages carry gradient partials, which depend
  on the gradient arriving.
- Only on the carrying ring's own group and device: the passenger travels on its exchange.
- Not inside backward (recomputations by activation checkpointing) nor under selective activation
  checkpointing (whose replay needs fresh buffers): rings there take no prefetch and make none.
- NCCL matches point-to-point operations by order, gloo by tag and size: the decisions depend only on
  the sequence of rings, which every rank runs alike, as the rings themselves require.
"""

import dataclasses

import torch

from .._compat import in_backward, in_selective_checkpoint
from ._param import Message
from ._ring import Prefetched, Ring


@dataclasses.dataclass
class _FirstMessage:
    """How a ring made its first message at its last call."""

    ring: Ring
    message: Message
    tensors: list[torch.Tensor]

    def signature(self) -> tuple:
        return (self.message.segments, _where(self.tensors))


def _where(tensors: list[torch.Tensor]) -> tuple:
    # Views made afresh each call (a transposed weight) are the same data if they start, look and
    # step alike.
    return tuple((t.data_ptr(), t.shape, t.stride(), t.dtype) for t in tensors)


class _NextFirstMessage:
    """The next ring's first message as a ``Passenger`` of this ring's last exchange."""

    def __init__(self, order: "ForwardRingOrder", tag: int, first: _FirstMessage):
        self.order, self.tag, self.first = order, tag, first
        self.nbytes = first.message.nbytes

    def board(self, region: torch.Tensor) -> None:
        first = self.first
        as_is = first.message.as_is(first.tensors)
        if as_is is None:
            first.message.pack(region, first.ring.rank, first.tensors)
        else:
            region.copy_(as_is)

    def alight(self, sent: torch.Tensor, received: torch.Tensor, received_in: int) -> None:
        self.order.prefetched = (self.tag, self.first.signature(), Prefetched(sent, received, received_in))


class ForwardRingOrder:
    """The forward rings of the pass now running, those of the previous pass, and the first exchange
    done ahead for the ring expected next."""

    def __init__(self):
        # (tag, message layout or None) of each forward ring, in call order: a ring's layout changes
        # when Linears start sharing its ring, and then it is another ring to wait for.
        self._previous_pass: list[tuple] = []
        self._this_pass: list[tuple] = []
        self._first_messages: dict[int, _FirstMessage | None] = {}  # None: not prefetchable
        self.prefetched: tuple[int, tuple, Prefetched] | None = None  # (tag, signature, exchange)
        self._forget = False
        self.used = 0  # prefetched exchanges that their ring took (tests count them)

    def begin(self, ring: Ring, tag: int, message: Message | None, tensors: list[torch.Tensor]) -> Prefetched | None:
        """A forward ring begins; ``message`` is None when its first message cannot be prefetched.
        Returns its first exchange if the ring before did it, or None (then it makes its own)."""
        prefetched, self.prefetched = self.prefetched, None
        if in_backward():
            return None
        prefetchable = message is not None and ring.size > 1 and not in_selective_checkpoint()
        first = _FirstMessage(ring, message, tensors) if prefetchable else None
        self._first_messages[tag] = first
        self._this_pass.append((tag, None if message is None else message.segments))
        if prefetched is None:
            return None
        expected_tag, signature, exchange = prefetched
        if first is None or expected_tag != tag or signature != first.signature():
            return None
        self.used += 1
        return exchange

    def next_first(self, ring: Ring) -> _NextFirstMessage | None:
        """The next ring's first message, for ``ring``'s last exchange to carry (``Ring.circulate``'s
        ``carry_next``), if the previous pass says which ring that is and it shares ``ring``'s group
        and device. Called as a forward ring starts."""
        if in_backward() or in_selective_checkpoint():
            return None
        position = len(self._this_pass)
        if position >= len(self._previous_pass) or self._this_pass != self._previous_pass[:position]:
            return None
        tag, segments = self._previous_pass[position]
        first = self._first_messages.get(tag)
        if first is None or first.message.segments != segments:
            return None
        if first.ring.group is not ring.group or first.ring.device != ring.device:
            return None
        return _NextFirstMessage(self, tag, first)

    def forget_this_pass(self) -> None:
        """The rings change after this pass (Linears start sharing one): do not predict from it."""
        self._forget = True

    def end_pass(self) -> None:
        """The outermost rsdp forward ended: drop an exchange no ring took, remember the order."""
        self.prefetched = None
        self._previous_pass = [] if self._forget else self._this_pass
        # Only this pass's rings can be prefetched next: the others' tensors (a model no longer
        # trained, perhaps) are not kept alive here.
        called = {tag for tag, _ in self._this_pass}
        self._first_messages = {tag: first for tag, first in self._first_messages.items() if tag in called}
        self._this_pass, self._forget = [], False


FORWARD_RING_ORDER = ForwardRingOrder()
