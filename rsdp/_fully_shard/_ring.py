"""The ring: which shard a rank holds at each step, who it talks to, and the one step loop every ring runs.

Every message travels "down" (rank r receives from r+1 and sends to r-1), so at step k rank r holds
weight shard (r + k) mod W. In backward the gradient partials ride in the same message as the weights:
the partial for shard t starts at rank t-1 and collects every rank's contribution on its way down to
its owner t, which it reaches after W-1 hops, so at step k rank r holds the partial of shard
(r + 1 + k) mod W. One message per step, forward and backward: W-1 synchronising exchanges per ring
and pass, the fewest a ring can do. A planned sub-block's gradient needs its weights, so its partial
starts one rank further from its owner and ends one hop short of it after the W-1 exchanges; that
hop is deferred and travels behind the next ring's first message (``DeferredHop``, ``_sub_block.py``).

``Ring.circulate`` is the one step loop. At each step it starts sending the message it holds and
receiving the next one, runs ``during`` (the GEMMs on the weights held, the next gradient contribution)
while they travel, waits, and gives the arrived message to ``on_arrival`` (add the contribution
computed meanwhile) before it is forwarded.

A ring's W-1 steps pass every rank's message by every other rank, which is what an all-gather does,
and carry one running sum per rank to its owner, which is what a reduce-scatter does. So a
collective of small data can ride a ring's messages (``Rider``) instead of synchronising every rank
once more: the norms' all-gather rides the forward's *carrier* (its first ring able to carry it)
and their gradients' reduce-scatter the first backward ring that begins once every module has queued
its gradients, as the pass's record says (``_collectives.py``). Likewise an exchange can carry ``Passenger``s to the
same neighbour behind its message: the next ring's first message (a forward ring's, or a planned
sub-block's backward weights) rides a ring's last exchange (``_prefetch.py``), and the last hop of a
planned sub-block's partials an early exchange of the next ring (``_Boarding``).

Messages live in the ring buffers of the model's ``RingContext`` (``_buffers.py``); ``circulate``
asks for them at the size of its message and its passengers.

On a ring of groups (``group_size`` g > 1, docs/design.md "A ring of groups") the owners are the W/g
groups of g consecutive ranks, and ``circulate_blocks`` is the step loop: a rank passes its own place's
shards to the same place in the previous group, its group all-gathers the shards held into a block
(the g shards of one group, contiguous rows) for the step to use, and in backward reduce-scatters the
contributions to the block's partials, each rank's piece travelling on to its owner. A forward's
all-gather rider travels behind a rank's shards and is gathered with them; no passenger rides.

Pitfalls this file exists to contain (docs/design.md, "The ring"):
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
- On a ring of groups each step issues its exchange (shard group) before its group's collectives (the
  group's process group), on every rank in the same order: NCCL matches both by order.
"""

import dataclasses
import enum
import functools
import itertools
import typing
from collections.abc import Callable

import torch
import torch.distributed as dist

from .._compat import current_graph_task_id, gather_in_group, send_and_receive, sum_scatter_in_group
from ._param import ShardLayout, owners_layout
from ._wire import BlockRegions, Message


class Phase(enum.IntEnum):
    FORWARD = 0
    BACKWARD = 1


_next_layer_id = itertools.count()


def new_layer_tags() -> dict[Phase, int]:
    """Tags for one ring layer; every rank numbers its layers in the order it shards them."""
    layer = next(_next_layer_id)
    return {phase: layer * len(Phase) + phase for phase in Phase}


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
    model, which ``rsdp_shard`` sets and may later replace by its root's (``join``).

    ``size`` and ``rank`` are the shard dimension's (W ranks, this rank's place); the ring passes
    messages among ``owners``, which are ranks, or on a ring of groups (``group_size`` g > 1) the W/g
    groups of g consecutive ranks (``owner``: this rank's group; ``within``: its process group). Ring
    layers compute with owners' shards, laid out by ``layout`` (``_param.ShardLayout``)."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, context, group_size: int = 1):
        self.join(context)
        self.group = group
        self.device = device
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.group_size = group_size
        self.owners, self.owner = self.size // group_size, self.rank // group_size
        # Group ranks; on a ring of groups the rank at this rank's place in the next group.
        self._down, self._up = (self.rank - group_size) % self.size, (self.rank + group_size) % self.size
        self.within = within_group(group, group_size) if group_size > 1 else None
        # ``layout(rows)``: how ``rows`` rows split over this ring's owners.
        self.layout: Callable[[int], ShardLayout] = functools.partial(owners_layout, self.owners, group_size)

    def join(self, context) -> None:
        """Use ``context`` (a ``RingContext``) and its ring buffers (``buffers``, where ring layers lay out
        their messages) from now on."""
        self.context, self.buffers = context, context.buffers

    def weight_shard_at(self, step: int) -> int:
        return (self.owner + step) % self.owners

    def partial_shard_at(self, step: int) -> int:
        return (self.owner + 1 + step) % self.owners

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
        *,
        region: Callable[[int], slice] | None = None,
        carry_next: "Callable[[Ring], NextFirst | None] | None" = None,
        rider: "Rider | None" = None,
    ) -> torch.Tensor:
        """Pass a message of ``nbytes`` bytes W-1 times down the ring; return the one held last.

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
        ring_pass = _RingPass(self, nbytes, tag, start, region, carry_next, rider)
        for step in range(self.size):
            ring_pass.send(step)
            if during is not None:
                try:
                    during(step, ring_pass.current)
                except BaseException:
                    drain(ring_pass.works, self.context.waited_works)
                    raise
            ring_pass.receive(step, on_arrival)
        return ring_pass.finish()

    def circulate_blocks(
        self,
        message: Message,
        tag: int,
        start: Callable[[torch.Tensor], None],
        during: Callable[[int, torch.Tensor], None] | None,
        gathered: int,
        fill: Callable[[int, torch.Tensor], None] | None = None,
        rider: "Rider | None" = None,
    ) -> torch.Tensor:
        """``circulate`` on a ring of groups: ``message`` (laid out in blocks, ``layout``) makes W/g - 1
        exchanges between groups, each rank's of its own place's shards (``message.members``).

        ``start`` writes this rank's first message (its own shards of segments ``:gathered``) into the
        buffer it is given. At step k the rank's group all-gathers segments ``:gathered`` of the shards
        its ranks hold into the block of ``weight_shard_at(k)`` and ``during(k, block)`` uses it, while
        the next shards travel. The other segments are partials: ``fill(t, block)`` writes this rank's
        contribution to block t into them; the group sums the contributions by a reduce-scatter, each
        rank's piece added to the partial of its place that travels on toward its owner (the partial of
        ``partial_shard_at(k)`` is held at step k, and the owner's own at the end). Returns the message
        held last (``message.members``' layout: this rank's reduced shards of the partials).

        A ``rider`` (an all-gather's, with ``arrived_from``) travels behind this rank's shards: each step's
        all-gather brings the parts of the g ranks whose shards it gathers. No passenger rides these
        exchanges: a deferred hop goes alone first. Every rank issues the same exchanges and
        collectives in the same order, whatever the data."""
        context = self.context
        context.deferred_hops.flush()
        regions = message.block_regions(gathered)
        rider_at = _aligned(message.members.nbytes)
        sent = message.members.nbytes if rider is None else rider_at + rider.nbytes
        pair = self.buffers.pair(sent, self.device)
        scratch_nbytes = regions.scratch_nbytes if rider is None else regions.staging_at + self.group_size * sent
        scratch = self.buffers.scratch(max(regions.scratch_nbytes, scratch_nbytes), self.device)
        block = scratch[: message.nbytes]
        # The collectives' views, per buffer held.
        sides = [self._within(regions, buffer, scratch, None if rider is None else (rider_at, sent)) for buffer in pair]
        held = 0
        start(pair[0])
        if rider is not None:
            rider.start(pair[0][rider_at:sent])
        if fill is not None:
            fill(self.partial_shard_at(0), block)
            sides[0].reduce(add_held=False)
        for step in range(self.owners):
            works = []
            if step + 1 < self.owners:
                works = self.exchange(pair[held], pair[1 - held], tag)
            try:
                sides[held].gather()
                if rider is not None:
                    first = self.weight_shard_at(step) * self.group_size
                    for place, part in enumerate(sides[held].rider_parts):
                        rider.arrived_from(first + place, part)
                if during is not None:
                    during(step, block)
                if fill is not None and works:
                    fill(self.partial_shard_at(step + 1), block)
            except BaseException:
                drain(works, context.waited_works)
                raise
            if works:
                wait_for(works, context.waited_works)
                held = 1 - held
                if fill is not None:
                    sides[held].reduce(add_held=True)
        if rider is not None:
            rider.finish(pair[held][rider_at:sent])
        return pair[held]

    def _within(self, regions: BlockRegions, held: torch.Tensor, scratch: torch.Tensor, rider: tuple[int, int] | None) -> "_WithinGroup":
        """The collectives within the group for ``held`` (one of the ring buffers), made once per pool
        generation and buffer: the views they use cost host time, and a ring of groups runs them at
        every step. Fresh buffers (selective checkpointing's, outside the pool) get fresh ones."""
        if self.buffers.place_of(held) is None:
            return _WithinGroup(self, regions, held, scratch, rider)
        # The buffers are the pool's own tensors, the same until it replaces them (a new generation);
        # their memory may be freed and given again between passes, and views follow it.
        key = (self.buffers.generation, id(held), id(scratch), rider)
        within = regions.collectives.get(key)
        if within is None or within.held is not held or within.scratch is not scratch:
            if len(regions.collectives) >= 4:  # two buffers held (with a rider or not): the others are of older buffers
                regions.collectives.clear()
            within = regions.collectives[key] = _WithinGroup(self, regions, held, scratch, rider)
        return within


class _WithinGroup:
    """What a ring of groups does within its group with one message buffer ``held`` (this rank's
    shards) and the scratch (the block, and the staging area behind it): ``gather`` all-gathers the
    group's shards of the gathered segments into the block; ``reduce`` sums the group's contributions to
    the partials in the block into ``held``'s, each rank's piece at its place. Several segments go in one
    collective, staged rank-major (``_wire.BlockRegions``); partials of several dtypes go one by one.
    A ``rider`` (where its bytes lie behind the message: start, end) is gathered with the weights,
    staged: ``rider_parts`` are the g ranks' parts of it, in place order."""

    def __init__(self, ring: Ring, regions: BlockRegions, held: torch.Tensor, scratch: torch.Tensor, rider: tuple[int, int] | None):
        self.held, self.scratch, self.group = held, scratch, ring.within
        size, place = ring.group_size, ring.rank % ring.group_size
        block, staging = scratch[: regions.staging_at], scratch[regions.staging_at :]
        self.gathers, self.unstage = [], []  # (output, input) of each all-gather; (block, staged) copies after
        self.rider_parts = []
        if rider is not None:
            rider_at, end = rider
            gathered = staging[: size * end]
            self.gathers.append((gathered, held[:end]))
            by_rank = gathered.view(size, end)
            self.unstage = _block_and_staged(block, by_rank, regions.weights)
            self.rider_parts = list(by_rank[:, rider_at:end])
        elif len(regions.weights) == 1:
            ((block_region, member_region),) = regions.weights
            self.gathers.append((block[block_region], held[member_region]))
        elif regions.weights:
            gathered = staging[: size * regions.gathered_end]
            self.gathers.append((gathered, held[: regions.gathered_end]))
            by_rank = gathered.view(size, regions.gathered_end)
            self.unstage = _block_and_staged(block, by_rank, regions.weights)
        # (this rank's partials, the group's contributions, this rank's place in them) of each
        # reduce-scatter, and the (staged, block) copies before.
        self.reductions, self.stage = [], []
        partials = held[regions.partials_start :]
        if len(regions.partials) > 1 and regions.partial_dtype is not None:
            by_rank = staging[: size * partials.numel()].view(size, partials.numel())
            self.stage = [(staged, block_part) for block_part, staged in _block_and_staged(block, by_rank, [(b, m) for b, m, _ in regions.partials])]
            pieces = [(partials.view(regions.partial_dtype), by_rank.view(-1).view(regions.partial_dtype))]
        else:
            pieces = [(partials[m].view(dtype), block[b].view(dtype)) for b, m, dtype in regions.partials]
        for into, summed in pieces:
            self.reductions.append((into, summed, summed[place * into.numel() : (place + 1) * into.numel()]))

    def gather(self) -> None:
        for output, input in self.gathers:
            gather_in_group(self.group, output, input)
        for block, staged in self.unstage:
            block.copy_(staged)

    def reduce(self, add_held: bool) -> None:
        """The partials that arrived (``add_held``) are added to this rank's piece of the contributions
        first, so that the reduce-scatter writes the sum over them."""
        for staged, block in self.stage:
            staged.copy_(block)
        for into, summed, mine in self.reductions:
            if add_held:
                mine.add_(into)
            sum_scatter_in_group(self.group, into, summed)


def _block_and_staged(block: torch.Tensor, by_rank: torch.Tensor, regions: list[tuple[slice, slice]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (block, staged) views a ring of groups copies between for ``regions`` (per segment: its block
    region, the g ranks' shards in rank order; its member region, a column range of ``by_rank``,
    ``[g, bytes]``): one pair per run of segments of equal width that follow each other in both (q/k/v
    or gate/up of one width), each run a transposition of ``[g, segments, width]``, so that a step
    copies once per run, not once per segment (each copy is a host dispatch, a kernel on a GPU)."""
    size = by_rank.shape[0]
    runs: list[list[int]] = []  # [block start, member start, width, segments]
    for block_region, member_region in regions:
        width = member_region.stop - member_region.start
        if runs:
            block_start, member_start, run_width, count = runs[-1]
            if (width == run_width and block_region.start == block_start + count * size * width
                    and member_region.start == member_start + count * width):
                runs[-1][3] += 1
                continue
        runs.append([block_region.start, member_region.start, width, 1])
    pairs = []
    for block_start, member_start, width, count in runs:
        block_part = block[block_start : block_start + count * size * width]
        staged = by_rank[:, member_start : member_start + count * width]
        if count == 1:
            pairs.append((block_part.view(size, width), staged))
        else:
            pairs.append((block_part.view(count, size, width), staged.view(size, count, width).transpose(0, 1)))
    return pairs


_within_groups: dict[tuple[dist.ProcessGroup, int], dist.ProcessGroup] = {}
within_group_names: set[str] = set()  # the process groups of rings' groups, for ``rsdp.memory.CommCounter``


def within_group(group: dist.ProcessGroup, size: int) -> dist.ProcessGroup:
    """The process group of this rank's group of ``size`` consecutive ranks of ``group``, made once per
    (group, size): every rank of a group makes it together (only they take part)."""
    key = (group, size)
    if key not in _within_groups:
        first = dist.get_rank(group) // size * size
        ranks = [dist.get_global_rank(group, rank) for rank in range(first, first + size)]
        made = _within_groups[key] = dist.new_group(ranks, use_local_synchronization=True)
        within_group_names.add(made.group_name)
    return _within_groups[key]


class _RingPass:
    """One ``Ring.circulate``: the two message buffers, which of them holds the message ``current``, the
    exchange in flight (``works``), and what rides it (rider, passengers).

    Step k ``send``s the message held (the part ``region(k)`` says) and starts receiving the next into
    the other buffer, except at the last step and at a prefetched ring's first (done ahead); after the
    step's computation, ``receive`` waits, makes the arrived message ``current`` and shows it to
    ``on_arrival``, the rider and the passengers that alight."""

    def __init__(self, ring: Ring, nbytes: int, tag: int, start, region, carry_next, rider: "Rider | None"):
        self.ring, self.tag, self.region, self.rider = ring, tag, region, rider
        self.hops = ring.size - 1
        # True for step 0 only: its exchange was done ahead, and its arrival is taken after the step's
        # computation like any other.
        self.prefetched = isinstance(start, Prefetched)
        self.rider_at = nbytes
        if rider is not None:
            if self.prefetched or region is not None:
                raise AssertionError("a rider needs a whole message not yet sent")
            self.rider_at = _aligned(nbytes)
            nbytes = self.rider_at + rider.nbytes
        boarding = self.boarding = _Boarding(ring, nbytes, self.prefetched, region)
        boarding.add_deferred_hop()
        if carry_next is not None:
            boarding.add_next_first(carry_next)
        boarding.fit()
        self.boarding_at = boarding.steps  # looked up at every step
        buffers = ring.context.buffers
        if boarding:
            # First, so that the message's own (shorter) views below are of the buffers it makes.
            self.wide = buffers.pair(boarding.nbytes, ring.device)
        if isinstance(start, torch.Tensor) and (rider is not None or boarding):
            start = functools.partial(_copy_message, start)  # into a ring buffer, for what follows it
        self.buffers = buffers.pair(nbytes, ring.device)
        self.works: list = []
        self.held = None  # which of ``buffers`` holds ``current``, if one does
        if self.prefetched:
            self.current, self.incoming, self.arriving = start.sent, start.received, start.received_in
        elif callable(start):
            self.current, self.held = self.buffers[0], 0
            start(self.current)
        else:
            self.current = start
        if rider is not None:
            rider.start(self.current[self.rider_at :])

    def send(self, step: int) -> None:
        """Start the exchange of ``step``: the message held (its ``region``, and what boards it) down,
        the next one from up into the buffer not held, whose last send was waited for at the last step."""
        if step == self.hops or self.prefetched:
            return
        self.arriving = arriving = 1 if self.held == 0 else 0
        self.incoming = incoming = self.buffers[arriving]
        part = None if self.region is None else self.region(step)
        if part == slice(None):
            part = None  # all of it, with no slice dispatched
        if step in self.boarding_at:
            sent, received = self.wide[self.held], self.wide[arriving]
            self.aboard = self.boarding.board(step, sent, received)
            first, end = 0 if part is None else part.start, self.boarding.end(step)
            self.works = self.ring.exchange(sent[first:end], received[first:end], self.tag)
        elif part is None:
            self.works = self.ring.exchange(self.current, incoming, self.tag)
        else:
            self.works = self.ring.exchange(self.current[part], incoming[part], self.tag)

    def receive(self, step: int, on_arrival: Callable[[int, torch.Tensor], None] | None) -> None:
        """Wait for the exchange of ``step`` (if there was one); the message that arrived is held next."""
        if not (self.works or self.prefetched):
            return
        if self.works:
            wait_for(self.works, self.ring.context.waited_works)
            self.works = []
        self.current, self.held = self.incoming, self.arriving
        if on_arrival is not None:
            on_arrival(step + 1, self.current)
        if self.rider is not None:
            self.rider.arrived(step + 1, self.current[self.rider_at :])
        if step in self.boarding_at:
            for passenger, sent_region, received_region in self.aboard:
                passenger.alight(sent_region, received_region, self.arriving)
        self.prefetched = False

    def finish(self) -> torch.Tensor:
        """The message held last, once the rider has seen it."""
        if self.rider is not None:
            self.rider.finish(self.current[self.rider_at :])
        return self.current


class _Boarding:
    """Which passengers ride which exchanges of one ``Ring.circulate``, and where they lie in the ring
    buffers: behind the message (and rider), each after the one before, each at a multiple of 16 bytes,
    its lead over what precedes it."""

    def __init__(self, ring: Ring, nbytes: int, prefetched: bool, region: Callable[[int], slice] | None):
        self.ring, self.message_nbytes, self.prefetched, self.region = ring, nbytes, prefetched, region
        self.hops = ring.size - 1
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

    def defer(self, hop: DeferredHop) -> None:
        self.flush()
        self._pending = hop
        if current_graph_task_id() == -1:  # outside a backward nothing says a ring follows soon
            self.flush()
        else:
            self._context.end_with_backward(self)

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

    def end_of_backward(self) -> None:
        """The backward that deferred the hop ended with no ring to take it: it goes alone."""
        self.flush()

    def abandon(self) -> None:
        """Drop a hop that a backward which raised left behind (called as a forward starts)."""
        self._pending = None


def _send_alone(hop: DeferredHop) -> None:
    received = torch.empty_like(hop.payload)
    wait_for(hop.ring.exchange(hop.payload, received, hop.tag), hop.ring.context.waited_works)
    hop.arrived(received)



class WaitedWorks:
    """The works of the exchange waited for last, kept referenced until the next one has been waited for.

    Dropping a gloo work frees its transport buffer, whose destructor spins (``sched_yield``) until
    gloo's event-loop thread has let go of the buffer; right after ``wait()`` returns, that thread is
    usually still in the completion it has just signalled. One exchange later it has long let go, so
    the works are dropped then, with no spin (what the spins cost: ``benchmarks/collective_latency.py``,
    docs/benchmarks.md). The works hold nothing else of note: the
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
