"""FSDP2: torch's ``fully_shard`` on every decoder layer, then on the root (embedding and output Linear).

    python benchmarks/rtp/fsdp_benchmark.py --use_synthetic_data [--nproc 4 --device cpu ...]
"""

import torch.nn as nn
from torch.distributed.fsdp import fully_shard

import common


def parallelize(model: nn.Module, worker: common.Worker) -> nn.Module:
    policy = common.mixed_precision(worker)
    for layer in model.layers:
        fully_shard(layer, mesh=worker.mesh, mp_policy=policy)
    return fully_shard(model, mesh=worker.mesh, mp_policy=policy)


if __name__ == "__main__":
    common.main(common.Strategy("fsdp", parallelize))
