"""Prefetch across ring layers: the next forward ring's first exchange starts during this ring's last step.

A forward ring's first message is this rank's own shards, packed from the parameters: it does not
depend on the input, so it can travel before its layer is called. The last step of a ring sends
nothing (the rank computes with the last shard it received), so that is when the next ring's first
exchange starts: it overlaps the last GEMMs and whatever runs between the two layers (attention,
norms, activations), and the next ring then exposes W-2 exchanges of its W-1.

Which ring comes next is learned from the previous forward pass (the rings between the start of the
outermost rsdp forward and its end), and a ring is prefetched as its previous call made its first
message: the same layout, packed from the same tensors. A prefetched ring that is not called next
(control flow changed, or a different layout) still has its exchange completed — every rank posted
it — and runs as usual; the next pass learns the new order.

Pitfalls:
- A third buffer is in use during a ring's last step: the next ring's message, and the one it is
  received into, take the two ring buffers the last step does not hold.
- Only forward rings of a weights-only first message are prefetched (Linear groups, ring plans'
  sub-blocks, input-split products); an Embedding's first message carries the rank's "index out of
  range" flag, known only once it is called. Backward messages carry gradient partials, which depend
  on the gradient arriving.
- Not inside backward (recomputations by activation checkpointing) nor under selective activation
  checkpointing (whose replay needs fresh buffers): rings there take no prefetch and make none.
- NCCL matches point-to-point operations by order: the decisions depend only on the sequence of
  rings, which every rank runs alike, as the rings themselves require.
"""

import dataclasses

import torch

from .._compat import in_backward, in_selective_checkpoint
from ._param import Message
from ._ring import RING_BUFFERS, InFlight, Ring, drain


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


class ForwardRingOrder:
    """The forward rings of the pass now running, those of the previous pass, and the exchange
    started for the ring expected next."""

    def __init__(self):
        # (tag, message layout or None) of each forward ring, in call order: a ring's layout changes
        # when Linears start sharing its ring, and then it is another ring to wait for.
        self._previous_pass: list[tuple] = []
        self._this_pass: list[tuple] = []
        self._first_messages: dict[int, _FirstMessage | None] = {}  # None: not prefetchable
        self._in_flight: tuple[int, tuple, InFlight] | None = None  # (tag, signature, exchange)
        self._forget = False
        self.used = 0  # prefetched exchanges that their ring took (tests count them)

    def begin(self, ring: Ring, tag: int, message: Message | None, tensors: list[torch.Tensor]) -> InFlight | None:
        """A forward ring begins; ``message`` is None when its first message cannot be prefetched.
        Returns the first exchange prefetched for it, or None (then it starts its own)."""
        in_flight, self._in_flight = self._in_flight, None
        if in_backward():
            if in_flight is not None:  # a forward's leftover; cannot happen while passes end cleanly
                drain(in_flight[2].works)
            return None
        prefetchable = message is not None and ring.size > 1 and not in_selective_checkpoint()
        first = _FirstMessage(ring, message, tensors) if prefetchable else None
        self._first_messages[tag] = first
        self._this_pass.append((tag, None if message is None else message.segments))
        if in_flight is None:
            return None
        expected_tag, signature, exchange = in_flight
        if first is None or expected_tag != tag or signature != first.signature():
            drain(exchange.works)
            return None
        self.used += 1
        return exchange

    def prefetch_next(self, busy: torch.Tensor) -> None:
        """Start the next ring's first exchange, if the previous pass says which ring that is. Called
        before a forward ring's last step; ``busy`` is the buffer that step computes with."""
        if in_backward() or in_selective_checkpoint():
            return
        position = len(self._this_pass)
        if position >= len(self._previous_pass) or self._this_pass != self._previous_pass[:position]:
            return
        tag, segments = self._previous_pass[position]
        first = self._first_messages.get(tag)
        if first is None or first.message.segments != segments:
            return
        ring, message = first.ring, first.message
        send, receive = RING_BUFFERS.others(busy, message.nbytes, ring.device)
        as_is = message.as_is(first.tensors)
        if as_is is None:
            message.pack(send, ring.rank, first.tensors)
        else:
            send = as_is
        works = ring.exchange(send, receive, tag)
        self._in_flight = (tag, first.signature(), InFlight(send, receive, works))

    def forget_this_pass(self) -> None:
        """The rings change after this pass (Linears start sharing one): do not predict from it."""
        self._forget = True

    def end_pass(self) -> None:
        """The outermost rsdp forward ended: complete an exchange no ring took, remember the order."""
        if self._in_flight is not None:
            drain(self._in_flight[2].works)
            self._in_flight = None
        self._previous_pass = [] if self._forget else self._this_pass
        # Only this pass's rings can be prefetched next: the others' tensors (a model no longer
        # trained, perhaps) are not kept alive here.
        called = {tag for tag, _ in self._this_pass}
        self._first_messages = {tag: first for tag, first in self._first_messages.items() if tag in called}
        self._this_pass, self._forget = [], False


FORWARD_RING_ORDER = ForwardRingOrder()
