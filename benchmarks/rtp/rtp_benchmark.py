"""RSDP: ``rsdp.rsdp_shard`` on every decoder layer, then on the root, used exactly like FSDP2's
``fully_shard``; Linear and Embedding weight shards rotate on a ring instead of being all-gathered.

    python benchmarks/rtp/rtp_benchmark.py --use_synthetic_data [--nproc 4 --device cpu ...]
"""

import functools

from rsdp import rsdp_shard

import common

if __name__ == "__main__":
    common.main(common.Strategy("rtp", functools.partial(common.shard_layers_then_root, rsdp_shard)))
