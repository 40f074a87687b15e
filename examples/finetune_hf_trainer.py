"""Fine-tune a Hugging Face causal LM with transformers' ``Trainer`` (or TRL's ``SFTTrainer``) under rsdp.

    torchrun --nproc-per-node 2 examples/finetune_hf_trainer.py                    # CPU ranks (gloo)
    torchrun --nproc-per-node 2 examples/finetune_hf_trainer.py --trainer sft --lora --ring-plan
    torchrun --nproc-per-node 2 examples/finetune_hf_trainer.py --strategy fsdp rsdp   # side by side, checked
    torchrun --nproc-per-node 8 examples/finetune_hf_trainer.py --model-path ./my-llama --bf16   # GPUs (nccl)

The recipe: every rank builds the same model (the same seed, or the same local weights); LoRA adapters,
if any, go on before sharding (``peft.get_peft_model``, not the trainer's ``peft_config``); each decoder
layer is sharded, then the root (``--ring-plan``: the model's own tensor-parallel plan,
``config.base_model_tp_plan``, makes each attention and MLP one ring); then a stock trainer class with
``rsdp.integrations.transformers``'s mixin in front (``rsdp_trainer(Trainer)``) trains it: no DDP
wrapping, no gradient reduction on non-final accumulation micro-steps, clipping over DTensor gradients,
``save_model()`` writing full safetensors (or the adapters), checkpoints that resume exactly.

With several ``--strategy`` values the same script trains each in turn from the same start (``fsdp``:
``fully_shard`` by hand with the same mixin; ``ddp``: the stock trainer on the unsharded model) and
prints their losses, gradient norms, weight differences and peak memory side by side; it raises if
rsdp's losses or weights drift from the first strategy's.

No downloads: without ``--model-path`` the model is a small Qwen2 built from a config, the tokenizer a
word-level one over its ids, the data random tokens. Needs ``pip install -e '.[hf]'``.
"""

import argparse
import copy
import os
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from rsdp import release_ring_buffers, rsdp_shard
from rsdp._compat import fully_shard
from rsdp.integrations.transformers import rsdp_trainer
from rsdp.memory import MemoryTracker


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trainer", choices=["trainer", "sft"], default="trainer")
    parser.add_argument("--strategy", nargs="+", choices=["rsdp", "fsdp", "ddp"], default=["rsdp"])
    parser.add_argument("--model-path", help="a local Hugging Face causal LM directory (config, weights, tokenizer)")
    parser.add_argument("--lora", action="store_true", help="train LoRA adapters on every Linear but the LM head")
    parser.add_argument("--ring-plan", action="store_true", help="rotate each attention and MLP as one ring")
    parser.add_argument("--max-steps", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=2, help="sequences per rank and micro-step")
    parser.add_argument("--accumulation", type=int, default=2, help="micro-steps per optimizer step")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--out", help="output directory (default: a temporary one)")
    return parser.parse_args()


# Without --model-path: a small Qwen2 (grouped KV heads) with random weights, its config's defaults otherwise.
SMALL_QWEN2 = dict(vocab_size=8000, hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip



def build_model(args: argparse.Namespace):
    """The same model on every rank; LoRA adapters added before sharding."""
    import transformers

    torch.manual_seed(0)
    # A ring plan needs an attention that returns only its o_proj output: sdpa, not eager.
    load = dict(attn_implementation="sdpa")
    if args.model_path:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model_path, local_files_only=True, **load)
    else:
        model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen2Config(**SMALL_QWEN2), **load)
    if args.lora:
        import peft

        # Every Linear but the LM head; with --ring-plan they sit inside the planned attention and MLP.
        lora = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear")
        model = peft.get_peft_model(model, lora)
    return model


def shard(model, strategy: str, ring_plan: dict | None):
    """Each decoder layer, then the root: rsdp_shard, or fully_shard for FSDP2; nothing for DDP."""
    if strategy == "ddp":
        return model
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for layer in base.model.layers:
        rsdp_shard(layer, ring_plan=ring_plan) if strategy == "rsdp" else fully_shard(layer)
    rsdp_shard(model) if strategy == "rsdp" else fully_shard(model)
    return model


def ring_plan(args: argparse.Namespace, model) -> dict | None:
    """The model's tensor-parallel plan, as it is (LoRA adapters on planned Linears run per shard)."""
    return base_config(model).base_model_tp_plan if args.ring_plan else None


def tokenizer_for(args: argparse.Namespace, vocab_size: int):
    import transformers

    if args.model_path:
        return transformers.AutoTokenizer.from_pretrained(args.model_path, local_files_only=True)
    from tokenizers import Tokenizer, models

    word_level = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t1"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=word_level, pad_token="t0", eos_token="t2", unk_token="t1")


def token_dataset(args: argparse.Namespace, vocab_size: int, rows: int):
    """Random token ids: replace with your tokenized data set (``input_ids``; ``labels`` for Trainer)."""
    import datasets

    ids = torch.randint(3, vocab_size, (rows, args.seq_len), generator=torch.Generator().manual_seed(1)).tolist()
    return datasets.Dataset.from_dict({"input_ids": ids, "labels": ids})


def train(args: argparse.Namespace, base, strategy: str, out: str) -> dict:
    import transformers

    model = shard(copy.deepcopy(base), strategy, ring_plan(args, base))
    vocab = base_config(base).vocab_size
    world = dist.get_world_size()
    dataset = token_dataset(args, vocab, rows=world * args.batch_size * args.accumulation * args.max_steps)
    settings = dict(
        output_dir=os.path.join(out, strategy), per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size, gradient_accumulation_steps=args.accumulation,
        max_steps=args.max_steps, learning_rate=1e-3, max_grad_norm=1.0, logging_steps=1,
        save_strategy="steps", save_steps=args.max_steps, report_to=[], seed=0, disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),  # on CPU, accelerate makes the ranks one data-parallel job only so
        bf16=args.bf16,
    )  # fmt: skip
    if args.trainer == "sft":
        import trl

        trainer_class = trl.SFTTrainer
        extra = {"processing_class": tokenizer_for(args, vocab)}
        # SFTTrainer's defaults: its fused LM-head loss, and gradient checkpointing on.
        training_args = trl.SFTConfig(dataset_kwargs={"skip_prepare_dataset": True}, **settings)
    else:
        trainer_class, extra, training_args = transformers.Trainer, {}, transformers.TrainingArguments(**settings)
    if strategy != "ddp":
        trainer_class = rsdp_trainer(trainer_class)
    trainer = trainer_class(model=model, args=training_args, train_dataset=dataset, eval_dataset=dataset.select(range(8)), **extra)
    release_ring_buffers()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    with MemoryTracker(device) as tracker:  # above the sharded model; optimizer state included
        trainer.train()
    history = [entry for entry in trainer.state.log_history if "loss" in entry]
    final_dir = os.path.join(out, strategy, "final")
    trainer.save_model(final_dir)
    return {
        "losses": [entry["loss"] for entry in history],
        "grad_norms": [entry["grad_norm"] for entry in history],
        "eval_loss": trainer.evaluate()["eval_loss"],
        "peak_bytes": max_over_ranks(tracker.peak_bytes),
        "weights": get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)),
        "final_dir": final_dir,
    }


def base_config(model):
    return model.get_base_model().config if hasattr(model, "get_base_model") else model.config


def max_over_ranks(value: float) -> float:
    value = torch.tensor(float(value))
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


def check_reload(args: argparse.Namespace, base, result: dict) -> float:
    """Rank 0 loads the saved model in one process, as an inference engine would: the largest logit
    difference to the trained weights."""
    import transformers

    if args.lora:
        import peft

        reloaded = peft.PeftModel.from_pretrained(copy.deepcopy(base).get_base_model(), result["final_dir"])
    else:
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(result["final_dir"])
    trained = copy.deepcopy(base)
    trained.load_state_dict(result["weights"], strict=False)
    tokens = torch.randint(3, base_config(base).vocab_size, (2, args.seq_len), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        return (reloaded(input_ids=tokens).logits - trained(input_ids=tokens).logits).abs().max().item()


def main() -> None:
    args = parse_args()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank()
    out = args.out or tempfile.mkdtemp(prefix="rsdp-hf-trainer-")
    base = build_model(args)
    results = {strategy: train(args, base, strategy, out) for strategy in args.strategy}
    if rank == 0:
        strategies = list(results)
        print(f"{args.trainer}{' + LoRA' if args.lora else ''}{' + ring plan' if args.ring_plan else ''}, {dist.get_world_size()} ranks")
        print("| step | " + " | ".join(f"{s} loss | {s} grad norm" for s in strategies) + " |")
        print("| --- |" + " --- | --- |" * len(strategies))
        for step in range(len(results[strategies[0]]["losses"])):
            cells = [f"{results[s]['losses'][step]:.6f} | {results[s]['grad_norms'][step]:.6f}" for s in strategies]
            print(f"| {step + 1} | " + " | ".join(cells) + " |")
        for strategy, result in results.items():
            drift = check_reload(args, base, result)
            print(
                f"{strategy}: eval loss {result['eval_loss']:.6f}, peak memory {result['peak_bytes'] / 2**20:.2f} MiB per rank "
                f"above the sharded model, saved to {result['final_dir']} (reloaded logits within {drift:.1e})"
            )
            if drift > 1e-4:
                raise RuntimeError(f"{strategy}: the reloaded model's logits differ by {drift:.2e}")
        first = strategies[0]
        for strategy in strategies[1:]:
            loss_drift = max(abs(a - b) for a, b in zip(results[first]["losses"], results[strategy]["losses"]))
            weight_drift = max((results[first]["weights"][k] - v).abs().max().item() for k, v in results[strategy]["weights"].items())
            print(f"{strategy} against {first}: losses within {loss_drift:.2e}, weights within {weight_drift:.2e}")
            if loss_drift > 1e-4 or weight_drift > 1e-3:
                raise RuntimeError(f"{strategy}'s losses or weights drift from {first}'s")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
