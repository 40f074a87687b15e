"""The parameters of an rsdp module that do not rotate: gathered whole for its forward, like FSDP2.

Norm weights, biases of other layers and free ``nn.Parameter``s are used whole by ops that have no
ring form, and they are small next to the Linear and Embedding weights. They stay ``Shard(0)`` at rest
(so the optimizer state is sharded too); the module's forward all-gathers them in one flat collective
and its backward reduce-scatters their gradients in one, over the shard dimension of the mesh.
"""

import math

import torch
import torch.nn as nn
from torch.autograd.function import once_differentiable

from .._compat import all_gather_flat, reduce_scatter_flat
from ._param import ShardLayout


class GatheredParams:
    """The non-rotating parameters of one rsdp module, laid out as one padded flat segment per rank."""

    def __init__(self, state, params: list[nn.Parameter]):
        self.state = state
        self.params = params
        self.layouts = [ShardLayout(p.shape[0], state.ring.size) for p in params]
        self.trailing = [p.shape[1:] for p in params]
        self._inner = [math.prod(shape) for shape in self.trailing]
        self._offsets = [0]
        for layout, inner in zip(self.layouts, self._inner):
            self._offsets.append(self._offsets[-1] + layout.chunk * inner)
        self.unsynced: torch.Tensor | None = None

    @property
    def segment_numel(self) -> int:
        return self._offsets[-1]

    def segment_view(self, flat: torch.Tensor, index: int, shard: int) -> torch.Tensor:
        """Shard ``shard`` of parameter ``index`` inside one rank's flat segment."""
        rows = self.layouts[index].rows_of(shard)
        offset = self._offsets[index]
        return flat[offset : offset + rows * self._inner[index]].view(rows, *self.trailing[index])

    def gather(self) -> list[torch.Tensor]:
        """The full parameters, connected to the local shards by autograd."""
        return list(_AllGatherParams.apply(self, *(p.to_local() for p in self.params)))


class _AllGatherParams(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gathered: GatheredParams, *local_shards):
        state, world = gathered.state, gathered.state.ring.size
        dtype = state.compute_dtype(local_shards[0].dtype)
        send = torch.empty(gathered.segment_numel, dtype=dtype, device=state.device)
        for index, shard in enumerate(local_shards):
            gathered.segment_view(send, index, state.ring.rank).copy_(shard)
        received = torch.empty(world, gathered.segment_numel, dtype=dtype, device=state.device)
        all_gather_flat(received.view(-1), send, group=state.ring.group)
        ctx.gathered = gathered
        ctx.orig_dtypes = [shard.dtype for shard in local_shards]
        return tuple(
            torch.cat([gathered.segment_view(received[s], index, s) for s in range(world)])
            for index in range(len(local_shards))
        )

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        gathered: GatheredParams = ctx.gathered
        state, world = gathered.state, gathered.state.ring.size
        if not any(ctx.needs_input_grad[1:]):
            return (None,) * (1 + len(grads))
        dtype = state.reduce_dtype(ctx.orig_dtypes[0])
        contributions = torch.zeros(world, gathered.segment_numel, dtype=dtype, device=state.device)
        for index, grad in enumerate(grads):
            if grad is None:
                continue
            layout = gathered.layouts[index]
            for s in range(world):
                gathered.segment_view(contributions[s], index, s).copy_(grad[layout.start(s) : layout.stop(s)])

        if not state.requires_gradient_sync:
            if gathered.unsynced is None:
                gathered.unsynced = contributions
            else:
                gathered.unsynced.add_(contributions)
            return (None,) * (1 + len(grads))
        if gathered.unsynced is not None:
            contributions.add_(gathered.unsynced)
            gathered.unsynced = None

        reduced = torch.empty(gathered.segment_numel, dtype=dtype, device=state.device)
        reduce_scatter_flat(reduced, contributions.view(-1), group=state.ring.group)
        reduced = state.finish_gradient(reduced)
        local_grads = [
            gathered.segment_view(reduced, index, state.ring.rank).to(orig_dtype)
            if needs_grad
            else None
            for index, (orig_dtype, needs_grad) in enumerate(zip(ctx.orig_dtypes, ctx.needs_input_grad[1:]))
        ]
        return (None, *local_grads)
