"""RSDP: ``rsdp.rsdp_shard`` on every decoder layer, then on the root, used exactly like FSDP2's
``fully_shard``; Linear and Embedding weight shards rotate on a ring instead of being all-gathered.

Each decoder layer gets tensor parallelism's plan as its ring plan (``DECODER_LAYER_PLAN``), so its
attention and its FFN rotate as one ring each, when the heads and the FFN width divide by the ranks;
otherwise each Linear (q/k/v together) rotates on its own ring. The MoE model (``--experts``) gets
Hugging Face's plan (its attention one ring, when the heads divide); its experts rotate in blocks of
whole experts whatever the plan. With ``--ring_group_size`` g > 1 the ranks form a ring of groups of g
(``rsdp_shard``'s ``ring_group_size``), plans and experts included (experts in blocks of a group's experts).

    python benchmarks/rtp/rtp_benchmark.py --use_synthetic_data [--nproc 4 --device cpu ...]
"""

import torch.nn as nn

from rsdp import rsdp_shard

import common
from transformer_lm import DECODER_LAYER_PLAN


def parallelize(model: nn.Module, worker: common.Worker) -> nn.Module:
    args = worker.args
    moe = args.experts > 0
    group = args.ring_group_size
    plannable = args.nhead % worker.world_size == 0 and (moe or args.nhid % worker.world_size == 0)
    if worker.rank == 0:
        planned = "attention as one ring, experts in blocks" if moe else "attention and FFN as one ring each"
        print(f"[rtp] ring plan: {planned if plannable else 'none (heads or nhid do not divide)'}")
    plan = (model.ring_plan if moe else DECODER_LAYER_PLAN) if plannable else None
    policy = common.mixed_precision(worker)
    for layer in model.layers:
        rsdp_shard(layer, mesh=worker.mesh, mp_policy=policy, ring_plan=plan, ring_group_size=group)
    return rsdp_shard(model, mesh=worker.mesh, mp_policy=policy, ring_group_size=group)


if __name__ == "__main__":
    common.main(common.Strategy("rtp", parallelize))
