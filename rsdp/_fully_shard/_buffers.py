"""The ring buffers: the memory every ring message of one model lives in.

Messages live in byte buffers shared by every ring of one model (``RingBuffers``, owned by the
model's ``RingContext``: two ping-pong message buffers and a scratch, given memory once per pass and
then reused), so a ring step allocates nothing; on CUDA this also keeps NCCL's stream from pinning a
freed block per step in the caching allocator. They live for one pass, not longer: freed when the
outermost rsdp module's forward returns and when the backward ends, so they never add to the loss
computation's or the optimizer step's peak. ``release_ring_buffers()`` frees them at any other time.

A buffer's memory is the most the rest of its pass will ask of it, read from the recorded schedule of
its pass kind (``_schedule.py``: every request is an entry of it), so it is allocated once per pass; and in backward it is freed after a
ring when the rest of the backward needs less (``RingBuffers.trim``): gradients pile up as a backward
goes on, so its end is where memory peaks, and the buffers of a tied table's head (the first ring of
a backward, weights and partials) must not stay for the Embedding's and the blocks' (the last rings).

The pool knows sizes and regions, not what the bytes mean: the wire format (``_wire.Message``) lays
messages out in it, and the transport (``_ring.py``) exchanges them. A region that must outlive a
``trim`` (the next ring's first message, exchanged ahead: ``_prefetch.py``) is named with ``keep``.

Pitfalls:
- Rings never run concurrently on one rank (a ring layer's computation calls no other ring), so one
  set of buffers serves them all.
- Old and new buffer alive at once would be the step's peak: a buffer is freed before it is made again.
- Under selective activation checkpointing every request gets fresh memory: SAC replays a
  recomputation op by op, and whether a shared buffer exists already would change the ops issued.
"""

import torch

from .._compat import current_graph_task_id, dispatch_modes, in_selective_checkpoint, outside_inference_mode
from ._wire import Message, Segment


class RingBuffers:
    """Two flat byte buffers per device for the messages, and one for a backward's own contribution,
    shared by every ring of one model (its ``RingContext``), and the ``Message`` layouts whose views
    of them are cached.

    Rings never run concurrently on one rank (a ring layer's computation calls no other ring), so one
    set serves them all: two of the largest message (weights and partials, ~2/W of the largest ring
    layer each in backward) and one of the largest gradient contribution. A buffer is given the memory
    the rest of its pass will ask of it (the pass's schedule, ``_schedule.py``) when it is asked for more than it holds, so
    once per pass; in backward, one that holds more than the rest of the backward needs is freed after
    a ring (``trim``). The tensors stay, at the largest size ever asked, and so do the views of them
    that messages cached.
    """

    def __init__(self, context):
        self._context = context  # its RingContext: the end of a backward that used the buffers frees them
        self._sets: dict[torch.device, list[torch.Tensor | None]] = {}
        # The bytes each buffer's storage holds now (0: none; -1: no buffer yet, so that a request of 0
        # bytes makes one), kept beside it: every ring checks it for every buffer it asks for, and only
        # this pool resizes the storages (a call less each than ``untyped_storage().nbytes()``, two builtins).
        self._held: dict[torch.device, list[int]] = {}
        # data_ptr of a live buffer -> (its index, 0): where a message at a buffer's start lies (``_wire.MessagePool``).
        self.starts: dict[int, tuple[int, int]] = {}
        self._spans: list[tuple[int, int, int]] = []  # (index, first and last + 1 address) of each live buffer
        # Bumped whenever buffers are replaced, so views of old ones are not reused.
        self.generation = 0
        self._ends_with = -1  # the graph task of the backward whose end frees the buffers (``_schedule_now``)
        # The one ``Message`` per segment layout, so that its views of these buffers are reused.
        self._messages: dict[tuple[Segment, ...], Message] = {}
        # (device, nbytes) -> both message buffers' first nbytes (``pair``), and the scratch's: made once,
        # not at every ring (a dispatch each); they follow the storage through ``resize_``, and a reset
        # drops them.
        self._pairs: dict[tuple[torch.device, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._scratches: dict[tuple[torch.device, int], torch.Tensor] = {}
        # (device, start, stop) -> both message buffers' bytes start:stop (``regions``); a reset drops them.
        self._regions: dict[tuple[torch.device, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        # Regions of the message buffers that ``trim`` keeps (the next ring's first exchange, done ahead).
        self._kept: tuple[torch.Tensor, ...] = ()

    def message_of(self, segments: tuple[Segment, ...]) -> Message:
        """The one ``Message`` for these segments, so that its views of these buffers are reused."""
        message = self._messages.get(segments)
        if message is None:
            message = self._messages[segments] = Message(segments, self)
        return message

    def pair(self, nbytes: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The two message buffers (ping-pong), ``nbytes`` long."""
        if dispatch_modes() and in_selective_checkpoint():  # (``dispatch_modes`` first: no frame when none is active)
            return _fresh(nbytes, device), _fresh(nbytes, device)
        first, second = self._schedule_now().ask_pair(nbytes)
        held = self._held.get(device)
        if held is None or held[0] < nbytes or held[1] < nbytes:  # else kept as they are (``_give``)
            self._give(0, nbytes, first, device)
            self._give(1, nbytes, second, device)
        pair = self._pairs.get((device, nbytes))
        if pair is None:
            buffers = self._sets[device]
            with outside_inference_mode():
                pair = self._pairs[(device, nbytes)] = (buffers[0][:nbytes], buffers[1][:nbytes])
        return pair

    def regions(self, pair: tuple[torch.Tensor, torch.Tensor], start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``pair[0][start:stop], pair[1][start:stop]`` of the message buffers ``pair`` (``pair()``'s, at
        least ``stop`` long): where a passenger rides, at every exchange that carries one, made once per
        range (a dispatch each) while the buffers stay; fresh buffers (selective checkpointing's) get
        fresh ones."""
        if pair[0].data_ptr() not in self.starts:
            return pair[0][start:stop], pair[1][start:stop]
        key = (pair[0].device, start, stop)
        regions = self._regions.get(key)
        if regions is None:
            with outside_inference_mode():
                regions = self._regions[key] = (pair[0][start:stop], pair[1][start:stop])
        return regions

    def hold(self, nbytes: int, device: torch.device) -> bool:
        """Whether both message buffers hold ``nbytes`` already, so that asking for them keeps what
        they hold (a prefetched message, for one). Either way the request is recorded in the pass's
        schedule as if made: the next pass of the kind then gives them that much memory from its start."""
        self._context.schedules[current_graph_task_id() != -1].ask_pair(nbytes)  # (in backward)
        held = self._held.get(device)
        return held is not None and held[0] >= nbytes and held[1] >= nbytes

    def scratch(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A buffer for what a ring step computes between two arrivals, ``nbytes`` long."""
        if dispatch_modes() and in_selective_checkpoint():
            return _fresh(nbytes, device)
        size = self._schedule_now().ask(2, nbytes)
        held = self._held.get(device)
        if held is None or held[2] < nbytes:
            self._give(2, nbytes, size, device)
        scratch = self._scratches.get((device, nbytes))
        if scratch is None:
            with outside_inference_mode():
                scratch = self._scratches[(device, nbytes)] = self._sets[device][2][:nbytes]
        return scratch

    def _schedule_now(self):
        """The schedule of the pass running, which records the requests (asked once per request, not
        per buffer: each check is host time at every ring); a backward's end frees the buffers, asked
        of the context once per backward (``_ends_with``: the backward asked for last; a nested one,
        a reentrant checkpoint's, ends first and frees them, and the one around it asks again)."""
        task = current_graph_task_id()
        if task != -1 and task != self._ends_with:
            self._context.end_with_backward(self)
            self._ends_with = task
        return self._context.schedules[task != -1]

    def _give(self, index: int, nbytes: int, size: int, device: torch.device) -> None:
        """Give buffer ``index`` the memory for a request of ``nbytes`` that its storage does not hold
        (``size``: what the schedule says the rest of the pass asks of it, at least ``nbytes``). A buffer
        that holds a request is kept as it is (the callers check ``_held``): it may hold a prefetched
        message. One whose memory must be given again anyway is made anew if the rest of the pass needs
        it larger than its tensor."""
        buffers = self._sets.setdefault(device, [None, None, None])
        held = self._held.setdefault(device, [-1, -1, -1])
        buffer = buffers[index]
        if held[index] >= nbytes:  # (the pair's other buffer, which holds it)
            return
        if buffer is None or buffer.numel() < size:
            self._reset()
            if buffer is not None:  # free it first: old and new alive at once would be the step's peak
                buffer.untyped_storage().resize_(0)
                held[index] = 0
            # Zeroed, so padding rows are never uninitialised memory (NCCL's NaN check reads them).
            with outside_inference_mode():
                buffers[index] = torch.zeros(size, dtype=torch.uint8, device=device)
        else:  # freed at the end of the last pass, or by ``trim``
            # Storage only: the tensor and the views of it that messages cached stay (as FSDP2 frees
            # and refills its unsharded parameters), and a view is only used after a request covering it.
            storage = buffer.untyped_storage()
            storage.resize_(0)  # nothing to keep: no copy
            storage.resize_(size)
            buffer[:size].zero_()
        held[index] = size
        self._reindex()

    def trim(self) -> None:
        """Free the buffers that are larger than the rest of the backward running needs; called by a
        backward ring once it has copied out its result. Gradients pile up as a backward goes on, so
        its end is where memory peaks: the buffers of its first, largest rings (a tied table's head:
        weights and partials) must not stay for its last ones (the Embedding's partials). The next
        request makes a freed buffer again, at the size the rest of the backward needs. A buffer that
        holds a region named by ``keep`` keeps it (and what lies before it)."""
        upcoming = self._context.schedules[True].upcoming() if current_graph_task_id() != -1 else None  # in backward
        if upcoming is None:
            return
        freed = False
        for held, index, buffer in self._live():
            kept = self._kept_end(index, buffer, held[index]) if self._kept else 0
            need = upcoming[index] if kept <= upcoming[index] else kept
            if 8 * held[index] > 9 * need:  # more than an eighth to spare
                held[index] = need if kept else 0
                buffer.untyped_storage().resize_(held[index])  # resize_ keeps the start
                freed = True
        if freed:
            self._reindex()

    def keep(self, *regions: torch.Tensor) -> None:
        """Keep ``regions`` (views of the message buffers) through ``trim`` until ``keep()`` again."""
        self._kept = regions

    def _kept_end(self, index: int, buffer: torch.Tensor, held: int) -> int:
        """Where the last kept region in message buffer ``buffer`` (whose storage holds ``held`` bytes)
        ends in it, or 0."""
        if index > 1:
            return 0
        start, end = buffer.data_ptr(), buffer.data_ptr() + held
        return max(
            (region.data_ptr() - start + region.numel() for region in self._kept
             if region.device == buffer.device and start <= region.data_ptr() < end),
            default=0,
        )

    def place_of(self, buffer: torch.Tensor) -> tuple[int, int] | None:
        """Where ``buffer`` starts in the ring buffers: (which of the three, byte offset), or None when
        in none of them. A message is at offset 0, or behind the message of the ring that carried it
        (a prefetched one, a deferred hop)."""
        pointer = buffer.data_ptr()
        place = self.starts.get(pointer)
        if place is None:
            for index, start, end in self._spans:
                if start < pointer < end:
                    return index, pointer - start
        return place

    def _live(self) -> list[tuple[list[int], int, torch.Tensor]]:
        """(its device's ``_held``, index, buffer) of every buffer that holds memory now (a list: every
        backward ring asks, through ``trim``, and each step of a generator would be a Python call)."""
        return [
            (held, index, buffer)
            for device, buffers in self._sets.items()
            for held in (self._held[device],)
            for index, buffer in enumerate(buffers)
            if held[index] > 0
        ]

    def _reindex(self) -> None:
        live = self._live()
        self.starts = {buffer.data_ptr(): (index, 0) for _, index, buffer in live}
        self._spans = [(index, buffer.data_ptr(), buffer.data_ptr() + held[index]) for held, index, buffer in live]

    def _reset(self) -> None:
        self.generation += 1
        self._pairs.clear()
        self._scratches.clear()
        self._regions.clear()
        self._messages.clear()

    @property
    def nbytes(self) -> int:
        return sum(held[index] for held, index, _ in self._live())

    def end_of_backward(self) -> None:
        """The backward that used the buffers ended (a backward that raised runs no end callbacks, and
        the next one frees them)."""
        self.release()

    def release(self) -> None:
        """Free the buffers' memory. The tensors stay, with no storage, and so do the views of them that
        messages cached: the next pass gives the same storages memory again (``resize_``, as FSDP2 frees
        and refills its unsharded parameters), and its views need not be made again."""
        for held, index, buffer in self._live():
            buffer.untyped_storage().resize_(0)
            held[index] = 0
        self._reindex()


def _fresh(nbytes: int, device: torch.device) -> torch.Tensor:
    """A buffer of its own under selective activation checkpointing (and so fresh views): SAC replays a
    recomputation op by op, and whether a shared buffer exists already would change the ops issued."""
    return torch.zeros(nbytes, dtype=torch.uint8, device=device)
