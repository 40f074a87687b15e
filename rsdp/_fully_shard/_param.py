"""One sharded parameter: how its rows split over the ranks, and how shards are packed for the wire.

A parameter of ``n`` rows is split like ``torch.chunk`` (and like DTensor's ``Shard(0)``): every rank's
shard is padded to ``chunk = ceil(n / world)`` rows, so the last ranks may be short or empty. Only the
unpadded rows are stored (the local tensor of the DTensor parameter); padding exists on the wire alone,
because every rank must send and receive the same number of elements at each ring step.
"""

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .._compat import DTensor, Replicate, Shard, outside_inference_mode


@dataclass(frozen=True)
class ShardLayout:
    """How ``rows`` rows split over ``world`` ranks, torch.chunk-style."""

    rows: int
    world: int

    @functools.cached_property
    def chunk(self) -> int:
        return math.ceil(self.rows / self.world)

    @functools.cached_property
    def _bounds(self) -> tuple[tuple[int, int], ...]:
        # Looked up by every ring step, for every segment: computed once per layout.
        return tuple((min(s * self.chunk, self.rows), min((s + 1) * self.chunk, self.rows)) for s in range(self.world))

    @functools.cached_property
    def _slices(self) -> tuple[slice, ...]:
        return tuple(slice(start, stop) for start, stop in self._bounds)

    def row_slice(self, shard: int) -> slice:
        """Shard ``shard``'s rows, as a slice."""
        return self._slices[shard]

    def start(self, shard: int) -> int:
        return self._bounds[shard][0]

    def stop(self, shard: int) -> int:
        return self._bounds[shard][1]

    def rows_of(self, shard: int) -> int:
        start, stop = self._bounds[shard]
        return stop - start


@functools.lru_cache(maxsize=None)
def shard_layout(rows: int, world: int) -> ShardLayout:
    """The one ``ShardLayout`` of ``rows`` rows over ``world`` ranks, so that ring steps, which look up
    its bounds, find them computed (a fresh layout per call computes them again)."""
    return ShardLayout(rows, world)


def placements_for(mesh: DeviceMesh, dim: int = 0) -> tuple:
    """``Shard(dim)`` on a 1-D mesh; replicated across groups and sharded within them on a 2-D one (HSDP)."""
    return (Shard(dim),) if mesh.ndim == 1 else (Replicate(), Shard(dim))


def shard_parameter(param: nn.Parameter, mesh: DeviceMesh, device: torch.device, dim: int = 0) -> nn.Parameter:
    """This rank's rows (``dim=0``; columns for ``dim=1``, a ring plan's row-split Linear) of ``param``
    as an ``nn.Parameter(DTensor)``, with no communication.

    Every rank holds the same full initial value (as with FSDP2), so each keeps its own slice. A
    parameter on the meta device stays on meta; ``to_empty`` + initialisation fill it later.
    """
    shard_dim_rank = mesh.get_local_rank(mesh.ndim - 1)
    layout = ShardLayout(param.shape[dim], mesh.size(mesh.ndim - 1))
    index = (slice(None),) * dim + (slice(layout.start(shard_dim_rank), layout.stop(shard_dim_rank)),)
    if param.is_meta:
        local = torch.empty_like(param[index], device="meta")
    else:
        local = param.detach()[index].to(device, copy=True).contiguous()
    sharded = DTensor.from_local(
        local,
        mesh,
        placements_for(mesh, dim),
        run_check=False,
        shape=param.shape,
        stride=torch.empty(param.shape, device="meta").stride(),
    )
    return nn.Parameter(sharded, requires_grad=param.requires_grad)


@dataclass(frozen=True)
class Segment:
    """One tensor in a ring message: its row split, the shape of one row, and its dtype on the wire."""

    layout: ShardLayout
    trailing: torch.Size
    dtype: torch.dtype

    @property
    def padded_nbytes(self) -> int:
        return self.layout.chunk * math.prod(self.trailing) * self.dtype.itemsize


class Message:
    """The wire format of one ring step: shard ``s`` of several tensors in one flat byte buffer.

    A message is ``[segment 0 | segment 1 | ...]``, each segment holding the rows of one tensor's shard
    ``s`` padded to that tensor's ``chunk`` rows, in its own dtype. The weights and biases of Linears
    that share an input travel as one message, and in backward the weights travel together with the
    gradient partials (in ``reduce_dtype``), so one ring step is one message whatever it carries.
    Padding rows are never read: views cover the shard's real rows only. One per layout and model:
    made by its ``RingBuffers.message_of``, whose buffers' views it caches.
    """

    def __init__(self, segments: tuple[Segment, ...], buffers):
        self.segments = segments
        self._buffers = buffers  # the ``RingBuffers`` whose views it caches (and which made it)
        self.offsets = []
        offset = 0
        for segment in segments:
            # Aligned to the segment's element size only, for its typed view: wider alignment would
            # put gap bytes on the wire.
            offset = -(-offset // segment.dtype.itemsize) * segment.dtype.itemsize
            self.offsets.append(offset)
            offset += segment.padded_nbytes
        self.nbytes = offset
        # Views of the ring's own buffers, which outlive a step:
        # ((buffer index, offset), shard, first, transposed) -> views.
        self._ring_views: dict[tuple, list[torch.Tensor]] = {}
        self._generation = buffers.generation

    def views(self, buffer: torch.Tensor, shard: int, first: int = 0, transposed: tuple[bool, ...] = ()) -> list[torch.Tensor]:
        """Segments ``first:`` of ``buffer`` (a byte tensor holding one message) as shard ``shard``'s
        rows, shaped ``[rows, *trailing]``; those that ``transposed`` flags (one flag per segment from
        ``first`` on) transposed, as a GEMM takes a colwise weight.

        Views of the ring's buffers are made once and reused (making them is most of a small ring
        step's host time); other buffers get fresh views, since their memory may be reused."""
        place = self._buffers.place_of(buffer)
        if place is None:
            return self._make_views(buffer, shard, first, transposed)
        if self._generation != self._buffers.generation:
            self._ring_views.clear()
            self._generation = self._buffers.generation
        key = (place, shard, first, transposed)
        views = self._ring_views.get(key)
        if views is None:
            with outside_inference_mode():
                views = self._ring_views[key] = self._make_views(buffer, shard, first, transposed)
        return views

    def _make_views(self, buffer: torch.Tensor, shard: int, first: int, transposed: tuple[bool, ...] = ()) -> list[torch.Tensor]:
        views = []
        for index, (segment, offset) in enumerate(zip(self.segments[first:], self.offsets[first:])):
            rows = segment.layout.rows_of(shard)
            nbytes = rows * math.prod(segment.trailing) * segment.dtype.itemsize
            view = buffer[offset : offset + nbytes].view(segment.dtype).view(rows, *segment.trailing)
            views.append(view.t() if index < len(transposed) and transposed[index] else view)
        return views

    def tail(self, first: int) -> "Message":
        """The message made of segments ``first:``, laid out as they are here (offsets shifted)."""
        return self._buffers.message_of(self.segments[first:])

    def pack(self, buffer: torch.Tensor, shard: int, tensors: list[torch.Tensor], first: int = 0) -> None:
        """Write ``tensors`` (shard ``shard`` of segments ``first:``) into ``buffer``."""
        for view, tensor in zip(self.views(buffer, shard, first), tensors):
            view.copy_(tensor)

    def as_is(self, tensors: list[torch.Tensor]) -> torch.Tensor | None:
        """``tensors`` themselves as the message, with no copy, when a single tensor is exactly one
        full, contiguous segment in the wire dtype; else None."""
        if len(tensors) != 1 or len(self.segments) != 1:
            return None
        (tensor,), (segment,) = tensors, self.segments
        if tensor.dtype != segment.dtype or not tensor.is_contiguous():
            return None
        if tensor.numel() * tensor.element_size() != self.nbytes:
            return None
        return tensor.view(-1).view(torch.uint8)
