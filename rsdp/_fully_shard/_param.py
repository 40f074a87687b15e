"""One sharded parameter: how its rows split over the ranks, and this rank's shard of it.

A parameter of ``n`` rows is split like ``torch.chunk`` (and like DTensor's ``Shard(0)``): every rank's
shard is padded to ``chunk = ceil(n / world)`` rows, so the last ranks may be short or empty. Only the
unpadded rows are stored (the local tensor of the DTensor parameter); padding exists on the wire alone,
because every rank must send and receive the same number of elements at each ring step (``_wire.py``).

On a ring of groups (``_ring.py``) a ring layer computes with *blocks*: block ``T`` is the union of the
shards of the ``group`` consecutive ranks ``T*group ...``. Since only trailing shards are short, a
block's real rows are contiguous, and a block is a shard of a layout of ``world / group`` owners whose
chunk is ``group`` shard chunks (``shard_layout(rows, owners, group)``): a ring layer's code is the
same on a ring of ranks and on a ring of groups.

``Precision`` is the dtypes a module's ring layers compute and reduce in (its mixed-precision policy),
handed to each ring layer and gradient store of the module when they are made.
"""

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .._compat import DTensor, Replicate, Shard, autocast_dtype


@dataclass(frozen=True, eq=False)
class ShardLayout:
    """How ``rows`` rows split over ``world`` owners, torch.chunk-style; an owner is a rank, or a group of
    ``group`` consecutive ranks whose block is their shards together (padded to ``group`` rank chunks).
    Made by ``shard_layout`` only, one per (rows, world, group), so it compares and hashes by identity:
    layouts key the messages' caches, looked up at every ring, and a generated ``__hash__`` would be a
    Python call each time."""

    rows: int
    world: int
    group: int = 1

    @functools.cached_property
    def chunk(self) -> int:
        return self.group * math.ceil(self.rows / (self.world * self.group))

    @functools.cached_property
    def members(self) -> "ShardLayout":
        """The layout of the ranks' own shards: ``world * group`` owners of one rank each."""
        return self if self.group == 1 else shard_layout(self.rows, self.world * self.group)

    @functools.cached_property
    def _bounds(self) -> tuple[tuple[int, int], ...]:
        # Looked up by every ring step, for every segment: computed once per layout.
        return tuple((min(s * self.chunk, self.rows), min((s + 1) * self.chunk, self.rows)) for s in range(self.world))

    @functools.cached_property
    def _slices(self) -> tuple[slice, ...]:
        return tuple(slice(start, stop) for start, stop in self._bounds)

    @functools.cached_property
    def sizes(self) -> list[int]:
        """Every shard's row count, in shard order: what ``split`` takes to cut all shards in one op, and
        what a ring step indexes (``rows_of`` costs a Python call)."""
        return [stop - start for start, stop in self._bounds]

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
def shard_layout(rows: int, world: int, group: int = 1) -> ShardLayout:
    """The one ``ShardLayout`` of ``rows`` rows over ``world`` owners of ``group`` ranks each, so that
    ring steps, which look up its bounds, find them computed (a fresh layout per call computes them again)."""
    return ShardLayout(rows, world, group)


@functools.lru_cache(maxsize=None)
def owners_layout(owners: int, group: int, rows: int) -> ShardLayout:
    """``shard_layout(rows, owners, group)``, its arguments in the order a ring binds them
    (``Ring.layout``): a cache hit is then no Python call, and ring layers look layouts up at every pass."""
    return shard_layout(rows, owners, group)


class Precision:
    """The dtypes one rsdp module's parameters compute and reduce in, from its ``MixedPrecisionPolicy``
    (``param_dtype``, ``reduce_dtype``; unset: the parameter's own), on ``device_type``."""

    def __init__(self, param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None, device_type: str):
        self.param_dtype, self.reduce, self.device_type = param_dtype, reduce_dtype, device_type

    def compute_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        return self.param_dtype or param_dtype

    def matmul_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        """The dtype of a ring layer's matrix products, and so of its weights on the wire: the compute
        dtype, or the one ``torch.autocast`` casts a matmul's operands to where it is on (as for stock
        layers; it leaves float64 alone). Embedding lookups are not autocast: they use ``compute_dtype``."""
        dtype = self.param_dtype or param_dtype
        cast = autocast_dtype(self.device_type)
        return cast if cast is not None and dtype != torch.float64 else dtype

    def reduce_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        return self.reduce or self.param_dtype or param_dtype


def placements_for(mesh: DeviceMesh, dim: int = 0) -> tuple:
    """``Shard(dim)`` on a 1-D mesh; replicated across groups and sharded within them on a 2-D one (HSDP)."""
    return (Shard(dim),) if mesh.ndim == 1 else (Replicate(), Shard(dim))


def shard_parameter(param: nn.Parameter, mesh: DeviceMesh, device: torch.device, dim: int = 0) -> nn.Parameter:
    """This rank's rows (``dim=0``; columns for ``dim=1``, a ring plan's row-split Linear) of ``param``
    as an ``nn.Parameter(DTensor)``, with no communication.

    Every rank holds the same full initial value (as with FSDP2; ``rsdp_shard`` checks it first,
    ``_ddp_habits.py``), so each keeps its own slice. A parameter on the meta device stays on meta;
    ``to_empty`` + initialisation fill it later.
    """
    shard_dim_rank = mesh.get_local_rank(mesh.ndim - 1)
    layout = shard_layout(param.shape[dim], mesh.size(mesh.ndim - 1))
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
