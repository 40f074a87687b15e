from ._api import RSDPModule, rsdp_shard
from ._ring import release_ring_buffers

__all__ = ["RSDPModule", "release_ring_buffers", "rsdp_shard"]
