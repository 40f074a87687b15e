"""Ring autograd functions for Linear and Embedding, and the module classes that call them.

Each function receives the *local* shard (``param.to_local()``) and returns the gradient of that shard,
so autograd accumulates micro-batches into the ``Shard(0)`` DTensor ``.grad`` by itself, and only the
local shard is saved for backward. See design.md §1 for the algorithm.
"""

import torch
import torch.nn as nn
from torch.autograd.function import once_differentiable

from .._compat import DTensor
from ._param import PackedShards, ShardLayout
from ._ring import Phase


class RingLayer:
    """What one ring-rotated module needs at run time: the rsdp state whose settings (mesh, mixed
    precision, gradient reduction) it follows, its message tags, and the gradients it accumulated
    while gradient synchronisation was off."""

    def __init__(self, state, tags: dict[Phase, int]):
        self.state = state
        self.tags = tags
        self.unsynced: torch.Tensor | None = None

    def unsynced_for(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """One full-size gradient, ``[world, padded shard]``: the memory cost of skipping sync."""
        if self.unsynced is None:
            self.unsynced = torch.zeros(self.state.ring.size, numel, dtype=dtype, device=device)
        return self.unsynced


def _write_product(dst: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
    """``dst = a @ b`` when ``first``, else ``dst += a @ b``, in ``dst``'s dtype."""
    if dst.dtype == a.dtype:
        if first:
            torch.mm(a, b, out=dst)
        else:
            dst.addmm_(a, b)
    else:
        _write(dst, a @ b, first)


def _write(dst: torch.Tensor, value: torch.Tensor, first: bool) -> None:
    if first:
        dst.copy_(value)
    else:
        dst.add_(value)


def _reduce_to_owner(layer: RingLayer, packing: PackedShards, contribute, rotate_payload, consume, dtype):
    """The gradient half of a ring backward, shared by Linear and Embedding.

    With synchronisation on, partials travel the ring (fused with the weight rotation for the input
    gradient, when there is one) and the owner's reduced shard is returned. With it off, every shard's
    contribution is added to the layer's local full-size accumulator, which the next synchronised
    backward feeds into the ring; None is returned so ``.grad`` stays untouched, as with FSDP2.
    """
    state, ring = layer.state, layer.state.ring
    device = state.device
    if not state.requires_gradient_sync:
        unsynced = layer.unsynced_for(packing.numel, dtype, device)
        for shard in range(ring.size):
            contribute(shard, unsynced[shard], False)
        if rotate_payload is not None:
            ring.rotate(rotate_payload, layer.tags[Phase.BACKWARD_WEIGHTS], consume)
        return None

    unsynced, layer.unsynced = layer.unsynced, None

    def contribute_with_unsynced(shard: int, partial: torch.Tensor, first: bool) -> None:
        contribute(shard, partial, first)
        if unsynced is not None:
            partial.add_(unsynced[shard])

    partial = ring.rotate_and_reduce(
        rotate_payload,
        consume,
        contribute_with_unsynced,
        lambda: torch.empty(packing.numel, dtype=dtype, device=device),
        layer.tags,
    )
    return state.finish_gradient(partial)


class _RingLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, layer: RingLayer, out_features: int):
        state, ring = layer.state, layer.state.ring
        dtype = state.compute_dtype(weight.dtype)
        layout = ShardLayout(out_features, ring.size)
        shards = [weight] if bias is None else [weight, bias]
        packing = PackedShards(layout, [shard.shape[1:] for shard in shards])
        x2d = x.reshape(-1, x.shape[-1]).to(dtype)
        out = x2d.new_empty(x2d.shape[0], out_features)

        def consume(shard: int, flat: torch.Tensor) -> None:
            start, stop = layout.start(shard), layout.stop(shard)
            if start == stop:
                return
            views = packing.shard_views(flat, shard)
            # A column block of a row-major matrix is a valid BLAS output (leading dimension
            # out_features), so the product is written in place, with no temporary.
            if bias is None:
                torch.mm(x2d, views[0].t(), out=out[:, start:stop])
            else:
                torch.addmm(views[1], x2d, views[0].t(), out=out[:, start:stop])

        ring.rotate(packing.pack(shards, dtype), layer.tags[Phase.FORWARD_WEIGHTS], consume)
        ctx.save_for_backward(x2d, weight)
        ctx.layer, ctx.out_features, ctx.has_bias = layer, out_features, bias is not None
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        return out.view(*x.shape[:-1], out_features)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        x2d, weight = ctx.saved_tensors
        layer = ctx.layer
        state, ring = layer.state, layer.state.ring
        need_x, need_weight, need_bias = ctx.needs_input_grad[:3]
        need_bias = need_bias and ctx.has_bias
        dtype = state.compute_dtype(weight.dtype)
        layout = ShardLayout(ctx.out_features, ring.size)
        dy = grad_out.reshape(-1, ctx.out_features).to(dtype)

        grad_x = torch.zeros_like(x2d) if need_x else None
        weight_packing = PackedShards(layout, [weight.shape[1:]])
        payload = weight_packing.pack([weight], dtype) if need_x else None

        def consume(shard: int, flat: torch.Tensor) -> None:
            start, stop = layout.start(shard), layout.stop(shard)
            if start < stop:
                (w,) = weight_packing.shard_views(flat, shard)
                grad_x.addmm_(dy[:, start:stop], w)

        grad_weight = grad_bias = None
        if need_weight or need_bias:
            trailing = ([weight.shape[1:]] if need_weight else []) + ([torch.Size()] if need_bias else [])
            grad_packing = PackedShards(layout, trailing)

            def contribute(shard: int, partial: torch.Tensor, first: bool) -> None:
                views = iter(grad_packing.shard_views(partial, shard))
                dy_shard = dy[:, layout.start(shard) : layout.stop(shard)]
                if need_weight:
                    _write_product(next(views), dy_shard.t(), x2d, first)
                if need_bias:
                    _write(next(views), dy_shard.sum(0), first)

            reduced = _reduce_to_owner(
                layer, grad_packing, contribute, payload, consume, state.reduce_dtype(weight.dtype)
            )
            if reduced is not None:
                views = iter(grad_packing.shard_views(reduced, ring.rank))
                if need_weight:
                    grad_weight = next(views).to(weight.dtype)
                if need_bias:
                    grad_bias = next(views).to(weight.dtype)
        elif need_x:
            ring.rotate(payload, layer.tags[Phase.BACKWARD_WEIGHTS], consume)

        if grad_x is not None:
            grad_x = grad_x.view(ctx.x_shape).to(ctx.x_dtype)
        return grad_x, grad_weight, grad_bias, None, None


class _RingEmbeddingFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, indices, weight, layer: RingLayer, num_embeddings: int, padding_idx):
        state, ring = layer.state, layer.state.ring
        dtype = state.compute_dtype(weight.dtype)
        layout = ShardLayout(num_embeddings, ring.size)
        packing = PackedShards(layout, [weight.shape[1:]])
        flat_indices = indices.reshape(-1)
        if flat_indices.numel() and (flat_indices.min() < 0 or flat_indices.max() >= num_embeddings):
            raise IndexError(
                f"rsdp Embedding: index out of range: indices span [{int(flat_indices.min())}, "
                f"{int(flat_indices.max())}] but num_embeddings is {num_embeddings}"
            )
        owners = flat_indices.div(layout.chunk, rounding_mode="floor")
        out = torch.empty(flat_indices.numel(), *weight.shape[1:], dtype=dtype, device=weight.device)

        def consume(shard: int, flat: torch.Tensor) -> None:
            positions = (owners == shard).nonzero().squeeze(1)
            if positions.numel():
                (rows,) = packing.shard_views(flat, shard)
                out.index_copy_(0, positions, rows.index_select(0, flat_indices[positions] - layout.start(shard)))

        ring.rotate(packing.pack([weight], dtype), layer.tags[Phase.FORWARD_WEIGHTS], consume)
        ctx.save_for_backward(flat_indices)
        ctx.layer, ctx.num_embeddings, ctx.padding_idx = layer, num_embeddings, padding_idx
        ctx.weight_dtype, ctx.trailing = weight.dtype, weight.shape[1:]
        return out.view(*indices.shape, *weight.shape[1:])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        if not ctx.needs_input_grad[1]:
            return None, None, None, None, None
        (flat_indices,) = ctx.saved_tensors
        layer = ctx.layer
        ring = layer.state.ring
        layout = ShardLayout(ctx.num_embeddings, ring.size)
        packing = PackedShards(layout, [ctx.trailing])
        dy = grad_out.reshape(flat_indices.numel(), -1)
        owners = flat_indices.div(layout.chunk, rounding_mode="floor")
        if ctx.padding_idx is not None:
            owners = owners.masked_fill(flat_indices == ctx.padding_idx, -1)

        def contribute(shard: int, partial: torch.Tensor, first: bool) -> None:
            (rows,) = packing.shard_views(partial, shard)
            if first:
                rows.zero_()
            positions = (owners == shard).nonzero().squeeze(1)
            if positions.numel():
                rows.view(rows.shape[0], -1).index_add_(
                    0, flat_indices[positions] - layout.start(shard), dy[positions].to(rows.dtype)
                )

        reduced = _reduce_to_owner(
            layer, packing, contribute, None, None, layer.state.reduce_dtype(ctx.weight_dtype)
        )
        grad_weight = None
        if reduced is not None:
            (grad_weight,) = packing.shard_views(reduced, ring.rank)
            grad_weight = grad_weight.to(ctx.weight_dtype)
        return None, grad_weight, None, None, None


def _local(param: nn.Parameter | None, module: nn.Module, name: str) -> torch.Tensor | None:
    if param is None:
        return None
    if not isinstance(param, DTensor):
        raise RuntimeError(
            f"rsdp: {type(module).__name__}.{name} is no longer the sharded DTensor parameter that "
            "rsdp_shard installed (was it reassigned?). Assign new values in place, e.g. "
            "`with torch.no_grad(): param.copy_(value)`, or load them with load_state_dict."
        )
    return param.to_local()


# The ring is a loop of point-to-point messages, which torch.compile cannot capture: each ring layer
# is an explicit graph break, and the code around it compiles as usual.


def _check_device(input: torch.Tensor, weight: torch.Tensor, module: nn.Module) -> None:
    if input.device != weight.device:
        raise ValueError(
            f"rsdp {type(module).__name__}: input is on {input.device} but the parameters are on "
            f"{weight.device}; move the input there first (e.g. `batch.to('{weight.device}')`)."
        )


class RingLinear:
    """Mixed into an ``nn.Linear`` (by class swap) whose weight rotates on the ring."""

    _rsdp_ring: RingLayer

    @torch.compiler.disable
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        # Checked before the ring starts: a rank that failed half-way through a ring step would leave
        # its peers waiting for the process group's timeout.
        weight = _local(self.weight, self, "weight")
        if not input.is_floating_point():
            raise TypeError(f"rsdp {type(self).__name__}: input must be floating point, got {input.dtype}")
        if input.dim() == 0 or input.shape[-1] != self.in_features:
            raise ValueError(
                f"rsdp {type(self).__name__}: input of shape {tuple(input.shape)} does not end in "
                f"in_features={self.in_features}"
            )
        _check_device(input, weight, self)
        return _RingLinearFunction.apply(
            input,
            weight,
            _local(self.bias, self, "bias"),
            self._rsdp_ring,
            self.out_features,
        )


class RingEmbedding:
    """Mixed into an ``nn.Embedding`` (by class swap) whose rows rotate on the ring."""

    _rsdp_ring: RingLayer

    @torch.compiler.disable
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = _local(self.weight, self, "weight")
        if input.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"rsdp {type(self).__name__}: indices must be int32 or int64, got {input.dtype}")
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

