"""The Embedding ring: the table's rows (the vocabulary) split over the ring.

Forward: the table rotates; at each step every token's row is selected from the shard held (a block
on a ring of groups: the same code over ``ring.layout``'s owners) with a precomputed ``[W, N]`` mask and a clamped row index (``_shard_selection``). Backward needs no weights:
each rank adds its tokens' gradient rows (``index_add_``) into the travelling partial of each shard, a
sparse contribution (``_ring_function.SparseContribution``). Tokens equal to ``padding_idx`` contribute
no gradient.

Pitfalls:
- Nothing on the ring path reads a device value on the host: rows are selected with masks, never
  ``nonzero()``, and indices are validated on the device. Each rank puts its "some index is out of
  range" byte into its first message, and every rank ORs together the bytes of the shards it holds, so
  every rank raises after the last step, not one (``torch._assert_async``; a device-side assert on CUDA).
- ``max_norm``, ``scale_grad_by_freq`` and ``sparse`` need the whole table or global counts: such an
  Embedding is refused at ``rsdp_shard`` (``ring_mixin_for``).
"""

import math

import torch
from torch.autograd.function import once_differentiable

from .._compat import assert_async
from ._checkpoint import kept_or_run
from ._param import ShardLayout
from ._ring_function import RingLayer, SparseContribution, check_device, local_shard, ring_backward
from ._wire import segment


class RingEmbeddingFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, indices, weight, layer: RingLayer, num_embeddings: int, padding_idx):
        ring = layer.ring
        dtype = layer.precision.compute_dtype(weight.dtype)
        layout = ring.layout(num_embeddings)
        # The table's rows, and one byte per rank: "this rank saw an index out of range".
        message = layer.ring.buffers.message_of(
            (segment(layout, weight.shape[1:], dtype), segment(ring.layout(ring.size), torch.Size(), torch.uint8))
        )
        flat_indices = indices.reshape(-1)

        def rotate() -> tuple[torch.Tensor]:
            out_of_range = ((flat_indices < 0) | (flat_indices >= num_embeddings)).any()
            selects, rows_in = _shard_selection(flat_indices, layout, None)
            out = torch.zeros(*indices.shape, *weight.shape[1:], dtype=dtype, device=weight.device)
            out2d = out.view(flat_indices.numel(), math.prod(weight.shape[1:]))
            scratch = torch.empty_like(out2d)
            seen = torch.zeros(ring.group_size, dtype=torch.uint8, device=weight.device)  # the flags of the shards held

            def during(step: int, buffer: torch.Tensor) -> None:
                shard = ring.weight_shards[step]
                rows, flags = message.views(buffer, shard)
                seen.bitwise_or_(flags)
                if layout.sizes[shard]:
                    torch.index_select(rows.reshape(rows.shape[0], -1), 0, rows_in[shard], out=scratch)
                    out2d.add_(scratch.masked_fill_(~selects[shard].unsqueeze(1), 0))

            # The flag is known only once called: not prefetchable.
            layer.driver.forward(message, during, [weight, out_of_range], prefetchable=False)
            assert_async(
                seen.amax() == 0,
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
        ring = layer.ring
        reduce_dtype = layer.precision.reduce_dtype(ctx.weight_dtype)
        layout = ring.layout(ctx.num_embeddings)
        message = layer.ring.buffers.message_of((segment(layout, ctx.trailing, reduce_dtype),))
        selects, rows_in = _shard_selection(flat_indices, layout, ctx.padding_idx)
        dy = grad_out.reshape(flat_indices.numel(), math.prod(ctx.trailing))
        masked = torch.empty(dy.shape, dtype=reduce_dtype, device=dy.device)

        def add_contribution(shard: int, views: list[torch.Tensor]) -> None:
            (rows,) = views
            if layout.sizes[shard]:
                masked.copy_(dy).masked_fill_(~selects[shard].unsqueeze(1), 0)
                rows.view(rows.shape[0], dy.shape[1]).index_add_(0, rows_in[shard], masked)

        reduced = ring_backward(layer, message, 0, [(id(layer), "weight")], None, SparseContribution(add_contribution))
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


class RingEmbedding:
    """Mixed into an ``nn.Embedding`` (by class swap) whose rows rotate on the ring."""

    _rsdp_ring: RingLayer

    @torch.compiler.disable
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = local_shard(self.weight, self, "weight", self._rsdp_ring)
        if input.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"rsdp {type(self).__qualname__}: indices must be int32 or int64, got {input.dtype}")
        check_device(input, weight, self)
        return RingEmbeddingFunction.apply(input, weight, self._rsdp_ring, self.num_embeddings, self.padding_idx)
