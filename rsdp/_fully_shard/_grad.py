"""Ring parameters' gradients: rsdp accumulates them itself, as FSDP2 does for its sharded parameters.

A ring function computes with the local shard of a ``Shard(0)`` (or ``Shard(1)``) DTensor parameter and
returns that shard's reduced gradient. It does not take the shard through ``param.to_local()``: that is a
differentiable op whose backward wraps every gradient in a new DTensor through ``DTensor.from_local``,
host time spent on every ring call (docs/benchmarks.md).
It takes a *gradient leaf* instead: a detached alias of the local shard (same storage and version
counter, so the optimizer's in-place updates are seen and autograd's saved-tensor checks still hold)
that requires grad when the parameter does. Autograd accumulates into the leaf; a hook after each
accumulation moves the gradient to its module's gradient store (``RingGradients``, which every ring
layer of the module is handed when it is made), which writes it into the parameter's ``.grad`` (a
DTensor made without autograd) at the module's post-backward, or when the backward ends for a module
that has none, and then runs the parameter's hooks. The store also keeps the module's gradient
settings (synchronise or not, the divisor) and, while synchronisation is off, the full-size local
accumulators.

Under HSDP (a 2-D mesh) that write waits for one all-reduce over the replicate dimension of everything
the module's backward produced, ring and gathered parameters together in one flat tensor, instead of
one per ring. It starts at the module's post-backward and is waited for by the next one (or at the end
of the backward), so it overlaps the next module's backward, as FSDP2's does.

Pitfalls:
- The DTensor parameter is not in the autograd graph (as FSDP2's sharded parameters are not), so
  ``torch.autograd.grad`` with respect to it finds nothing. Hooks on it still run: ``register_hook``
  hooks on the gradient of each backward before it is accumulated, post-accumulate-grad hooks after.
- A leaf is made again when the parameter's local tensor or ``requires_grad`` changes (``to_empty``,
  ``load_state_dict(assign=True)``, freezing).
- Each backward moves what the leaves received into ``.grad``, so a leaf holds one backward's
  gradient only and the HSDP all-reduce never sums an earlier micro-batch's again.
- Nothing here may hold a weak reference to a parameter: ``module.to_empty()`` swaps them in place,
  which refuses tensors that have one.
"""

import functools
import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from .._compat import (
    current_graph_task_id,
    gradient_hooks,
    local_of,
    outside_inference_mode,
    sharded_like,
)


class _Leaf:
    __slots__ = ("local", "tensor")

    def __init__(self, local: torch.Tensor, tensor: torch.Tensor):
        self.local, self.tensor = local, tensor


class RingGradients:
    """The gradient store of one rsdp module (``RSDPState``), handed to its ring layers and gathered
    parameters when they are made: its gradient leaves; what its module's backward produced, awaiting
    ``flush``; how reduced gradients are divided (``divisor``); whether backward synchronises them
    (``requires_sync``), and the full-size local accumulators of the backwards that do not.

    It reaches the backward running through its ``ring``'s ``RingContext`` (``rsdp_shard`` on a parent
    replaces a ring's context); ``precision`` gives the dtype of an HSDP all-reduce; ``replicate_group``
    is the replicate dimension's process group under HSDP, else None; ``data_parallel_ranks`` is every
    rank that holds a replica of a shard's data."""

    def __init__(self, ring, precision, replicate_group, data_parallel_ranks: int):
        self.ring, self.precision, self.replicate_group = ring, precision, replicate_group
        self._data_parallel_ranks = data_parallel_ranks
        self.requires_sync = True  # ``set_requires_gradient_sync``
        self.divide_factor: float | None = None  # ``set_gradient_divide_factor``
        self._leaves: dict[int, _Leaf] = {}  # id(param) -> its leaf (params are held by their module)
        self._per_param: dict[int, tuple[torch.nn.Parameter, torch.Tensor]] = {}
        self._reduced: list[tuple[torch.Tensor, Callable[[torch.Tensor], None]]] = []
        # Per ring parameter: its contributions while gradient sync was off.
        self._unsynced: dict[tuple[int, str], torch.Tensor] = {}

    @property
    def divisor(self) -> float:
        """What a shard group's reduced gradient is divided by: the mean over all data-parallel ranks once
        the replica groups' are summed (HSDP, ``flush``), unless a divide factor was set."""
        return self.divide_factor or self._data_parallel_ranks

    def divide(self, reduced: torch.Tensor) -> None:
        """Divide a shard group's reduced gradient in place (``divisor``)."""
        if self.divisor != 1:
            reduced.div_(self.divisor)

    def unsynced_total(self, key, segment) -> torch.Tensor:
        """The full-size gradient (every owner's shard, ``[owners, padded shard]``) accumulated for one
        parameter of a ring while gradient sync is off: the memory cost of skipping sync, as with FSDP2.
        Keyed per parameter, so it survives a change of grouping between micro-batches."""
        if key not in self._unsynced:
            numel = segment.layout.chunk * math.prod(segment.trailing)
            self._unsynced[key] = torch.zeros(self.ring.owners, numel, dtype=segment.dtype, device=self.ring.device)
        return self._unsynced[key]

    @staticmethod
    def unsynced_shard(total: torch.Tensor, shard: int, shape: tuple[int, ...]) -> torch.Tensor:
        """Shard ``shard`` of an accumulator from ``unsynced_total``, shaped ``shape`` (its message view's)."""
        return total[shard, : math.prod(shape)].view(*shape)

    @property
    def synced_alone(self) -> bool:
        """Whether backward synchronises with nothing kept from backwards that did not: the partials are
        then the contributions alone (a ring of groups may lay them out rank-major, ``_linear.py``)."""
        return self.requires_sync and not self._unsynced

    def take_unsynced(self, key) -> torch.Tensor | None:
        """The accumulator of ``key``, if backwards without synchronisation made one, to add in the
        synchronised backward running; it is gone from the store afterwards."""
        return self._unsynced.pop(key, None)

    def leaf(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The tensor a ring function computes with for ``param`` (a DTensor)."""
        local = local_of(param)
        entry = self._leaves.get(id(param))
        if entry is None or entry.local is not local or entry.tensor.requires_grad != param.requires_grad:
            with outside_inference_mode():
                tensor = local.detach()
            if param.requires_grad:
                tensor.requires_grad_()
                tensor.register_post_accumulate_grad_hook(functools.partial(self._received, param))
            entry = self._leaves[id(param)] = _Leaf(local, tensor)
        return entry.tensor

    def _received(self, param: torch.nn.Parameter, leaf: torch.Tensor) -> None:
        grad, leaf.grad = leaf.grad, None
        if grad is not None:  # the hook also runs when a function returned no gradient (sync off)
            self.receive(param, grad)

    def receive(self, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
        """``param``'s gradient (its local shard's) from this backward: what its leaf received, or what a
        ring function hands over itself because it arrives after the function returned."""
        self.ring.context.running_backward.holds(self)
        earlier = self._per_param.get(id(param))
        if earlier is None:
            self._per_param[id(param)] = (param, grad)
        else:  # used again in this backward (a tied weight): summed in place, as autograd would
            earlier[1].add_(grad)

    def add_reduced(self, reduced: torch.Tensor, finish: Callable[[torch.Tensor], None]) -> None:
        """A flat tensor of reduced gradients from this backward (the gathered parameters'), for
        ``finish`` to write once the replicas have summed it (under HSDP) at the next flush."""
        self.ring.context.running_backward.holds(self)
        self._reduced.append((reduced, finish))

    def drop(self) -> None:
        self._per_param, self._reduced = {}, []

    def flush(self) -> None:
        """Write what this backward produced into ``.grad``; under HSDP after one all-reduce (per
        dtype), started now and finished by the next flush or at the end of the backward."""
        parts = [(grad, functools.partial(write_gradient, param)) for param, grad in self._per_param.values()]
        parts += self._reduced
        self.drop()
        running = self.ring.context.running_backward
        running.flushed(self)
        group = self.replicate_group
        if group is None:
            for tensor, finish in parts:
                finish(tensor)
            return
        running.finish_all_reduces()
        by_dtype: dict[torch.dtype, list] = {}
        for tensor, finish in parts:
            by_dtype.setdefault(self.precision.reduce_dtype(tensor.dtype), []).append((tensor, finish))
        for dtype, same in by_dtype.items():
            flat = torch.cat([tensor.reshape(-1).to(dtype) for tensor, _ in same])
            running.all_reduce(flat, group, same)


def _finish(flat: torch.Tensor, parts: list) -> None:
    offset = 0
    for tensor, finish in parts:
        finish(flat[offset : offset + tensor.numel()].view(*tensor.shape).to(tensor.dtype))
        offset += tensor.numel()


def write_gradient(param: torch.nn.Parameter, grad: torch.Tensor) -> None:
    """``grad`` into ``param.grad`` (a DTensor laid out like ``param``), as autograd would accumulate it
    into a leaf: its ``register_hook`` hooks first, its post-accumulate-grad hooks after."""
    new = sharded_like(grad, param)
    before, after = gradient_hooks(param)
    for hook in before:
        changed = hook(new)
        new = new if changed is None else changed
    if param.grad is None:
        param.grad = new
    else:
        local_of(param.grad).add_(local_of(new))
    for hook in after:
        hook(param)


class RunningBackward:
    """The states holding gradients of the backward now running, in the order the backward reached
    them (the same on every rank, so the flushes at its end issue matching all-reduces), and the HSDP
    all-reduces started and not yet finished. A backward ends by flushing them all; one that raised
    leaves them behind, and the next forward drops them (``abandon``) rather than let an abandoned
    backward's gradients be added to the next one's."""

    def __init__(self, context):
        self._context = context
        self.pending: dict[int, RingGradients] = {}
        self.in_flight: list[tuple] = []

    def holds(self, gradients: RingGradients) -> None:
        self.pending.setdefault(id(gradients), gradients)
        self._context.end_with_backward(self)

    def flushed(self, gradients: RingGradients) -> None:
        self.pending.pop(id(gradients), None)

    def all_reduce(self, flat: torch.Tensor, group, parts: list) -> None:
        if current_graph_task_id() == -1:  # a flush outside backward: nothing to overlap with
            dist.all_reduce(flat, group=group)
            _finish(flat, parts)
            return
        self.in_flight.append((dist.all_reduce(flat, group=group, async_op=True), flat, parts))
        self._context.end_with_backward(self)

    def finish_all_reduces(self) -> None:
        while self.in_flight:
            work, flat, parts = self.in_flight.pop(0)
            work.wait()
            _finish(flat, parts)

    def end_of_backward(self) -> None:
        """Flush the states whose module ran no post-backward (its inputs needed no gradient, or it has
        no hooks to run one) and finish the all-reduces: step 4 of ``RingContext``'s end of backward,
        after the steps that hand it gradients."""
        for gradients in list(self.pending.values()):
            gradients.flush()
        self.finish_all_reduces()

    def abandon(self) -> None:
        """Drop what a backward that raised left behind (called as a forward starts outside backward)."""
        if not self.pending and not self.in_flight:
            return
        for gradients in self.pending.values():
            gradients.drop()
        self.pending.clear()
        for work, _, _ in self.in_flight:
            work.wait()  # unwaited, gloo would match a later message to it
        self.in_flight.clear()

