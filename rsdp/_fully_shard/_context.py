"""``RingContext``: everything one model's rsdp modules share while a pass runs (FSDP2's root-owned
comm and state contexts).

One context serves every rsdp module of one model. Each ``rsdp_shard`` call gives its module a
context of its own; ``rsdp_shard`` on a module with rsdp modules under it (a root, its blocks sharded
before it) gives it and them one new context (``share_ring_context``), so a model sharded bottom-up
has its root's. ``parallelize`` under a root that is not rsdp (FSDP2 or replicate) gives its rsdp
units one context too, as that root would. Blocks sharded one by one under a plain ``nn.Module``
keep one context each, as FSDP2's modules with no FSDP root are each a root of their own: their
rings carry nothing of another block's (each block's vectors' gradients are reduce-scattered at the
end of the backward, and a planned block's deferred hop goes alone when no ring of its own takes
it), so the root should be sharded too. A state finds its context through its ring
(``state.ring.context``; ``Ring.join`` replaces it), and a ring layer's passes through its ring driver
(``_ring_driver.py``), the one place they look it up.

A context owns: the recorded schedule of each pass kind (``_schedule.py``: its rings, their
messages and the buffers they ask for, from which buffer sizes, prefetch targets and what rides a
ring, the gathers and the reductions, are read); the
ring buffers and the messages laid out in them; the prefetch of each pass kind; the parameters left to ride a ring (pending gathers and reductions); the hop a
planned sub-block deferred; the works of the exchange waited for last; the gradients the backward
running holds; how many of its forwards are open and how many passes have begun. Two models in one
process each have their own: sharding, running or failing one never touches another's buffers,
records or queues.

A pass: the first forward of the context that starts outside a backward is the outermost; it
``begin_forward``s (dropping what a pass that raised left behind: ``reset``; the forward's record,
keyed by that module, is followed from here), and when it ends the context ``end_forward``s
(forward schedule recorded where it changed, gathers still pending dropped, buffers freed). Each
backward that touches the context queues ONE end-of-backward callback (``queue_end_of_backward``),
which finishes, in this order:

1. the post-backward of every module still awaiting it, in the order their backward began (their
   gathered parameters' gradients queue for reduction; their ring gradients are written);
2. the hop a planned sub-block deferred and no ring took, sent alone (its partials reach their owners);
3. the queued reductions of gathered parameters, one reduce-scatter per group, dtype and device;
4. the gradients still held (written to ``.grad``; under HSDP after their all-reduce), and the
   all-reduces in flight;
5. the backward's schedule (recorded for the next backward if it left the one it followed; an unused
   prefetch dropped);
6. the ring buffers (freed).

Each step acts only if that part was used in the backward ending: a part says so with
``end_with_backward``, and is finished at the end of the last backward that used it (a reentrant
checkpoint's nested backward finishes what it used). Later steps consume what earlier ones produce (1 queues
for 3, 2 and 3 hand gradients to 4), so no step queues another callback.

Pitfalls:
- Every rank must finish in the same order: the order is fixed here and what each step issues
  depends only on the order of modules and rings, which every rank shares.
- A backward that raised runs no end callback: its leftovers stay until the next outermost forward
  ``reset``s them (never a later backward's gradients mixed with an abandoned one's).
- The context a module uses can change when its parent is sharded: read it through the ring at use,
  never keep it.
"""

import functools
import weakref

from .._compat import at_end_of_backward, current_graph_task_id
from ._collectives import PendingGathers, PendingReductions
from ._grad import RunningBackward
from ._prefetch import RingPrefetch
from ._buffers import RingBuffers
from ._ring import DeferredHops, WaitedWorks
from ._schedule import PassSchedule

# Every context alive, for ``release_ring_buffers()`` without a module; weak, so a model's context
# goes with it. The engine's only mutable module-level state besides caches of immutable values and
# the ring layers' tag counter: a registry that no pass reads.
LIVE_CONTEXTS: weakref.WeakSet = weakref.WeakSet()


class RingContext:
    """The shared state of one model's rsdp modules; see the module docstring for the end-of-backward order."""

    def __init__(self):
        # The recorded schedule of each pass kind (forward, backward), indexed by "in backward".
        self.schedules = (PassSchedule(self, backward=False), PassSchedule(self, backward=True))
        self.buffers = RingBuffers(self)
        self.waited_works = WaitedWorks()
        self.deferred_hops = DeferredHops(self)
        self.forward_prefetch = RingPrefetch(self, backward=False)
        self.backward_prefetch = RingPrefetch(self, backward=True)
        self.pending_gathers = PendingGathers(self)
        self.pending_reductions = PendingReductions(self)
        self.running_backward = RunningBackward(self)
        self.open_forwards = 0  # forwards of this context's modules running now (nested modules count once each)
        # Outermost forwards begun so far (outside backward): a module's gathered parameters are
        # current if gathered in the pass running.
        self.forward_pass = 0
        # Graph task id -> the states awaiting their post-backward in that backward, in the order
        # their backward began.
        self._awaiting_post_backward: dict[int, list] = {}
        self._end_queued: set[int] = set()  # graph tasks whose end-of-backward callback is queued
        # part -> the graph task at whose end the part (buffers, the backward's schedule or prefetch,
        # the deferred hop, the running backward) finishes: the last backward that used it. Keyed by identity.
        self._due: dict[object, int] = {}
        LIVE_CONTEXTS.add(self)

    def begin_forward(self, outermost) -> None:
        """An outermost forward starts, with the pre-forward of ``outermost`` (an ``RSDPState``): drop
        what a pass that raised left behind, count the pass, and follow the record of the last forward
        that began with the same module."""
        self.reset()
        self.forward_pass += 1
        self.schedules[False].begin_forward(outermost)

    def end_forward(self, raised: bool = False) -> None:
        """The outermost forward ended (or ``raised``: half a pass is no schedule to follow)."""
        if raised:
            self.schedules[False].abandon()
        else:
            self._end_schedule(False)
        self.forward_prefetch.end_pass()
        self.pending_gathers.end_pass()
        self.buffers.release()

    def reset(self) -> None:
        """The one clean-up after a pass that raised (its end never came): queued gradients,
        reductions, a deferred hop, the backward's prefetch and schedule, and the post-backwards it
        awaited (their modules' sharded parameters put back, their gathered gradients dropped)."""
        self.running_backward.abandon()
        self.pending_reductions.abandon()
        self.deferred_hops.abandon()
        self.backward_prefetch.abandon()
        self.schedules[True].abandon()
        for states in self._awaiting_post_backward.values():
            for state in states:
                state.abandon_backward()
        self._awaiting_post_backward.clear()
        self._end_queued.clear()
        self._due.clear()

    def await_post_backward(self, state) -> None:
        """``state``'s module began its backward: finish it at the end of this backward unless its
        post-backward runs before."""
        task = current_graph_task_id()
        self._awaiting_post_backward.setdefault(task, []).append(state)
        self.queue_end_of_backward()

    def end_with_backward(self, part) -> None:
        """Have ``part.end_of_backward()`` run when the backward now running ends: once, and only at
        the end of the last backward that used the part (a reentrant checkpoint's nested backward ends
        before the one it runs in)."""
        task = current_graph_task_id()
        if task != -1 and self._due.get(part) != task:
            self._due[part] = task
            self.queue_end_of_backward()

    def _end_if_due(self, part, task: int) -> None:
        if self._due.get(part) == task:
            del self._due[part]
            part.end_of_backward()

    def _end_schedule(self, backward: bool) -> None:
        """The pass of the kind ended: record its schedule where it changed, and keep the first
        messages of only the rings the records expect."""
        if self.schedules[backward].end_pass():
            (self.backward_prefetch if backward else self.forward_prefetch).keep_expected()

    def queue_end_of_backward(self) -> None:
        """Finish the backward now running at its end (one callback per backward and context)."""
        task = current_graph_task_id()
        if task != -1 and task not in self._end_queued:
            self._end_queued.add(task)
            at_end_of_backward(functools.partial(self._end_of_backward, task))

    def _end_of_backward(self, task: int) -> None:
        # The steps may ask for the end again (a reduction hands gradients on): already under way.
        for state in self._awaiting_post_backward.pop(task, []):
            state.post_backward()
        self._end_if_due(self.deferred_hops, task)
        self.pending_reductions.end_of_backward(task)
        self._end_if_due(self.running_backward, task)
        self._end_if_due(self.backward_prefetch, task)
        if self._due.get(self.schedules[True]) == task:
            del self._due[self.schedules[True]]
            self._end_schedule(True)
        self._end_if_due(self.buffers, task)
        self._end_queued.discard(task)


def share_ring_context(states: list) -> None:
    """Give these rsdp states (and so every ring of theirs) one new context: the rsdp modules of one
    model, sharded separately (``rsdp_shard``'s nested calls, ``parallelize``'s units under a root
    that is not rsdp)."""
    context = RingContext()
    for state in states:
        if state.gathered is not None:
            state.gathered.gathered_in_pass = -1  # counted in its old context's passes
        state.ring.join(context)
