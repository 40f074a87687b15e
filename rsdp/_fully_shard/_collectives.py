"""The parameters of an rsdp module that do not rotate: gathered whole around its forward and backward,
like FSDP2's.

Vectors — norm weights, biases of layers other than stock Linears, free 1-D ``nn.Parameter``s — are used
whole by elementwise ops (every matrix rotates, op by op: ``_operand.py``). They stay ``Shard(0)`` at rest (so the optimizer state is sharded too);
they are all-gathered in one flat collective over the shard dimension of the mesh, and their gradients
reduce-scattered in one: per pass, not per module. The outermost rsdp forward gathers the vectors of
every rsdp module under it at once (``gather_together``; a module's own forward then finds them
current), and each module's post-backward queues its contributions for one reduce-scatter when the
backward ends (``PendingReductions``, in the model's ``RingContext``): a vector's collective costs
its latency, not its bytes.

From the second step on even that latency mostly goes, as the recorded schedule of the pass kind
says (``_schedule.py``): the vectors of the modules whose forward starts after the pass's *carrier*
(its first Linear, Embedding or input-split ring that was not prefetched) travel on that ring's
messages (``PendingGathers``), and the gradients, once every module has queued its own, on the
messages of the backward ring that begins next (``_ring.Rider``). A misprediction costs the collective, never a wrong result (docs/benchmarks.md has
what it saves).

While installed they are **leaf** ``nn.Parameter``s, persistent tensors whose storage is allocated for a
gather and freed afterwards (FSDP2's unsharded parameters; views of one flat tensor, so that a gather
refills a norm's weight and bias with one copy): tools that hook module parameters during forward
(torch's ``MemTracker``, ``register_post_accumulate_grad_hook``) work, and autograd saves the same
tensor the backward's gather refills. Their gradients land in ``.grad`` of the full tensors; once
reduce-scattered they go to the module's ``RingGradients`` (``_grad.py``), which writes the
``Shard(0)`` ``.grad``. Under HSDP the module's post-backward reduce-scatters its own at once, so that
they join the one all-reduce over replicas it makes of the module's gradients.

Resharding after forward (``reshard_after_forward=True``) frees the full tensors between forward and
backward, which then gathers them again: one more all-gather per module and step. rsdp's default keeps
them (FSDP2's ``reshard_after_forward=False``): each costs one activation row.

Pitfalls:
- A parameter no rank used gets ``None`` as its gradient, as with FSDP2, not a zero (AdamW would decay
  it). Each rank adds one "used" flag per parameter to every rank's segment of the reduce-scatter, so
  whether *some* rank (of any replica) used it arrives with the gradients and costs no collective; only
  a rank that did not use it itself reads its flag (a host sync on CUDA, in that case alone).
- The refill must not bump the version counter of the tensor autograd saved
  (``preserve_version_counter``), or backward would report an in-place modification.
- A module gathered at the start of the pass does not gather again in it: gathered tensors are
  current for the pass they were gathered in (``gathered_in_pass``); a module called on its own (not
  under the module that started the pass), or in a later pass, gathers its own.
- The gradients of the gathered parameters are written when the backward ends, not at the module's
  post-backward (except under HSDP): their hooks run then.
- Whether a collective rides a ring must be decided alike on every rank (the message sizes depend on
  it): the decisions read only the order of modules and rings, never which parameters a rank used.
"""

import functools
import math
import weakref

import torch
import torch.nn as nn

from .._compat import (
    all_gather_flat,
    current_graph_task_id,
    dispatch_modes,
    in_backward,
    in_selective_checkpoint,
    local_of,
    outside_inference_mode,
    preserve_version_counter,
    reduce_scatter_flat,
)
from ._grad import write_gradient
from ._param import shard_layout
from ._ring import Prefetched


class GatheredParams:
    """The non-rotating parameters of one rsdp module, laid out as one padded flat segment per rank."""

    def __init__(self, ring, precision, gradients, params: list[nn.Parameter], reshard_after_forward: bool):
        # Handed by its module's state: the ring (its group and device, and through it the model's
        # context), the precision, and the gradient store its reduced gradients go to.
        self.ring, self.precision, self.gradients = ring, precision, gradients
        self.params = params
        self.reshard_after_forward = reshard_after_forward
        self.layouts = [shard_layout(p.shape[0], ring.size) for p in params]
        self.trailing = [p.shape[1:] for p in params]
        self._inner = [math.prod(shape) for shape in self.trailing]
        self._widths = [layout.chunk * inner for layout, inner in zip(self.layouts, self._inner)]  # per rank
        self._offsets = [0]
        for width in self._widths:
            self._offsets.append(self._offsets[-1] + width)
        # The full parameters are views of one flat tensor: parameter i at the start of a block of its W
        # segments (``W * _offsets[i]``; its padding rows follow it), so that a run of parameters whose
        # segments are equally wide (a norm's weight and bias) is refilled by one copy.
        self._runs: list[tuple[int, int, int]] = []  # (first parameter, count, segment width)
        for index, width in enumerate(self._widths):
            if self._runs and self._runs[-1][2] == width:
                first, count, _ = self._runs[-1]
                self._runs[-1] = (first, count + 1, width)
            else:
                self._runs.append((index, 1, width))
        self._flat: torch.Tensor | None = None
        self._run_blocks: list[torch.Tensor] = []  # per run, its part of the flat tensor as [count, W, width]
        self.full: list[nn.Parameter] | None = None
        self.is_gathered = False
        self.gathered_in_pass = -1  # the forward pass (``_state.py``) whose start last gathered them
        # Contributions (with their "used" flags) of backwards run while gradient sync was off.
        self.unsynced: torch.Tensor | None = None
        self.unsynced_used = [False] * len(params)

    @property
    def segment_numel(self) -> int:
        return self._offsets[-1]

    @property
    def full_nbytes(self) -> int:
        """The memory the full parameters hold while gathered: the flat tensor they are views of, with
        every parameter's padding rows (fewer than W rows each, as in FSDP2's all-gather output)."""
        return 0 if self._flat is None else self._flat.numel() * self._flat.element_size()

    @property
    def requires_grad(self) -> bool:
        return any(p.requires_grad for p in self.params)

    def segment_views(self, flat: torch.Tensor, shard: int) -> list[torch.Tensor]:
        """Shard ``shard`` of every parameter inside one rank's flat segment (``flat`` may go on after it):
        one split, and a view more only where a shard is shorter than its place or not a vector."""
        pieces = flat.split_with_sizes([*self._widths, flat.numel() - self.segment_numel])
        views = []
        for piece, layout, inner, trailing in zip(pieces, self.layouts, self._inner, self.trailing):
            rows = layout.rows_of(shard)
            if rows * inner != piece.numel():
                piece = piece[: rows * inner]
            views.append(piece.view(rows, *trailing) if trailing else piece)
        return views

    def every_shard(self, shards: torch.Tensor, index: int, full: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Parameter ``index``'s rows in ``shards`` (``[W, its width]``: its place in every rank's flat
        segment) and in ``full`` (the whole parameter, or its gradient; contiguous), as at most two pairs
        of views of the same rows, ``(in full, in shards)``: the whole shards, and the last, short one.
        Copying those is two ops per parameter instead of one per rank (a host dispatch each)."""
        layout, trailing = self.layouts[index], self.trailing[index]
        if layout.rows == 0:
            return []
        shards = shards.view(layout.world, layout.chunk, *trailing)
        whole, rest = divmod(layout.rows, layout.chunk)
        if not rest:
            return [(full.view(whole, layout.chunk, *trailing), shards if whole == layout.world else shards[:whole])]
        return [
            (full[: whole * layout.chunk].view(whole, layout.chunk, *trailing), shards[:whole]),
            (full[whole * layout.chunk :], shards[whole, :rest]),
        ]

    @property
    def gather_key(self) -> tuple:
        """What modules whose parameters are gathered in one collective share: the shard group, the
        dtype on the wire and the device."""
        return (self.ring.group, self.precision.compute_dtype(self.params[0].dtype), self.ring.device)

    def gather(self) -> list[nn.Parameter]:
        """All-gather the full parameters into their persistent leaf tensors."""
        gather_together([self])
        return self.full

    def _pack(self, send: torch.Tensor) -> None:
        for view, param in zip(self.segment_views(send, self.ring.rank), self.params):
            view.copy_(local_of(param))

    def _unpack(self, received: torch.Tensor) -> None:
        """The full parameters from ``received`` (``[W, segment]``: every rank's segment)."""
        world = self.ring.size
        if self.full is None:
            with outside_inference_mode():
                self._make_full(world, received.dtype)
        elif not self.is_gathered:
            self._flat.untyped_storage().resize_(self._flat.numel() * self._flat.element_size())
        for full, param in zip(self.full, self.params):
            full.requires_grad_(param.requires_grad)
        # The full parameters share the flat tensor's version counter: autograd may have saved them.
        with torch.no_grad(), preserve_version_counter(self._flat):
            for block, (first, count, width) in zip(self._run_blocks, self._runs):
                offset = self._offsets[first]
                block.copy_(received[:, offset : offset + count * width].unflatten(1, (count, width)).transpose(0, 1))
        self.is_gathered = True

    def _make_full(self, world: int, dtype: torch.dtype) -> None:
        self._flat = torch.empty(world * self.segment_numel, dtype=dtype, device=self.ring.device)
        self.full = []
        for param, offset in zip(self.params, self._offsets):
            data = self._flat[world * offset : world * offset + param.numel()].view(param.shape)
            self.full.append(nn.Parameter(data, requires_grad=param.requires_grad))
        self._run_blocks = [
            self._flat[world * self._offsets[first] : world * self._offsets[first + count]].view(count, world, width)
            for first, count, width in self._runs
        ]

    def free(self) -> None:
        if self.is_gathered:
            self._flat.untyped_storage().resize_(0)
            self.is_gathered = False

    def reduce_gradients(self) -> None:
        """Reduce-scatter the gradients accumulated in the full tensors into the sharded parameters'
        ``.grad`` (or keep them locally while gradient sync is off)."""
        ring, gradients, world, count = self.ring, self.gradients, self.ring.size, len(self.params)
        if not self.requires_grad:
            return
        grads = [full.grad for full in self.full]
        used_here = [grad is not None or earlier for grad, earlier in zip(grads, self.unsynced_used)]
        for full in self.full:
            full.grad = None
        dtype = self.precision.reduce_dtype(self.params[0].dtype)
        # [W, segment | one "used" flag per parameter]: rank r receives the sum of everyone's flags.
        contributions = torch.zeros(world, self.segment_numel + count, dtype=dtype, device=ring.device)
        used = [index for index, grad in enumerate(grads) if grad is not None]
        places = contributions.split_with_sizes([*self._widths, count], dim=1)
        for index in used:
            for rows, shards in self.every_shard(places[index], index, grads[index].contiguous()):
                shards.copy_(rows)
        flags = contributions[:, self.segment_numel :]
        if len(used) == count:  # the usual case: one op sets them all
            flags.fill_(1)
        else:
            for index in used:
                flags[:, index] = 1

        if not gradients.requires_sync:
            if self.unsynced is None:
                self.unsynced = contributions
            else:
                self.unsynced.add_(contributions)
            self.unsynced_used = used_here
            return
        if self.unsynced is not None:
            contributions.add_(self.unsynced)
            self.unsynced, self.unsynced_used = None, [False] * count

        if gradients.replicate_group is None and in_backward():
            ring.context.pending_reductions.add(self, contributions, used_here)
            return
        # Under HSDP each module's reduced gradients join its one all-reduce over replicas at once.
        reduced = torch.empty(self.segment_numel + count, dtype=dtype, device=ring.device)
        reduce_scatter_flat(reduced, contributions.view(-1), group=ring.group)
        self.finish_reduction(reduced, used_here)

    def finish_reduction(self, reduced: torch.Tensor, used_here: list[bool]) -> None:
        """This rank's segment of the reduced gradients (and "used" flags): divided, then written."""
        self.gradients.divide(reduced)
        self.gradients.add_reduced(reduced, functools.partial(self._write_gradients, used_here))

    def _write_gradients(self, used_here: list[bool], reduced: torch.Tensor) -> None:
        """Each used parameter's shard of ``reduced`` (summed over replicas, under HSDP) into its ``.grad``."""
        views = self.segment_views(reduced, self.ring.rank)
        for index, (param, used, view) in enumerate(zip(self.params, used_here, views)):
            if not param.requires_grad:
                continue
            if not used and not bool(reduced[self.segment_numel + index] > 0):
                continue  # no rank used it
            write_gradient(param, view.to(param.dtype))


def _parts(modules: list[GatheredParams]) -> list[tuple[GatheredParams, int, int]]:
    """(module, start, stop) of each module's segment in one flat segment of them all."""
    parts, offset = [], 0
    for module in modules:
        parts.append((module, offset, offset + module.segment_numel))
        offset += module.segment_numel
    return parts


def gather_together(modules: list[GatheredParams], forward_pass: int | None = None) -> None:
    """All-gather the parameters of several modules (of one ``gather_key``) in one collective: the
    outermost rsdp forward gathers every module's under it so (``RSDPState.gather_nested``), one
    collective per step instead of one per module, as each module's vectors are small and a
    collective's cost is mostly its latency. With ``forward_pass``, marks them gathered in it."""
    ring = modules[0].ring
    dtype, world = modules[0].gather_key[1], ring.size
    parts = _parts(modules)
    send = torch.empty(parts[-1][2], dtype=dtype, device=ring.device)
    for module, start, stop in parts:
        module._pack(send[start:stop])
    received = torch.empty(world, parts[-1][2], dtype=dtype, device=ring.device)
    all_gather_flat(received.view(-1), send, group=ring.group)
    for module, start, stop in parts:
        module._unpack(received[:, start:stop])
        if forward_pass is not None:
            module.gathered_in_pass = forward_pass


class PendingGathers:
    """The gathered parameters that the forward running leaves to a ring, not to a collective.

    The outermost rsdp forward gathers the parameters of every module under it in one all-gather
    (``RSDPState.gather_nested``). A ring is W-1 steps in which every rank's message passes every
    other rank, which is what an all-gather does, and a collective is another synchronisation of every
    rank (with gloo as dear as several ring exchanges). So a module is left pending for the forward's
    *carrier*, its first ring able to carry them (the Linear, Embedding and input-split rings, not
    prefetched; not a planned sub-block's, which runs module code while it turns), when the record of
    the last forward with the same outermost module (``_schedule.py``) says its forward began after
    that ring: the record holds each module's forward start (``GATHER``) and the carrier (``CARRIER``)
    as entries, in order. The pass's own carrier takes them, whichever ring it is; a module whose
    forward starts while they are still pending (the pass differs: the module starts before the
    carrier, or no carrier comes) gathers all those pending in one collective, as before, and the
    pass, off its record, is recorded for the next. The decisions depend only on the order of modules
    and rings, which every rank shares.

    The outermost module itself always gathers at once (its forward starts before any ring), so a
    model whose root holds a final norm keeps one all-gather for it; its blocks' still ride.
    """

    def __init__(self, context):
        self._schedule = context.schedules[False]
        self._pending: list[GatheredParams] = []
        self._forward_pass = -1

    def begin_pass(self, forward_pass: int, candidates: list[GatheredParams]) -> list[GatheredParams]:
        """The outermost forward starts and would gather ``candidates``: returns those to gather now,
        and leaves the others (of one ``gather_key``: one ring carries them) pending for the carrier,
        as the record the pass follows says."""
        self._forward_pass = forward_pass
        needed_early = self._schedule.following.needed_early
        if needed_early is None:  # no record, or no ring of its pass could carry them
            self._pending = []
            return candidates
        riding = [module for module in candidates if weakref.ref(module) not in needed_early]
        self._pending = [module for module in riding if module.gather_key == riding[0].gather_key]
        return [module for module in candidates if not any(module is pending for pending in self._pending)]

    def needs(self, module: GatheredParams) -> None:
        """``module``'s forward starts: its parameters must be current (gather the pending now if it is
        one of them)."""
        self._schedule.gather(module)
        if any(module is pending for pending in self._pending):
            gather_together(self._pending, self._forward_pass)
            self._pending = []

    def ring_rider(self, ring, start) -> "_RingAllGather | None":
        """The pending parameters, to all-gather on a forward ring whose first message is ``start``
        (``Ring.circulate``'s), if it is the pass's carrier and shares their group and device."""
        # A recomputation, or a replay that needs its ops alike (builtins first: no frame at every ring).
        if current_graph_task_id() != -1 or (dispatch_modes() and in_selective_checkpoint()):
            return None
        if isinstance(start, Prefetched) or not self._schedule.carrier() or not self._pending:
            return None
        group, _, device = self._pending[0].gather_key
        if group is not ring.group or device != ring.device:
            return None
        rider, self._pending = _RingAllGather(ring, self._pending, self._forward_pass), []
        return rider

    def end_pass(self) -> None:
        """The outermost forward ended (or raised): what no ring carried and no module needed stays
        sharded."""
        self._pending = []


class _RingAllGather:
    """Pending gathered parameters all-gathered on a forward ring (a ``Rider``): each rank's message
    carries the segments of the rank whose weight shard it carries (``ring.weight_shards``), which
    every other rank copies as it passes. The full parameters are made when the ring ends."""

    reduces = False

    def __init__(self, ring, modules: list[GatheredParams], forward_pass: int):
        self.ring, self.forward_pass = ring, forward_pass
        self.parts = _parts(modules)
        self.dtype = modules[0].gather_key[1]
        self.segments = torch.empty(ring.size, self.parts[-1][2], dtype=self.dtype, device=ring.device)
        for module, start, stop in self.parts:
            module._pack(self.segments[ring.rank, start:stop])
        self.nbytes = self.segments.shape[1] * self.segments.element_size()

    def _segment(self, region: torch.Tensor) -> torch.Tensor:
        return region[: self.nbytes].view(self.segments.dtype)

    def start(self, region: torch.Tensor) -> None:
        self._segment(region).copy_(self.segments[self.ring.rank])

    def arrived(self, step: int, region: torch.Tensor) -> None:
        self.segments[self.ring.weight_shards[step]].copy_(self._segment(region))

    def block(self, step: int, parts: torch.Tensor) -> None:
        """On a ring of groups: the parts of the g ranks whose shards the step's all-gather brought."""
        first = self.ring.weight_shards[step] * self.ring.group_size
        self.segments[first : first + self.ring.group_size].copy_(parts.view(self.dtype))

    def finish(self, region: torch.Tensor) -> None:
        for module, start, stop in self.parts:
            module._unpack(self.segments[:, start:stop])
            module.gathered_in_pass = self.forward_pass


class PendingReductions:
    """The gathered parameters' gradients of the backward running, reduce-scattered together: one
    reduce-scatter per backward (per dtype) instead of one per module, as for the gather.

    Modules queue in the order their backward finishes, which the autograd graph fixes alike on every
    rank (as the per-module collectives already required), so every rank lays the message out alike.

    Where it can, the reduce-scatter rides a backward ring (``ring_rider``): a ring is W-1 steps that
    pass one segment per rank down to its owner, which is what a reduce-scatter does, and a collective
    is another synchronisation of every rank (with gloo as dear as several ring exchanges). A ring can
    carry the queue once every module has queued, which the backward's schedule predicts (each module
    queued is an entry of it, ``_schedule.py``): when every module its record queued has queued, in
    the same order, the next backward ring that offers a ride takes the queue. A module that queues after that (the graph changed) is reduce-scattered
    when the backward ends, as are the queues of backwards that never matched. A model whose outermost
    rsdp module holds gathered parameters (a final norm) queues that module only at the very end,
    after its last ring, so it keeps the collective.

    A nested backward (a reentrant checkpoint's) reduces its own at its end; a backward that raised
    leaves its queue behind, dropped when the next forward starts.
    """

    def __init__(self, context):
        self._context = context
        self._queued: dict[int, list] = {}  # graph task -> [(module, contributions, used flags)] not reduced yet

    def add(self, module: GatheredParams, contributions: torch.Tensor, used_here: list[bool]) -> None:
        task = current_graph_task_id()
        if task not in self._queued:
            self._queued[task] = []
            self._context.queue_end_of_backward()
        self._queued[task].append((module, contributions, used_here))
        self._context.schedules[True].reduction(module)

    def ring_rider(self, ring, dtype: torch.dtype | None = None) -> "_RingReduceScatter | None":
        """The queue of the backward running, to reduce-scatter on ``ring``'s messages, if the
        backward's schedule says every module has queued (so none will after), all on ``ring``'s
        group, device and one dtype (``dtype``, where given: a ring of groups sums it with partials of
        that dtype). Depends only on the order of rings and modules, which every rank shares."""
        queued = self._queued.get(current_graph_task_id())
        if not queued or not self._context.schedules[True].all_reductions_queued():
            return None
        if any(_batch_key(entry) != (ring.group, dtype or queued[0][1].dtype, ring.device) for entry in queued):
            return None
        self._queued[current_graph_task_id()] = []
        return _RingReduceScatter(ring, queued)

    def end_of_backward(self, task: int) -> None:
        """Reduce-scatter what the backward ``task`` queued and no ring carried."""
        batches: dict[tuple, list] = {}
        for entry in self._queued.pop(task, []):
            batches.setdefault(_batch_key(entry), []).append(entry)
        for batch in batches.values():
            ring = batch[0][0].ring
            contributions = _contributions_of(batch)
            reduced = torch.empty(contributions.shape[1], dtype=contributions.dtype, device=ring.device)
            reduce_scatter_flat(reduced, contributions.view(-1), group=ring.group)
            _finish_batch(batch, reduced)

    def abandon(self) -> None:
        self._queued.clear()


def _batch_key(entry: tuple) -> tuple:
    """What the queued gradients reduced in one collective share: the group, the dtype, the device."""
    module, contributions, _ = entry
    return (module.ring.group, contributions.dtype, module.ring.device)


def _contributions_of(batch: list) -> torch.Tensor:
    """Every queued module's contributions to every rank's segment, side by side: ``[W, all segments]``."""
    return torch.cat([contributions for _, contributions, _ in batch], dim=1)


def _finish_batch(batch: list, reduced: torch.Tensor) -> None:
    """Hand each module of ``batch`` its part of ``reduced`` (this rank's segment of them all)."""
    offset = 0
    for module, part, used_here in batch:
        module.finish_reduction(reduced[offset : offset + part.shape[1]], used_here)
        offset += part.shape[1]


class _RingReduceScatter:
    """Queued gradients reduce-scattered on a backward ring (a ``Rider``): the message a rank holds at
    step k carries the running sum of shard ``ring.partial_shards[k]``'s segment, to which each rank
    adds its own contribution as it passes; at the last step it is the owner's, complete. On a ring of
    groups the running sums travel as the partials do, summed within the group at every step."""

    reduces = True

    def __init__(self, ring, batch: list):
        self.ring, self.batch = ring, batch
        self.contributions = _contributions_of(batch)
        self.dtype = self.contributions.dtype
        self.nbytes = self.contributions.shape[1] * self.contributions.element_size()

    def _segment(self, region: torch.Tensor) -> torch.Tensor:
        return region[: self.nbytes].view(self.contributions.dtype)

    def start(self, region: torch.Tensor) -> None:
        self._segment(region).copy_(self.contributions[self.ring.partial_shards[0]])

    def arrived(self, step: int, region: torch.Tensor) -> None:
        self._segment(region).add_(self.contributions[self.ring.partial_shards[step]])

    def block(self, step: int, parts: torch.Tensor) -> None:
        """On a ring of groups: this rank's contributions for the g ranks of the partial of ``step``."""
        first = self.ring.partial_shards[step] * self.ring.group_size
        parts.view(self.dtype).copy_(self.contributions[first : first + self.ring.group_size])

    def finish(self, region: torch.Tensor) -> None:
        _finish_batch(self.batch, self._segment(region).clone())

