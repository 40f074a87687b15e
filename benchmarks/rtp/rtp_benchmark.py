"""RSDP: ``rsdp.rsdp_shard`` on every decoder layer, then on the root, used exactly like FSDP2's
``fully_shard``; Linear and Embedding weight shards rotate on a ring instead of being all-gathered.

    python benchmarks/rtp/rtp_benchmark.py --use_synthetic_data [--nproc 4 --device cpu ...]
"""

import torch.nn as nn

import common
from rsdp import rsdp_shard


def parallelize(model: nn.Module, worker: common.Worker) -> nn.Module:
    policy = common.mixed_precision(worker)
    for layer in model.layers:
        rsdp_shard(layer, mesh=worker.mesh, mp_policy=policy)
    return rsdp_shard(model, mesh=worker.mesh, mp_policy=policy)


if __name__ == "__main__":
    common.main(common.Strategy("rtp", parallelize))
