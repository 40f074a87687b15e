"""The parameters of an rsdp module that do not rotate: gathered whole around its forward and backward,
like FSDP2's.

Vectors — norm weights, biases of layers other than stock Linears, free 1-D ``nn.Parameter``s — are used
whole by elementwise ops (every matrix rotates, op by op: ``_operand.py``). They stay ``Shard(0)`` at rest (so the optimizer state is sharded too);
they are all-gathered in one flat collective over the shard dimension of the mesh, and their gradients
reduce-scattered in one: per pass, not per module. The outermost rsdp forward gathers the vectors of
every rsdp module under it at once (``gather_together``; a module's own forward then finds them
current), and each module's post-backward queues its contributions for one reduce-scatter when the
backward ends (``PENDING_REDUCTIONS``): a vector's collective costs its latency, not its bytes.

While installed they are **leaf** ``nn.Parameter``s, one persistent tensor per parameter whose storage
is allocated for a gather and freed afterwards (FSDP2's unsharded parameters): tools that hook module
parameters during forward (torch's ``MemTracker``, ``register_post_accumulate_grad_hook``) work, and
autograd saves the same tensor the backward's gather refills. Their gradients land in ``.grad`` of the
full tensors; once reduce-scattered they go to the module's ``RingGradients`` (``_grad.py``), which
writes the ``Shard(0)`` ``.grad``. Under HSDP the module's post-backward reduce-scatters its own at
once, so that they join the one all-reduce over replicas it makes of the module's gradients.

Resharding after forward (``reshard_after_forward=True``) frees the full tensors between forward and
backward, which then gathers them again: one more all-gather per module and step. rsdp's default keeps
them (FSDP2's ``reshard_after_forward=False``): each costs one activation row.

Pitfalls:
- A parameter no rank used gets ``None`` as its gradient, as with FSDP2, not a zero (AdamW would decay
  it). Each rank adds one "used" flag per parameter to every rank's segment of the reduce-scatter, so
  whether *some* rank (of any replica) used it arrives with the gradients and costs no collective; only
  a rank that did not use it itself reads its flag (a host sync on CUDA, in that case alone).
- The refill must not bump the version counter of the tensor autograd saved
  (``preserve_version_counter``), or backward would report an in-place modification.
- A module gathered at the start of the pass does not gather again in it: gathered tensors are
  current for the pass they were gathered in (``gathered_in_pass``); a module called on its own (not
  under the module that started the pass), or in a later pass, gathers its own.
- The gradients of the gathered parameters are written when the backward ends, not at the module's
  post-backward (except under HSDP): their hooks run then.
"""

import functools
import math

import torch
import torch.nn as nn

from .._compat import (
    all_gather_flat,
    at_end_of_backward,
    current_graph_task_id,
    in_backward,
    local_of,
    preserve_version_counter,
    reduce_scatter_flat,
)
from ._grad import write_gradient
from ._param import shard_layout


class GatheredParams:
    """The non-rotating parameters of one rsdp module, laid out as one padded flat segment per rank."""

    def __init__(self, state, params: list[nn.Parameter], reshard_after_forward: bool):
        self.state = state
        self.params = params
        self.reshard_after_forward = reshard_after_forward
        self.layouts = [shard_layout(p.shape[0], state.ring.size) for p in params]
        self.trailing = [p.shape[1:] for p in params]
        self._inner = [math.prod(shape) for shape in self.trailing]
        self._offsets = [0]
        for layout, inner in zip(self.layouts, self._inner):
            self._offsets.append(self._offsets[-1] + layout.chunk * inner)
        self.full: list[nn.Parameter] | None = None
        self.is_gathered = False
        self.gathered_in_pass = -1  # the forward pass (``_state.py``) whose start last gathered them
        # Contributions (with their "used" flags) of backwards run while gradient sync was off.
        self.unsynced: torch.Tensor | None = None
        self.unsynced_used = [False] * len(params)

    @property
    def segment_numel(self) -> int:
        return self._offsets[-1]

    @property
    def requires_grad(self) -> bool:
        return any(p.requires_grad for p in self.params)

    def segment_view(self, flat: torch.Tensor, index: int, shard: int) -> torch.Tensor:
        """Shard ``shard`` of parameter ``index`` inside one rank's flat segment."""
        rows = self.layouts[index].rows_of(shard)
        offset = self._offsets[index]
        return flat[offset : offset + rows * self._inner[index]].view(rows, *self.trailing[index])

    def every_shard(self, segments: torch.Tensor, index: int, full: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Parameter ``index``'s rows in ``segments`` (``[W, segment]``: every rank's flat segment) and in
        ``full`` (the whole parameter, or its gradient; contiguous), as at most two pairs of views of
        the same rows, ``(in full, in segments)``: the whole shards, and the last, short one. Copying
        those is two ops per parameter instead of one per rank (a host dispatch each)."""
        layout, trailing = self.layouts[index], self.trailing[index]
        if layout.rows == 0:
            return []
        offset = self._offsets[index]
        shards = segments[:, offset : offset + layout.chunk * self._inner[index]].view(layout.world, layout.chunk, *trailing)
        whole, rest = divmod(layout.rows, layout.chunk)
        pairs = [(full[: whole * layout.chunk].view(whole, layout.chunk, *trailing), shards[:whole])]
        if rest:
            pairs.append((full[whole * layout.chunk :], shards[whole, :rest]))
        return pairs

    @property
    def gather_key(self) -> tuple:
        """What modules whose parameters are gathered in one collective share: the shard group, the
        dtype on the wire and the device."""
        return (self.state.ring.group, self.state.compute_dtype(self.params[0].dtype), self.state.device)

    def gather(self) -> list[nn.Parameter]:
        """All-gather the full parameters into their persistent leaf tensors."""
        gather_together([self])
        return self.full

    def _pack(self, send: torch.Tensor) -> None:
        for index, param in enumerate(self.params):
            self.segment_view(send, index, self.state.ring.rank).copy_(local_of(param))

    def _unpack(self, received: torch.Tensor) -> None:
        """The full parameters from ``received`` (``[W, segment]``: every rank's segment)."""
        state, dtype = self.state, received.dtype
        if self.full is None:
            self.full = [
                nn.Parameter(torch.empty(p.shape, dtype=dtype, device=state.device), requires_grad=p.requires_grad)
                for p in self.params
            ]
        elif not self.is_gathered:
            for full in self.full:
                full.untyped_storage().resize_(full.numel() * full.element_size())
        for index, (full, param) in enumerate(zip(self.full, self.params)):
            full.requires_grad_(param.requires_grad)
            with torch.no_grad(), preserve_version_counter(full):
                for rows, shards in self.every_shard(received, index, full):
                    rows.copy_(shards)
        self.is_gathered = True

    def free(self) -> None:
        if self.is_gathered:
            for full in self.full:
                full.untyped_storage().resize_(0)
            self.is_gathered = False

    def reduce_gradients(self) -> None:
        """Reduce-scatter the gradients accumulated in the full tensors into the sharded parameters'
        ``.grad`` (or keep them locally while gradient sync is off)."""
        state, world, count = self.state, self.state.ring.size, len(self.params)
        if not self.requires_grad:
            return
        grads = [full.grad for full in self.full]
        used_here = [grad is not None or earlier for grad, earlier in zip(grads, self.unsynced_used)]
        for full in self.full:
            full.grad = None
        dtype = state.reduce_dtype(self.params[0].dtype)
        # [W, segment | one "used" flag per parameter]: rank r receives the sum of everyone's flags.
        contributions = torch.zeros(world, self.segment_numel + count, dtype=dtype, device=state.device)
        used = [index for index, grad in enumerate(grads) if grad is not None]
        for index in used:
            for rows, shards in self.every_shard(contributions, index, grads[index].contiguous()):
                shards.copy_(rows)
        flags = contributions[:, self.segment_numel :]
        if len(used) == count:  # the usual case: one op sets them all
            flags.fill_(1)
        else:
            for index in used:
                flags[:, index] = 1

        if not state.requires_gradient_sync:
            if self.unsynced is None:
                self.unsynced = contributions
            else:
                self.unsynced.add_(contributions)
            self.unsynced_used = used_here
            return
        if self.unsynced is not None:
            contributions.add_(self.unsynced)
            self.unsynced, self.unsynced_used = None, [False] * count

        if state.replicate_group is None and in_backward():
            PENDING_REDUCTIONS.add(self, contributions, used_here)
            return
        # Under HSDP each module's reduced gradients join its one all-reduce over replicas at once.
        reduced = torch.empty(self.segment_numel + count, dtype=dtype, device=state.device)
        reduce_scatter_flat(reduced, contributions.view(-1), group=state.ring.group)
        self.finish_reduction(reduced, used_here)

    def finish_reduction(self, reduced: torch.Tensor, used_here: list[bool]) -> None:
        """This rank's segment of the reduced gradients (and "used" flags): divided, then written."""
        self.state.divide_gradient(reduced)
        self.state.gradients.add_reduced(reduced, functools.partial(self._write_gradients, used_here))

    def _write_gradients(self, used_here: list[bool], reduced: torch.Tensor) -> None:
        """Each used parameter's shard of ``reduced`` (summed over replicas, under HSDP) into its ``.grad``."""
        for index, (param, used) in enumerate(zip(self.params, used_here)):
            if not param.requires_grad:
                continue
            if not used and not bool(reduced[self.segment_numel + index] > 0):
                continue  # no rank used it
            write_gradient(param, self.segment_view(reduced, index, self.state.ring.rank).to(param.dtype))


def gather_together(modules: list[GatheredParams]) -> None:
    """All-gather the parameters of several modules (of one ``gather_key``) in one collective: the
    outermost rsdp forward gathers every module's under it so (``RSDPState.gather_nested``), one
    collective per step instead of one per module, as each module's vectors are small and a
    collective's cost is mostly its latency."""
    state = modules[0].state
    dtype, world = modules[0].gather_key[1], state.ring.size
    offsets = [0]
    for module in modules:
        offsets.append(offsets[-1] + module.segment_numel)
    send = torch.empty(offsets[-1], dtype=dtype, device=state.device)
    for module, start, stop in zip(modules, offsets, offsets[1:]):
        module._pack(send[start:stop])
    received = torch.empty(world, offsets[-1], dtype=dtype, device=state.device)
    all_gather_flat(received.view(-1), send, group=state.ring.group)
    for module, start, stop in zip(modules, offsets, offsets[1:]):
        module._unpack(received[:, start:stop])


class _PendingReductions:
    """The gathered parameters' gradients of the backward running, reduce-scattered together when it
    ends: one collective per backward (per dtype) instead of one per module, as for the gather.

    Modules queue in the order their backward finishes, which the autograd graph fixes alike on every
    rank (as the per-module collectives already required), so every rank lays the message out alike.
    A nested backward (a reentrant checkpoint's) reduces its own at its end; a backward that raised
    leaves its queue behind, dropped when the next forward starts.
    """

    def __init__(self):
        self._queued: dict[int, list] = {}  # graph task -> [(module, contributions, used flags)]

    def add(self, module: GatheredParams, contributions: torch.Tensor, used_here: list[bool]) -> None:
        task = current_graph_task_id()
        if task not in self._queued:
            self._queued[task] = []
            at_end_of_backward(functools.partial(self._reduce, task))
        self._queued[task].append((module, contributions, used_here))

    def _reduce(self, task: int) -> None:
        batches: dict[tuple, list] = {}
        for entry in self._queued.pop(task, []):
            module, contributions, _ = entry
            batches.setdefault((module.state.ring.group, contributions.dtype, module.state.device), []).append(entry)
        for batch in batches.values():
            state = batch[0][0].state
            contributions = torch.cat([contributions for _, contributions, _ in batch], dim=1)
            reduced = torch.empty(contributions.shape[1], dtype=contributions.dtype, device=state.device)
            reduce_scatter_flat(reduced, contributions.view(-1), group=state.ring.group)
            offset = 0
            for module, part, used_here in batch:
                module.finish_reduction(reduced[offset : offset + part.shape[1]], used_here)
                offset += part.shape[1]

    def abandon(self) -> None:
        self._queued.clear()


PENDING_REDUCTIONS = _PendingReductions()
