"""Fine-tune a Hugging Face Llama with peft LoRA under rsdp, next to FSDP2, on ``--nproc`` ranks.

    python examples/finetune_llama_lora.py --nproc 2 --steps 5
    python examples/finetune_llama_lora.py --model-path ./my-llama --nproc 4 --steps 20   # local weights
    torchrun --nproc-per-node 8 examples/finetune_llama_lora.py --device cuda --model-path ./my-llama

The recipe, for both strategies: every rank builds the same model (the same seed, or the same local
weights), wraps it with LoRA adapters on the attention projections (the base frozen), shards each decoder
layer and then the root, and builds the optimizer over the trainable parameters *after* sharding. Both
runs see the same batches from the same start, so their losses agree step by step; the script prints
them side by side with step time and peak memory per rank. It then saves the adapters (gathered to full
tensors on rank 0 with torch's ``get_model_state_dict``), loads them into a freshly sharded model
(``set_model_state_dict`` broadcasts them from rank 0) and checks that it computes the same loss.

No downloads: without ``--model-path`` the model is a small Llama built from a config with random weights;
the data is random tokens. Needs ``pip install -e '.[hf]'`` (transformers and peft).
"""

import argparse
import copy
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh

from rsdp import release_ring_buffers, rsdp_shard
from rsdp._compat import fully_shard
from rsdp.memory import MemoryTracker


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks to start here (ignored under torchrun)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--model-path", help="a local Hugging Face Llama directory (config and weights)")
    parser.add_argument("--batch-size", type=int, default=2, help="sequences per rank")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--out", help="where to save the adapters (default: a temporary directory)")
    return parser.parse_args()


def build_model(args: argparse.Namespace):
    """The same LoRA-wrapped Llama on every rank: a seeded start, or the local weights."""
    import peft
    import transformers

    torch.manual_seed(0)
    if args.model_path:
        model = transformers.LlamaForCausalLM.from_pretrained(args.model_path, local_files_only=True)
    else:
        config = transformers.LlamaConfig(
            vocab_size=8000,
            hidden_size=128,
            intermediate_size=352,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
        )
        model = transformers.LlamaForCausalLM(config)
    lora = peft.LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    return peft.get_peft_model(model, lora)


def shard(model, strategy: str, mesh):
    """Each decoder layer, then the root: the same recipe for FSDP2 and rsdp."""
    apply = rsdp_shard if strategy == "rsdp" else fully_shard
    for layer in model.base_model.model.model.layers:
        apply(layer, mesh=mesh)
    apply(model, mesh=mesh)
    return model


def batches(args: argparse.Namespace, vocab: int, rank: int, world: int, device: torch.device):
    """This rank's rows of the same global batches in every run."""
    generator = torch.Generator().manual_seed(1)
    for _ in range(args.steps):
        tokens = torch.randint(0, vocab, (world * args.batch_size, args.seq_len), generator=generator)
        yield tokens[rank * args.batch_size : (rank + 1) * args.batch_size].to(device)


def mean_over_ranks(value: torch.Tensor) -> float:
    value = value.detach().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def max_over_ranks(value: float) -> float:
    value = torch.tensor(float(value))
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


def train(args, base, strategy: str, mesh, rank: int, world: int, device: torch.device) -> dict:
    model = shard(copy.deepcopy(base).to(device), strategy, mesh)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    losses, seconds, peak = [], [], 0
    for step, tokens in enumerate(batches(args, base.config.vocab_size, rank, world, device)):
        if step == 1:
            release_ring_buffers()  # resident after the first step: counted from here on
        with MemoryTracker(device) as tracker:
            start = time.perf_counter()
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
        losses.append(mean_over_ranks(loss))
        if step > 0:
            peak = max(peak, tracker.peak_bytes)
    step_seconds = max_over_ranks(statistics.median(seconds[1:] or seconds))
    return {"model": model, "losses": losses, "step_seconds": step_seconds, "peak_bytes": max_over_ranks(peak)}


def adapter_state(model) -> dict[str, torch.Tensor]:
    """Full adapter tensors on rank 0 (empty elsewhere): every rank takes part in gathering them."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    return {name: value for name, value in state.items() if "lora_" in name}


def save_and_reload(args, base, trained, strategy: str, mesh, rank: int, world: int, device: torch.device) -> tuple[float, float]:
    """Save the trained adapters, load them into a fresh sharded model; the loss of both on one batch."""
    adapters = adapter_state(trained)
    out = args.out or tempfile.gettempdir()
    path = os.path.join(out, f"lora_adapters_{strategy}.pt")
    if rank == 0:
        os.makedirs(out, exist_ok=True)
        torch.save(adapters, path)
    dist.barrier()
    fresh = shard(copy.deepcopy(base).to(device), strategy, mesh)
    loaded = torch.load(path, weights_only=True) if rank == 0 else {}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    set_model_state_dict(fresh, loaded, options=options)
    tokens = next(batches(args, base.config.vocab_size, rank, world, device))
    with torch.no_grad():
        before = mean_over_ranks(trained(input_ids=tokens, labels=tokens).loss)
        after = mean_over_ranks(fresh(input_ids=tokens, labels=tokens).loss)
    if rank == 0:
        print(f"[{strategy}] adapters saved to {path}, reloaded: loss {before:.6f} -> {after:.6f}")
    return before, after


def run(rank: int, world: int, args: argparse.Namespace) -> None:
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    mesh = init_device_mesh(args.device, (world,))
    base = build_model(args)
    results = {strategy: train(args, base, strategy, mesh, rank, world, device) for strategy in ("fsdp", "rsdp")}
    if rank == 0:
        trainable = sum(p.numel() for p in base.parameters() if p.requires_grad)
        total = sum(p.numel() for p in base.parameters())
        print(f"Llama with LoRA: {total:,} parameters, {trainable:,} trainable; {world} ranks, {args.device}")
        print("| step | FSDP2 loss | rsdp loss |\n| --- | --- | --- |")
        for step, (a, b) in enumerate(zip(results["fsdp"]["losses"], results["rsdp"]["losses"])):
            print(f"| {step} | {a:.6f} | {b:.6f} |")
        for strategy, result in results.items():
            print(
                f"{strategy}: step time {result['step_seconds'] * 1e3:.1f} ms (median after the first, slowest rank), "
                f"peak memory {result['peak_bytes'] / 2**20:.2f} MiB per rank above parameters and optimizer state"
            )
    for strategy, result in results.items():
        before, after = save_and_reload(args, base, result["model"], strategy, mesh, rank, world, device)
        if abs(before - after) > 1e-5 * max(1.0, abs(before)):
            raise RuntimeError(f"{strategy}: reloaded adapters give loss {after}, trained ones {before}")
    drift = max(abs(a - b) for a, b in zip(results["fsdp"]["losses"], results["rsdp"]["losses"]))
    if drift > 1e-3:
        raise RuntimeError(f"rsdp's losses drift from FSDP2's by {drift:.2e}")


def _rank_main(local_rank: int, args: argparse.Namespace) -> None:
    rank, world = int(os.environ.get("RANK", local_rank)), int(os.environ.get("WORLD_SIZE", args.nproc))
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", local_rank)))
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.nproc))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=rank, world_size=world)
    try:
        run(rank, world, args)
    finally:
        dist.destroy_process_group()


def main() -> None:
    args = parse_args()
    if "LOCAL_RANK" in os.environ:  # started by torchrun
        _rank_main(int(os.environ["LOCAL_RANK"]), args)
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # fork after torch is imported is fast on CPU; CUDA cannot be forked.
    mp.start_processes(_rank_main, args=(args,), nprocs=args.nproc, start_method="spawn" if args.device == "cuda" else "fork")


if __name__ == "__main__":
    main()
