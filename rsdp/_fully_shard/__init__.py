from ._api import RSDPModule, rsdp_shard

__all__ = ["RSDPModule", "rsdp_shard"]
