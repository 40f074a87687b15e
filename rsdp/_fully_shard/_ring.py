"""The ring: which shard a rank holds at each step, who it talks to, and the one step loop every ring runs.

Every message travels "down" (rank r receives from r+1 and sends to r-1), so at step k rank r holds
weight shard (r + k) mod W. In backward the gradient partials ride in the same message as the weights:
the partial for shard t starts at rank t-1 and collects every rank's contribution on its way down to
its owner t, which it reaches after W-1 hops, so at step k rank r holds the partial of shard
(r + 1 + k) mod W. One message per step, forward and backward: W-1 synchronising exchanges per ring
and pass, the fewest a ring can do. A planned sub-block's gradient needs its weights, so its partial
starts one rank further from its owner and ends one hop short of it after the W-1 exchanges; that
hop is deferred and travels behind the next ring's first message (``DeferredHop``, ``_sub_block.py``).

``Ring.circulate`` is the one step loop, for a ring of ranks and a ring of groups alike. At each step
it starts sending the message it holds and receiving the next one, runs ``during`` (the GEMMs on the
weights held, the next gradient contribution) while they travel, waits, and gives the arrived message
to ``on_arrival`` (add the contribution computed meanwhile) before it is forwarded.

On a ring of groups (``group_size`` g > 1, docs/design.md "A ring of groups") the owners are the W/g
groups of g consecutive ranks, and the same loop passes a rank's own place's shards (``Message.members``)
to the same place in the previous group. Two things are added to a step, both nothing on a ring of
ranks (a group of one): before ``during``, the group all-gathers the shards its ranks hold into a
*block* (the g shards of one group, contiguous rows) for the step to use; after the arrival, it
reduce-scatters the contributions to the block's partials (``fill``), each rank's piece added to the
partial that arrived and travelling on to its owner (``_WithinGroup``). Where a contribution needs its
block's weights (a planned sub-block's, ``own``), the block is gathered as its message arrives, and
the contributions written then (``on_arrival``) are summed before the message goes on. Everything
else is the ring of ranks': the same buffers, exchanges, riders and passengers, W/g - 1 exchanges
instead of W - 1.

A ring's steps pass every rank's message by every other rank, which is what an all-gather does, and
carry one running sum per rank to its owner, which is what a reduce-scatter does. So a collective of
small data can ride a ring's messages (``Rider``) instead of synchronising every rank once more: the
norms' all-gather rides the forward's *carrier* (its first ring able to carry it) and their
gradients' reduce-scatter the first backward ring that begins once every module has queued its
gradients, as the pass's record says (``_collectives.py``). On a ring of groups a rider travels behind
a rank's shards and goes with the collectives within the group: gathered with the weights, or summed
with the partials. Likewise an exchange can carry ``Passenger``s to the same neighbour behind its
message: the next ring's first message (a forward ring's, or a planned sub-block's backward weights)
rides a ring's last exchange (``_prefetch.py``), and the last hop of a planned sub-block's partials an
early exchange of the next ring (``_Boarding``); only between rings of one group size, whose
neighbours are the same ranks.

Messages live in the ring buffers of the model's ``RingContext`` (``_buffers.py``); ``circulate``
asks for them at the size of its message and its passengers, and on a ring of groups for a scratch
that holds the block (and the staging area of the collectives within the group).

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
  group's process group), on every rank in the same order: NCCL matches both by order. Which
  collectives a step makes depends on the message's layout and the rider alone, which every rank shares.
- A passenger or a prefetched message rides only between rings whose neighbours are the same ranks:
  the same shard group and group size.
- A ring of groups' partials that arrived are added to this rank's place of the contributions before
  the reduce-scatter, whose output is the travelling piece itself.
"""

import dataclasses
import enum
import functools
import itertools
import typing
from collections.abc import Callable

import torch
import torch.distributed as dist

from .._compat import current_graph_task_id, group_collectives, send_and_receive
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
        self.owners, self.owner = owners, owner = self.size // group_size, self.rank // group_size
        # Which owner's weight shard a rank holds at each step (``weight_shards[k]``), and whose partial
        # (``partial_shards[k]``): for ring layers to index at each step (a lookup, not a call).
        self.weight_shards = tuple((owner + step) % owners for step in range(owners))
        self.partial_shards = tuple((owner + 1 + step) % owners for step in range(owners))
        # Group ranks; on a ring of groups the rank at this rank's place in the next group.
        self._down, self._up = (self.rank - group_size) % self.size, (self.rank + group_size) % self.size
        self.within = within_group(group, group_size) if group_size > 1 else None
        # Its all-gather and reduce-scatter, called with no Python frame of their own (two or three per step).
        self.within_collectives = group_collectives(self.within) if group_size > 1 else None
        # ``layout(rows)``: how ``rows`` rows split over this ring's owners.
        self.layout: Callable[[int], ShardLayout] = functools.partial(owners_layout, self.owners, group_size)

    def join(self, context) -> None:
        """Use ``context`` (a ``RingContext``) and its ring buffers (``buffers``, where ring layers lay out
        their messages) from now on."""
        self.context, self.buffers = context, context.buffers

    def exchange(self, send: torch.Tensor, receive: torch.Tensor, tag: int) -> list:
        """Start sending ``send`` down and receiving ``receive`` from up, as one batch; returns the works."""
        return send_and_receive(self.group, send, self._down, receive, self._up, tag)

    def circulate(
        self,
        message: Message,
        tag: int,
        start: torch.Tensor | Callable[[torch.Tensor], None] | Prefetched,
        during: Callable[[int, torch.Tensor], None] | None,
        on_arrival: Callable[[int, torch.Tensor], None] | None = None,
        *,
        gathered: range | None = None,
        fill: Callable[[int, torch.Tensor], None] | None = None,
        own: torch.Tensor | None = None,
        region: Callable[[int], slice] | None = None,
        carry_next: "Callable[[Ring], NextFirst | None] | None" = None,
        rider: "Rider | None" = None,
        rank_major: bool = False,
    ) -> torch.Tensor:
        """Pass ``message`` round the ring, ``owners`` - 1 exchanges; return the message held last.

        What travels is this rank's own shards (``message.members``: on a ring of ranks the message
        itself). ``start`` is this rank's first message: a byte tensor sent as it is, a function that
        writes it into the buffer it is given, or the first exchange done already (prefetched). At step
        k, ``during(k, block)`` runs while the message held is sent on and the next one received:
        ``block`` holds owner ``weight_shards[k]``'s shards, which on a ring of ranks is the message
        held, and on a ring of groups the block its group all-gathers (the segments ``gathered``, all
        by default) from the shards its ranks hold. ``on_arrival(k + 1, message)`` then sees the next
        message before it is forwarded. ``region(k)`` is the part of the message that travels at step k
        (all of it by default: a message whose weights are no longer needed sends its partials only).

        On a ring of groups the other segments are partials: ``fill(t, block)`` writes this rank's
        contribution to block t into them (before the steps, and in each step that an arrival
        follows); the group sums the contributions by a reduce-scatter, each rank's piece added to the
        partial of its place that travels on toward its owner, so the partial of
        ``partial_shards[k]`` is held at step k and the owner's own at the end. With ``own`` instead
        (a planned sub-block's: a contribution to block t needs t's weights) the partials follow the
        weights, ``[partials | weights]``: the partial held at step k >= 1 is that of
        ``weight_shards[k]``, begun at step 1 (step 0 sends no partials: ``region``). As a message
        arrives its block is gathered and ``on_arrival(k, block)`` writes this rank's contribution to
        its partials, which the group sums (with the piece that arrived, from step 2 on) before it
        travels on; ``during(0, block)`` writes the contribution to this rank's own group's block,
        which the group sums into ``own`` (this rank's piece, laid out as ``message.members``'
        partials). The piece held last then lacks only its owner's ``own``.
        The block is laid out by segment, or with ``rank_major`` as the collectives move it (each of
        the weights and the partials as the g places' member regions in rank order, with no staging
        copy: ``_wire.BlockRegions``).

        ``rider`` travels behind the message in every step (see ``Rider``): only on all steps of a
        whole message not yet sent (one to be sent as it is gets copied into a ring buffer first).
        Exchanges may carry ``Passenger``s behind the message (and rider): a hop deferred by an
        earlier ring (``DeferredHops``) rides the first exchange that is this ring's own, sends its
        message to the end, and sends a message at the start of a buffer (a prefetched one lies behind
        the message of the ring that carried it); ``carry_next(ring)`` may give the next ring's first
        message, which rides the last exchange if that is such an exchange. A prefetched ring takes
        passengers only where the ring buffers hold them already (growing them would lose its own
        first message); a deferred hop it cannot take goes alone before its first exchange.
        The returned buffer is reused by the next ring: copy out what you keep.
        """
        return _RingPass(self, message, tag, start, region, carry_next, rider, gathered, fill, own, rank_major).run(during, on_arrival)

    def _within(self, regions: BlockRegions, held: torch.Tensor, scratch: torch.Tensor, rider: tuple | None) -> "_WithinGroup":
        """The collectives within the group for the message ``held`` (in the ring buffers: at the start
        of one, or behind the message of the ring that carried it), made once per pool generation and
        place: the views they use cost host time, and a ring of groups runs them at every step. Fresh
        buffers (selective checkpointing's, outside the pool) get fresh ones."""
        place = self.buffers.place_of(held)
        if place is None:
            return _WithinGroup(self, regions, held, scratch, rider)
        # The buffers are the pool's own tensors, the same until it replaces them (a new generation);
        # their memory may be freed and given again between passes, and views follow it.
        key = (self.buffers.generation, place, id(scratch), rider)
        within = regions.collectives.get(key)
        if within is None:
            if len(regions.collectives) >= 12:  # two buffers, their pair and two prefetched places, with a rider or not: the others are older
                regions.collectives.clear()
            within = regions.collectives[key] = _WithinGroup(self, regions, held, scratch, rider)
        return within

    def _within_pair(self, regions: BlockRegions, pair: tuple[torch.Tensor, torch.Tensor], scratch: torch.Tensor, rider: tuple | None) -> "list[_WithinGroup]":
        """``_within`` of both message buffers ``pair``, looked up once per ring: every ring of groups
        asks at its start. Fresh buffers (not at the start of a pool buffer) get their own."""
        starts = self.buffers.starts
        places = (starts.get(pair[0].data_ptr()), starts.get(pair[1].data_ptr()))
        if None in places:
            return [self._within(regions, buffer, scratch, rider) for buffer in pair]
        key = (self.buffers.generation, places, id(scratch), rider)
        within = regions.collectives.get(key)
        if within is None:
            within = [self._within(regions, buffer, scratch, rider) for buffer in pair]
            regions.collectives[key] = within
        return within


class _WithinGroup:
    """What a ring of groups does within its group with one message ``held`` (this rank's shards) and
    the scratch (the block, and the staging area behind it): ``gathers`` all-gather the group's shards
    of the gathered segments into the block, or into the staging area that ``unstage`` copies to the
    block (``_RingPass.run`` runs them, at every step); ``reduce`` sums the group's contributions to the partials
    in the block into ``held``'s, each rank's piece at its place. Several segments go in one
    collective, staged rank-major (``_wire.BlockRegions``); partials of several dtypes go one by one.

    A ``rider`` is ``(start, end, reduced_as)``: where its bytes lie behind the message, and for a
    reduce-scatter's (``Rider.reduces``) the dtype it is summed in, None for an all-gather's. It goes
    in the collective of its kind, staged with the weights or the partials (a reduce-scatter's only with
    partials of its dtype: ``RingRun.turn`` offers it no other ring), and ``rider_parts`` is the g
    ranks' parts of it, ``[g, its bytes]`` in place order. Only messages whose weights lead carry a
    rider (a planned sub-block's ``[partials | weights]`` rings carry none)."""

    def __init__(self, ring: Ring, regions: BlockRegions, held: torch.Tensor, scratch: torch.Tensor, rider: tuple | None):
        self.all_gather, self.sum_scatter = ring.within_collectives
        size, place = ring.group_size, ring.rank % ring.group_size
        # ``block``: the scratch's block (to the staging area's start, past the message's padded end),
        # made here once rather than by every ring that uses it.
        self.block = block = scratch[: regions.staging_at]
        staging = scratch[regions.staging_at :]
        self.gathers, self.unstage = [], []  # (output, input) of each all-gather; (block, staged) copies after
        self.rider_parts = None
        reduced_as = None if rider is None else rider[2]
        if rider is not None and reduced_as is None:
            rider_at, end, _ = rider
            gathered = staging[: size * end]
            self.gathers.append((gathered, held[:end]))
            by_rank = gathered.view(size, end)
            self.unstage = _block_and_staged(block, by_rank, regions.weights)
            self.rider_parts = by_rank[:, rider_at:end]
        elif len(regions.weights) == 1:
            ((block_region, member_region),) = regions.weights
            self.gathers.append((block[block_region], held[regions.weights_start :][member_region]))
        elif regions.weights:
            width = regions.weights_end - regions.weights_start
            gathered = staging[: size * width]
            self.gathers.append((gathered, held[regions.weights_start : regions.weights_end]))
            by_rank = gathered.view(size, width)
            self.unstage = _block_and_staged(block, by_rank, regions.weights)
        # Each reduce-scatter's (bytes from ``first``, dtype, the group's contributions), and the
        # (staged, block) copies before.
        self.stage, self.place = [], place
        staged_as = reduced_as or (regions.partial_dtype if len(regions.partials) > 1 else None)
        if staged_as is not None:  # one reduce-scatter of every partial (and the rider), staged
            # From the partials on, or, with none (they would start at the message's end, aligned for
            # its segments only), from the rider; the gap between them and the rider is summed and
            # never read.
            first = regions.partials_start if regions.partials else rider[0]
            end = regions.partials_end if reduced_as is None else rider[1]
            by_rank = staging[: size * (end - first)].view(size, end - first)
            self.stage = [(staged, block_part) for block_part, staged in _block_and_staged(block, by_rank, [(b, m) for b, m, _ in regions.partials])]
            if reduced_as is not None:
                self.rider_parts = by_rank[:, rider[0] - first : end - first]
            self.pieces = [(slice(0, end - first), staged_as, by_rank.view(-1).view(staged_as))]
        else:
            first = regions.partials_start
            self.pieces = [(m, dtype, block[b].view(dtype)) for b, m, dtype in regions.partials]
        # (this rank's partials, the group's contributions, this rank's place in them) of each reduce-scatter.
        self.reductions = self._reductions(held[first:])

    def _reductions(self, partials: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        reductions = []
        for member_region, dtype, summed in self.pieces:
            into = partials[member_region].view(dtype)
            reductions.append((into, summed, summed[self.place * into.numel() : (self.place + 1) * into.numel()]))
        return reductions

    def gather(self) -> None:
        all_gather = self.all_gather
        for output, input in self.gathers:
            all_gather(output, input).wait()
        for block, staged in self.unstage:
            block.copy_(staged)

    def reduce(self, add_held: bool, rider: "Rider | None", step: int, into: torch.Tensor | None = None) -> None:
        """The partials that arrived (``add_held``) are added to this rank's piece of the contributions
        first, so that the reduce-scatter writes the sum over them; a reduce-scatter's ``rider`` writes
        its contributions to the partial of ``step`` (``Rider.block``) into its parts first. ``into``:
        bytes laid out as the members' partials (from the first) to write this rank's piece to instead
        of the held message's partials (``Ring.circulate``'s ``own``)."""
        for staged, block in self.stage:
            staged.copy_(block)
        if rider is not None:
            rider.block(step, self.rider_parts)
        sum_scatter = self.sum_scatter
        for into, summed, mine in self.reductions if into is None else self._reductions(into):
            if add_held:
                mine.add_(into)
            sum_scatter(into, summed).wait()


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
    exchange in flight (``works``), what rides it (rider, passengers) and, on a ring of groups, the
    collectives within the group (``within``, per message held) and the scratch that holds the block.

    Step k (``run``) sends the message held (the part ``region(k)`` says) and starts receiving the next
    into the other buffer, except at the last step and at a prefetched ring's first (done ahead); on a
    ring of groups it then gathers the block and runs the step on it; after the step's computation it
    receives: waits, makes the arrived message ``current``, reduce-scatters a ring of
    groups' contributions into it (where the partials follow the weights, ``own``: after gathering its
    block and letting ``on_arrival`` contribute), and shows it to ``on_arrival``, the rider and the
    passengers that alight."""

    def __init__(self, ring: Ring, message: Message, tag: int, start, region, carry_next, rider: "Rider | None", gathered, fill, own, rank_major: bool):
        self.ring, self.tag, self.region, self.rider = ring, tag, region, rider
        self.hops = ring.owners - 1
        # True for step 0 only: its exchange was done ahead, and its arrival is taken after the step's
        # computation like any other.
        self.prefetched = isinstance(start, Prefetched)
        nbytes = message.members.nbytes
        self.rider_at = nbytes
        if rider is not None:
            if self.prefetched or region is not None:
                raise AssertionError("a rider needs a whole message not yet sent")
            self.rider_at = _aligned(nbytes)
            nbytes = self.rider_at + rider.nbytes
        boarding = self.boarding = _Boarding(ring, nbytes, self.prefetched, region)
        if ring.context.deferred_hops.pending is not None:
            boarding.add_deferred_hop()
        if carry_next is not None:
            boarding.add_next_first(carry_next)
        self.boarding_at = boarding_at = boarding.steps  # looked up at every step
        if boarding_at and self.prefetched:
            boarding.fit()
        buffers, grouped = ring.buffers, ring.group_size > 1
        if boarding_at:
            # First, so that the message's own (shorter) views below are of the buffers it makes.
            self.wide = buffers.pair(boarding.nbytes, ring.device)
        if isinstance(start, torch.Tensor) and (rider is not None or boarding_at or grouped):
            start = functools.partial(_copy_message, start)  # into a ring buffer, for what follows it
        self.buffers = buffers.pair(nbytes, ring.device)
        self.works: list = []
        self.held = None  # which of ``buffers`` holds ``current``, if one does
        self.arriving_rider = None if grouped else rider  # a ring of groups' rider comes with its collectives
        self.within, self.reduce_rider, self.own = None, None, own
        self.block = self.fill = None  # a ring of groups' (``_within_group``)
        if grouped:
            self._within_group(message, nbytes, gathered, fill, rank_major)
        if self.prefetched:
            self.current, self.incoming, self.arriving = start.sent, start.received, start.received_in
        elif callable(start):
            self.current, self.held = self.buffers[0], 0
            start(self.current)
        else:
            self.current = start
        if rider is not None and self.reduce_rider is None:
            rider.start(self.current[self.rider_at :])
        if self.within is not None:
            self.side = self._side()
            if self.reduces and own is None:
                if fill is not None:
                    fill(ring.partial_shards[0], self.block)
                self.side.reduce(False, self.reduce_rider, 0)

    def _within_group(self, message: Message, nbytes: int, gathered: range | None, fill, rank_major: bool) -> None:
        """A ring of groups: the block's regions, the scratch, and the collectives of the two buffers."""
        ring, rider = self.ring, self.rider
        self.regions = regions = message.block_regions(range(len(message.segments)) if gathered is None else gathered, rank_major)
        self.fill = fill
        self.reduce_rider = rider if rider is not None and rider.reduces else None
        scratch_nbytes = regions.scratch_nbytes
        self.rider_key = None
        if rider is not None:
            self.rider_key = (self.rider_at, nbytes, rider.dtype if rider.reduces else None)
            # Staged with the weights (from the message's start) or the partials (from theirs).
            staged = nbytes - (regions.partials_start if rider.reduces and regions.partials else 0)
            scratch_nbytes = max(scratch_nbytes, regions.staging_at + ring.group_size * staged)
        self.scratch = ring.buffers.scratch(scratch_nbytes, ring.device)
        self.within = ring._within_pair(regions, self.buffers, self.scratch, self.rider_key)
        self.block = self.within[0].block
        self.reduces = bool(self.within[0].reductions)
        self.gathered_at = None  # the step whose block was gathered as its message arrived (``own``)

    def _side(self) -> _WithinGroup:
        """The collectives within the group for the message held (``side``, set as a message is held):
        its buffer's own, or (a prefetched message, behind the carrying ring's) those of its place."""
        held = self.held
        if held is not None and self.current is self.buffers[held]:
            return self.within[held]
        return self.ring._within(self.regions, self.current, self.scratch, self.rider_key)

    def run(self, during: Callable[[int, torch.Tensor], None] | None, on_arrival: Callable[[int, torch.Tensor], None] | None) -> torch.Tensor:
        """Every step of the pass (``Ring.circulate``'s ``during`` and ``on_arrival``); returns the message
        held last. A step's three parts are written out in one loop, not as methods: each call would
        be host time at every step of every ring (``benchmarks/host_overhead.py`` counts them)."""
        ring, hops, tag, within, region, boarding_at = self.ring, self.hops, self.tag, self.within, self.region, self.boarding_at
        group, down, up, kept = ring.group, ring._down, ring._up, ring.context.waited_works
        all_gather, sum_scatter = ring.within_collectives if within is not None else (None, None)
        buffers, block, fill, own, partial_shards = self.buffers, self.block, self.fill, self.own, ring.partial_shards
        for step in range(ring.owners):
            # Send: the exchange of ``step``, the message held (its ``region``, and what boards it) down,
            # the next one from up into the buffer not held, whose last send was waited for at the last
            # step; none at the last step, nor at a prefetched ring's first (done ahead).
            if step != hops and not self.prefetched:
                self.arriving = arriving = 1 if self.held == 0 else 0
                self.incoming = incoming = buffers[arriving]
                part = None if region is None else region(step)
                if part == slice(None):
                    part = None  # all of it, with no slice dispatched
                if step in boarding_at:
                    self.aboard = self.boarding.board(step, self.wide, self.held, arriving)
                    regions = ring.buffers.regions(self.wide, 0 if part is None else part.start, self.boarding.ends[step])
                    sent, received = regions[self.held], regions[arriving]
                elif part is None:
                    sent, received = self.current, incoming
                else:
                    sent, received = self.current[part], incoming[part]
                self.works = send_and_receive(group, sent, down, received, up, tag)
            # The step's computation while the exchange travels; on a ring of groups on the block: the
            # group's all-gather of the shards held into it (the rider's parts with them), the
            # computation, and the contribution to the partial that arrives next.
            try:
                if within is not None:
                    side = self.side
                    if step != self.gathered_at:  # ``side.gather()``, written out (a call less a step)
                        for output, input in side.gathers:
                            all_gather(output, input).wait()
                        for block_part, staged in side.unstage:
                            block_part.copy_(staged)
                    if side.rider_parts is not None and self.reduce_rider is None:
                        self.rider.block(step, side.rider_parts)
                    if during is not None:
                        during(step, block)
                    if fill is not None and step < hops:
                        fill(partial_shards[step + 1], block)
                    if step == 0 and own is not None:
                        side.reduce(False, None, 0, own)
                elif during is not None:
                    during(step, self.current)
            except BaseException:
                drain(self.works, kept)
                raise
            # Receive: wait for the exchange of ``step`` (if there was one); the message that arrived is
            # held next.
            if not (self.works or self.prefetched):
                continue
            if self.works:
                for work in self.works:  # ``wait_for``, written out
                    work.wait()
                kept.works, self.works = self.works, []
            self.current, self.held = current, held = self.incoming, self.arriving
            arrival = on_arrival
            if within is not None:
                self.side = side = within[held] if current is buffers[held] else self._side()
                if own is not None:  # the partials follow the weights: contributed to the block that came
                    side.gather()
                    self.gathered_at = step + 1
                    on_arrival(step + 1, block)
                    side.reduce(step > 0, None, step + 1)  # none came with the first: step 0 sent the weights alone
                    arrival = None
                elif self.reduces:
                    if side.stage or self.reduce_rider is not None:
                        side.reduce(True, self.reduce_rider, step + 1)
                    else:  # ``side.reduce(True, None, ...)`` with nothing staged, written out (a call less a step)
                        for into, summed, mine in side.reductions:
                            mine.add_(into)
                            sum_scatter(into, summed).wait()
            if arrival is not None:
                arrival(step + 1, current)
            if self.arriving_rider is not None:
                self.arriving_rider.arrived(step + 1, current[self.rider_at :])
            if step in boarding_at:
                for passenger, sent_region, received_region in self.aboard:
                    passenger.alight(sent_region, received_region, self.arriving)
            self.prefetched = False
        return self.finish()

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
        self.hops = ring.owners - 1
        # The steps at which passengers board: step -> (passenger, where its data starts); a dict, as a
        # step is looked up at every ring step.
        self.steps: dict[int, list[tuple[Passenger, int]]] = {}
        self.ends: dict[int, int] = {}  # step -> where what it sends ends
        self.nbytes = 0
        self._deferred: DeferredHop | None = None

    def _can_board(self, step: int) -> bool:
        """Whether the exchange of ``step`` is this ring's own, sends its message to the end, and sends a
        message at the start of a buffer."""
        if step >= self.hops or (self.prefetched and step < 2):  # 0: done ahead; 1: sends it from behind
            return False
        part = None if self.region is None else self.region(step)
        return part is None or part.stop is None

    def _free_at(self, step: int) -> int:
        return _aligned(self.ends.get(step, self.message_nbytes))

    def _add(self, step: int, passenger: Passenger) -> None:
        at = self._free_at(step)
        self.steps.setdefault(step, []).append((passenger, at))
        self.ends[step] = at + passenger.nbytes
        self.nbytes = max(self.nbytes, self.ends[step])

    def add_deferred_hop(self) -> None:
        """The hop an earlier ring deferred (``DeferredHops.pending``), aboard the first exchange that can
        take it, or sent alone now."""
        deferred_hops = self.ring.context.deferred_hops
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
        """A prefetched ring that takes passengers must not grow the ring buffers: that would lose its
        own first message. If they are too small it carries nothing (a deferred hop goes alone), and
        the next pass makes them large enough from its start (``RingBuffers.hold``)."""
        if not self.ring.context.buffers.hold(self.nbytes, self.ring.device):
            self.steps.clear()
            self.ends, self.nbytes = {}, 0
            if self._deferred is not None:
                _send_alone(self._deferred)

    def board(self, step: int, wide: tuple[torch.Tensor, torch.Tensor], sent: int, received: int) -> list[tuple[Passenger, torch.Tensor, torch.Tensor]]:
        """Board the passengers of ``step`` into message buffer ``sent`` of ``wide`` (the pair that holds
        them); their regions in it and in buffer ``received``."""
        aboard, buffers = [], self.ring.buffers
        for passenger, at in self.steps[step]:
            regions = buffers.regions(wide, at - passenger.lead, at + passenger.nbytes)
            sent_region, received_region = regions[sent], regions[received]
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
    carries the rider part of shard ``ring.partial_shards[k]`` (whose owner it reaches at the last
    step) or, read the other way, the part that left shard ``ring.weight_shards[k]``'s owner k steps
    ago. ``start(region)`` writes this rank's part into its first message, ``arrived(k, region)`` sees
    the part that arrived at step k (before it is sent on), ``finish(region)`` the part held at the end;
    ``region`` is a byte view of ``nbytes``.

    On a ring of groups the rider goes with the collectives within the group instead, in ``dtype``:
    an all-gather's (``reduces`` False) with the weights, so that ``block(k, parts)`` sees the parts of
    the g ranks of group ``ring.weight_shards[k]`` as they arrived; a reduce-scatter's (``reduces``)
    with the partials, so that ``block(k, parts)`` writes this rank's contributions for the g ranks of
    group ``ring.partial_shards[k]`` into ``parts`` before the group sums them (no ``start`` then,
    and no ``arrived``); ``parts`` is ``[g, nbytes]`` bytes, in place order."""

    nbytes: int
    dtype: torch.dtype
    reduces: bool

    def start(self, region: torch.Tensor) -> None: ...

    def arrived(self, step: int, region: torch.Tensor) -> None: ...

    def block(self, step: int, parts: torch.Tensor) -> None: ...

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
    it can (same group, group size (so the same neighbours) and device, an exchange of its own that sends its message to the end, from a
    buffer's start: ``_Boarding``); otherwise, and when the backward ends with none to take it, it is
    sent alone. Every rank runs the same rings in the same order, so all decide alike (the messages'
    sizes match)."""

    def __init__(self, context):
        self._context = context
        self.pending: DeferredHop | None = None  # read as each ring starts: an attribute, not a call

    def defer(self, hop: DeferredHop) -> None:
        self.flush()
        self.pending = hop
        if current_graph_task_id() == -1:  # outside a backward nothing says a ring follows soon
            self.flush()
        else:
            self._context.end_with_backward(self)

    def take(self, ring: "Ring", can_carry: bool) -> DeferredHop | None:
        """The hop deferred, for an exchange of ``ring`` to carry, or None (sent alone if there is one
        that ``ring`` cannot carry)."""
        hop, self.pending = self.pending, None
        if hop is None or (can_carry and hop.ring.group is ring.group and hop.ring.group_size == ring.group_size and hop.ring.device == ring.device):
            return hop
        _send_alone(hop)
        return None

    def flush(self) -> None:
        hop, self.pending = self.pending, None
        if hop is not None:
            _send_alone(hop)

    def end_of_backward(self) -> None:
        """The backward that deferred the hop ended with no ring to take it: it goes alone."""
        self.flush()

    def abandon(self) -> None:
        """Drop a hop that a backward which raised left behind (called as a forward starts)."""
        self.pending = None


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
        self.works: list = []  # set by ``wait_for`` and ``drain`` (an attribute: every exchange sets it)

    def clear(self) -> None:
        self.works = []


def wait_for(works: list, kept: WaitedWorks) -> None:
    """Wait for an exchange's works (see ``WaitedWorks`` for why ``kept`` references them a while)."""
    for work in works:
        work.wait()
    kept.works = works


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
    kept.works = works
