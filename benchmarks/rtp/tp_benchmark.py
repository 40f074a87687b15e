"""Megatron-style tensor parallelism with ``torch.distributed.tensor.parallel``: all ranks compute one
batch together. Attention heads and FFN columns are split (q/k/v and the first FFN Linear column-wise,
the out projection and the second FFN Linear row-wise), the embedding and the output Linear are split
over the vocabulary, and the loss is computed on vocabulary-sharded logits (``loss_parallel``).

    python benchmarks/rtp/tp_benchmark.py --use_synthetic_data [--nproc 4 --device cpu ...]
"""

import argparse

import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module

import common
from transformer_lm import DECODER_LAYER_PLAN

VOCABULARY_PLAN = {
    "embed.embedding": RowwiseParallel(input_layouts=Replicate()),
    # Logits stay sharded over the vocabulary, for loss_parallel.
    "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
}


def check_heads_divide(args: argparse.Namespace, world_size: int) -> None:
    if args.experts:
        raise ValueError(
            f"--experts {args.experts}: this script's plan is the dense model's (its FFN Linears); run the MoE "
            "model with the other strategies (compare.py --preset moe leaves tp out)."
        )
    if args.nhead % world_size:
        raise ValueError(
            f"--nhead {args.nhead} is not divisible by the {world_size} ranks; tensor parallelism gives "
            "every rank whole attention heads. Choose --nhead a multiple of the rank count, or --nproc a "
            "divisor of --nhead."
        )


def parallelize(model: nn.Module, worker: common.Worker) -> nn.Module:
    model = model.to(worker.dtype)
    for layer in model.layers:
        parallelize_module(layer, worker.mesh, DECODER_LAYER_PLAN)
    return parallelize_module(model, worker.mesh, VOCABULARY_PLAN)


if __name__ == "__main__":
    common.main(
        common.Strategy(
            "tp",
            parallelize,
            same_batch_on_every_rank=True,
            loss_context=loss_parallel,
            check_config=check_heads_divide,
        )
    )
