from ._api import RSDPModule, register_rsdp_forward_method, rsdp_shard
from ._checkpoint import ring_checkpoint_context
from ._state import release_ring_buffers

__all__ = ["RSDPModule", "register_rsdp_forward_method", "release_ring_buffers", "ring_checkpoint_context", "rsdp_shard"]
