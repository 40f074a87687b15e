"""RSDP: ``rsdp.rsdp_shard`` on every decoder layer, then on the root, used exactly like FSDP2's
``fully_shard``; Linear and Embedding weight shards rotate on a ring instead of being all-gathered.

Each decoder layer gets tensor parallelism's plan as its ring plan (``DECODER_LAYER_PLAN``), so its
attention and its FFN rotate as one ring each, when the heads and the FFN width divide by the ranks;
otherwise each Linear (q/k/v together) rotates on its own ring. In the MoE model (``--experts``) the
experts rotate in blocks of whole experts and each attention is gathered whole: ``rsdp_shard`` on it
with Hugging Face's plan and ``ring_group_size`` = W, a ring of one group, so one all-gather of its
q/k/v/o (FSDP's pattern) and one run of the attention. Its weights are a few percent of the layer's,
so gathering them adds little to the peak, where a ring of W steps would run the attention once per
shard (docs/benchmarks.md, "Mixture of experts"). With ``--ring_group_size`` g > 1 the ranks form a
ring of groups of g (``rsdp_shard``'s ``ring_group_size``), plans and experts included (experts in
blocks of a group's experts; the MoE model's attention stays gathered whole).

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
    policy = common.mixed_precision(worker)
    if moe:
        # Without the plan (heads that do not divide) q/k/v and o are gathered apart: two all-gathers.
        plan = model.ring_plan if args.nhead % worker.world_size == 0 else None
        if worker.rank == 0:
            print(f"[rtp] experts in blocks, attention gathered whole ({'one' if plan else 'two'} all-gathers)")
        for layer in model.layers:
            rsdp_shard(layer.self_attn, mesh=worker.mesh, mp_policy=policy, ring_plan=plan, ring_group_size=worker.world_size)
            rsdp_shard(layer, mesh=worker.mesh, mp_policy=policy, ring_group_size=group)
        return rsdp_shard(model, mesh=worker.mesh, mp_policy=policy, ring_group_size=group)
    plannable = args.nhead % worker.world_size == 0 and args.nhid % worker.world_size == 0
    if worker.rank == 0:
        print(f"[rtp] ring plan: {'attention and FFN as one ring each' if plannable else 'none (heads or nhid do not divide)'}")
    plan = DECODER_LAYER_PLAN if plannable else None
    for layer in model.layers:
        rsdp_shard(layer, mesh=worker.mesh, mp_policy=policy, ring_plan=plan, ring_group_size=group)
    return rsdp_shard(model, mesh=worker.mesh, mp_policy=policy, ring_group_size=group)


if __name__ == "__main__":
    common.main(common.Strategy("rtp", parallelize))
