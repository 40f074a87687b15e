"""Ring autograd functions for Linear and Embedding, and the module classes that call them.

Each function receives the *local* shards (as gradient leaves, ``_grad.py``) and returns the reduced
gradients of those shards, which rsdp writes into the ``Shard(0)`` DTensor ``.grad``; only the local
shards are saved for backward. See design.md §1 for the algorithm.

One Linear function serves a *group* of Linears that consume the same input (q/k/v, gate/up; see
``_fusion.py``): their shards travel as one message, so the group costs one ring per pass, and a lone
Linear is a group of one. In backward the weights and the gradient partials travel in one message
(``_ring.py``); the GEMMs on the weights held and the contribution to the next partial run while it is
in flight, and only the addition of that contribution waits for its arrival.

Pitfalls:
- Nothing on the ring path reads a device value on the host (no ``nonzero``, ``item`` or data-dependent
  shapes): on CUDA each would stall the stream. The Embedding selects rows with precomputed masks, and
  validates indices on the device; the verdict travels with the table, so every rank raises, not one.
- The ring's buffers are reused by the next ring: results are written into fresh tensors or copied out.
- Outputs are returned as fresh tensors, not views, so in-place ops on them work as on stock layers.
"""

import contextlib
import itertools
import math
from typing import NamedTuple

import torch
import torch.nn as nn
from torch.autograd.function import once_differentiable
from torch.profiler import record_function

from .._compat import DTensor, autocast_dtype, profiler_enabled
from ._checkpoint import kept_or_run
from ._param import ShardLayout, shard_layout
from ._wire import Message, Segment
from ._prefetch import ring_begins
from ._ring import Phase


class RingLayer:
    """What one ring-rotated module needs at run time: the rsdp state whose settings (mesh, mixed
    precision, gradient reduction) it follows, its message tags, and a name for profiles."""

    def __init__(self, state, tags: dict[Phase, int], name: str):
        self.state = state
        self.tags = tags
        self.name = name
        self._range_names = {phase: f"rsdp::ring_{phase.name.lower()} ({name})" for phase in Phase}

    def profiled(self, phase: Phase) -> contextlib.AbstractContextManager:
        """The profiler range of one pass of this ring, ``rsdp::ring_forward (<layers>)`` or
        ``rsdp::ring_backward (<layers>)``; none when no profiler records: a ``record_function`` costs
        ~15 µs of host time even then, and a step runs two per ring."""
        return record_function(self._range_names[phase]) if profiler_enabled() else contextlib.nullcontext()


def finished_gradients(state, message: Message, first: int, final: torch.Tensor) -> list[torch.Tensor]:
    """This rank's reduced shards of the gradient segments ``first:`` of the last message, copied out of
    the ring buffer divided (``gradient_divisor``): one op each, from views of the buffer."""
    divisor = state.gradient_divisor
    return [view.clone() if divisor == 1 else view / divisor for view in message.views(final, state.ring.rank, first)]


def _ring_backward(layer: RingLayer, message: Message, weight_segments: int, grad_keys: list, pack_weights, use_weights, contribute, adds: bool = False):
    """The backward ring shared by Linear groups and Embedding: the weights (segments
    ``:weight_segments`` of ``message``, for the input gradient) and the gradient partials (the rest,
    one per key of ``grad_keys``) travel together. ``pack_weights(views)`` writes this rank's weight
    shards, ``use_weights(shard, views)`` adds their input-gradient terms, ``contribute(shard, views)``
    writes this rank's contribution to shard ``shard`` of every gradient into ``views`` — or, with
    ``adds``, adds it there. A dense contribution (a Linear's GEMM) is written into a scratch buffer
    while the partial travels and added on arrival; a sparse one (an Embedding's: a few rows) is added
    straight into the arrived partial, with no scratch buffer and no dense addition.

    Returns this rank's reduced gradient shards, or None when gradient synchronisation is off: then
    each contribution is added to a local accumulator for every shard (one full-size gradient, as with
    FSDP2), which the next synchronised backward adds into the travelling partials.
    """
    state, ring = layer.state, layer.state.ring
    grads = message.tail(weight_segments)
    weights = ring.context.buffers.message_of(message.segments[:weight_segments])
    has_grads = len(grad_keys) > 0
    unsynced = has_grads and not state.requires_gradient_sync
    # Its first message carries partials: not prefetchable, but its last exchange may carry the next
    # ring's first message. Begun before the buffers are asked for: a backward's first ring says which
    # prediction of their sizes the pass follows (``RingBuffers.begin_pass``).
    ring_begins(ring, Phase.BACKWARD, layer.tags[Phase.BACKWARD], weights if unsynced else message)
    ring.context.buffers.pair(message.nbytes, ring.device)
    scratch = None if adds else ring.context.buffers.scratch(grads.nbytes, ring.device)

    def shard_of(accumulators: list[torch.Tensor], shard: int) -> list[torch.Tensor | None]:
        return [
            None if total is None else state.unsynced_shard(total, shard, (segment.layout.rows_of(shard), *segment.trailing))
            for total, segment in zip(accumulators, grads.segments)
        ]

    def contribute_into(shard: int, views: list[torch.Tensor]) -> None:
        """Add this rank's contribution to shard ``shard`` into ``views``."""
        if adds:
            contribute(shard, views)
            return
        mine = grads.views(scratch, shard)
        contribute(shard, mine)
        for view, part in zip(views, mine):
            view.add_(part)

    if unsynced:
        accumulators = [state.unsynced_gradient(key, segment) for key, segment in zip(grad_keys, grads.segments)]
        for shard in range(ring.size):
            contribute_into(shard, shard_of(accumulators, shard))
        has_grads, message = False, weights
    if not has_grads:
        if weight_segments:
            ring.circulate(
                message.nbytes,
                layer.tags[Phase.BACKWARD],
                lambda buffer: pack_weights(message.views(buffer, ring.rank)),
                lambda step, buffer: use_weights(ring.weight_shard_at(step), message.views(buffer, ring.weight_shard_at(step))),
                rider=ring.context.pending_reductions.ring_rider(ring),
                carry_next=ring.context.backward_order.next_first,
            )
            ring.context.buffers.trim()
        return None

    unsynced = [state.take_unsynced(key) for key in grad_keys]

    def add_unsynced(shard: int, views: list[torch.Tensor]) -> None:
        for view, earlier in zip(views, shard_of(unsynced, shard)):
            if earlier is not None:
                view.add_(earlier)

    def start(buffer: torch.Tensor) -> None:
        if weight_segments:
            pack_weights(message.views(buffer, ring.rank)[:weight_segments])
        shard = ring.partial_shard_at(0)
        partials = message.views(buffer, shard, weight_segments)
        if adds:
            for partial in partials:
                partial.zero_()
        contribute(shard, partials)
        add_unsynced(shard, partials)

    def during(step: int, buffer: torch.Tensor) -> None:
        if weight_segments:
            shard = ring.weight_shard_at(step)
            use_weights(shard, message.views(buffer, shard)[:weight_segments])
        if not adds and step + 1 < ring.size:  # the contribution the next partial needs, while it travels
            shard = ring.partial_shard_at(step + 1)
            mine = grads.views(scratch, shard)
            contribute(shard, mine)
            add_unsynced(shard, mine)

    def on_arrival(step: int, buffer: torch.Tensor) -> None:
        shard = ring.partial_shard_at(step)
        partials = message.views(buffer, shard, weight_segments)
        if adds:
            contribute(shard, partials)
            add_unsynced(shard, partials)
            return
        for partial, mine in zip(partials, grads.views(scratch, shard)):
            partial.add_(mine)

    final = ring.circulate(message.nbytes, layer.tags[Phase.BACKWARD], start, during, on_arrival,
                           rider=ring.context.pending_reductions.ring_rider(ring), carry_next=ring.context.backward_order.next_first)
    reduced = finished_gradients(state, message, weight_segments, final)
    ring.context.buffers.trim()
    return reduced


def first_message(layer: RingLayer, message: Message, tensors: list[torch.Tensor]):
    """A forward ring's first message, for ``Ring.circulate``: the exchange prefetched for it, else
    ``tensors`` themselves when they are the message, else a function that packs them."""
    ring = layer.state.ring
    prefetched = ring_begins(ring, Phase.FORWARD, layer.tags[Phase.FORWARD], message, tensors)
    if prefetched is not None:
        return prefetched
    as_is = message.as_is(tensors)
    if as_is is not None:
        return as_is
    return lambda buffer: message.pack(buffer, ring.rank, tensors)


def autocast_like(addend: torch.Tensor, product: torch.Tensor) -> torch.Tensor:
    """A bias added to a ring product as autocast hands it to the stock op (``linear``, ``addmm``): in the
    product's dtype, else the sum would promote back to float32 where the stock op returns bfloat16."""
    if autocast_dtype(product.device.type) is None or not addend.is_floating_point() or addend.dtype == torch.float64:
        return addend
    return addend.to(product.dtype)


def _write_product(dst: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``dst = a @ b`` in ``dst``'s dtype."""
    if dst.dtype == a.dtype:
        torch.mm(a, b, out=dst)
    else:
        dst.copy_(a @ b)


class _Stacked:
    """A Linear group's shard-s weights as one matrix: the members' weight segments lead the message and
    are adjacent, each padded to its ``chunk`` rows, so shard s of all of them is ``[width, in]``
    (``width`` the sum of the chunks) starting where the first member's view starts. Its products fill
    ``[tokens, W, width]``, whose member columns, unpadded, are that member's output."""

    def __init__(self, layouts: list[ShardLayout]):
        self.layouts = layouts
        self.offsets = list(itertools.accumulate((layout.chunk for layout in layouts), initial=0))
        self.width = self.offsets[-1]
        self.unpadded = all(layout.chunk * layout.world == layout.rows for layout in layouts)

    def rows(self, first: torch.Tensor) -> torch.Tensor:
        """``[width, trailing]`` from the first member's view of one shard (its real rows only)."""
        trailing = first.shape[1:]
        return first.as_strided((self.width, *trailing), (math.prod(trailing), *first.stride()[1:]), first.storage_offset())

    def spread(self, outputs: list[torch.Tensor]) -> torch.Tensor:
        """``[tokens, W, width]`` laid out like the products, holding ``outputs`` (every member's
        ``[tokens, out_features]``) and zeros in the padding columns."""
        world, tokens = self.layouts[0].world, outputs[0].shape[0]
        spread = (outputs[0].new_empty if self.unpadded else outputs[0].new_zeros)(tokens, world, self.width)
        for layout, start, output in zip(self.layouts, self.offsets, outputs):
            columns = spread[:, :, start : start + layout.chunk]
            if layout.chunk * world == layout.rows:
                columns.copy_(output.view(tokens, world, layout.chunk))
            else:
                whole = output.new_zeros(tokens, world * layout.chunk)
                whole[:, : layout.rows] = output
                columns.copy_(whole.view(tokens, world, layout.chunk))
        return spread

    def copy_member(self, out: torch.Tensor, products: torch.Tensor, member: int) -> None:
        """Member ``member``'s ``[tokens, out_features]`` columns of ``products`` into ``out``."""
        layout, start = self.layouts[member], self.offsets[member]
        columns = products[:, :, start : start + layout.chunk]
        if layout.chunk * layout.world == layout.rows:
            out.view(out.shape[0], layout.world, layout.chunk).copy_(columns)
        else:
            out.copy_(columns.reshape(out.shape[0], layout.world * layout.chunk)[:, : layout.rows])


class LinearMember(NamedTuple):
    """One Linear of a ring group: its output features, and the key of its parameters' sync-off
    gradient accumulators (``RSDPState.unsynced_gradient``)."""

    out_features: int
    key: object


class _RingLinearFunction(torch.autograd.Function):
    """``y_i = x W_i^T + b_i`` for a group of Linears sharing the input ``x``; params are
    ``W_0, b_0, W_1, b_1, ...`` (``b_i`` may be None)."""

    @staticmethod
    def forward(ctx, x, layer: RingLayer, members: tuple[LinearMember, ...], *params):
        state, ring = layer.state, layer.state.ring
        out_features = tuple(member.out_features for member in members)
        weights = params[0::2]
        dtype = state.matmul_dtype(weights[0].dtype)
        layouts = [shard_layout(rows, ring.size) for rows in out_features]
        # Every member's weight, then the biases there are: the weights of one shard are then adjacent
        # in the message, one [sum of chunks, in] matrix that a group multiplies in one GEMM.
        order = list(range(0, len(params), 2)) + [i for i in range(1, len(params), 2) if params[i] is not None]
        message = ring.context.buffers.message_of(tuple(Segment(layouts[index // 2], params[index].shape[1:], dtype) for index in order))
        slot = {index: position for position, index in enumerate(order)}
        x2d = x.reshape(-1, x.shape[-1]).to(dtype)
        stacked = _Stacked(layouts) if len(members) > 1 else None
        all_biases = all(bias is not None for bias in params[1::2])

        def rotate() -> tuple[torch.Tensor, ...]:
            outs = [x2d.new_empty(*x.shape[:-1], rows) for rows in out_features]
            outs2d = [out.view(-1, rows) for out, rows in zip(outs, out_features)]
            products = None if stacked is None else x2d.new_empty(x2d.shape[0], ring.size, stacked.width)

            def during(step: int, buffer: torch.Tensor) -> None:
                shard = ring.weight_shard_at(step)
                views = message.views(buffer, shard)
                if stacked is not None:
                    # Padding rows give columns that are never read.
                    product = products[:, shard]
                    if all_biases:  # adjacent too, right after the weights
                        torch.addmm(stacked.rows(views[len(layouts)]), x2d, stacked.rows(views[0]).t(), out=product)
                        return
                    torch.mm(x2d, stacked.rows(views[0]).t(), out=product)
                    for member, layout in enumerate(layouts):
                        if 2 * member + 1 in slot and layout.rows_of(shard):
                            start = stacked.offsets[member]
                            product[:, start : start + layout.rows_of(shard)].add_(views[slot[2 * member + 1]])
                    return
                layout, out = layouts[0], outs2d[0]
                start, stop = layout.start(shard), layout.stop(shard)
                if start == stop:
                    return
                # A column block of a row-major matrix is a valid BLAS output (leading dimension
                # out_features), so the product is written in place, with no temporary.
                if 1 in slot:
                    torch.addmm(views[slot[1]], x2d, views[0].t(), out=out[:, start:stop])
                else:
                    torch.mm(x2d, views[0].t(), out=out[:, start:stop])

            tensors = [params[index] for index in order]
            start = first_message(layer, message, tensors)
            with layer.profiled(Phase.FORWARD):
                ring.circulate(message.nbytes, layer.tags[Phase.FORWARD], start, during,
                               carry_next=ring.context.forward_order.next_first, rider=ring.context.pending_gathers.ring_rider(ring, start))
                if stacked is not None:
                    for member, out in enumerate(outs2d):
                        stacked.copy_member(out, products, member)
            return tuple(outs)

        outs = kept_or_run(layer, rotate)
        ctx.save_for_backward(x2d, *weights)
        ctx.layer, ctx.members, ctx.out_features = layer, members, out_features
        ctx.has_bias = [p is not None for p in params[1::2]]
        ctx.x_shape, ctx.x_dtype, ctx.dtype = x.shape, x.dtype, dtype
        return outs

    @staticmethod
    @once_differentiable
    def backward(ctx, *grad_outs):
        x2d, *weights = ctx.saved_tensors
        layer = ctx.layer
        state, ring = layer.state, layer.state.ring
        need_x = ctx.needs_input_grad[0]
        need_params = ctx.needs_input_grad[3:]
        dtype = ctx.dtype  # the forward's (autocast's, if it was on then)
        reduce_dtype = state.reduce_dtype(weights[0].dtype)
        layouts = [shard_layout(rows, ring.size) for rows in ctx.out_features]
        dys = [dy.reshape(-1, rows).to(dtype) for dy, rows in zip(grad_outs, ctx.out_features)]

        # Gradients in the message: (member, is_bias) for every parameter that needs one, the weights'
        # first, so that a group's are adjacent (one GEMM per shard when every member's is wanted).
        wanted = sorted(
            ((index // 2, index % 2 == 1) for index, need in enumerate(need_params)
             if need and (index % 2 == 0 or ctx.has_bias[index // 2])),
            key=lambda entry: (entry[1], entry[0]),
        )
        group = _Stacked(layouts) if len(layouts) > 1 else None
        every = range(len(layouts))
        stacked = group is not None and wanted[: len(layouts)] == [(member, False) for member in every]
        stacked_biases = stacked and wanted == [(m, False) for m in every] + [(m, True) for m in every]
        # The input gradient's term is one GEMM per shard too, but only without padding rows: they hold
        # stale bytes of earlier messages, which a zero column of the gradient would not cancel (0 × NaN).
        stacked_input = group is not None and need_x and group.unpadded
        dy_stacked = group.spread(dys) if stacked or stacked_input else None
        weight_segments = [Segment(layout, w.shape[1:], dtype) for layout, w in zip(layouts, weights)] if need_x else []
        grad_segments = [
            Segment(layouts[member], torch.Size() if is_bias else weights[member].shape[1:], reduce_dtype)
            for member, is_bias in wanted
        ]
        message = ring.context.buffers.message_of(tuple(weight_segments + grad_segments))
        grad_x = torch.zeros_like(x2d) if need_x else None

        def pack_weights(views: list[torch.Tensor]) -> None:
            for view, weight in zip(views, weights):
                view.copy_(weight)

        def use_weights(shard: int, views: list[torch.Tensor]) -> None:
            if stacked_input:
                grad_x.addmm_(dy_stacked[:, shard], group.rows(views[0]))
                return
            for layout, dy, weight in zip(layouts, dys, views):
                if layout.rows_of(shard):
                    grad_x.addmm_(dy[:, layout.row_slice(shard)], weight)

        def contribute(shard: int, views: list[torch.Tensor]) -> None:
            if stacked:
                _write_product(group.rows(views[0]), dy_stacked[:, shard].t(), x2d)
                if stacked_biases:
                    group.rows(views[len(layouts)]).copy_(dy_stacked[:, shard].sum(0))
                    return
            for (member, is_bias), view in zip(wanted, views):
                if stacked and not is_bias:
                    continue
                layout = layouts[member]
                dy_shard = dys[member][:, layout.row_slice(shard)]
                if is_bias:
                    view.copy_(dy_shard.sum(0))
                else:
                    _write_product(view, dy_shard.t(), x2d)

        with layer.profiled(Phase.BACKWARD):
            keys = [(ctx.members[member].key, "bias" if is_bias else "weight") for member, is_bias in wanted]
            reduced = _ring_backward(layer, message, len(weight_segments), keys, pack_weights, use_weights, contribute)
        grads = [None] * len(need_params)
        if reduced is not None:
            for (member, is_bias), grad in zip(wanted, reduced):
                grads[2 * member + is_bias] = grad.to(weights[member].dtype)
        if grad_x is not None:
            grad_x = grad_x.view(ctx.x_shape).to(ctx.x_dtype)
        return grad_x, None, None, *grads


class _RingEmbeddingFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, indices, weight, layer: RingLayer, num_embeddings: int, padding_idx):
        state, ring = layer.state, layer.state.ring
        dtype = state.compute_dtype(weight.dtype)
        layout = shard_layout(num_embeddings, ring.size)
        # The table's rows, and one byte: "some rank saw an index out of range", OR-ed on the way.
        message = ring.context.buffers.message_of(
            (Segment(layout, weight.shape[1:], dtype), Segment(shard_layout(ring.size, ring.size), torch.Size(), torch.uint8))
        )
        flat_indices = indices.reshape(-1)

        def rotate() -> tuple[torch.Tensor]:
            out_of_range = ((flat_indices < 0) | (flat_indices >= num_embeddings)).any()
            selects, rows_in = _shard_selection(flat_indices, layout, None)
            out = torch.zeros(*indices.shape, *weight.shape[1:], dtype=dtype, device=weight.device)
            out2d = out.view(flat_indices.numel(), math.prod(weight.shape[1:]))
            scratch = torch.empty_like(out2d)

            def start(buffer: torch.Tensor) -> None:
                rows, flag = message.views(buffer, ring.rank)
                rows.copy_(weight)
                flag.copy_(out_of_range)

            def during(step: int, buffer: torch.Tensor) -> None:
                shard = ring.weight_shard_at(step)
                rows, _ = message.views(buffer, shard)
                if layout.rows_of(shard):
                    torch.index_select(rows.reshape(rows.shape[0], -1), 0, rows_in[shard], out=scratch)
                    out2d.add_(scratch.masked_fill_(~selects[shard].unsqueeze(1), 0))

            def on_arrival(step: int, buffer: torch.Tensor) -> None:
                _, flag = message.views(buffer, ring.weight_shard_at(step))
                flag.bitwise_or_(out_of_range)

            ring_begins(ring, Phase.FORWARD, layer.tags[Phase.FORWARD], message)  # the flag: not prefetchable
            with layer.profiled(Phase.FORWARD):
                final = ring.circulate(message.nbytes, layer.tags[Phase.FORWARD], start, during, on_arrival,
                                       carry_next=ring.context.forward_order.next_first, rider=ring.context.pending_gathers.ring_rider(ring, start))
            _, flag = message.views(final, ring.weight_shard_at(ring.size - 1))
            torch._assert_async(
                (flag | out_of_range) == 0,
                f"rsdp Embedding: an index is out of range [0, {num_embeddings}) on at least one rank "
                "(every rank raises this; check the token ids against num_embeddings)",
            )
            return (out,)

        (out,) = kept_or_run(layer, rotate)
        ctx.save_for_backward(flat_indices)
        ctx.layer, ctx.num_embeddings, ctx.padding_idx = layer, num_embeddings, padding_idx
        ctx.weight_dtype, ctx.trailing = weight.dtype, weight.shape[1:]
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        if not ctx.needs_input_grad[1]:
            return None, None, None, None, None
        (flat_indices,) = ctx.saved_tensors
        layer = ctx.layer
        ring = layer.state.ring
        reduce_dtype = layer.state.reduce_dtype(ctx.weight_dtype)
        layout = shard_layout(ctx.num_embeddings, ring.size)
        message = ring.context.buffers.message_of((Segment(layout, ctx.trailing, reduce_dtype),))
        selects, rows_in = _shard_selection(flat_indices, layout, ctx.padding_idx)
        dy = grad_out.reshape(flat_indices.numel(), math.prod(ctx.trailing))
        masked = torch.empty(dy.shape, dtype=reduce_dtype, device=dy.device)

        def add_contribution(shard: int, views: list[torch.Tensor]) -> None:
            (rows,) = views
            if layout.rows_of(shard):
                masked.copy_(dy).masked_fill_(~selects[shard].unsqueeze(1), 0)
                rows.view(rows.shape[0], dy.shape[1]).index_add_(0, rows_in[shard], masked)

        with layer.profiled(Phase.BACKWARD):
            reduced = _ring_backward(layer, message, 0, [(id(layer), "weight")], None, None, add_contribution, adds=True)
        grad_weight = None if reduced is None else reduced[0].to(ctx.weight_dtype)
        return None, grad_weight, None, None, None


def _shard_selection(flat_indices: torch.Tensor, layout: ShardLayout, padding_idx: int | None):
    """For every shard: which tokens it serves (``[W, N]`` bool; padding tokens excluded when
    ``padding_idx`` is given) and their row in it (``[W, N]``, clamped into the shard so that the
    others index a valid row too) — computed on the device, with no data-dependent shape."""
    # Built on the device (a host list copied there would be a synchronous copy on CUDA).
    starts = (torch.arange(layout.world, device=flat_indices.device) * layout.chunk).clamp_(max=layout.rows)
    counts = (starts + layout.chunk).clamp_(max=layout.rows) - starts
    rows_in = flat_indices.unsqueeze(0) - starts.unsqueeze(1)
    selects = (rows_in >= 0) & (rows_in < counts.unsqueeze(1))
    if padding_idx is not None:
        selects &= flat_indices.unsqueeze(0) != padding_idx
    rows_in = torch.minimum(rows_in.clamp_(min=0), (counts - 1).clamp_(min=0).unsqueeze(1))
    return selects, rows_in


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
    return None if param is None else layer.state.gradients.leaf(param)


def run_linear_group(layer: RingLayer, modules: list[nn.Module], input: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The outputs of ``modules`` (ring Linears of one rsdp module) on one input, in one ring."""
    params = []
    for module in modules:
        params += [local_shard(module.weight, module, "weight", layer), local_shard(module.bias, module, "bias", layer)]
    members = tuple(LinearMember(module.out_features, id(module)) for module in modules)
    return _RingLinearFunction.apply(input, layer, members, *params)


# The ring is a loop of point-to-point messages, which torch.compile cannot capture: each ring layer
# is an explicit graph break, and the code around it compiles as usual.


def _check_device(input: torch.Tensor, weight: torch.Tensor, module: nn.Module) -> None:
    if input.device != weight.device:
        raise ValueError(
            f"rsdp {type(module).__qualname__}: input is on {input.device} but the parameters are on "
            f"{weight.device}; move the input there first (e.g. `batch.to('{weight.device}')`)."
        )


class RingLinear:
    """Mixed into an ``nn.Linear`` (by class swap) whose weight rotates on the ring."""

    _rsdp_ring: RingLayer

    @torch.compiler.disable
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        # Not run inside a ring sub-block's steps: there each planned Linear's forward is its product
        # with the shard held, installed on the instance (_sub_block.py).
        if self.__dict__.get("_rsdp_row_of") is not None:
            raise RuntimeError(
                f"rsdp: {type(self).__qualname__} is the rowwise Linear of ring sub-block "
                f"{self._rsdp_row_of.name!r}; its columns are sharded, so call the sub-block, not the Linear."
            )
        # Checked before the ring starts: a rank that failed half-way through a ring step would leave
        # its peers waiting for the process group's timeout.
        weight = sharded(self.weight, self, "weight")
        if not input.is_floating_point():
            raise TypeError(f"rsdp {type(self).__qualname__}: input must be floating point, got {input.dtype}")
        if input.dim() == 0 or input.shape[-1] != self.in_features:
            raise ValueError(
                f"rsdp {type(self).__qualname__}: input of shape {tuple(input.shape)} does not end in "
                f"in_features={self.in_features}"
            )
        _check_device(input, weight, self)
        return self._rsdp_ring.state.fusion.linear(self, input)


class RingEmbedding:
    """Mixed into an ``nn.Embedding`` (by class swap) whose rows rotate on the ring."""

    _rsdp_ring: RingLayer

    @torch.compiler.disable
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = local_shard(self.weight, self, "weight", self._rsdp_ring)
        if input.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"rsdp {type(self).__qualname__}: indices must be int32 or int64, got {input.dtype}")
        _check_device(input, weight, self)
        return _RingEmbeddingFunction.apply(input, weight, self._rsdp_ring, self.num_embeddings, self.padding_idx)


def ring_mixin_for(module: nn.Module, parent: nn.Module | None) -> type | None:
    """The ring class for ``module`` if it is a Linear or Embedding whose forward is the stock one and
    whose weight is only used through that forward."""
    if isinstance(parent, nn.MultiheadAttention):
        return None  # it passes out_proj.weight to F.multi_head_attention_forward itself
    if isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward:
        return RingLinear
    if isinstance(module, nn.Embedding) and type(module).forward is nn.Embedding.forward:
        unsupported = [
            option
            for option, value in (
                ("max_norm", module.max_norm is not None),
                ("scale_grad_by_freq", module.scale_grad_by_freq),
                ("sparse", module.sparse),
            )
            if value
        ]
        if unsupported:
            raise ValueError(
                f"rsdp_shard: nn.Embedding with {', '.join(unsupported)} cannot rotate on the ring "
                "(these options need the whole table or global index counts). Drop the option, or "
                "shard this embedding with torch's fully_shard instead."
            )
        return RingEmbedding
    return None
