"""FSDP2: torch's ``fully_shard`` on every decoder layer, then on the root (embedding and output Linear).

    python benchmarks/rtp/fsdp_benchmark.py --use_synthetic_data [--nproc 4 --device cpu ...]
"""

import functools

from torch.distributed.fsdp import fully_shard

import common

if __name__ == "__main__":
    common.main(common.Strategy("fsdp", functools.partial(common.shard_layers_then_root, fully_shard)))
