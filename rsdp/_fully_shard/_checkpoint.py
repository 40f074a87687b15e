"""Ring outputs under activation checkpointing: kept from the forward, not recomputed.

Activation checkpointing runs a region's forward again in backward to rebuild what it saved. A ring
layer in the region would rotate its weights a second time there: 4(W-1)/W of the parameters on the
wire per step instead of the ZeRO-3 figure 3(W-1)/W, and W-1 more exchanges per ring. So inside a
*selective* activation checkpointing region (torch's SAC: ``checkpoint(..., context_fn=...)`` with
``create_selective_checkpoint_contexts``, which torchtitan's default ``selective`` AC uses) every ring
layer keeps its outputs — the way SAC policies keep collectives' outputs — and the recomputation
takes them back instead of running the ring: the cheap work between ring layers is recomputed, the
communication is not. The region keeps one activation per ring output in exchange.

Full checkpointing (a plain ``checkpoint(fn)``, Hugging Face's ``gradient_checkpointing_enable()``)
has no such region; :func:`ring_checkpoint_context` is the ``context_fn`` that gives it one with
nothing else saved: recompute everything but the ring outputs.

Pitfalls:
- SAC finds each op's saved output by counting that op's calls, so the ops a ring issues in the
  forward are counted again in the recomputation, which skips them (``_ring_op_counts``).
- A kept output modified in place after the forward (``nn.ReLU(inplace=True)`` on a Linear's output)
  no longer holds the ring's result: the recomputation then runs the ring again (always correct).
- The recomputation must call the ring layers in the forward's order, as SAC requires of every op;
  if it does not, rsdp raises rather than hand one layer's output to another.
"""

import collections
from collections.abc import Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from .._compat import selective_checkpoint_policy, selective_checkpoint_region

# The key of rsdp's queue of kept ring outputs in a SAC region's storage (torch's keys are ops).
_KEPT_RING_OUTPUTS = object()


class _Kept:
    """A ring's outputs (and what else its forward returned about them), kept for the recomputation."""

    def __init__(self, layer, outputs: tuple, op_counts: dict):
        self.layer = layer
        self.outputs = tuple(out.detach() if isinstance(out, torch.Tensor) else out for out in outputs)
        self.versions = [(out, out._version) for out in self.outputs if isinstance(out, torch.Tensor)]
        self.op_counts = op_counts  # the ops the ring issued, per op: the recomputation counts them too

    def intact(self) -> bool:
        return all(out._version == version for out, version in self.versions)


def kept_or_run(layer, run: Callable[[], tuple]) -> tuple:
    """``run()`` (a ring's forward, returning its outputs), unless this is a SAC recomputation of a
    forward that kept them: then the kept outputs, and no communication."""
    region = selective_checkpoint_region()
    if region is None:
        return run()
    storage, op_counts, recomputing = region
    queue = storage.get(_KEPT_RING_OUTPUTS)
    if recomputing:
        if not queue:  # a second backward through the region (retain_graph), or nothing was kept
            return run()
        kept = queue.popleft()
        if kept.layer is not layer:
            raise RuntimeError(
                f"rsdp: activation checkpointing recomputed ring layer {layer.name!r} where the forward ran "
                f"{kept.layer.name!r}; a recomputation must call the ring layers in the forward's order (is "
                "the checkpointed region's control flow data- or state-dependent?)."
            )
        if not kept.intact():
            return run()
        for op, count in kept.op_counts.items():
            op_counts[op] += count
        return kept.outputs
    before = dict(op_counts)
    outputs = run()
    issued = {op: count - before.get(op, 0) for op, count in op_counts.items() if count != before.get(op, 0)}
    if queue is None:
        queue = storage[_KEPT_RING_OUTPUTS] = collections.deque()
    queue.append(_Kept(layer, outputs, issued))
    return outputs


def _recompute_all_but_ring_outputs(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


def ring_checkpoint_context():
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: full activation
    checkpointing that keeps the ring layers' outputs, so the recomputation in backward sends nothing.

    ``checkpoint(block, x, use_reentrant=False, context_fn=rsdp.ring_checkpoint_context)``; for Hugging
    Face models, ``model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant":
    False, "context_fn": rsdp.ring_checkpoint_context})``."""
    return create_selective_checkpoint_contexts(_recompute_all_but_ring_outputs)


def in_ring_checkpoint_forward() -> bool:
    """Whether the forward running is inside a ``ring_checkpoint_context`` region (the planner's count
    charges the ring outputs kept there)."""
    return selective_checkpoint_policy() is _recompute_all_but_ring_outputs
