"""rsdp: Re-distributed Sharded Data Parallel for PyTorch.

``rsdp_shard`` is used like FSDP2's ``fully_shard`` but never all-gathers a layer's weights: shards of
Linear and Embedding weights rotate between ranks, each rank computes with the shard it holds, and
gradients reduce on the ring back to their owners. ``parallelize`` chooses replicate, FSDP or RSDP per
module.
"""

from ._compat import MixedPrecisionPolicy
from ._fully_shard import (
    RSDPModule,
    register_rsdp_forward_method,
    release_ring_buffers,
    ring_checkpoint_context,
    rsdp_shard,
)
from .planner import CostModel, Plan, Planner, plan
from .policy import Strategy, parallelize

__all__ = ["CostModel", "MixedPrecisionPolicy", "Plan", "Planner", "RSDPModule", "Strategy", "parallelize", "plan", "register_rsdp_forward_method", "release_ring_buffers", "ring_checkpoint_context", "rsdp_shard"]
