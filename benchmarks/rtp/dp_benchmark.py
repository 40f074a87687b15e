"""Data parallelism: every rank holds the whole model; DistributedDataParallel all-reduces gradients.

    python benchmarks/rtp/dp_benchmark.py --use_synthetic_data [--nproc 4 --device cpu ...]
"""

import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

import common


def parallelize(model: nn.Module, worker: common.Worker) -> nn.Module:
    model = model.to(worker.dtype)
    device_ids = [worker.device.index] if worker.device.type == "cuda" else None
    # The only buffer is the positional encoding, a constant: no need to broadcast it every forward.
    return DistributedDataParallel(model, device_ids=device_ids, broadcast_buffers=False)


if __name__ == "__main__":
    common.main(common.Strategy("dp", parallelize))
