"""The recorded schedule of a pass kind: what one pass asked of the rings and the ring buffers, in order,
from which the next pass of the kind predicts what it will ask.

A pass (a forward: the rings between the start of the outermost rsdp forward and its end; a backward:
the rings of one backward, forward rings recomputed by activation checkpointing included) is a
sequence of **entries**, each a plain tuple:

- a ring begins: ``(RING, tag, message segments, first segment its first exchange sends, message bytes)``;
- a ring buffer is asked for: ``(buffer index, bytes)``;
- (backward) a module queues its gathered parameters' gradients for reduction:
  ``(REDUCTION, weak reference to the module's GatheredParams)``;
- (forward) a module whose gathered parameters its forward needs starts its forward:
  ``(GATHER, weak reference to its GatheredParams)``;
- (forward) the first ring of the pass that can carry the gathers left to a ring has begun (its ring
  entry is the one before): ``(CARRIER,)``.

The first pass of a kind records them (a ``Schedule``); the next pass of the kind with the same key
follows it, comparing what each step asks with the recorded entry at its position (one
tuple equality), and reads the rest of the pass from the record: while every entry so far matched
(``on_track``), the most each buffer will be asked for from here on (``RingBuffers`` gives a buffer
that much at once, and frees in backward what the rest no longer needs); while every ring so far
matched (``rings_on_track``), the ring that comes next (``_prefetch.py`` sends its first message
ahead, and a backward ring carries it only within the pass's largest message). The two are followed
apart because the second changes the first: a ring that starts carrying the next one's first message
asks for larger buffers, and that must not stop the prefetches after it. A forward record also says,
from its start, which modules' forwards began before its carrier ring (``needed_early``): the
outermost forward gathers those at once and leaves the others to the pass's own carrier
(``_collectives.py``). A step that differs leaves
the track: the rest of the pass predicts nothing from it (buffers are made at the size asked; after a
different ring nothing is prefetched), and the pass is recorded as the schedule the next pass of the
kind follows. In steady state (every step of a training loop) a pass follows its record
to the end and nothing is recorded again: a pass costs a position and one comparison per entry, and
makes no list, tuple or dict of its own, which is the seam for capturing a whole ring step later.

Records are keyed so that the pass finds its record when it begins: a forward by its outermost rsdp
module (a forward pass begins with that module's pre-forward, before any ring, where the gathers are
decided), a backward by its first ring (a backward has no such module: it begins with whatever ring
or buffer request comes first). So two models sharing a context whose passes alternate, and a
model's forward and a forward of one of its blocks called alone, keep a record each; a few records
are kept, the least recently followed forgotten.

Pitfalls:
- Every rank must decide alike (the message sizes and the exchanges depend on the decisions): the
  entries hold only what every rank asks alike (tags, layouts, sizes), never a rank's data or
  addresses; so every rank leaves the track at the same entry.
- A prediction is only ever an optimisation: a pass off track asks for what it needs and gets it. A
  wrong record costs a buffer made again or a prefetch not taken, never a wrong result.
- A pass that raised records nothing (``abandon``): its end never came, and half a pass is no
  prediction for a whole one.
- A backward's schedule ends with the last backward that began one of its rings or queued one of
  its reductions (a reentrant checkpoint's nested backward ends before the one it runs in); buffer
  requests, which follow a ring, do not say so again (a call each, on the hot path).
"""

import collections
import weakref

RING = "ring"  # the first field of a ring entry (a buffer entry's is the buffer's index)
REDUCTION = "reduction"  # the first field of a gathered module's reduction entry
GATHER = "gather"  # the first field of a gathered module's forward start
CARRIER = "carrier"  # the entry after the forward's first ring able to carry the gathers left to a ring
_MARKS = (RING, REDUCTION, GATHER, CARRIER)  # every entry's first field but a buffer's index
BUFFERS = 3  # the two message buffers and the scratch
_NOTHING = (0,) * BUFFERS

# Records kept per pass kind, one per ring that begins a pass: one not followed is forgotten after as
# many others.
_KEPT_RECORDS = 8


class Schedule:
    """One recorded pass: its entries, and what is derived from them once, at recording: ``rest[p]``,
    the most each buffer is asked for from entry ``p`` on; ``rings``, the ring entries alone, in order
    (``rings[k]`` is the ring after the first ``k``); ``largest``, the largest message of the pass; and
    ``ring_tags``, the tags of its rings (none when ``prefetch`` is off: the rings change after the
    recorded pass, and it predicts no next ring); ``reductions``, the reduction entries alone;
    ``needed_early``, the modules (weak references to their ``GatheredParams``) whose forward began
    before the pass's carrier ring, or None when no ring of the pass could carry gathers."""

    __slots__ = ("entries", "rest", "rings", "largest", "ring_tags", "reductions", "needed_early")

    def __init__(self, entries: tuple, prefetch: bool = True):
        self.entries = entries
        most, rest = list(_NOTHING), [_NOTHING]
        for entry in reversed(entries):
            if entry[0] not in _MARKS:
                index, nbytes = entry
                most[index] = max(most[index], nbytes)
            rest.append(tuple(most))
        self.rest = rest[::-1]
        rings = tuple(entry for entry in entries if entry[0] == RING)
        self.largest = max((entry[4] for entry in rings), default=0)
        self.rings = rings if prefetch else ()
        self.ring_tags = frozenset(entry[1] for entry in self.rings)
        self.reductions = tuple(entry for entry in entries if entry[0] == REDUCTION)
        carrier = next((position for position, entry in enumerate(entries) if entry[0] == CARRIER), None)
        self.needed_early = (
            None if carrier is None else frozenset(entry[1] for entry in entries[:carrier] if entry[0] == GATHER)
        )


_EMPTY = Schedule(())


class PassSchedule:
    """The schedule of one pass kind (forward or backward) of one ``RingContext``: its records, and
    where the pass running stands in the one it follows."""

    def __init__(self, context, backward: bool):
        self._context = context  # its RingContext: a backward that uses the schedule ends it
        self.backward = backward
        self._records: collections.OrderedDict[object, Schedule] = collections.OrderedDict()
        self.following = _EMPTY  # the record the pass running follows
        self.position = 0  # entries of the pass running so far
        self.on_track = True  # every entry so far matched the record's
        # Rings of the pass running so far, and whether each matched the record's: the ring order
        # stays predictable while buffer requests differ (a ring that first carries the next one's
        # first message asks for larger buffers).
        self.ring_position = 0
        self.rings_on_track = True
        # Likewise the reductions queued so far (which module queued, in order): the queue is complete,
        # and may ride a ring, once it holds every one the record's does.
        self.reduction_position = 0
        self.reductions_on_track = True
        self._carrier_begun = False  # (forward) the pass's first ring able to carry gathers has begun
        self._begun = False
        # The record's key: a forward's outermost rsdp state (a weak reference), a backward's first
        # ring tag (None when a buffer came first).
        self._key = None
        self._recording: list | None = None  # the pass's entries, once it left the track
        self._forget = False

    def _begin(self, key) -> None:
        self._begun, self._key = True, key
        self.following = self._records.get(key, _EMPTY)

    def begin_forward(self, outermost) -> None:
        """A forward pass begins with the pre-forward of ``outermost`` (an ``RSDPState``): it follows
        the record of the last forward that began with it (``following``)."""
        self._begin(weakref.ref(outermost))

    def _follows(self, entry: tuple) -> bool:
        """Whether ``entry`` is the record's at the pass's position (then the position moves on)."""
        position, entries = self.position, self.following.entries
        if self.on_track and position < len(entries) and entries[position] == entry:
            self.position = position + 1
            return True
        return False

    def _leave(self, entry: tuple) -> None:
        """``entry`` is not the record's: record the pass from here on (the record up to here first)."""
        if self.on_track:
            self.on_track = False
            self._recording = list(self.following.entries[: self.position])
        self._recording.append(entry)
        self.position += 1

    def ring(self, tag: int, segments: tuple, first: int, nbytes: int) -> None:
        """A ring of the pass begins with a message of ``segments`` (``nbytes`` long), whose first
        exchange sends segments ``first:``; the first ring of a backward picks the record it follows."""
        if not self._begun:
            self._begin(tag)
        if self.backward:  # the backward's rings end it (its buffer requests follow them)
            self._context.end_with_backward(self)
        entry = (RING, tag, segments, first, nbytes)
        if self.rings_on_track:
            rings = self.following.rings
            self.rings_on_track = self.ring_position < len(rings) and rings[self.ring_position] == entry
        self.ring_position += 1
        if not self._follows(entry):
            self._leave(entry)

    def ask(self, index: int, nbytes: int) -> int:
        """Ring buffer ``index`` is asked for ``nbytes``: the size to make it if it must be made (the
        most the rest of the pass asks of it, when on track; at least ``nbytes``)."""
        if not self._begun:
            self._begin(None)
        # ``_follows`` inlined: every ring asks for its buffers, a few times per ring.
        position, entries = self.position, self.following.entries
        if self.on_track and position < len(entries) and entries[position] == (index, nbytes):
            self.position = position + 1
            return self.following.rest[position][index]
        self._leave((index, nbytes))
        return nbytes

    def ask_pair(self, nbytes: int) -> tuple[int, int]:
        """Both message buffers are asked for ``nbytes`` (``ask(0, nbytes), ask(1, nbytes)``, one call:
        every ring asks for the pair): the sizes to make them."""
        position, entries = self.position, self.following.entries
        if self.on_track and entries[position : position + 2] == ((0, nbytes), (1, nbytes)):
            self.position = position + 2
            rest = self.following.rest
            return rest[position][0], rest[position + 1][1]
        return self.ask(0, nbytes), self.ask(1, nbytes)

    def reduction(self, module) -> None:
        """``module`` (a ``GatheredParams``) queued its gradients for reduction."""
        if not self._begun:
            self._begin(None)
        self._context.end_with_backward(self)
        entry = (REDUCTION, weakref.ref(module))  # a dead module's never equals a live one's
        if self.reductions_on_track:
            reductions = self.following.reductions
            position = self.reduction_position
            self.reductions_on_track = position < len(reductions) and reductions[position] == entry
        self.reduction_position += 1
        if not self._follows(entry):
            self._leave(entry)

    def gather(self, module) -> None:
        """(forward) The forward of the module whose gathered parameters are ``module`` (a
        ``GatheredParams``) starts."""
        entry = (GATHER, weakref.ref(module))  # a dead module's never equals a live one's
        if not self._follows(entry):
            self._leave(entry)

    def carrier(self) -> bool:
        """(forward) The ring just begun could carry the gathers left to a ring. Returns whether it is
        the pass's first such ring, its carrier (recorded as an entry after the ring's)."""
        if self._carrier_begun:
            return False
        self._carrier_begun = True
        if not self._follows((CARRIER,)):
            self._leave((CARRIER,))
        return True

    def all_reductions_queued(self) -> bool:
        """Whether the reductions queued so far are every one the record's pass queued, in its order
        (so none will be queued after)."""
        return self.reductions_on_track and 0 < self.reduction_position == len(self.following.reductions)

    def upcoming(self) -> tuple[int, ...] | None:
        """The most each buffer will be asked for by the rest of the pass running, or None off track."""
        return self.following.rest[self.position] if self.on_track else None

    def next_ring(self) -> tuple | None:
        """The entry of the ring the record says comes next, or None (the rings so far left the
        record's, or it has none after them)."""
        rings, position = self.following.rings, self.ring_position
        return rings[position] if self.rings_on_track and position < len(rings) else None

    @property
    def largest(self) -> int:
        """The largest message of the record followed (the last backward that began with the same ring)."""
        return self.following.largest

    def forget_this_pass(self) -> None:
        """The rings change after this pass (Linears start sharing one): record no next ring from it."""
        self._forget = True

    def ring_tags(self) -> set:
        """The tags of every ring some record says comes next: only their first messages are kept."""
        return set().union(*(record.ring_tags for record in self._records.values()))

    def end_pass(self) -> bool:
        """The pass ended: a pass that left its record (or had none) is recorded for the next one.
        Returns whether the records changed."""
        if not self._begun:
            return False
        key, followed_to_end = self._key, self.on_track and self.position == len(self.following.entries)
        # A record whose rings were forgotten is recorded again, with them, by the pass that followed it.
        changed = self._forget or not followed_to_end or not self.rings_on_track
        if changed:
            entries = self.following.entries[: self.position] if self._recording is None else self._recording
            self._records[key] = Schedule(tuple(entries), prefetch=not self._forget)
            while len(self._records) > _KEPT_RECORDS:
                self._records.popitem(last=False)
        if key in self._records:
            self._records.move_to_end(key)
        self.abandon()
        return changed

    def abandon(self) -> None:
        """Forget the pass running without recording it (it raised: its end never came)."""
        self._begun, self._key, self.following = False, None, _EMPTY
        self.position, self.on_track, self._recording, self._forget = 0, True, None, False
        self.ring_position, self.rings_on_track = 0, True
        self.reduction_position, self.reductions_on_track = 0, True
        self._carrier_begun = False
