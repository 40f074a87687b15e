"""What PyTorch's CUDA caching allocator reserves for a sequence of allocations and frees: a replay of
the counted step's allocation log through a model of the allocator, whose reserved peak over the log's
allocated peak is the factor the cost model scales a GPU's byte figures by (``_cost_model._reserved``).

The model follows ``c10/cuda/CUDACachingAllocator.cpp`` (constants as it names them):

- every request is rounded up to a multiple of 512 bytes (``kMinBlockSize``);
- requests up to 1 MiB (``kSmallSize``) are served from the small pool, whose segments are 2 MiB
  (``kSmallBuffer``); larger ones from the large pool, whose new segments are 20 MiB (``kLargeBuffer``)
  for requests under 10 MiB (``kMinLargeAlloc``) and the request rounded up to 2 MiB (``kRoundLarge``)
  above;
- a request takes the smallest cached free block of its pool that fits (best fit), split when what
  is left is at least 512 bytes (small pool) or more than 1 MiB (large pool); otherwise the whole
  block, the rest wasted while it lives;
- a freed block merges with free neighbours of its segment and stays cached: reserved memory only
  grows (no ``empty_cache``), so the reserved peak is what the log ends with;
- with ``expandable_segments:True`` (``PYTORCH_CUDA_ALLOC_CONF``; torchtitan's launcher sets it) each
  pool is one segment that grows in 2 MiB pages: a request no free block fits extends the segment's
  end (taking the free block there, if any), so a gap is wasted only until something fits in it.

Fragmentation is thus what the order and sizes of the step's own allocations make of it. Pitfalls: the
log is the count's (activations, their gradients, the loss's temporaries), not the strategies'
buffers, which are few and large (their rounding is small against their size); the allocator's
per-stream pools (FSDP2's all-gather and reduce-scatter buffers live in their streams' pools, which
the compute stream cannot reuse) are not modelled, nor memory the communication library reserves.
"""

import bisect
import itertools

MIN_BLOCK = 512  # kMinBlockSize
SMALL_SIZE = 1 << 20  # kSmallSize
SMALL_BUFFER = 2 << 20  # kSmallBuffer
LARGE_BUFFER = 20 << 20  # kLargeBuffer
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc
ROUND_LARGE = 2 << 20  # kRoundLarge, and an expandable segment's page


def round_size(nbytes: int) -> int:
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def segment_size(size: int) -> int:
    """The segment a request of ``size`` (rounded) that no cached block fits allocates."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


class _Block:
    """A piece of a segment; ``small``: the segment is the small pool's."""

    __slots__ = ("size", "small", "free", "prev", "next", "key")

    def __init__(self, size: int, small: bool, prev=None, next=None):
        self.size, self.small, self.free, self.prev, self.next, self.key = size, small, False, prev, next, None


class CachingAllocator:
    """The allocator model: ``malloc`` returns a block, ``free`` takes it back; ``reserved`` is what
    the segments hold, ``allocated`` the requested bytes live and ``peak_allocated`` their highest."""

    def __init__(self, expandable_segments: bool = False):
        self.expandable = expandable_segments
        self.pools: dict[bool, list] = {True: [], False: []}  # small pool?: sorted (size, serial, block) of free blocks
        self.last: dict[bool, _Block | None] = {True: None, False: None}  # an expandable pool's end block
        self.serial = itertools.count()
        self.reserved = self.allocated = self.peak_allocated = 0

    def malloc(self, nbytes: int) -> tuple[_Block, int]:
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        pool = self.pools[small]
        index = bisect.bisect_left(pool, (size, -1))
        if index < len(pool):
            block = pool.pop(index)[2]
        elif self.expandable:
            block = self._extended(small, size)
        else:
            block = _Block(segment_size(size), small)
            self.reserved += block.size
        block.free = False
        left = block.size - size
        if left >= MIN_BLOCK if small else left > SMALL_SIZE:
            rest = _Block(left, small, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            if self.last[small] is block:
                self.last[small] = rest
            self._release(rest, small)
        self.allocated += nbytes
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block, nbytes

    def _extended(self, small: bool, size: int) -> _Block:
        """The expandable segment's end, grown by whole pages until it holds ``size``."""
        end = self.last[small]
        if end is not None and end.free:
            self.pools[small].remove((end.size, end.key, end))
            grow = -(-(size - end.size) // ROUND_LARGE) * ROUND_LARGE
            end.size += grow
        else:
            grow = -(-size // ROUND_LARGE) * ROUND_LARGE
            end = _Block(grow, small, prev=end)
            if end.prev is not None:
                end.prev.next = end
            self.last[small] = end
        self.reserved += grow
        return end

    def free(self, allocation: tuple[_Block, int]) -> None:
        block, nbytes = allocation
        self.allocated -= nbytes
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free:
                self.pools[block.small].remove((neighbour.size, neighbour.key, neighbour))
                block = self._merged(block, neighbour, block.small)
        self._release(block, block.small)

    def _merged(self, block: _Block, neighbour: _Block, small: bool) -> _Block:
        first, second = (neighbour, block) if neighbour is block.prev else (block, neighbour)
        first.size += second.size
        first.next = second.next
        if second.next is not None:
            second.next.prev = first
        if self.last[small] is second:
            self.last[small] = first
        return first

    def _release(self, block: _Block, small: bool) -> None:
        block.free, block.key = True, next(self.serial)
        bisect.insort(self.pools[small], (block.size, block.key, block))


def reserved_peak(events, expandable_segments: bool) -> tuple[int, int]:
    """``(allocated peak, reserved peak)`` of a log of ``("malloc", key, nbytes)`` and ``("free", key)``."""
    allocator, live = CachingAllocator(expandable_segments), {}
    for event in events:
        if event[0] == "malloc":
            if event[1] in live:  # a storage replaced under the same key
                allocator.free(live.pop(event[1]))
            live[event[1]] = allocator.malloc(event[2])
        elif event[1] in live:
            allocator.free(live.pop(event[1]))
    return allocator.peak_allocated, allocator.reserved
