"""The cost model's FSDP2 peak and step time against one GPU: a Llama-3-8B-shaped decoder (dim 4096, 32
heads without GQA, FFN 14336, vocabulary 128256) of a few layers, batch 2, torchtitan's selective
per-op activation checkpointing, bf16 parameters with fp32 reduction, AdamW.

    python benchmarks/planner_gpu_check.py --layers 4 --seq 2048 8192             # on the GPU (80 GB: 32768 does not fit)
    python benchmarks/planner_gpu_check.py --layers 4 --seq 2048 8192 --predict   # here, on meta

Each prints, per sequence length, allocated and reserved peaks and the forward + backward time (the
prediction: allocated, reserved as the caching allocator model replays the step with and without
expandable segments, and the H100 preset's compute time for the step). Run the measurement with and
without ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (torchtitan's launcher sets it) to check
both allocator modes. Self-contained (torch only), so that it runs on a machine without torchtitan.
"""

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

DIM, HEADS, FFN, VOCAB, BATCH = 4096, 32, 14336, 128256, 2
FLASH = torch.ops.aten._scaled_dot_product_flash_attention


class RMSNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(DIM))

    def forward(self, x):
        return F.rms_norm(x, (DIM,), self.weight)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.ffn_norm = RMSNorm(), RMSNorm()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        self.w1, self.w3 = nn.Linear(DIM, FFN, bias=False), nn.Linear(DIM, FFN, bias=False)
        self.w2 = nn.Linear(FFN, DIM, bias=False)

    def forward(self, x):
        h = self.attention_norm(x)
        batch, seq, _ = h.shape
        q, k, v = (w(h).view(batch, seq, HEADS, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        attended = FLASH(q, k, v, is_causal=True)[0]  # the GPU's kernel, and the count's on meta
        x = x + self.wo(attended.transpose(1, 2).reshape(batch, seq, DIM))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


def selective_policy():
    """torchtitan's per-op SAC: save matmuls but every second one, and attention; recompute the rest."""
    matmuls = [0]

    def policy(ctx, func, *args, **kwargs):
        if func == torch.ops.aten.mm.default:
            matmuls[0] += 1
            return CheckpointPolicy.PREFER_RECOMPUTE if matmuls[0] % 2 == 0 else CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.MUST_SAVE if func == FLASH.default else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


class Decoder(nn.Module):
    def __init__(self, layers: int):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(checkpoint_wrapper(Block(), context_fn=selective_policy) for _ in range(layers))
        self.norm = RMSNorm()
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def loss_fn(model, tokens):
    return F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten())


def predict(layers: int, seq: int) -> None:
    import dataclasses

    from rsdp import Strategy
    from rsdp.planner import _hardware
    from rsdp.planner._cost_model import count, estimate_root, estimate_units
    from rsdp.planner._plan import predict_uniform
    from rsdp.planner._profile import find_units

    with torch.device("meta"):
        model = Decoder(layers)
    units = find_units(model)
    tokens = torch.zeros(BATCH, seq + 1, dtype=torch.long, device="meta")
    counts = count(model, units, tokens, loss_fn, torch.bfloat16)
    h100 = _hardware.PRESETS["h100-sxm-nvlink"].cost_model(1, torch.bfloat16, torch.float32)
    peaks = {}
    for allocator in (None, "segments", "expandable_segments"):
        peaks[allocator], _ = predict_uniform(counts, units, Strategy.FSDP, dataclasses.replace(h100, caching_allocator=allocator))
    root = estimate_root(counts, Strategy.FSDP, h100)
    seconds = root.before.seconds + root.middle.seconds + root.after.seconds + sum(
        unit.forward.seconds + unit.backward.seconds for unit in estimate_units(counts, Strategy.FSDP, Strategy.FSDP, h100).values()
    )
    GiB = 2**30
    print(f"layers {layers} seq {seq}: predicted allocated {peaks[None] / GiB:.3f} GiB, reserved {peaks['segments'] / GiB:.3f} "
          f"(segments) / {peaks['expandable_segments'] / GiB:.3f} GiB (expandable), forward+backward {seconds * 1e3:.1f} ms "
          f"(compute only), {BATCH * seq / seconds:.0f} tokens/s")


def measure(layers: int, seq: int) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29511", rank=0, world_size=1)
    torch.cuda.set_device(0)
    torch.cuda.empty_cache()  # the previous sequence length's blocks: not this one's reserved memory
    with torch.device("cuda"):
        model = Decoder(layers)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for unit in (model.tok_embeddings, *model.layers, model.norm, model.lm_head, model):
        fully_shard(unit, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
    tokens = torch.randint(0, VOCAB, (BATCH, seq + 1), device="cuda")
    for step in range(4):
        if step == 3:  # steady state: optimizer state exists
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            started = time.perf_counter()
        loss_fn(model, tokens).backward()
        if step == 3:
            torch.cuda.synchronize()
            seconds = time.perf_counter() - started  # forward + backward, what the prediction covers
        optimizer.step()
        optimizer.zero_grad()
    torch.cuda.synchronize()
    stats, GiB = torch.cuda.memory_stats(), 2**30
    print(
        f"layers {layers} seq {seq}: allocated {stats['allocated_bytes.all.peak'] / GiB:.3f} GiB, reserved "
        f"{stats['reserved_bytes.all.peak'] / GiB:.3f} GiB, forward+backward {seconds * 1e3:.1f} ms, {BATCH * seq / seconds:.0f} tokens/s"
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, nargs="+", default=[8192])
    parser.add_argument("--predict", action="store_true", help="the cost model's peak and time, on the meta device")
    args = parser.parse_args()
    for seq in args.seq:
        (predict if args.predict else measure)(args.layers, seq)
