"""Estimates instead of measurements, to plan for a cluster this machine cannot run (8 to 1024 GPUs).

One single-process training step of the model on the meta device (no memory, no compute) counts each
unit's forward FLOPs, the bytes its forward saves for backward and its parameter bytes. A
:class:`CostModel` turns those counts into the same phases the profiler measures:

- memory: parameters, gradients and optimizer state (sharded 1/W, or whole when replicated), saved
  activations, and each strategy's transient buffers: FSDP one unit's unsharded parameters in forward
  and its unsharded parameters and gradient in backward (the root's unsharded parameters through the
  whole step: FSDP2 does not reshard its root after forward); RSDP two shards of the unit's largest
  layer in forward and five in backward (two messages of a weight shard and a partial, and the
  scratch for the next contribution); replication none beyond its whole gradient;
- time: compute at ``flops_per_s`` (backward twice forward), overlapped with communication at
  ``bandwidth_bytes_per_s`` plus ``latency_s`` per message. FSDP all-gathers (W-1)/W of a unit per
  phase and reduce-scatters as much; RSDP runs W ring steps per layer and phase, each the longer of its
  share of compute and one message (a shard forward; a shard and a partial backward, one latency);
  replication all-reduces 2(W-1)/W of the gradient.

The optimizer step's time is not modelled.
"""

import copy
import dataclasses
import math

import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

from ..policy import Strategy
from ._profile import Phase, RootCost, UnitCost


@dataclasses.dataclass(frozen=True)
class CostModel:
    world_size: int
    flops_per_s: float  # achieved per device
    bandwidth_bytes_per_s: float  # per device, for collectives and point-to-point
    latency_s: float  # per message
    optimizer_state_bytes_per_param_byte: float = 2.0  # AdamW keeps two moments


@dataclasses.dataclass
class _Counts:
    """What one part of the model holds and does in one step, counted on the meta device."""

    param_bytes: int = 0
    largest_layer_bytes: int = 0
    layers: int = 0
    forward_flops: int = 0
    saved_bytes: int = 0

    def add_layer(self, module: nn.Module, seen: set[int]) -> None:
        """Count ``module``'s own parameters, each parameter once however often it is tied (``seen``
        holds the identities of the original model's parameters, which moving to meta does not keep)."""
        originals = getattr(module, "_rsdp_original_params", {})
        layer_bytes = 0
        for name, param in module.named_parameters(recurse=False):
            identity = originals.get(name, id(param))
            layer_bytes += param.numel() * param.element_size()
            if identity not in seen:
                seen.add(identity)
                self.param_bytes += param.numel() * param.element_size()
        if layer_bytes:  # a tied weight is stored once but still moves wherever it is used
            self.layers += 1
            self.largest_layer_bytes = max(self.largest_layer_bytes, layer_bytes)


def count(model: nn.Module, units: list[str], batch: torch.Tensor, loss_fn) -> tuple[dict[str, _Counts], _Counts, _Counts]:
    """Counts for every unit, for the root's work before the first unit, and for the root's work after
    it (the head and the loss)."""
    meta = copy.deepcopy(model).to("meta")
    for original, moved in zip(model.modules(), meta.modules()):
        moved._rsdp_original_params = {name: id(p) for name, p in original.named_parameters(recurse=False)}
    per_unit = {name: _Counts() for name in units}
    before, after = _Counts(), _Counts()
    seen: set[int] = set()
    for name in units:
        for module in meta.get_submodule(name).modules():
            per_unit[name].add_layer(module, seen)
    in_units = {id(m) for name in units for m in meta.get_submodule(name).modules()}

    flops = FlopCounterMode(display=False)
    current = {"section": before, "flops_at_entry": 0}

    def switch_to(section: _Counts) -> None:
        current["section"].forward_flops += flops.get_total_flops() - current["flops_at_entry"]
        current["section"], current["flops_at_entry"] = section, flops.get_total_flops()

    handles = []
    for name in units:
        module = meta.get_submodule(name)
        handles.append(module.register_forward_pre_hook(lambda m, args, name=name: switch_to(per_unit[name])))
        handles.append(module.register_forward_hook(lambda m, args, out: switch_to(after)))
    for module in meta.modules():
        if id(module) not in in_units and any(True for _ in module.parameters(recurse=False)):
            handles.append(module.register_forward_pre_hook(lambda m, args: current["section"].add_layer(m, seen)))

    # Autograd saves parameters (and views of them) for backward too; they are not activations.
    parameter_storages = {param.untyped_storage()._cdata for param in meta.parameters()}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.untyped_storage()._cdata not in parameter_storages:
            current["section"].saved_bytes += tensor.numel() * tensor.element_size()
        return tensor

    with flops, torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss_fn(meta, batch.to("meta"))
        switch_to(after)
    for handle in handles:
        handle.remove()
    return per_unit, before, after


class _Estimate:
    """One part's phases under one strategy, from its counts and the cost model."""

    def __init__(self, counts: _Counts, strategy: Strategy, cost: CostModel):
        self.counts, self.strategy, self.cost = counts, strategy, cost
        world = cost.world_size
        whole = strategy is Strategy.REPLICATE or world == 1
        self.local_bytes = counts.param_bytes if whole else math.ceil(counts.param_bytes / world)
        self.static_bytes = int(self.local_bytes * (1 + cost.optimizer_state_bytes_per_param_byte))
        shard = math.ceil(counts.largest_layer_bytes / world)
        self.forward_transient, self.backward_transient = {
            Strategy.REPLICATE: (0, 0),
            Strategy.FSDP: (counts.param_bytes, 2 * counts.param_bytes),
            # Two messages in flight; in backward each carries a weight shard and a partial, plus the
            # scratch where the next contribution is computed.
            Strategy.RSDP: (2 * shard, 5 * shard),
        }[strategy]

    def seconds(self, flops: float, streams: int) -> float:
        """Compute of ``flops`` overlapped with ``streams`` concurrent transfers of this part's weights
        (or gradients)."""
        cost, world, counts = self.cost, self.cost.world_size, self.counts
        compute = flops / cost.flops_per_s
        if world == 1 or counts.param_bytes == 0:
            return compute
        share = (world - 1) / world
        if self.strategy is Strategy.RSDP:
            steps = max(counts.layers, 1) * world
            # Backward's weights and partials travel in one message per step: one latency, twice the bytes.
            message = cost.latency_s + streams * counts.param_bytes / steps / cost.bandwidth_bytes_per_s
            return steps * max(compute / steps, message)
        if self.strategy is Strategy.FSDP:
            transfer = streams * (share * counts.param_bytes / cost.bandwidth_bytes_per_s + (world - 1) * cost.latency_s)
            return max(compute, transfer)
        if streams < 2:  # replication communicates in backward only
            return compute
        return max(compute, 2 * share * counts.param_bytes / cost.bandwidth_bytes_per_s + 2 * (world - 1) * cost.latency_s)

    def forward(self) -> Phase:
        saved = self.counts.saved_bytes
        return Phase(saved, saved + self.forward_transient, self.seconds(self.counts.forward_flops, 1))

    def backward(self) -> Phase:
        gradient = self.local_bytes
        return Phase(gradient - self.counts.saved_bytes, gradient + self.backward_transient, self.seconds(2 * self.counts.forward_flops, 2))


def estimate(counts, strategy: Strategy, cost: CostModel) -> tuple[dict[str, UnitCost], RootCost]:
    """The profiler's output for ``strategy`` everywhere, estimated from ``count``'s counts."""
    per_unit, before, after = counts
    costs = {}
    for name, counts in per_unit.items():
        unit = _Estimate(counts, strategy, cost)
        costs[name] = UnitCost(unit.static_bytes, unit.forward(), unit.backward(), 0.0)
    head, embedding = _Estimate(after, strategy, cost), _Estimate(before, strategy, cost)
    head_forward, head_backward = head.forward(), head.backward()
    # FSDP2 keeps its root's parameters unsharded from the start of forward to the end of backward.
    held = before.param_bytes + after.param_bytes if strategy is Strategy.FSDP and cost.world_size > 1 else 0
    start, end = embedding.forward(), embedding.backward()
    middle = Phase(
        head_forward.delta + head_backward.delta,
        held + max(head_forward.peak, head_forward.delta + head_backward.peak),
        head_forward.seconds + head_backward.seconds,
    )
    return costs, RootCost(
        head.static_bytes + embedding.static_bytes,
        Phase(start.delta + held, max(start.peak, start.delta + held), start.seconds),
        middle,
        Phase(end.delta - held, end.peak + held, end.seconds),
        0.0,
    )
