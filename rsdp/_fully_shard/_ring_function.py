"""What every ring autograd Function shares: the layer it serves, and the backward ring of the Linear,
input-split and Embedding Functions.

A ring Function (``_linear.py``: Linear groups and input-split products; ``_embedding.py``; a planned
sub-block's, ``_sub_block.py``) receives the *local* shards (as gradient leaves, ``_grad.py``) and
returns the reduced gradients of those shards, which rsdp writes into the ``Shard(0)`` DTensor
``.grad``; only the local shards are saved for backward (docs/design.md, "The ring").

Every pass of a ring goes through the layer's ring driver (``_ring_driver.py``), which owns the protocol
(begin, buffers, profiler range, passengers and riders, trim). ``ring_backward`` is the backward ring
of every Function whose partials reach their owners in W-1 hops (all but a planned sub-block's): the weights (for the input gradient) and the gradient partials
travel in one message. At each step the rank uses the weights it holds, and adds its own contribution
to the partial it holds before sending it on. How it contributes is the Function's strategy:

- ``DenseContribution`` (a GEMM that writes every element of the shard's gradient: Linear,
  input-split): computed into a scratch buffer while the partial travels, added when it arrives, so
  only the addition waits for the exchange;
- ``SparseContribution`` (an ``index_add_`` of a few rows: Embedding): added straight into the arrived
  partial, with no scratch buffer and no dense addition.

With gradient synchronisation off (``set_requires_gradient_sync(False)``) no partial travels: each
rank adds its contribution to every shard into a local accumulator (one full-size gradient, as with
FSDP2), which the next synchronised backward adds into the travelling partials.

Pitfalls:
- Nothing on the ring path reads a device value on the host (no ``nonzero``, ``item`` or
  data-dependent shapes): on CUDA each would stall the stream.
- The ring's buffers are reused by the next ring: results are written into fresh tensors or copied out.
- Outputs are returned as fresh tensors, not views, so in-place ops on them work as on stock layers.
- A ring is a loop of point-to-point messages, which torch.compile cannot capture: each ring layer
  is an explicit graph break (``torch.compiler.disable``), and the code around it compiles as usual.
"""

import functools
from collections.abc import Callable

import torch
import torch.nn as nn

from .._compat import DTensor, autocast_dtype
from ._grad import RingGradients
from ._param import Precision
from ._ring import Phase, Ring
from ._ring_driver import RingDriver, RingRun
from ._wire import Message, Views


class RingLayer:
    """What one ring-rotated module needs at run time, handed to it when it is made (it looks nothing up
    through its rsdp module's state): its ``ring`` (group, neighbours, and the ring buffers its messages
    are laid out in, ``ring.buffers``), its ring ``driver`` (``_ring_driver.py``: the ring, its message
    tags, the protocol of a pass), its module's gradient store ``gradients`` (``_grad.RingGradients``:
    gradient leaves, gradient sync and divisor, local accumulators) and ``precision``
    (``_param.Precision``). ``carries_collectives``: whether its rings may carry a pending collective
    (not a planned sub-block's: ``_ring_driver.py``). ``by_shape`` holds what its autograd Functions
    derive from shapes and dtypes alone (layouts, segments, which gradients travel), made once per key
    rather than at every pass: host time at every ring."""

    def __init__(self, ring: Ring, gradients: RingGradients, precision: Precision, tags: dict[Phase, int], name: str, carries_collectives: bool = True):
        self.ring, self.gradients, self.precision = ring, gradients, precision
        self.tags = tags
        self.name = name
        self.driver = RingDriver(ring, tags, name, carries_collectives)
        self.by_shape: dict = {}

    def sharing(self, name: str) -> "RingLayer":
        """A ring layer for a group of ring modules whose first is this one's (``_fusion.py``): the same
        ring, store, precision and tags, under ``name``."""
        return RingLayer(self.ring, self.gradients, self.precision, self.tags, name)


def finished_gradients(layer: RingLayer, message: Message, first: int, final: torch.Tensor) -> list[torch.Tensor]:
    """This rank's reduced shards of the gradient segments ``first:`` of the last message, copied out of
    the ring buffer divided (``RingGradients.divisor``): one op each, from views of the buffer."""
    divisor = layer.gradients.divisor
    return [view.clone() if divisor == 1 else view / divisor for view in message.views(final, layer.ring.rank, first)]


def autocast_like(addend: torch.Tensor, product: torch.Tensor) -> torch.Tensor:
    """A bias added to a ring product as autocast hands it to the stock op (``linear``, ``addmm``): in the
    product's dtype, else the sum would promote back to float32 where the stock op returns bfloat16."""
    if autocast_dtype(product.device.type) is None or not addend.is_floating_point() or addend.dtype == torch.float64:
        return addend
    return addend.to(product.dtype)


def write_product(dst: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``dst = a @ b`` in ``dst``'s dtype."""
    if dst.dtype == a.dtype:
        torch.mm(a, b, out=dst)
    else:
        dst.copy_(a @ b)


class DenseContribution:
    """A contribution that is every element of its shard's gradients (a GEMM): written into a scratch
    buffer while the partial travels, added to the partial when it arrives.

    ``write(shard, views)`` writes this rank's contribution to shard ``shard`` of every gradient into
    ``views`` (a ``Views``: what it derives from them, ``Views.derived``, is kept for the next pass).
    ``earlier(shard, views)``, where given, adds what backwards without synchronisation kept for the
    shard."""

    computes_ahead = True

    def __init__(self, write: Callable[[int, Views], None]):
        self.write = write

    def reserve(self, run: RingRun, grads: Message) -> None:
        """Take the scratch buffer the run asked for (``scratch=grads.nbytes``)."""
        self._grads, self._scratch = grads, run.scratch_buffer

    def add_to(self, shard: int, views: list[torch.Tensor]) -> None:
        """Add the contribution to shard ``shard`` into ``views`` (a local accumulator's)."""
        mine = self._grads.views(self._scratch, shard)
        self.write(shard, mine)
        for view, part in zip(views, mine):
            view.add_(part)

    def start(self, shard: int, partials: list[torch.Tensor], earlier) -> None:
        """The first partial: the contribution itself."""
        self.write(shard, partials)
        if earlier is not None:
            earlier(shard, partials)

    def starter(self, earlier) -> Callable[[int, list[torch.Tensor]], None]:
        """``start`` with ``earlier`` bound; ``write`` itself where nothing was kept (a ring of groups
        starts a partial at every step: one call less each)."""
        return self.write if earlier is None else functools.partial(self.start, earlier=earlier)

    def ahead(self, shard: int, earlier) -> None:
        """While the partial of ``shard`` travels to this rank: its contribution, into the scratch."""
        mine = self._grads.views(self._scratch, shard)
        self.write(shard, mine)
        if earlier is not None:
            earlier(shard, mine)

    def arrival(self, ring: Ring, message: Message, first: int, earlier) -> Callable[[int, torch.Tensor], None]:
        """The ring's ``on_arrival``: add the contribution computed while the partial travelled."""
        grads, scratch = self._grads, self._scratch
        mine_flat = grads.flat(scratch)
        if mine_flat is not None:
            # Gradients of one dtype lie with no gap between them, in the message as in the scratch:
            # one add for all of them (padding rows too, which nothing reads), not one per gradient.
            def arrived(step: int, buffer: torch.Tensor) -> None:
                message.flat(buffer, first).add_(mine_flat)

            return arrived

        def arrived(step: int, buffer: torch.Tensor) -> None:
            shard = ring.partial_shards[step]
            for partial, mine in zip(message.views(buffer, shard, first), grads.views(scratch, shard)):
                partial.add_(mine)

        return arrived


class SparseContribution:
    """A contribution of a few rows (an ``index_add_``): added straight into the partial held, with no
    scratch buffer and no dense addition. ``add(shard, views)`` adds this rank's contribution to shard
    ``shard`` into ``views``."""

    computes_ahead = False

    def __init__(self, add: Callable[[int, list[torch.Tensor]], None]):
        self.add = add

    def reserve(self, run: RingRun, grads: Message) -> None:
        pass

    def add_to(self, shard: int, views: list[torch.Tensor]) -> None:
        self.add(shard, views)

    def start(self, shard: int, partials: list[torch.Tensor], earlier) -> None:
        for partial in partials:
            partial.zero_()
        self.add(shard, partials)
        if earlier is not None:
            earlier(shard, partials)

    def starter(self, earlier) -> Callable[[int, list[torch.Tensor]], None]:
        """``start`` with ``earlier`` bound."""
        return functools.partial(self.start, earlier=earlier)

    def arrival(self, ring: Ring, message: Message, first: int, earlier) -> Callable[[int, torch.Tensor], None]:
        """The ring's ``on_arrival``: add the contribution into the partial that arrived."""
        add = self.add

        def arrived(step: int, buffer: torch.Tensor) -> None:
            shard = ring.partial_shards[step]
            partials = message.views(buffer, shard, first)
            add(shard, partials)
            if earlier is not None:
                earlier(shard, partials)

        return arrived


class RingWeights:
    """The weights a backward ring rotates for the input gradient: ``pack(views)`` writes this rank's
    shards into a message's weight views, ``use(shard, views)`` adds their input-gradient terms
    (``views`` a ``Views``, as ``DenseContribution.write`` has them)."""

    def __init__(self, pack: Callable[[Views], None], use: Callable[[int, Views], None]):
        self.pack, self.use = pack, use

    def rotation(self, ring: Ring, message: Message) -> tuple[Callable[[torch.Tensor], None], Callable[[int, torch.Tensor], None]]:
        """``(start, during)`` for a ring of ``message``, whose leading segments are these weights: this
        rank's shards packed into its first message (one rank's layout, ``message.members``, on a ring
        of groups), and at step k the weights held used."""
        members = message.members

        def start(buffer: torch.Tensor) -> None:
            self.pack(members.views(buffer, ring.rank))

        def during(step: int, buffer: torch.Tensor) -> None:
            shard = ring.weight_shards[step]
            self.use(shard, message.views(buffer, shard))

        return start, during


def ring_backward(
    layer: RingLayer,
    message: Message,
    weight_segments: int,
    grad_keys: list,
    weights: RingWeights | None,
    contribution: DenseContribution | SparseContribution,
    rank_major: bool = False,
) -> list[torch.Tensor] | None:
    """The backward ring of one ring layer: the weights (segments ``:weight_segments`` of ``message``,
    rotated when ``weights`` is given) and the gradient partials (the rest, one per key of
    ``grad_keys``) travel together, each rank adding its ``contribution``. On a ring of groups the
    block is laid out ``rank_major`` if asked (``_wire.BlockRegions``): only where nothing is kept from
    backwards without synchronisation (added by segment).

    Returns this rank's reduced gradient shards, or None when there are none to reduce: no gradient is
    wanted, or synchronisation is off (then the contributions go to the local accumulators)."""
    gradients, ring = layer.gradients, layer.ring
    grads = message.tail(weight_segments)
    weights_only = ring.buffers.message_of(message.segments[:weight_segments])
    unsynced = bool(grad_keys) and not gradients.requires_sync
    # Its first message carries partials: not prefetchable, but its last exchange may carry the next
    # ring's first message. Begun before the buffers are asked for: a backward's first ring says which
    # record of the schedule, and so of the buffers' sizes, the pass follows (``PassSchedule.ring``).
    travelling = weights_only if unsynced else message
    if ring.group_size > 1:  # the ring's messages are a rank's shards, the blocks a scratch (``Ring.circulate``)
        # ``circulate`` asks for both (the pair, then the scratch), so nothing is asked first unless the
        # contributions go to the local accumulators through the scratch before the ring: two requests
        # less at every synchronised backward ring (host time; the buffers' sizes are the same).
        pair = scratch = None
        if unsynced:
            pair = travelling.members.nbytes
            scratch = max(travelling.block_regions(range(weight_segments), rank_major).scratch_nbytes, grads.nbytes)
    else:
        pair, scratch = message.nbytes, grads.nbytes if contribution.computes_ahead else None
    with layer.driver.run(Phase.BACKWARD, travelling, pair=pair, scratch=scratch) as run:
        if scratch is not None:
            contribution.reserve(run, grads)
        if unsynced:
            totals = [gradients.unsynced_total(key, segment) for key, segment in zip(grad_keys, grads.segments)]
            for shard in range(ring.owners):
                contribution.add_to(shard, _unsynced_shards(grads, totals, shard))
        if unsynced or not grad_keys:
            if weight_segments:
                start, during = weights.rotation(ring, weights_only)
                run.turn(start, during, gathered=range(weight_segments), rank_major=rank_major)
            return None
        earlier = [gradients.take_unsynced(key) for key in grad_keys]
        return _reduce_on_ring(layer, run, weights_only, grads, earlier, weights, contribution, rank_major)


def _unsynced_shards(grads: Message, totals: list[torch.Tensor | None], shard: int) -> list[torch.Tensor | None]:
    """Shard ``shard`` of each full-size local accumulator in ``totals``."""
    return [
        None if total is None else RingGradients.unsynced_shard(total, shard, (segment.layout.rows_of(shard), *segment.trailing))
        for total, segment in zip(totals, grads.segments)
    ]


def _reduce_on_ring(
    layer: RingLayer, run: RingRun, weights_only: Message, grads: Message, unsynced: list, weights, contribution, rank_major: bool
) -> list[torch.Tensor]:
    """The weights (``weights_only``, the leading segments of the run's message) and the partials
    (``grads``, the rest) round the ring: the partial of shard ``ring.partial_shards[k]`` is held at
    step k and reaches its owner after W-1 hops, reduced. ``unsynced``: what backwards without
    synchronisation kept for each gradient (None where nothing), added on the way."""
    ring, message = layer.ring, run.message
    weight_segments = len(weights_only.segments)

    def add_unsynced(shard: int, views: list[torch.Tensor]) -> None:
        for view, total in zip(views, _unsynced_shards(grads, unsynced, shard)):
            if total is not None:
                view.add_(total)

    earlier = None  # nothing kept: no call per step
    for total in unsynced:
        if total is not None:
            earlier = add_unsynced
    ahead = contribution.computes_ahead

    if ring.group_size > 1:
        # Each step's contribution to a whole block, as a ring of ranks' first partial is made; the ring
        # reduce-scatters it within the group.
        begin = contribution.starter(earlier)

        def fill(shard: int, block: torch.Tensor) -> None:
            begin(shard, message.views(block, shard, weight_segments))

        start, during = weights.rotation(ring, weights_only) if weight_segments else (_nothing_to_pack, None)
        final = run.turn(start, during, gathered=range(weight_segments), fill=fill, rank_major=rank_major)
        return finished_gradients(layer, message.members, weight_segments, final)

    def start(buffer: torch.Tensor) -> None:
        if weight_segments:
            weights.pack(weights_only.views(buffer, ring.rank))
        shard = ring.partial_shards[0]
        contribution.start(shard, message.views(buffer, shard, weight_segments), earlier)

    def during(step: int, buffer: torch.Tensor) -> None:
        if weight_segments:
            shard = ring.weight_shards[step]
            weights.use(shard, weights_only.views(buffer, shard))
        if ahead and step + 1 < ring.owners:
            contribution.ahead(ring.partial_shards[step + 1], earlier)

    final = run.turn(start, during, contribution.arrival(ring, message, weight_segments, earlier))
    return finished_gradients(layer, message, weight_segments, final)


def _nothing_to_pack(buffer: torch.Tensor) -> None:
    """The first message of a ring whose partials alone travel: they are filled in by the ring."""


def sharded(param: nn.Parameter | None, module: nn.Module, name: str) -> DTensor | None:
    """``module.<name>``: the sharded DTensor parameter rsdp installed (a ring operand stands in for it
    while its module runs); raises if it was replaced by something else."""
    if param is None:
        return None
    param = getattr(param, "sharded_param", param)
    if not isinstance(param, DTensor):
        raise RuntimeError(
            f"rsdp: {type(module).__qualname__}.{name} is no longer the sharded DTensor parameter that "
            "rsdp_shard installed (was it reassigned?). Assign new values in place, e.g. "
            "`with torch.no_grad(): param.copy_(value)`, or load them with load_state_dict."
        )
    return param


def local_shard(param: nn.Parameter | None, module: nn.Module, name: str, layer: RingLayer) -> torch.Tensor | None:
    """What a ring function computes with for ``module.<name>``: its local shard, as the gradient leaf
    through which rsdp accumulates its gradient (``_grad.py``)."""
    param = sharded(param, module, name)
    return None if param is None else layer.gradients.leaf(param)


def check_device(input: torch.Tensor, weight: torch.Tensor, module: nn.Module) -> None:
    if input.device != weight.device:
        raise ValueError(
            f"rsdp {type(module).__qualname__}: input is on {input.device} but the parameters are on "
            f"{weight.device}; move the input there first (e.g. `batch.to('{weight.device}')`)."
        )
