"""The largest local batch each strategy fits, full fine-tuning against LoRA, from the cost model.

For each model, the meta-device count of ``rsdp plan`` (one per local batch size, and per shorter
sequence at batch 1 where a whole sequence does not fit), then every strategy everywhere on every
world size and memory size: the largest batch whose predicted peak (reserved, as the preset's
caching-allocator model replays each count) fits, else the longest sequence at batch 1, else nothing. Prints a markdown
table (docs/planner.md, "Fine-tuning").

    python benchmarks/planner_fine_tuning.py --models torchtitan:llama3:8B torchtitan:llama3:70B
"""

import argparse

import torch

from rsdp import Strategy
from rsdp.planner import _hardware, _models, _training
from rsdp.planner._cost_model import count
from rsdp.planner._plan import predict_uniform
from rsdp.planner._profile import find_units

GiB = 2**30


def counted(spec: str, lora_rank: int, seq_len: int, batch: int, activation_checkpoint: str):
    model, loss_fn, _ = _models.build(spec, {})
    model = _training.as_trained(model, training_dtype="bf16" if lora_rank else "fp32", lora_rank=lora_rank)
    _models.apply_activation_checkpointing(model, activation_checkpoint)
    units = find_units(model)
    return count(model, units, torch.zeros(batch, seq_len + 1, dtype=torch.long), loss_fn, torch.bfloat16), units


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["torchtitan:llama3:8B", "torchtitan:llama3:70B"])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--memory-gib", type=int, nargs="+", default=[24, 48, 80])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--short-seq-lens", type=int, nargs="+", default=[1024, 512, 256])
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--activation-checkpoint", default="full")
    parser.add_argument("--hardware", default="h100-sxm-nvlink")
    args = parser.parse_args()
    hardware = _hardware.load(args.hardware)
    print(f"| model | training | GPUs | memory | {' | '.join(s.value for s in Strategy)} |")
    print("| --- | --- | --- | --- |" + " --- |" * len(Strategy))
    for spec in args.models:
        for lora_rank in (0, args.lora_rank):
            shapes = [(args.seq_len, b) for b in args.batch_sizes] + [(s, 1) for s in args.short_seq_lens]
            counts = {shape: counted(spec, lora_rank, *shape, args.activation_checkpoint) for shape in shapes}
            for world in args.world_sizes:
                cost = hardware.cost_model(world, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                for memory in args.memory_gib:
                    cells = []
                    for strategy in Strategy:
                        fits = [
                            (seq, batch) for (seq, batch), (c, units) in counts.items()
                            if predict_uniform(c, units, strategy, cost)[0] <= memory * GiB
                        ]
                        full = [batch for seq, batch in fits if seq == args.seq_len]
                        cells.append(f"{max(full)}" if full else (f"seq {max(s for s, _ in fits)}" if fits else "—"))
                    training = f"LoRA r{lora_rank}, bf16" if lora_rank else "full, fp32 AdamW"
                    print(f"| {spec.split(':')[-1]} | {training} | {world} | {memory} GiB | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
