"""The ring: which shard a rank holds at each step, who it talks to, and the one schedule every ring runs.

Every message travels "down" (rank r receives from r+1 and sends to r-1), so at step k rank r holds
weight shard (r + k) mod W. In backward the gradient partials ride in the same message as the weights:
the partial for shard t starts at rank t-1 and collects every rank's contribution on its way down to
its owner t, which it reaches after W-1 hops, so at step k rank r holds the partial of shard
(r + 1 + k) mod W. One message per step, forward and backward: W-1 synchronising exchanges per ring
and pass, the fewest a ring can do. A planned sub-block's gradient needs its weights, so its partial
starts one rank further from its owner and ends one hop short of it after the W-1 exchanges; that
hop is deferred and travels behind the next ring's first message (``DeferredHop``, ``_sub_block.py``).

``Ring.circulate`` is the only schedule. At each step it starts sending the message it holds and
receiving the next one, runs ``during`` (the GEMMs on the weights held, the next gradient contribution)
while they travel, waits, and gives the arrived message to ``on_arrival`` (add the contribution
computed meanwhile) before it is forwarded.

A ring's W-1 steps pass every rank's message by every other rank, which is what an all-gather does,
and carry one running sum per rank to its owner, which is what a reduce-scatter does. So a
collective of small data can ride a ring's messages (``Rider``) instead of synchronising every rank
once more: the norms' all-gather rides the first forward ring and their gradients' reduce-scatter
the last backward ring (``_collectives.py``). Likewise an exchange can carry ``Passenger``s to the
same neighbour behind its message: the next ring's first message (a forward ring's, or a planned
sub-block's backward weights) rides a ring's last exchange (``_prefetch.py``), and the last hop of a
planned sub-block's partials an early exchange of the next ring (``_Boarding``).

Messages live in byte buffers shared by every ring of one model (``RingBuffers``, owned by the
model's ``RingContext``: two ping-pong message buffers and a scratch, given memory once per pass and
then reused), so a ring step allocates nothing; on CUDA this also keeps NCCL's stream from pinning a
freed block per step in the caching allocator. They live for one pass, not longer: freed when the outermost rsdp module's forward
returns and when the backward ends, so they never add to the loss computation's or the optimizer
step's peak. ``release_ring_buffers()`` frees them at any other time.

A buffer's memory is the most the rest of its pass will ask of it, learned from the previous pass of
the same kind (``_PassSizes``), so it is allocated once per pass; and in backward it is freed after a
ring when the rest of the backward needs less (``RingBuffers.trim``): gradients pile up as a backward
goes on, so its end is where memory peaks, and the buffers of a tied table's head (the first ring of
a backward, weights and partials) must not stay for the Embedding's and the blocks' (the last rings).

Pitfalls this file exists to contain (design.md §3):
- gloo matches messages on (peer, tag): every ring layer gets its own tags per pass, so that ranks that
  disagree about the order of layers fail loudly instead of exchanging the wrong tensors.
- NCCL ignores tags and needs every rank to issue P2P ops in the same order: ``circulate`` issues one
  send and one receive per step in a fixed order, with no data-dependent branches.
- Waiting twice on a completed gloo send blocks until the timeout, so each work is waited exactly once;
  and every work is waited, also when the step's computation raised (``drain``).
- A gloo work dropped right after ``wait()`` spins in its buffer's destructor until gloo's event-loop
  thread lets go of the buffer, so an exchange's works are kept until the next one has been waited for
  (``WaitedWorks``).
- A buffer is received into only after the send that last read it was waited for (ping-pong).
- On CUDA, ProcessGroupNCCL runs P2P on its own stream, orders it after the compute that produced the
  buffers, and ``wait()`` makes the compute stream wait for the received data.
"""

import dataclasses
import enum
import functools
import itertools
import typing
from collections.abc import Callable

import torch
import torch.distributed as dist

from .._compat import (
    current_graph_task_id,
    in_backward,
    in_selective_checkpoint,
    outside_inference_mode,
    send_and_receive,
)
from ._param import Message, Segment


class Phase(enum.IntEnum):
    FORWARD = 0
    BACKWARD = 1


_next_layer_id = itertools.count()


def new_layer_tags() -> dict[Phase, int]:
    """Tags for one ring layer; every rank numbers its layers in the order it shards them."""
    layer = next(_next_layer_id)
    return {phase: layer * len(Phase) + phase for phase in Phase}


class _PassSizes:
    """What the ring buffers are asked for during the passes of one kind (forward or backward): from
    each request of the pass running to its end, the most each buffer will be asked for, predicted
    from the previous pass of that kind as long as this one has asked for the same sizes in the same
    order (every step of a training loop does). Otherwise there is no prediction for the rest of the
    pass: a buffer is made at the size asked, and none is freed early.

    Only a prediction: a wrong one costs a buffer made again, never a wrong result."""

    def __init__(self):
        self._asked: list[tuple[int, int]] = []  # (buffer index, bytes) of the pass running, in order
        self._previous: list[tuple[int, int]] = []
        self._rest: list[tuple[int, int, int]] = []  # per request of the previous pass: the most each buffer was asked from it on
        self._on_track = True

    def ask(self, index: int, nbytes: int) -> int:
        """Record a request; return the size to make the buffer if it must be made (at least ``nbytes``)."""
        position = len(self._asked)
        self._asked.append((index, nbytes))
        self._on_track = self._on_track and position < len(self._previous) and self._previous[position] == (index, nbytes)
        return self._rest[position][index] if self._on_track else nbytes

    def upcoming(self) -> tuple[int, int, int] | None:
        """The most each buffer will be asked for by the rest of the pass running, or None."""
        if not self._on_track:
            return None
        position = len(self._asked)
        return self._rest[position] if position < len(self._rest) else (0, 0, 0)

    def end(self) -> None:
        """The pass ended: it is the prediction for the next one (unless it asked for nothing)."""
        if not self._asked:
            return
        self._previous, self._asked, self._on_track = self._asked, [], True
        most, rest = [0, 0, 0], []
        for index, nbytes in reversed(self._previous):
            most[index] = max(most[index], nbytes)
            rest.append(tuple(most))
        self._rest = rest[::-1]


class RingBuffers:
    """Two flat byte buffers per device for the messages, and one for a backward's own contribution,
    shared by every ring of one model (its ``RingContext``), and the ``Message`` layouts whose views
    of them are cached.

    Rings never run concurrently on one rank (a ring layer's computation calls no other ring), so one
    set serves them all: two of the largest message (weights and partials, ~2/W of the largest ring
    layer each in backward) and one of the largest gradient contribution. A buffer is given the memory
    the rest of its pass will ask of it (``_PassSizes``) when it is asked for more than it holds, so
    once per pass; in backward, one that holds more than the rest of the backward needs is freed after
    a ring (``trim``). The tensors stay, at the largest size ever asked, and so do the views of them
    that messages cached.
    """

    def __init__(self, context):
        self._context = context  # its RingContext: the end of a backward that used the buffers frees them
        self._sets: dict[torch.device, list[torch.Tensor | None]] = {}
        self._index: dict[int, tuple[int, int]] = {}  # data_ptr of a live buffer -> (its index, 0)
        self._spans: list[tuple[int, int, int]] = []  # (index, first and last + 1 address) of each live buffer
        # Bumped whenever buffers are replaced, so views of old ones are not reused.
        self.generation = 0
        # The one ``Message`` per segment layout, so that its views of these buffers are reused.
        self._messages: dict[tuple[Segment, ...], Message] = {}
        self._release_task = -1  # the backward at whose end a release is queued
        # (in backward, the tag of the pass's first ring) -> its sizes: each model's passes predict its own.
        self._sizes: dict[tuple[bool, int | None], _PassSizes] = {}
        self._pass_keys: dict[bool, int | None] = {False: None, True: None}
        # (device, index, nbytes) -> the buffer's first nbytes: made once, not at every ring (a
        # dispatch each); they follow the storage through ``resize_``, and a reset drops them.
        self._prefixes: dict[tuple[torch.device, int, int], torch.Tensor] = {}
        # The next ring's first exchange, done ahead: its messages lie in the message buffers (``_prefetch.py``).
        self.prefetched: "Prefetched | None" = None

    def begin_pass(self, backward: bool, first_tag: int) -> None:
        """A pass of the kind begins with the ring tagged ``first_tag`` (``RingOrder.begin``): its
        requests are predicted from the last pass that began with the same ring."""
        self._pass_keys[backward] = first_tag

    def _pass_sizes(self, backward: bool) -> "_PassSizes":
        key = (backward, self._pass_keys[backward])
        sizes = self._sizes.get(key)
        if sizes is None:
            sizes = self._sizes[key] = _PassSizes()
        return sizes

    def message_of(self, segments: tuple[Segment, ...]) -> Message:
        """The one ``Message`` for these segments, so that its views of these buffers are reused."""
        message = self._messages.get(segments)
        if message is None:
            message = self._messages[segments] = Message(segments, self)
        return message

    def pair(self, nbytes: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The two message buffers (ping-pong), ``nbytes`` long."""
        return tuple(self._buffer(index, nbytes, device) for index in (0, 1))

    def hold(self, nbytes: int, device: torch.device) -> bool:
        """Whether both message buffers hold ``nbytes`` already, so that asking for them keeps what
        they hold (a prefetched message, for one). If not, the request is recorded as if made: the
        next pass of the kind then gives them that much memory from its start."""
        buffers = self._sets.get(device, [None, None])[:2]
        if all(b is not None and b.numel() >= nbytes and b.untyped_storage().nbytes() >= nbytes for b in buffers):
            return True
        for index in (0, 1):
            self._pass_sizes(in_backward()).ask(index, nbytes)
        return False

    def scratch(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A buffer for what a ring step computes between two arrivals, ``nbytes`` long."""
        return self._buffer(2, nbytes, device)

    def _buffer(self, index: int, nbytes: int, device: torch.device) -> torch.Tensor:
        if in_selective_checkpoint():
            # Fresh buffers (and so fresh views): SAC replays a recomputation op by op, and whether a
            # shared buffer exists already would change the ops issued.
            return torch.zeros(nbytes, dtype=torch.uint8, device=device)
        backward = in_backward()
        if backward:
            self._release_at_end_of_backward()
        size = self._pass_sizes(backward).ask(index, nbytes)
        buffers = self._sets.setdefault(device, [None, None, None])
        buffer = buffers[index]
        # A buffer that holds this request is kept as it is: it may hold a prefetched message. One whose
        # memory must be given again anyway is made anew if the rest of the pass needs it larger.
        short = buffer is not None and buffer.untyped_storage().nbytes() < nbytes
        if buffer is None or buffer.numel() < nbytes or (short and buffer.numel() < size):
            self._reset()
            if buffer is not None:  # free it first: old and new alive at once would be the step's peak
                buffer.untyped_storage().resize_(0)
            # Zeroed, so padding rows are never uninitialised memory (NCCL's NaN check reads them).
            with outside_inference_mode():
                buffers[index] = buffer = torch.zeros(size, dtype=torch.uint8, device=device)
            self._reindex()
        elif short:  # freed at the end of the last pass, or by ``trim``
            # Storage only: the tensor and the views of it that messages cached stay (as FSDP2 frees
            # and refills its unsharded parameters), and a view is only used after a request covering it.
            storage = buffer.untyped_storage()
            size = min(size, buffer.numel())
            storage.resize_(0)  # nothing to keep: no copy
            storage.resize_(size)
            buffer[:size].zero_()
            self._reindex()
        key = (device, index, nbytes)
        prefix = self._prefixes.get(key)
        if prefix is None:
            with outside_inference_mode():
                prefix = self._prefixes[key] = buffer[:nbytes]
        return prefix

    def trim(self) -> None:
        """Free the buffers that are larger than the rest of the backward running needs; called by a
        backward ring once it has copied out its result. Gradients pile up as a backward goes on, so
        its end is where memory peaks: the buffers of its first, largest rings (a tied table's head:
        weights and partials) must not stay for its last ones (the Embedding's partials). The next
        request makes a freed buffer again, at the size the rest of the backward needs. A buffer that
        holds the next ring's first message, prefetched, keeps it (and what lies before it)."""
        upcoming = self._pass_sizes(True).upcoming() if in_backward() else None
        if upcoming is None:
            return
        freed = False
        for index, buffer in list(self._live()):
            kept = 0 if self.prefetched is None else self._prefetched_end(index, buffer)
            need = upcoming[index] if kept <= upcoming[index] else kept
            storage = buffer.untyped_storage()
            if 8 * storage.nbytes() > 9 * need:  # more than an eighth to spare
                storage.resize_(need if kept else 0)  # resize_ keeps the start
                freed = True
        if freed:
            self._reindex()

    def _prefetched_end(self, index: int, buffer: torch.Tensor) -> int:
        """Where the prefetched message that ``buffer`` holds ends in it, or 0."""
        if index > 1 or buffer.device != self.prefetched.sent.device:
            return 0
        message = self.prefetched.received if index == self.prefetched.received_in else self.prefetched.sent
        return message.data_ptr() - buffer.data_ptr() + message.numel()

    def place_of(self, buffer: torch.Tensor) -> tuple[int, int] | None:
        """Where ``buffer`` starts in the ring buffers: (which of the three, byte offset), or None when
        in none of them. A message is at offset 0, or behind the message of the ring that carried it
        (a prefetched one, a deferred hop)."""
        pointer = buffer.data_ptr()
        place = self._index.get(pointer)
        if place is None:
            for index, start, end in self._spans:
                if start < pointer < end:
                    return index, pointer - start
        return place

    def _live(self):
        """(index, buffer) of every buffer that holds memory now."""
        for buffers in self._sets.values():
            for index, buffer in enumerate(buffers):
                if buffer is not None and buffer.untyped_storage().nbytes():
                    yield index, buffer

    def _reindex(self) -> None:
        live = list(self._live())
        self._index = {buffer.data_ptr(): (index, 0) for index, buffer in live}
        self._spans = [(index, buffer.data_ptr(), buffer.data_ptr() + buffer.untyped_storage().nbytes()) for index, buffer in live]

    def _reset(self) -> None:
        self.generation += 1
        self._prefixes.clear()
        self._messages.clear()

    @property
    def nbytes(self) -> int:
        return sum(buffer.untyped_storage().nbytes() for _, buffer in self._live())

    def _release_at_end_of_backward(self) -> None:
        """Free the buffers when the backward now running ends (a backward that raised runs no end
        callbacks, and the next one frees them)."""
        task = current_graph_task_id()
        if task != self._release_task:
            self._release_task = task
            self._context.queue_end_of_backward()

    def end_of_backward(self, task: int) -> None:
        if task == self._release_task:
            self._release_task = -1
            self.release()

    def release(self) -> None:
        """Free the buffers' memory. The tensors stay, with no storage, and so do the views of them that
        messages cached: the next pass gives the same storages memory again (``resize_``, as FSDP2 frees
        and refills its unsharded parameters), and its views need not be made again."""
        for _, buffer in list(self._live()):
            buffer.untyped_storage().resize_(0)
        self._reindex()
        for sizes in self._sizes.values():
            sizes.end()


@dataclasses.dataclass
class Prefetched:
    """A ring's first exchange, done ahead of the ring by the ring before it (``_prefetch.py``): the
    message sent (this rank's own), the one received, and which of the two ring buffers holds it."""

    sent: torch.Tensor
    received: torch.Tensor
    received_in: int


class Passenger(typing.Protocol):
    """Data that travels behind the message of one exchange of a ring, to save an exchange of its
    own: the last hop of an earlier ring's message (``DeferredHop``), the next ring's first message
    (``_prefetch.py``). ``board(region)`` writes this rank's data into ``region``;
    ``alight(sent, received, received_in)`` sees the data sent and the data received (in ring buffer
    ``received_in``), both in the ring buffers behind the message, where the next ring may start.

    The ``nbytes`` bytes that travel may be preceded by ``lead`` bytes that do not: the regions given
    start ``lead`` bytes before them (a backward message's first exchange sends its weights, which
    follow its partials). The lead lies over what the exchange carried before the passenger, which its
    ring has read (or copied out) by the time the next ring writes there."""

    nbytes: int
    lead: int

    def board(self, region: torch.Tensor) -> None: ...

    def alight(self, sent: torch.Tensor, received: torch.Tensor, received_in: int) -> None: ...


class NextFirst(Passenger, typing.Protocol):
    """The next ring's first message as a passenger (``_prefetch.py``); ``room`` is the most the ring
    buffers may hold for it and what rides before it."""

    room: int


class Ring:
    """One rsdp module's ring: its group and neighbours, and (``context``) the ``RingContext`` of its
    model, which ``rsdp_shard`` sets and may later replace by its root's."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, context):
        self.context = context
        self.group = group
        self.device = device
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._down, self._up = (self.rank - 1) % self.size, (self.rank + 1) % self.size  # group ranks

    def weight_shard_at(self, step: int) -> int:
        return (self.rank + step) % self.size

    def partial_shard_at(self, step: int) -> int:
        return (self.rank + 1 + step) % self.size

    def exchange(self, send: torch.Tensor, receive: torch.Tensor, tag: int) -> list:
        """Start sending ``send`` down and receiving ``receive`` from up, as one batch; returns the works."""
        return send_and_receive(self.group, send, self._down, receive, self._up, tag)

    def circulate(
        self,
        nbytes: int,
        tag: int,
        start: torch.Tensor | Callable[[torch.Tensor], None] | Prefetched,
        during: Callable[[int, torch.Tensor], None] | None,
        on_arrival: Callable[[int, torch.Tensor], None] | None = None,
        hops: int | None = None,
        region: Callable[[int], slice] | None = None,
        carry_next: "Callable[[Ring], NextFirst | None] | None" = None,
        rider: "Rider | None" = None,
    ) -> torch.Tensor:
        """Pass a message of ``nbytes`` bytes ``hops`` (default W-1) times down the ring; return the one
        held last.

        ``start`` is this rank's first message: a byte tensor sent as it is, a function that writes it
        into the buffer it is given, or the first exchange done already (prefetched). At step k,
        ``during(k, message)`` runs while the message held is sent on and the next one received;
        ``on_arrival(k + 1, message)`` then sees the next message before it is forwarded. ``region(k)``
        is the part of the message that travels at step k (all of it by default: a message whose
        weights are no longer needed sends its partials only). ``rider`` travels behind the message in
        every step (see ``Rider``): only on all W-1 steps of a whole message not yet sent (one to be
        sent as it is gets copied into a ring buffer first).

        Exchanges may carry ``Passenger``s behind the message (and rider): a hop deferred by an
        earlier ring (``DeferredHops``) rides the first exchange that is this ring's own, sends its
        message to the end, and sends a message at the start of a buffer (a prefetched one lies behind
        the message of the ring that carried it); ``carry_next(ring)`` may give the next ring's first
        message, which rides the last exchange if that is such an exchange. A prefetched ring takes
        passengers only where the ring buffers hold them already (growing them would lose its own
        first message); a deferred hop it cannot take goes alone before its first exchange.
        The returned buffer is reused by the next ring: copy out what you keep.
        """
        hops = self.size - 1 if hops is None else hops
        prefetched = isinstance(start, Prefetched)
        rider_at = nbytes
        if rider is not None:
            if prefetched or hops != self.size - 1 or region is not None:
                raise AssertionError("a rider needs a message not yet sent and all of the ring's W-1 steps")
            rider_at = _aligned(nbytes)
            nbytes = rider_at + rider.nbytes
        boarding = _Boarding(self, nbytes, hops, prefetched, region)
        boarding.add_deferred_hop()
        if carry_next is not None:
            boarding.add_next_first(carry_next)
        boarding.fit()
        if boarding:
            # First, so that the message's own (shorter) views below are of the buffers it makes.
            wide = self.context.buffers.pair(boarding.nbytes, self.device)
        if isinstance(start, torch.Tensor) and (rider is not None or boarding):
            start = functools.partial(_copy_message, start)  # into a ring buffer, for what follows it
        buffers = self.context.buffers.pair(nbytes, self.device)
        boarding_at = boarding.steps
        works = []
        held = None  # which of ``buffers`` holds ``current``, if one does
        # ``prefetched`` stays true for step 0 only: its exchange was done ahead, and its arrival is
        # taken after the step's computation like any other.
        if prefetched:
            current, incoming, arriving = start.sent, start.received, start.received_in
        elif callable(start):
            current, held = buffers[0], 0
            start(current)
        else:
            current = start
        if rider is not None:
            rider.start(current[rider_at:])
        for step in range(hops + 1):
            if step < hops and not prefetched:
                # The buffer not held: its last send was waited for at the last step.
                arriving = 1 if held == 0 else 0
                incoming = buffers[arriving]
                part = None if region is None else region(step)
                if part == slice(None):
                    part = None  # all of it, with no slice dispatched
                if step in boarding_at:
                    sent, received = wide[held], wide[arriving]
                    aboard = boarding.board(step, sent, received)
                    first = 0 if part is None else part.start
                    works = self.exchange(sent[first : boarding.end(step)], received[first : boarding.end(step)], tag)
                elif part is None:
                    works = self.exchange(current, incoming, tag)
                else:
                    works = self.exchange(current[part], incoming[part], tag)
            if during is not None:
                try:
                    during(step, current)
                except BaseException:
                    drain(works, self.context.waited_works)
                    raise
            if works or prefetched:
                if works:
                    wait_for(works, self.context.waited_works)
                works = []
                current, held = incoming, arriving
                if on_arrival is not None:
                    on_arrival(step + 1, current)
                if rider is not None:
                    rider.arrived(step + 1, current[rider_at:])
                if step in boarding_at:
                    for passenger, sent_region, received_region in aboard:
                        passenger.alight(sent_region, received_region, arriving)
            prefetched = False
        if rider is not None:
            rider.finish(current[rider_at:])
        return current


class _Boarding:
    """Which passengers ride which exchanges of one ``Ring.circulate``, and where they lie in the ring
    buffers: behind the message (and rider), each after the one before, each at a multiple of 16 bytes,
    its lead over what precedes it."""

    def __init__(self, ring: Ring, nbytes: int, hops: int, prefetched: bool, region: Callable[[int], slice] | None):
        self.ring, self.message_nbytes, self.hops, self.prefetched, self.region = ring, nbytes, hops, prefetched, region
        self._aboard: dict[int, list[tuple[Passenger, int]]] = {}  # step -> (passenger, where its data starts)
        self._ends: dict[int, int] = {}
        self.nbytes = 0
        self._deferred: DeferredHop | None = None

    def __bool__(self) -> bool:
        return bool(self._aboard)

    @property
    def steps(self) -> dict:
        """The steps at which passengers board (a dict: a step is looked up at every ring step)."""
        return self._aboard

    def _can_board(self, step: int) -> bool:
        """Whether the exchange of ``step`` is this ring's own, sends its message to the end, and sends a
        message at the start of a buffer."""
        if step >= self.hops or (self.prefetched and step < 2):  # 0: done ahead; 1: sends it from behind
            return False
        part = None if self.region is None else self.region(step)
        return part is None or part.stop is None

    def _free_at(self, step: int) -> int:
        return _aligned(self._ends.get(step, self.message_nbytes))

    def _add(self, step: int, passenger: Passenger) -> None:
        at = self._free_at(step)
        self._aboard.setdefault(step, []).append((passenger, at))
        self._ends[step] = at + passenger.nbytes
        self.nbytes = max(self.nbytes, self._ends[step])

    def add_deferred_hop(self) -> None:
        deferred_hops = self.ring.context.deferred_hops
        if not deferred_hops.pending:
            return
        step = next((s for s in range(self.hops) if self._can_board(s)), None)
        hop = deferred_hops.take(self.ring, step is not None)
        if hop is not None:
            self._add(step, hop)
            self._deferred = hop

    def add_next_first(self, carry_next: "Callable[[Ring], NextFirst | None]") -> None:
        step = self.hops - 1
        if not self._can_board(step):
            return
        passenger = carry_next(self.ring)
        if passenger is None:
            return
        at = self._free_at(step)
        # Its lead lies over what the exchange carries before it: a longer one would be bytes sent for
        # nothing (a short message carrying one whose partials are longer). And the buffers are not
        # made larger than the pass needs them anyway (``room``).
        if passenger.lead <= at and at + passenger.nbytes <= passenger.room:
            self._add(step, passenger)

    def fit(self) -> None:
        """A prefetched ring must not grow the ring buffers: that would lose its own first message. If
        they are too small it carries nothing (a deferred hop goes alone), and the next pass makes
        them large enough from its start (``RingBuffers.hold``)."""
        if self and self.prefetched and not self.ring.context.buffers.hold(self.nbytes, self.ring.device):
            self._aboard, self._ends, self.nbytes = {}, {}, 0
            if self._deferred is not None:
                _send_alone(self._deferred)
        self._deferred = None

    def end(self, step: int) -> int:
        return self._ends[step]

    def board(self, step: int, sent: torch.Tensor, received: torch.Tensor) -> list[tuple[Passenger, torch.Tensor, torch.Tensor]]:
        """Board the passengers of ``step`` into ``sent``; their regions in ``sent`` and ``received``."""
        aboard = []
        for passenger, at in self._aboard[step]:
            start, stop = at - passenger.lead, at + passenger.nbytes
            sent_region, received_region = sent[start:stop], received[start:stop]
            passenger.board(sent_region)
            aboard.append((passenger, sent_region, received_region))
        return aboard


def _copy_message(message: torch.Tensor, buffer: torch.Tensor) -> None:
    buffer[: message.numel()].copy_(message)


def _aligned(nbytes: int) -> int:
    """Where data behind a message of ``nbytes`` starts: at a multiple of the largest element size."""
    return -(-nbytes // 16) * 16


class Rider(typing.Protocol):
    """Data of W segments, one per rank, that travels behind a ring's messages instead of in a
    collective of its own: a collective is another synchronisation of every rank, and with gloo it
    costs several ring exchanges (``benchmarks/collective_latency.py``). At step k a rank's message
    carries the rider part of shard ``ring.partial_shard_at(k)`` (whose owner it reaches at the last
    step) or, read the other way, the part that left shard ``ring.weight_shard_at(k)``'s owner k steps
    ago. ``start(region)`` writes this rank's part into its first message, ``arrived(k, region)`` sees
    the part that arrived at step k (before it is sent on), ``finish(region)`` the part held at the end;
    ``region`` is a byte view of ``nbytes``."""

    nbytes: int

    def start(self, region: torch.Tensor) -> None: ...

    def arrived(self, step: int, region: torch.Tensor) -> None: ...

    def finish(self, region: torch.Tensor) -> None: ...


@dataclasses.dataclass
class DeferredHop:
    """The last hop of a ring's message, deferred to travel behind a message of the next ring (a
    ``Passenger``, see ``_Boarding``): a planned sub-block's backward partials end one hop from their
    owners (``_sub_block.py``), and that hop alone would be one more synchronisation of every rank.
    ``payload`` (bytes) goes down the ring of ``ring``; ``arrived`` is given the bytes that came from
    up, in a buffer it may change but not keep."""

    ring: "Ring"
    tag: int
    payload: torch.Tensor
    arrived: Callable[[torch.Tensor], None]
    lead = 0

    @property
    def nbytes(self) -> int:
        return self.payload.numel()

    def board(self, region: torch.Tensor) -> None:
        region.copy_(self.payload)

    def alight(self, sent: torch.Tensor, received: torch.Tensor, received_in: int) -> None:
        self.arrived(received)


class DeferredHops:
    """The one hop deferred and not yet sent (per ``RingContext``). The next ``Ring.circulate`` takes it into an exchange when
    it can (same group and device, an exchange of its own that sends its message to the end, from a
    buffer's start: ``_Boarding``); otherwise, and when the backward ends with none to take it, it is
    sent alone. Every rank runs the same rings in the same order, so all decide alike (the messages'
    sizes match)."""

    def __init__(self, context):
        self._context = context
        self._pending: DeferredHop | None = None
        self._flush_task = -1  # the backward at whose end a flush is due

    def defer(self, hop: DeferredHop) -> None:
        self.flush()
        self._pending = hop
        task = current_graph_task_id()
        if task == -1:  # outside a backward nothing says a ring follows soon
            self.flush()
        elif task != self._flush_task:
            self._flush_task = task
            self._context.queue_end_of_backward()

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def take(self, ring: "Ring", can_carry: bool) -> DeferredHop | None:
        """The hop deferred, for an exchange of ``ring`` to carry, or None (sent alone if there is one
        that ``ring`` cannot carry)."""
        hop, self._pending = self._pending, None
        if hop is None or (can_carry and hop.ring.group is ring.group and hop.ring.device == ring.device):
            return hop
        _send_alone(hop)
        return None

    def flush(self) -> None:
        hop, self._pending = self._pending, None
        if hop is not None:
            _send_alone(hop)

    def end_of_backward(self, task: int) -> None:
        if task == self._flush_task:
            self._flush_task = -1
            self.flush()

    def abandon(self) -> None:
        """Drop a hop that a backward which raised left behind (called as a forward starts)."""
        self._pending, self._flush_task = None, -1


def _send_alone(hop: DeferredHop) -> None:
    received = torch.empty_like(hop.payload)
    wait_for(hop.ring.exchange(hop.payload, received, hop.tag), hop.ring.context.waited_works)
    hop.arrived(received)



class WaitedWorks:
    """The works of the exchange waited for last, kept referenced until the next one has been waited for.

    Dropping a gloo work frees its transport buffer, whose destructor spins (``sched_yield``) until
    gloo's event-loop thread has let go of the buffer; right after ``wait()`` returns, that thread is
    usually still in the completion it has just signalled. One exchange later it has long let go, so
    the works are dropped then, with no spin. On 4 ranks sharing 2 cores the spins cost 2.4 ms of
    system time per exchange, summed over the ranks, and made an exchange take 6× as long
    (``benchmarks/collective_latency.py`` runs both). The works hold nothing else of note: the
    buffers they read and wrote are the ring's own, or parameters.
    """

    def __init__(self):
        self._works: list = []

    def keep(self, works: list) -> None:
        self._works = works

    def clear(self) -> None:
        self._works = []


def wait_for(works: list, kept: WaitedWorks) -> None:
    """Wait for an exchange's works (see ``WaitedWorks`` for why ``kept`` references them a while)."""
    for work in works:
        work.wait()
    kept.keep(works)


def drain(works: list, kept: WaitedWorks) -> None:
    """Wait for the exchange in flight when a ring step raised, ignoring its own errors (the step's
    error is the one to report). The peers posted the matching operations, so it completes; left
    unwaited, gloo keeps the abandoned operations in its transport, which then spins on the socket and
    can match a later message with the same tag to them."""
    for work in works:
        try:
            work.wait()
        except RuntimeError:
            pass
    kept.keep(works)
