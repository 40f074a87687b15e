"""The wire format of a ring step: shard ``s`` of several tensors as one flat byte message.

A message is ``[segment 0 | segment 1 | ...]``; a segment is one tensor's shard ``s``, padded to that
tensor's ``chunk`` rows (``_param.ShardLayout``), in its dtype on the wire. Padding exists on the wire
only: every rank must send and receive the same number of bytes at each step, while parameters store
their real rows. Views cover the real rows only, so padding bytes are never read.

A ``Message`` knows nothing of where messages live. It is handed the pool that made it (a
``MessagePool``: ``_buffers.RingBuffers``), and asks it only where a buffer lies in the pool and
whether the pool's buffers were replaced, so that views of the pool's own buffers are made once and
reused, and views of any other buffer are made fresh.

Pitfalls:
- A segment is aligned to its own element size only (a wider alignment would put gap bytes on the
  wire), but a 3-D parameter's (a block of experts: ``[experts, out, in]``) starts at a multiple of 16
  bytes, as torch's grouped GEMM on CUDA requires of its operands; the ring buffers and what rides
  behind a message are 16-byte aligned too (``_ring._aligned``).
- A cached view is valid only while the pool's buffers are the ones it was made of (``generation``).
- What a caller derives from a shard's views (``Views.derived``: a transposed or stacked view of them)
  is cached with the views, so it must be a function of the views alone, and its key must name it.
"""

import functools
import math
import typing
from dataclasses import dataclass

import torch

from .._compat import outside_inference_mode
from ._param import ShardLayout


# Where a 3-D parameter's segment (a block of experts) starts in a message: a multiple of this many bytes.
EXPERTS_ALIGNMENT = 16


class MessagePool(typing.Protocol):
    """What a ``Message`` asks of the buffers that hold messages (``_buffers.RingBuffers``)."""

    generation: int  # bumped whenever the pool's buffers are replaced
    # ``place_of`` of a buffer at the start of one of the pool's (data_ptr -> place), looked up first: a
    # ring step's views are of such a buffer, and the lookup then costs no Python call.
    starts: dict[int, tuple[int, int]]

    def place_of(self, buffer: torch.Tensor) -> tuple[int, int] | None: ...

    def message_of(self, segments: tuple["Segment", ...]) -> "Message": ...


@dataclass(frozen=True, eq=False)
class Segment:
    """One tensor in a ring message: its row split, the shape of one row, and its dtype on the wire.
    Made by ``segment`` only, one per value, so it compares and hashes by identity (as ``ShardLayout``
    does): a message's segments key the pool's ``Message`` of them at every ring."""

    layout: ShardLayout
    trailing: torch.Size
    dtype: torch.dtype

    @property
    def padded_nbytes(self) -> int:
        return self.layout.chunk * math.prod(self.trailing) * self.dtype.itemsize


@functools.lru_cache(maxsize=None)
def segment(layout: ShardLayout, trailing: torch.Size, dtype: torch.dtype) -> Segment:
    """The one ``Segment`` of these values."""
    return Segment(layout, torch.Size(trailing), dtype)


class BlockRegions:
    """Where a block message's segments lie in it and in its members' message (``Message.members``),
    for the collectives within a group (``_ring._WithinGroup``).

    The segments ``gathered`` (a range: the weights) are all-gathered, the others (partials, one run
    before or after the weights: ``[weights | partials]``, or a planned sub-block's ``[partials |
    weights]``) reduce-scattered. A segment's g member shards, each padded to its chunk, are its
    block's padded rows in rank order, so one segment's all-gather writes its block and its
    reduce-scatter reads it with no copy. Several segments go in one collective over the members'
    bytes ``[weights_start:weights_end]`` (or, for partials of one dtype, ``[partials_start:partials_end]``),
    laid out rank-major in a staging area behind the block: one copy per run of equal-width segments
    between staging and block (``_ring._block_and_staged``; ``weights``: block and member byte slices,
    the member's from ``weights_start``; ``partials``: block, member slices from ``partials_start``,
    dtype). The staging area starts at ``staging_at`` in the scratch buffer, whose size with the block
    before it is ``scratch_nbytes``.

    ``rank_major``: the block holds the weights and the partials each as the collectives move them, g
    member regions in rank order (``[place 0's weights | place 1's | ...]`` where the weights start,
    likewise the partials where theirs start), so the all-gather writes the block and the
    reduce-scatter reads it with no staging copy whatever the segments (a ring layer that reads such a
    block: a Linear group's stacked weights, ``_linear.py``). Each run then counts as one segment; the
    partials must share one dtype, and each run of segments must lie in the members' message with no
    gap (segments of one dtype)."""

    def __init__(self, message: "Message", gathered: range, rank_major: bool = False):
        members, group = message.members, message.segments[0].layout.group if message.segments else 1
        self.weights, self.partials = [], []
        partial_at = [index for index in range(len(message.segments)) if index not in gathered]
        self.weights_start = members.offsets[gathered.start] if gathered else 0
        self.partials_start = members.offsets[partial_at[0]] if partial_at else members.nbytes
        for index, (block, member) in enumerate(zip(message.segments, members.segments)):
            block_region = slice(message.offsets[index], message.offsets[index] + block.padded_nbytes)
            if index in gathered:
                start = members.offsets[index] - self.weights_start
                self.weights.append((block_region, slice(start, start + member.padded_nbytes)))
            else:
                start = members.offsets[index] - self.partials_start
                self.partials.append((block_region, slice(start, start + member.padded_nbytes), block.dtype))
        self.weights_end = self.weights_start + self.weights[-1][1].stop if self.weights else 0
        self.partials_end = self.partials_start + self.partials[-1][1].stop if self.partials else members.nbytes
        dtypes = {dtype for _, _, dtype in self.partials}
        self.partial_dtype = next(iter(dtypes)) if len(dtypes) == 1 else None
        # The dtype a reduce-scatter rider must have to be summed with the partials (``_ring._WithinGroup``):
        # theirs, None (any) with no partials, False where they have several.
        self.rider_dtype = False if len(dtypes) > 1 else self.partial_dtype
        if rank_major:
            if len(dtypes) > 1:
                raise AssertionError("a rank-major block needs partials of one dtype")
            self.weights = [_whole_run(self.weights, group)] if self.weights else []
            self.partials = [(*_whole_run(self.partials, group), self.partial_dtype)] if self.partials else []
        self.staging_at = -(-message.nbytes // 16) * 16
        staged = max(
            self.weights_end - self.weights_start if len(self.weights) > 1 else 0,
            self.partials_end - self.partials_start if len(self.partials) > 1 and self.partial_dtype is not None else 0,
        )
        self.scratch_nbytes = self.staging_at + group * staged
        self.collectives: dict = {}  # the ring's collectives over these regions, per buffer (``_ring._WithinGroup``)


def _whole_run(regions: list, group: int) -> tuple[slice, slice]:
    """A run of segments as one (``BlockRegions``' ``rank_major``): its block region from its first
    segment's offset, ``group`` times its bytes in the members' message, which must have no gap."""
    width = regions[-1][1].stop
    if width != sum(region[1].stop - region[1].start for region in regions):
        raise AssertionError("a rank-major block needs its runs of segments with no gap in the members' message")
    return slice(regions[0][0].start, regions[0][0].start + group * width), slice(0, width)


_JOINED = "joined"  # the key of ``_joined``'s value in ``Views.known``


def _joined(views: "Views") -> torch.Tensor | bool:
    """Views that lie back to back in one buffer (one dtype and row shape, each contiguous) as one
    tensor of all their rows, or False (fewer than two, or a gap: a padded shard, an aligned segment)."""
    first = views[0] if len(views) > 1 else None
    if first is None or not first.is_contiguous():
        return False
    end = first.storage_offset() + first.numel()
    for view in views[1:]:
        if view.dtype != first.dtype or view.shape[1:] != first.shape[1:] or view.storage_offset() != end or not view.is_contiguous():
            return False
        end += view.numel()
    shape = (sum(view.shape[0] for view in views), *first.shape[1:])
    return first.as_strided(shape, tuple(math.prod(shape[index + 1 :]) for index in range(len(shape))), first.storage_offset())


class Views(list):
    """The views of one shard's segments (a list), and what callers derive from them: a ring step's
    GEMM often wants a transposed or stacked view of a segment, and making it again at every step costs
    a dispatch each. Views of the ring's own buffers are cached, and so is what is derived from them;
    fresh views (of any other buffer) derive afresh and are dropped with the list. ``known`` holds what
    was derived, by key: a caller at every ring step reads it first (``known.get(key)``), sparing the
    call of ``derived`` once the value exists."""

    __slots__ = ("known", "_cached")

    def __init__(self, views: list[torch.Tensor], cached: bool):
        super().__init__(views)
        self.known: dict = {}
        self._cached = cached

    def write(self, tensors: list[torch.Tensor]) -> None:
        """Copy ``tensors`` into these views (one per view, or into the first ``len(tensors)`` of them: a
        planned backward packs its weights ahead of the partials the message also carries): one ``cat``
        where every view is written and they lie back to back as one tensor (one dtype and row shape,
        each but the last whole: a group's weights), which is one host dispatch (a kernel on a GPU)
        rather than one per view; else a copy each (a ``cat`` into fewer rows would resize the joined
        view)."""
        joined = self.known.get(_JOINED)
        if joined is None:
            joined = self.derived(_JOINED, _joined)
        if joined is False or len(tensors) != len(self):
            for view, tensor in zip(self, tensors):
                view.copy_(tensor)
        else:
            torch.cat(tensors, out=joined)

    def derived(self, key, make: "typing.Callable[[Views], torch.Tensor]") -> torch.Tensor:
        """``make(self)``, made once per ``key`` for these views (``key`` names what ``make`` derives)."""
        value = self.known.get(key)
        if value is None:
            if self._cached:
                with outside_inference_mode():
                    value = make(self)
            else:
                value = make(self)
            self.known[key] = value
        return value


class Message:
    """The wire format of one ring step: shard ``s`` of several tensors in one flat byte buffer.

    A message is ``[segment 0 | segment 1 | ...]``, each segment holding the rows of one tensor's shard
    ``s`` padded to that tensor's ``chunk`` rows, in its own dtype. The weights and biases of Linears
    that share an input travel as one message, and in backward the weights travel together with the
    gradient partials (in ``reduce_dtype``), so one ring step is one message whatever it carries.
    Padding rows are never read: views cover the shard's real rows only. One per layout and pool:
    made by the pool's ``message_of``, whose buffers' views it caches.
    """

    def __init__(self, segments: tuple[Segment, ...], buffers: MessagePool):
        self.segments = segments
        self._buffers = buffers  # the pool whose views it caches (and which made it)
        self.offsets = []
        offset = 0
        for segment in segments:
            # Aligned to the segment's element size, for its typed view: wider alignment would put gap
            # bytes on the wire. A block of experts (rows of two dimensions) goes to a grouped GEMM,
            # which on CUDA wants 16-byte-aligned operands.
            alignment = EXPERTS_ALIGNMENT if len(segment.trailing) > 1 else segment.dtype.itemsize
            offset = -(-offset // alignment) * alignment
            self.offsets.append(offset)
            offset += segment.padded_nbytes
        self.nbytes = offset
        # Views of the ring's own buffers, which outlive a step:
        # ((buffer index, offset), shard, first, transposed) -> views; ((index, offset), "flat", first) -> ``flat``.
        self._ring_views: dict[tuple, Views | torch.Tensor] = {}
        self._generation = buffers.generation
        self._flat_dtypes: dict[int, torch.dtype | None] = {}  # first -> the one dtype of segments first:
        self._block_regions: dict[tuple[range, bool], BlockRegions] = {}  # (gathered, rank_major) -> ``block_regions``

    @functools.cached_property
    def members(self) -> "Message":
        """On a ring of groups, where this message holds a block (the shards of a group's ranks), the
        message of one rank's shards: what travels between groups. Itself on a ring of ranks."""
        if all(segment.layout.group == 1 for segment in self.segments):
            return self
        return self._buffers.message_of(tuple(segment(s.layout.members, s.trailing, s.dtype) for s in self.segments))

    def block_regions(self, gathered: range, rank_major: bool = False) -> "BlockRegions":
        """Where this block message's segments lie in it and in ``members``' (see ``BlockRegions``):
        segments ``gathered`` all-gathered within a group, the others partials, reduce-scattered; laid
        out by segment, or ``rank_major``."""
        key = (gathered, rank_major)
        regions = self._block_regions.get(key)
        if regions is None:
            regions = self._block_regions[key] = BlockRegions(self, gathered, rank_major)
        return regions

    def views(self, buffer: torch.Tensor, shard: int, first: int = 0, transposed: tuple[bool, ...] = ()) -> Views:
        """Segments ``first:`` of ``buffer`` (a byte tensor holding one message) as shard ``shard``'s
        rows, shaped ``[rows, *trailing]``; those that ``transposed`` flags (one flag per segment from
        ``first`` on) transposed (their last two dimensions), as a GEMM takes a colwise weight.

        Views of the ring's buffers are made once and reused (making them is most of a small ring
        step's host time); other buffers get fresh views, since their memory may be reused."""
        pool = self._buffers
        place = pool.starts.get(buffer.data_ptr()) or pool.place_of(buffer)
        if place is None:
            return Views(self._make_views(buffer, shard, first, transposed), cached=False)
        if self._generation != self._buffers.generation:
            self._forget_views()
        key = (place, shard, first, transposed)
        views = self._ring_views.get(key)
        if views is None:
            with outside_inference_mode():
                views = self._ring_views[key] = Views(self._make_views(buffer, shard, first, transposed), cached=True)
        return views

    def flat(self, buffer: torch.Tensor, first: int = 0) -> torch.Tensor | None:
        """Segments ``first:`` of ``buffer`` as one flat tensor, padding rows included, when they share
        one dtype (then no gap lies between them); else None. What a GEMM never reads may be added to:
        one op over every segment instead of one per segment. Cached like ``views``."""
        dtype = self._flat_dtypes.get(first, False)
        if dtype is False:
            dtypes = {segment.dtype for segment in self.segments[first:]}
            dtype = self._flat_dtypes[first] = dtypes.pop() if len(dtypes) == 1 else None
        if dtype is None:
            return None
        pool = self._buffers
        place = pool.starts.get(buffer.data_ptr()) or pool.place_of(buffer)
        if place is None:
            return buffer[self.offsets[first] : self.nbytes].view(dtype)
        if self._generation != self._buffers.generation:
            self._forget_views()
        key = (place, "flat", first)
        flat = self._ring_views.get(key)
        if flat is None:
            with outside_inference_mode():
                flat = self._ring_views[key] = buffer[self.offsets[first] : self.nbytes].view(dtype)
        return flat

    def _forget_views(self) -> None:
        """The pool's buffers were replaced: the views cached are of old ones."""
        self._ring_views.clear()
        self._generation = self._buffers.generation

    def _make_views(self, buffer: torch.Tensor, shard: int, first: int, transposed: tuple[bool, ...] = ()) -> list[torch.Tensor]:
        views = []
        for index, (segment, offset) in enumerate(zip(self.segments[first:], self.offsets[first:])):
            rows = segment.layout.rows_of(shard)
            nbytes = rows * math.prod(segment.trailing) * segment.dtype.itemsize
            view = buffer[offset : offset + nbytes].view(segment.dtype).view(rows, *segment.trailing)
            views.append(view.mT if index < len(transposed) and transposed[index] else view)
        return views

    def tail(self, first: int) -> "Message":
        """The message made of segments ``first:``, laid out as they are here (offsets shifted)."""
        return self._buffers.message_of(self.segments[first:])

    def pack(self, buffer: torch.Tensor, shard: int, tensors: list[torch.Tensor], first: int = 0) -> None:
        """Write ``tensors`` (shard ``shard`` of segments ``first:``) into ``buffer`` (``Views.write``)."""
        self.views(buffer, shard, first).write(tensors)

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
