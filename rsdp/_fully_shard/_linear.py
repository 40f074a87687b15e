"""The Linear ring: ``y = x W^T + b`` with W's rows (output features) split over the ring, for a group
of Linears that share an input; and the input-split product ``y = x W`` with W stored ``[in, out]``.

One Function serves a *group* of Linears that consume the same input (q/k/v, gate/up; see
``_fusion.py``): their shards travel as one message, so the group costs one ring per pass, and a lone
Linear is a group of one. Forward: at step k the rank holds shard s = (r + k) mod W of every member's
weight and writes ``x W_s^T + b_s`` into the output columns of shard s while the next shard travels.
Backward (``_ring_function.ring_backward``): the weights rotate again for ``grad_x``, and the weight
gradients' partials travel in the same message, each rank's contribution a dense GEMM.

``RingLinear`` is mixed into a stock ``nn.Linear`` (class swap); its forward checks the input, and
``_fusion.SharedInputFusion`` runs the group's ring (``run_linear_group``) or hands over the output the
group's first member computed. ``RingInputSplitFunction`` serves a weight stored ``[in, out]`` (Hugging
Face's ``Conv1D``), which a ``RingOperand`` meets in ``addmm`` / ``mm`` / ``@`` (``_operand.py``).

Pitfalls:
- A group's padding rows hold stale bytes of earlier messages: the forward's products over them land
  in columns never read, and the backward runs the input-gradient GEMM over the whole group only
  when no member is padded (a zero gradient column does not cancel a stale NaN).
- The first exchange of a forward ring may have been done ahead, by the ring before
  (``_ring_driver.RingRun.first_message``): the weights packed must be the ones it would pack.
"""

import functools
import itertools
import math
from typing import NamedTuple

import torch
import torch.nn as nn
from torch.autograd.function import once_differentiable

from ._checkpoint import kept_or_run
from ._param import ShardLayout
from ._ring_function import (
    DenseContribution,
    RingLayer,
    RingWeights,
    check_device,
    local_shard,
    ring_backward,
    sharded,
    write_product,
)
from ._wire import Views, segment


class _Stacked:
    """A Linear group's shard-s weights as one matrix: the members' weight segments lead the message and
    are adjacent, each padded to its ``chunk`` rows, so shard s of all of them is ``[width, in]``
    (``width`` the sum of the chunks) starting where the first member's view starts. Its products fill
    ``[tokens, W, width]``, whose member columns, unpadded, are that member's output."""

    def __init__(self, layouts: tuple[ShardLayout, ...]):
        self.layouts = layouts
        self.offsets = list(itertools.accumulate((layout.chunk for layout in layouts), initial=0))
        self.width = self.offsets[-1]
        self.unpadded = all(layout.chunk * layout.world == layout.rows for layout in layouts)
        # The keys ``rows_of(views, 0)`` keeps its value under (transposed or not) in ``Views.known``: a
        # ring step reads them there itself, a call less each step.
        self.weights_key, self.weights_key_t = ("stacked", 0, self.width), ("stacked.t", 0, self.width)

    def rows(self, first: torch.Tensor) -> torch.Tensor:
        """``[width, trailing]`` from the first member's view of one shard (its real rows only)."""
        trailing = first.shape[1:]
        return first.as_strided((self.width, *trailing), (math.prod(trailing), *first.stride()[1:]), first.storage_offset())

    def rows_of(self, views: Views, index: int, transposed: bool = False) -> torch.Tensor:
        """``rows`` of ``views[index]`` (transposed, as a GEMM takes a weight), made once per view (read
        from ``Views.known`` first: one call less at every ring step)."""
        key = ("stacked.t" if transposed else "stacked", index, self.width)
        rows = views.known.get(key)
        if rows is not None:
            return rows
        if transposed:
            return views.derived(key, lambda views: self.rows(views[index]).t())
        return views.derived(key, lambda views: self.rows(views[index]))

    def spread(self, outputs: list[torch.Tensor]) -> torch.Tensor:
        """``[tokens, W, width]`` laid out like the products, holding ``outputs`` (every member's
        ``[tokens, out_features]``) and zeros in the padding columns."""
        world, tokens = self.layouts[0].world, outputs[0].shape[0]
        if self.unpadded:  # one op (and a view per member)
            return torch.cat([output.view(tokens, world, layout.chunk) for layout, output in zip(self.layouts, outputs)], dim=2)
        spread = outputs[0].new_zeros(tokens, world, self.width)
        for layout, start, output in zip(self.layouts, self.offsets, outputs):
            columns = spread[:, :, start : start + layout.chunk]
            if layout.chunk * world == layout.rows:
                columns.copy_(output.view(tokens, world, layout.chunk))
            else:
                whole = output.new_zeros(tokens, world * layout.chunk)
                whole[:, : layout.rows] = output
                columns.copy_(whole.view(tokens, world, layout.chunk))
        return spread

    def member_output(self, products: torch.Tensor, member: int, leading: torch.Size) -> torch.Tensor:
        """Member ``member``'s output, ``[*leading, out_features]``: its columns of ``products``, copied
        into a fresh tensor by the copy itself (no output made first and viewed: two ops less a member).
        ``reshape`` copies columns it cannot view into a tensor that is no view; columns it can view
        (a ring of one owner, one token) are cloned: an autograd Function's output that is a view may
        not be modified in place, and a stock Linear's may."""
        layout, start = self.layouts[member], self.offsets[member]
        columns = products[:, :, start : start + layout.chunk]
        if layout.chunk * layout.world != layout.rows:
            columns = columns.reshape(products.shape[0], layout.world * layout.chunk)[:, : layout.rows]
        out = columns.reshape(*leading, layout.rows)
        return out if out._base is None else out.clone()


@functools.lru_cache(maxsize=None)
def _stacked(layouts: tuple[ShardLayout, ...]) -> _Stacked:
    """The one ``_Stacked`` of a group's layouts (it holds nothing else), made once, not at every pass."""
    return _Stacked(layouts)


class LinearMember(NamedTuple):
    """One Linear of a ring group: its output features, and the key of its parameters' sync-off
    gradient accumulators (``RingGradients.unsynced_total``)."""

    out_features: int
    key: object


class RingLinearFunction(torch.autograd.Function):
    """``y_i = x W_i^T + b_i`` for a group of Linears sharing the input ``x``; params are
    ``W_0, b_0, W_1, b_1, ...`` (``b_i`` may be None)."""

    @staticmethod
    def forward(ctx, x, layer: RingLayer, members: tuple[LinearMember, ...], *params):
        group = _GroupForward(layer, x, members, params)
        outs = kept_or_run(layer, group.rotate)
        ctx.save_for_backward(group.x2d, *group.weights)
        ctx.layer, ctx.members, ctx.out_features = layer, members, group.out_features
        ctx.has_bias = group.has_bias
        ctx.x_shape, ctx.x_dtype, ctx.dtype = x.shape, x.dtype, group.dtype
        return outs

    @staticmethod
    @once_differentiable
    def backward(ctx, *grad_outs):
        x2d, *weights = ctx.saved_tensors
        group = _GroupBackward(ctx, x2d, weights, grad_outs)
        reduced = ring_backward(ctx.layer, group.message, group.weight_segments, group.keys,
                                RingWeights(group.pack_weights, group.use_weights), DenseContribution(group.contribute), group.rank_major)
        return group.x_gradient(), None, None, *group.parameter_gradients(reduced)


class _ForwardLayout:
    """What a Linear group's forward derives from its shapes alone, made once per ring layer, matmul
    dtype, input width and biases present (``_GroupForward.of``), not at every pass: its members'
    ``layouts``, the message's ``order`` of parameters (every member's weight, then the biases there
    are: the weights of one shard are then adjacent in the message, one [sum of chunks, in] matrix that
    a group multiplies in one GEMM), their ``segments`` and ``slot`` in it, the group's ``stacked``
    weights (``_Stacked``; None for a lone Linear), and whether every member has a bias.

    A group of weights alone (no bias) reads a ring of groups' block ``rank_major``
    (``_wire.BlockRegions``): its g places' messages back to back, each its stacked weights, are one
    ``[g * width, in]`` matrix as the all-gather writes it, with no staging copy; its products are the
    columns of g consecutive rank shards, laid out by rank shard (``outputs``: the members' layouts).
    Otherwise ``outputs`` is ``stacked``, by owner."""

    def __init__(self, ring, out_features: tuple[int, ...], has_bias: tuple[bool, ...], in_features: int, dtype: torch.dtype):
        self.layouts = layouts = [ring.layout(rows) for rows in out_features]
        self.order = order = [2 * member for member in range(len(out_features))] + [
            2 * member + 1 for member, present in enumerate(has_bias) if present
        ]
        trailing = {0: torch.Size([in_features]), 1: torch.Size()}
        self.segments = tuple(segment(layouts[index // 2], trailing[index % 2], dtype) for index in order)
        self.slot = {index: position for position, index in enumerate(order)}
        self.stacked = _stacked(tuple(layouts)) if len(out_features) > 1 else None
        self.all_biases = all(has_bias)
        self.rank_major = self.stacked is not None and not any(has_bias)
        self.outputs = _stacked(tuple([layout.members for layout in layouts])) if self.rank_major else self.stacked


class _GroupForward:
    """One forward of a Linear group (``RingLinearFunction``): its message (every member's weight, then
    the biases there are; ``_ForwardLayout``) and, at each ring step, the products of the shard held
    (``during``)."""

    def __init__(self, layer: RingLayer, x: torch.Tensor, members: tuple[LinearMember, ...], params: tuple):
        self.layer, self.x_shape, self.params = layer, x.shape, params
        ring = self.ring = layer.ring
        self.out_features = out_features = tuple([member.out_features for member in members])
        self.weights = params[0::2]
        self.has_bias = has_bias = tuple([bias is not None for bias in params[1::2]])
        self.dtype = dtype = layer.precision.matmul_dtype(self.weights[0].dtype)
        key = ("forward", members, has_bias, x.shape[-1], dtype)
        known = layer.by_shape.get(key)
        if known is None:
            known = layer.by_shape[key] = _ForwardLayout(ring, out_features, has_bias, x.shape[-1], dtype)
        self.layouts, self.order, self.slot = known.layouts, known.order, known.slot
        self.stacked, self.all_biases, self.outputs, self.rank_major = known.stacked, known.all_biases, known.outputs, known.rank_major
        self.message = ring.buffers.message_of(known.segments)
        # Shapes go to ``view`` as ints and a dtype already right gets no ``.to()`` (here and in the
        # backward): a ``torch.Size`` argument costs ~3 us of argument parsing, a ``.to()`` ~1 us, each
        # per Linear group and pass (docs/benchmarks.md's figures behind the engine's choices).
        x2d = x.reshape(-1, x.shape[-1])
        self.x2d = x2d if x2d.dtype == dtype else x2d.to(dtype)

    def rotate(self) -> tuple[torch.Tensor, ...]:
        """The group's outputs, from one ring."""
        layer, ring, x2d, stacked = self.layer, self.ring, self.x2d, self.stacked
        # Every shard's output block, split once (one op) rather than sliced at each step.
        if stacked is None:
            (rows,) = self.out_features
            out = x2d.new_empty(*self.x_shape[:-1], rows)
            self.columns = out.view(-1, rows).split_with_sizes(self.layouts[0].sizes, 1)
        else:
            outputs = self.outputs
            products = x2d.new_empty(x2d.shape[0], outputs.layouts[0].world, outputs.width)
            # An owner's columns: on a ring of groups laid out rank-major, its g rank shards'.
            self.columns = (products if outputs is stacked else products.view(x2d.shape[0], ring.owners, stacked.width)).unbind(1)
        layer.driver.forward(self.message, self.during, [self.params[index] for index in self.order], rank_major=self.rank_major)
        if stacked is None:
            return (out,)
        return tuple([self.outputs.member_output(products, member, self.x_shape[:-1]) for member in range(len(self.out_features))])

    def during(self, step: int, buffer: torch.Tensor) -> None:
        """The products of the shard held at ``step`` (in ``buffer``), into their output columns."""
        shard, stacked, x2d = self.ring.weight_shards[step], self.stacked, self.x2d
        if stacked is not None:
            views = self.message.views(buffer, shard)
            # Padding rows give columns that are never read.
            product = self.columns[shard]
            if self.all_biases:  # adjacent too, right after the weights
                torch.addmm(stacked.rows_of(views, len(self.layouts)), x2d, stacked.rows_of(views, 0, transposed=True), out=product)
                return
            weights_t = views.known.get(stacked.weights_key_t)
            if weights_t is None:
                weights_t = stacked.rows_of(views, 0, transposed=True)
            torch.mm(x2d, weights_t, out=product)
            for member, layout in enumerate(self.layouts):
                if 2 * member + 1 in self.slot and layout.sizes[shard]:
                    start = stacked.offsets[member]
                    product[:, start : start + layout.sizes[shard]].add_(views[self.slot[2 * member + 1]])
            return
        if not self.layouts[0].sizes[shard]:
            return
        views = self.message.views(buffer, shard, transposed=(True,))
        # A column block of a row-major matrix is a valid BLAS output (leading dimension
        # out_features), so the product is written in place, with no temporary.
        if 1 in self.slot:
            torch.addmm(views[self.slot[1]], x2d, views[0], out=self.columns[shard])
        else:
            torch.mm(x2d, views[0], out=self.columns[shard])


class _BackwardLayout:
    """What a Linear group's backward derives from its shapes alone, made once per ring layer and the
    gradients wanted, dtypes and input width (``_GroupBackward``), not at every pass: the members'
    ``layouts``; the gradients in the message (``wanted``: (member, is_bias) for every parameter that
    needs one, the weights' first, so that a group's are adjacent, one GEMM per shard when every member's
    is wanted: ``stacked``, ``stacked_biases``); whether the input gradient's term is one GEMM per shard
    (``stacked_input``: only without padding rows, which hold stale bytes of earlier messages that a
    zero column of the gradient would not cancel, 0 × NaN); which splits of the output gradients the
    steps use; the message's segments (the weights when the input gradient is wanted, then the
    gradients) and the gradients' sync-off ``keys``. Where the GEMMs are stacked and no bias travels,
    a ring of groups' block is read ``rank_major`` (``_ForwardLayout``), the output gradients' columns
    laid out by rank shard (``outputs``)."""

    def __init__(self, ctx, in_features: int, dtype: torch.dtype, reduce_dtype: torch.dtype):
        ring = ctx.layer.ring
        need_x, need_params = ctx.needs_input_grad[0], ctx.needs_input_grad[3:]
        self.n_params = len(need_params)
        self.layouts = layouts = [ring.layout(rows) for rows in ctx.out_features]
        self.wanted = wanted = sorted(
            ((index // 2, index % 2 == 1) for index, need in enumerate(need_params)
             if need and (index % 2 == 0 or ctx.has_bias[index // 2])),
            key=lambda entry: (entry[1], entry[0]),
        )
        self.group = group = _stacked(tuple(layouts)) if len(layouts) > 1 else None
        every = range(len(layouts))
        self.stacked = stacked = group is not None and wanted[: len(layouts)] == [(member, False) for member in every]
        self.stacked_biases = stacked and wanted == [(m, False) for m in every] + [(m, True) for m in every]
        self.stacked_input = group is not None and need_x and group.unpadded
        unstacked_biases = not self.stacked_biases and any(is_bias for _, is_bias in wanted)
        self.splits_dy = (need_x and not self.stacked_input) or unstacked_biases
        self.splits_dy_t = not stacked and any(not is_bias for _, is_bias in wanted)
        trailing = torch.Size([in_features])
        weight_segments = [segment(layout, trailing, dtype) for layout in layouts] if need_x else []
        grad_segments = [segment(layouts[member], torch.Size() if is_bias else trailing, reduce_dtype) for member, is_bias in wanted]
        self.segments = tuple(weight_segments + grad_segments)
        self.weight_segments = len(weight_segments)
        self.keys = [(ctx.members[member].key, "bias" if is_bias else "weight") for member, is_bias in wanted]
        self.rank_major = stacked and not any(is_bias for _, is_bias in wanted) and (not need_x or self.stacked_input)
        self.outputs = _stacked(tuple([layout.members for layout in layouts])) if self.rank_major else group


class _GroupBackward:
    """One backward of a Linear group (``RingLinearFunction``): the message it lays out, and what each
    ring step does with the shard held (``ring_backward`` drives the ring):

    - ``pack_weights`` / ``use_weights``: the weights rotate for the input gradient, ``grad_x +=
      dy[:, cols(s)] W_s`` at each step;
    - ``contribute``: this rank's term of shard s's weight (and bias) gradients, ``dy[:, cols(s)]^T x``.

    Where every member's weight gradient is wanted they are adjacent in the message and computed as one
    GEMM per shard (``_Stacked``), and so is the input gradient's term when no member is padded."""

    def __init__(self, ctx, x2d: torch.Tensor, weights: list[torch.Tensor], grad_outs: tuple[torch.Tensor, ...]):
        layer = ctx.layer
        self.x2d, self.weights = x2d, weights
        self.x_shape, self.x_dtype = ctx.x_shape, ctx.x_dtype
        dtype = ctx.dtype  # the forward's (autocast's, if it was on then)
        reduce_dtype = layer.precision.reduce_dtype(weights[0].dtype)
        key = ("backward", ctx.members, ctx.has_bias, ctx.needs_input_grad, x2d.shape[1], dtype, reduce_dtype)
        known = layer.by_shape.get(key)
        if known is None:
            known = layer.by_shape[key] = _BackwardLayout(ctx, x2d.shape[1], dtype, reduce_dtype)
        self.n_params, self.layouts, self.wanted, self.group = known.n_params, known.layouts, known.wanted, known.group
        self.stacked, self.stacked_biases, self.stacked_input = known.stacked, known.stacked_biases, known.stacked_input
        self.weight_segments, self.keys = known.weight_segments, known.keys
        self.message = layer.ring.buffers.message_of(known.segments)
        dys = [dy.reshape(-1, rows) if dy.dtype == dtype else dy.reshape(-1, rows).to(dtype) for dy, rows in zip(grad_outs, ctx.out_features)]
        # Rank-major only on a ring of groups (a ring of ranks' block is one shard: the layouts agree)
        # and where the partials are the contributions alone: what backwards without synchronisation
        # kept is added by segment (``_ring_function.ring_backward``).
        self.rank_major = rank_major = known.outputs is not known.group and layer.gradients.synced_alone
        # Each shard's columns of the output gradients (and, transposed, as the weight gradient's GEMM
        # takes them), split once (an op or two) rather than sliced and transposed at every step; read
        # rank-major, an owner's are its g rank shards' (``_ForwardLayout``).
        if known.stacked or known.stacked_input:
            outputs = known.outputs if rank_major else known.group
            dy_stacked = outputs.spread(dys)
            if outputs is not known.group:
                dy_stacked = dy_stacked.view(dy_stacked.shape[0], layer.ring.owners, known.group.width)
            self.dy_shards, self.dy_shards_t = dy_stacked.unbind(1), dy_stacked.permute(1, 2, 0).unbind(0)
        if known.splits_dy:
            self.dys_split = [dy.split_with_sizes(layout.sizes, 1) for dy, layout in zip(dys, known.layouts)]
        if known.splits_dy_t:
            self.dys_split_t = [dy.t().split_with_sizes(layout.sizes, 0) for dy, layout in zip(dys, known.layouts)]
        self.grad_x = torch.zeros_like(x2d) if ctx.needs_input_grad[0] else None
        self.in_place = dtype == reduce_dtype  # the weight gradient's GEMM writes the partials' dtype
        # The weights into a message's views, with no call of its own (one a backward ring).
        self.pack_weights = functools.partial(Views.write, tensors=weights)

    def use_weights(self, shard: int, views: Views) -> None:
        if self.stacked_input:
            rows = views.known.get(self.group.weights_key)
            self.grad_x.addmm_(self.dy_shards[shard], self.group.rows_of(views, 0) if rows is None else rows)
            return
        for layout, dy, weight in zip(self.layouts, self.dys_split, views):
            if layout.sizes[shard]:
                self.grad_x.addmm_(dy[shard], weight)

    def contribute(self, shard: int, views: Views) -> None:
        if self.stacked:
            rows = views.known.get(self.group.weights_key)
            if rows is None:
                rows = self.group.rows_of(views, 0)
            if self.in_place:  # the GEMM writes the partials' dtype: ``write_product``'s case, with no call of it
                torch.mm(self.dy_shards_t[shard], self.x2d, out=rows)
            else:
                write_product(rows, self.dy_shards_t[shard], self.x2d)
            if self.stacked_biases:
                self.group.rows_of(views, len(self.layouts)).copy_(self.dy_shards[shard].sum(0))
                return
        for (member, is_bias), view in zip(self.wanted, views):
            if self.stacked and not is_bias:
                continue
            if is_bias:
                view.copy_(self.dys_split[member][shard].sum(0))
            else:
                write_product(view, self.dys_split_t[member][shard], self.x2d)

    def x_gradient(self) -> torch.Tensor | None:
        if self.grad_x is None:
            return None
        grad_x = self.grad_x.view(*self.x_shape)
        return grad_x if grad_x.dtype == self.x_dtype else grad_x.to(self.x_dtype)

    def parameter_gradients(self, reduced: list[torch.Tensor] | None) -> list[torch.Tensor | None]:
        """The reduced shards (``ring_backward``'s), as ``W_0, b_0, W_1, b_1, ...`` in their dtypes."""
        grads = [None] * self.n_params
        for (member, is_bias), grad in zip(self.wanted, reduced or ()):
            dtype = self.weights[member].dtype
            grads[2 * member + is_bias] = grad if grad.dtype == dtype else grad.to(dtype)
        return grads


class RingInputSplitFunction(torch.autograd.Function):
    """``y = x W`` for ``W`` stored ``[in, out]`` with its rows (input features) split over the ring: each
    step adds ``x[:, rows of shard s] W_s``; backward writes ``dy W_s^T`` into the input gradient's
    columns of shard s and sends ``x[:, rows of s]^T dy`` on to its owner."""

    @staticmethod
    def forward(ctx, x, layer: RingLayer, full_shape: tuple[int, int], weight):
        ring = layer.ring
        in_features, out_features = full_shape
        dtype = layer.precision.matmul_dtype(weight.dtype)
        layout = ring.layout(in_features)
        message = layer.ring.buffers.message_of((segment(layout, weight.shape[1:], dtype),))
        x2d = x.reshape(-1, in_features).to(dtype)

        def rotate() -> tuple[torch.Tensor]:
            out = x2d.new_zeros(x2d.shape[0], out_features)
            x_shards = x2d.split_with_sizes(layout.sizes, 1)

            def during(step: int, buffer: torch.Tensor) -> None:
                shard = ring.weight_shards[step]
                if layout.sizes[shard]:
                    out.addmm_(x_shards[shard], message.views(buffer, shard)[0])

            layer.driver.forward(message, during, [weight])
            return (out,)

        (out,) = kept_or_run(layer, rotate)
        ctx.save_for_backward(x2d, weight)
        ctx.layer, ctx.full_shape, ctx.x_shape, ctx.x_dtype, ctx.dtype = layer, full_shape, x.shape, x.dtype, dtype
        return out.view(*x.shape[:-1], out_features)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        x2d, weight = ctx.saved_tensors
        layer = ctx.layer
        ring = layer.ring
        in_features, out_features = ctx.full_shape
        dtype = ctx.dtype
        layout = ring.layout(in_features)
        need_x, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[3]
        dy = grad_out.reshape(-1, out_features).to(dtype)
        weight_segments = [segment(layout, weight.shape[1:], dtype)] if need_x else []
        grad_segments = [segment(layout, weight.shape[1:], layer.precision.reduce_dtype(weight.dtype))] if need_weight else []
        message = layer.ring.buffers.message_of(tuple(weight_segments + grad_segments))
        grad_x = torch.zeros_like(x2d) if need_x else None

        def pack_weights(views: list[torch.Tensor]) -> None:
            views[0].copy_(weight)

        grad_x_shards = grad_x.split_with_sizes(layout.sizes, 1) if need_x else None
        x_shards_t = x2d.t().split_with_sizes(layout.sizes, 0) if need_weight else None

        def use_weights(shard: int, views: Views) -> None:
            if layout.sizes[shard]:
                grad_x_shards[shard].addmm_(dy, views.derived(("t", 0), lambda views: views[0].t()))

        def contribute(shard: int, views: Views) -> None:
            write_product(views[0], x_shards_t[shard], dy)

        keys = [(id(layer), "weight")] if need_weight else []
        reduced = ring_backward(layer, message, len(weight_segments), keys, RingWeights(pack_weights, use_weights), DenseContribution(contribute))
        grad_weight = None if reduced is None else reduced[0].to(weight.dtype)
        if grad_x is not None:
            grad_x = grad_x.view(*ctx.x_shape).to(ctx.x_dtype)
        return grad_x, None, None, grad_weight


def run_linear_group(layer: RingLayer, modules: list[nn.Module], input: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The outputs of ``modules`` (ring Linears of one rsdp module) on one input, in one ring."""
    params = []
    for module in modules:
        # Read from ``_parameters``, not as attributes: each is ``nn.Module.__getattr__``, a Python call
        # per name, Linear and pass. The bias is None for most (checked here: two calls less).
        weight, bias = module._parameters["weight"], module._parameters["bias"]
        params += [local_shard(weight, module, "weight", layer), bias if bias is None else local_shard(bias, module, "bias", layer)]
    members = tuple([LinearMember(module.out_features, id(module)) for module in modules])
    return RingLinearFunction.apply(input, layer, members, *params)


class RingLinear:
    """Mixed into an ``nn.Linear`` (by class swap) whose weight rotates on the ring: ``_rsdp_ring`` is its
    ring layer, ``_rsdp_fusion`` its rsdp module's ``SharedInputFusion`` (``_fusion.py``), which runs
    its ring, alone or with the Linears that share its input."""

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
        weight = sharded(self._parameters["weight"], self, "weight")  # not ``self.weight``: a Python call less
        if not input.is_floating_point():
            raise TypeError(f"rsdp {type(self).__qualname__}: input must be floating point, got {input.dtype}")
        if input.dim() == 0 or input.shape[-1] != self.in_features:
            raise ValueError(
                f"rsdp {type(self).__qualname__}: input of shape {tuple(input.shape)} does not end in "
                f"in_features={self.in_features}"
            )
        check_device(input, weight, self)
        return self._rsdp_fusion.linear(self, input)
