"""One sharded parameter: how its rows split over the ranks, and how shards are packed for the wire.

A parameter of ``n`` rows is split like ``torch.chunk`` (and like DTensor's ``Shard(0)``): every rank's
shard is padded to ``chunk = ceil(n / world)`` rows, so the last ranks may be short or empty. Only the
unpadded rows are stored (the local tensor of the DTensor parameter); padding exists on the wire alone,
because every rank must send and receive the same number of elements at each ring step.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .._compat import DTensor, Replicate, Shard


@dataclass(frozen=True)
class ShardLayout:
    """How ``rows`` rows split over ``world`` ranks, torch.chunk-style."""

    rows: int
    world: int

    @property
    def chunk(self) -> int:
        return math.ceil(self.rows / self.world)

    def start(self, shard: int) -> int:
        return min(shard * self.chunk, self.rows)

    def stop(self, shard: int) -> int:
        return min((shard + 1) * self.chunk, self.rows)

    def rows_of(self, shard: int) -> int:
        return self.stop(shard) - self.start(shard)


def placements_for(mesh: DeviceMesh) -> tuple:
    """``Shard(0)`` on a 1-D mesh; replicated across groups and sharded within them on a 2-D one (HSDP)."""
    return (Shard(0),) if mesh.ndim == 1 else (Replicate(), Shard(0))


def shard_parameter(param: nn.Parameter, mesh: DeviceMesh, device: torch.device) -> nn.Parameter:
    """This rank's rows of ``param`` as an ``nn.Parameter(DTensor)``, with no communication.

    Every rank holds the same full initial value (as with FSDP2), so each keeps its own slice. A
    parameter on the meta device stays on meta; ``to_empty`` + initialisation fill it later.
    """
    shard_dim_rank = mesh.get_local_rank(mesh.ndim - 1)
    layout = ShardLayout(param.shape[0], mesh.size(mesh.ndim - 1))
    rows = slice(layout.start(shard_dim_rank), layout.stop(shard_dim_rank))
    if param.is_meta:
        local = torch.empty_like(param[rows], device="meta")
    else:
        local = param.detach()[rows].to(device, copy=True).contiguous()
    sharded = DTensor.from_local(
        local,
        mesh,
        placements_for(mesh),
        run_check=False,
        shape=param.shape,
        stride=torch.empty(param.shape, device="meta").stride(),
    )
    return nn.Parameter(sharded, requires_grad=param.requires_grad)


class PackedShards:
    """The wire format of one ring step: shard ``s`` of several tensors sharing dim 0, in one flat buffer.

    A Linear's weight and bias travel together as ``[weight rows | bias rows]``, each padded to
    ``chunk`` rows, so a ring step is one message rather than one per tensor.
    """

    def __init__(self, layout: ShardLayout, trailing_shapes: list[torch.Size]):
        self.layout = layout
        self.trailing_shapes = trailing_shapes
        self._inner = [math.prod(shape) for shape in trailing_shapes]
        self._offsets = [0]
        for inner in self._inner:
            self._offsets.append(self._offsets[-1] + layout.chunk * inner)

    @property
    def numel(self) -> int:
        return self._offsets[-1]

    def pack(self, shards: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """This rank's shards as one padded buffer; no copy when a single full shard already fits."""
        only = shards[0]
        if (
            len(shards) == 1
            and only.dtype == dtype
            and only.is_contiguous()
            and only.numel() == self.numel
        ):
            return only.view(-1)
        flat = torch.empty(self.numel, dtype=dtype, device=only.device)
        for view, shard in zip(self.views(flat, shards[0].shape[0]), shards):
            view.copy_(shard)
        return flat

    def views(self, flat: torch.Tensor, rows: int) -> list[torch.Tensor]:
        """The first ``rows`` rows of each packed tensor, shaped ``[rows, *trailing]``."""
        return [
            flat[offset : offset + rows * inner].view(rows, *shape)
            for offset, inner, shape in zip(self._offsets, self._inner, self.trailing_shapes)
        ]

    def shard_views(self, flat: torch.Tensor, shard: int) -> list[torch.Tensor]:
        return self.views(flat, self.layout.rows_of(shard))
