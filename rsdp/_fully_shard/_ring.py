"""The ring: which shard a rank holds at each step, who it talks to, and the double-buffered exchange.

Weight shards travel "down" (rank r receives from r+1 and sends to r-1), so at step k rank r holds
shard (r + k) mod W. Gradient partials travel "up" (r sends to r+1): the partial for shard t starts at
rank t+1 and reaches its owner t after W-1 hops, collecting every rank's contribution on the way.

Pitfalls this file exists to contain (design.md §3):
- ``P2POp`` peers are global ranks, so group ranks are translated once here.
- gloo matches messages on (peer, tag): with W = 2 both neighbours are one rank, so the weight and the
  partial streams of one backward need distinct tags. Every ring layer also gets its own tags, so that
  ranks that disagree about the order of layers fail loudly instead of exchanging the wrong tensors.
- NCCL ignores tags and needs every rank to issue P2P ops in the same order: ``exchange`` always issues
  sends and receives in the order of its arguments and has no data-dependent branches.
- Waiting twice on a completed gloo send blocks until the timeout, so each work is waited exactly once.
- On CUDA, ProcessGroupNCCL runs P2P on its own stream, orders it after the compute that produced the
  buffers, and ``wait()`` makes the compute stream wait for the received data.
"""

import enum
import itertools
from collections.abc import Callable

import torch
import torch.distributed as dist


class Direction(enum.Enum):
    WEIGHTS = "weights"  # r+1 -> r -> r-1
    PARTIALS = "partials"  # r-1 -> r -> r+1


class Phase(enum.IntEnum):
    FORWARD_WEIGHTS = 0
    BACKWARD_WEIGHTS = 1
    BACKWARD_PARTIALS = 2


_next_layer_id = itertools.count()


def new_layer_tags() -> dict[Phase, int]:
    """Tags for one ring layer; every rank numbers its layers in the order it shards them."""
    layer = next(_next_layer_id)
    return {phase: layer * len(Phase) + phase for phase in Phase}


class InFlight:
    """Sends and receives of one ring step; ``wait`` blocks until all of them are done, once."""

    def __init__(self, works: list):
        self._works = works

    def wait(self) -> None:
        works, self._works = self._works, []
        for work in works:
            work.wait()


class Ring:
    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._peer = {
            "down": dist.get_global_rank(group, (self.rank - 1) % self.size),
            "up": dist.get_global_rank(group, (self.rank + 1) % self.size),
        }

    def weight_shard_at(self, step: int) -> int:
        return (self.rank + step) % self.size

    def partial_shard_at(self, step: int) -> int:
        return (self.rank - 1 - step) % self.size

    def exchange(self, transfers: list[tuple[Direction, torch.Tensor, torch.Tensor, int]]) -> InFlight:
        """Start sending each ``send`` to the next rank of its direction and receiving ``recv`` from the
        previous one. Returns at once; the caller computes, then waits."""
        ops = []
        for direction, send, recv, tag in transfers:
            to, frm = ("down", "up") if direction is Direction.WEIGHTS else ("up", "down")
            ops.append(dist.P2POp(dist.isend, send, self._peer[to], self.group, tag))
            ops.append(dist.P2POp(dist.irecv, recv, self._peer[frm], self.group, tag))
        return InFlight(dist.batch_isend_irecv(ops) if ops else [])

    def rotate(self, payload: torch.Tensor, tag: int, consume: Callable[[int, torch.Tensor], None]) -> None:
        """Call ``consume(shard, buffer)`` for every shard, each while the next one is in flight.

        Besides its own ``payload`` a rank holds at most two shards: the one it computes with (and
        forwards) and the one it receives.
        """
        current = payload
        for step in range(self.size):
            in_flight = None
            if step + 1 < self.size:
                incoming = torch.empty_like(payload)
                in_flight = self.exchange([(Direction.WEIGHTS, current, incoming, tag)])
            consume(self.weight_shard_at(step), current)
            if in_flight is not None:
                in_flight.wait()
                current = incoming

    def rotate_and_reduce(
        self,
        payload: torch.Tensor | None,
        consume: Callable[[int, torch.Tensor], None],
        contribute: Callable[[int, torch.Tensor, bool], None],
        new_partial: Callable[[], torch.Tensor],
        tags: dict[Phase, int],
    ) -> torch.Tensor:
        """Backward: rotate the weights again (``consume`` computes the input gradient with each shard)
        while gradient partials travel to their owners (``contribute(shard, partial, first)`` adds this
        rank's share to the partial of ``shard``, or writes it when ``first``).

        Returns this rank's own shard of the gradient summed over the ring. A full-size gradient never
        exists: a rank holds two weight shards and two partials at a time.
        """
        weights = payload
        partial = new_partial()
        for step in range(self.size):
            contribute(self.partial_shard_at(step), partial, step == 0)
            in_flight = None
            if step + 1 < self.size:
                transfers = []
                if weights is not None:
                    incoming_weights = torch.empty_like(weights)
                    transfers.append(
                        (Direction.WEIGHTS, weights, incoming_weights, tags[Phase.BACKWARD_WEIGHTS])
                    )
                incoming_partial = torch.empty_like(partial)
                transfers.append(
                    (Direction.PARTIALS, partial, incoming_partial, tags[Phase.BACKWARD_PARTIALS])
                )
                in_flight = self.exchange(transfers)
            if weights is not None:
                consume(self.weight_shard_at(step), weights)
            if in_flight is not None:
                in_flight.wait()
                partial = incoming_partial
                if weights is not None:
                    weights = incoming_weights
        return partial
