"""Hugging Face's ``Trainer`` and TRL's ``SFTTrainer`` on rsdp-sharded models, through
``rsdp.integrations.transformers``, against the same script on FSDP2 (``fully_shard`` by hand, with the
same mixin) and on DDP (the stock trainer on the unsharded model, as accelerate wraps it): per-step
losses and gradient norms, the trained weights, ``evaluate()``, and the saved model reloaded in one
process. Models (Llama, Qwen2 with grouped KV heads, a Llama whose head is tied to its embedding) are
built from configs in float64; data are random token ids.

Accelerate's own FSDP2 plugin cannot run here: it needs a GPU (``use_cpu=True`` makes accelerate's
state MULTI_CPU, which wraps in DDP and ignores ``fsdp``; without it, the Trainer refuses FSDP as "not
distributed"), hence ``fully_shard`` by hand for the FSDP2 side.

Everything runs with the defaults a user gets: the model's config (``use_cache=True``, also with a ring
plan), SFTTrainer's own loss (TRL's fused LM-head loss, which reads ``lm_head.weight`` inside its own
autograd Function) and SFTConfig's gradient checkpointing (on, with a second, ``no_grad`` forward for
its metrics between each forward and its backward).
"""

import os

import pytest
import torch
import torch.distributed as dist

from models import assert_close, draw_lora_b, full
from rsdp import rsdp_shard
from rsdp._compat import fully_shard

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
datasets = pytest.importorskip("datasets")
peft = pytest.importorskip("peft")

from rsdp.integrations.transformers import check_training_setup, rsdp_trainer  # noqa: E402

VOCAB = 37
ROWS, SEQ = 16, 8
# Llama's and Qwen2's RMSNorm compute in float32 even in a float64 model.
TOLERANCE = {"rtol": 1e-5, "atol": 1e-7}


def attention_for(name: str) -> str:
    # A planned attention must return only its o_proj output: eager attention also returns its weights.
    return "sdpa" if name.endswith("-ring") else "eager"


# The MoE model's experts implementation: batched_mm takes float64 (grouped_mm's kernel does not) and
# uses every expert's weights, which DDP needs.
MOE_EXPERTS = "batched_mm"


def _config(name: str, dropout: float):
    common = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=32, attention_dropout=dropout, attn_implementation=attention_for(name))  # fmt: skip
    if name == "qwen2" or name == "qwen2-ring":
        return transformers.Qwen2Config(num_key_value_heads=2, **common)
    if name == "qwen3_moe":  # 8 experts on the expert ring, the router's load-balancing loss in the loss
        return transformers.Qwen3MoeConfig(num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=8,
                                           output_router_logits=True, router_aux_loss_coef=0.1, experts_implementation=MOE_EXPERTS, **common)  # fmt: skip
    # 4 KV heads with a ring plan on 4 ranks: planned heads must divide by the ranks. "tied": a Llama whose
    # LM head is its embedding.
    return transformers.LlamaConfig(num_key_value_heads=4 if name == "llama-ring" else 2, tie_word_embeddings=name == "tied", **common)


def build_model(name: str, lora: bool, dropout: float = 0.0):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(name, dropout), dtype=torch.float64)
    if lora:
        # With a ring plan, the usual recipe: adapters on every Linear but the LM head, all inside planned sub-blocks.
        targets = "all-linear" if name.endswith("-ring") else ["q_proj", "v_proj", "down_proj"]
        config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets)
        model = peft.get_peft_model(model, config)
        draw_lora_b(model, 0.1)
    return model


def shard(model, strategy: str, name: str):
    """Each decoder layer, then the root; rsdp with the model's own tensor-parallel plan as ring plan
    for the ``-ring`` models. DDP: nothing (accelerate wraps the model)."""
    if strategy == "ddp":
        return model
    base = model.get_base_model() if isinstance(model, peft.PeftModel) else model
    ring_plan = base.config.base_model_tp_plan if name.endswith("-ring") else None
    for layer in base.model.layers:
        if strategy == "rsdp":
            rsdp_shard(layer, ring_plan=ring_plan)
        else:
            fully_shard(layer)
    (rsdp_shard if strategy == "rsdp" else fully_shard)(model)
    return model


def token_dataset(seed: int = 1):
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(seed)).tolist()
    return datasets.Dataset.from_dict({"input_ids": ids, "labels": ids})


def join_launched_ranks():
    """What torchrun sets: accelerate reads it to make the Trainer one data-parallel job of these ranks."""
    os.environ.update(RANK=str(dist.get_rank()), LOCAL_RANK=str(dist.get_rank()), WORLD_SIZE=str(dist.get_world_size()),
                      LOCAL_WORLD_SIZE=str(dist.get_world_size()), MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")  # fmt: skip


def training_args(output_dir, trainer_kind: str = "trainer", **overrides):
    settings = dict(output_dir=output_dir, per_device_train_batch_size=2, per_device_eval_batch_size=2,
                    gradient_accumulation_steps=2, max_steps=3, learning_rate=1e-2, max_grad_norm=0.05,
                    logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True)  # fmt: skip
    settings.update(overrides)
    if trainer_kind == "sft":
        import trl

        return trl.SFTConfig(dataset_kwargs={"skip_prepare_dataset": True}, **settings)
    return transformers.TrainingArguments(**settings)


def tiny_tokenizer():
    """A word-level tokenizer over the ids' own vocabulary (``t0`` .. ``t36``, words split at spaces),
    which SFTTrainer needs for its padding id and DPOTrainer to tokenize its texts; no download."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t1"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="t0", eos_token="t2", unk_token="t1")


class GradientsUnreducedBetweenSteps(transformers.TrainerCallback):
    """On every micro-step but the last of a step, ``.grad`` must still be unset: a reduction there
    would have written it (rsdp and FSDP2 keep the unreduced contributions aside). ``exempt``: the
    parameters rsdp reduces in every backward by design (docs/design.md, Limits): a weight whose
    gradient another autograd Function returns (TRL's fused LM-head loss reads ``lm_head.weight``)."""

    def __init__(self, exempt: tuple[str, ...] = ()):
        self.checked = 0
        self.exempt = exempt

    def on_substep_end(self, args, state, control, model=None, **kwargs):
        reduced = [name for name, p in model.named_parameters() if p.grad is not None and not name.endswith(self.exempt)]
        assert not reduced, f"gradients were reduced on a non-final micro-step: {reduced}"
        self.checked += 1


def make_trainer(strategy: str, name: str, trainer_kind: str, args, lora: bool, callbacks=(), dropout: float = 0.0):
    model = shard(build_model(name, lora, dropout), strategy, name)
    if trainer_kind == "sft":
        import trl

        trainer_class, extra = trl.SFTTrainer, {"processing_class": tiny_tokenizer()}
    else:
        trainer_class, extra = transformers.Trainer, {}
    if strategy != "ddp":
        trainer_class = rsdp_trainer(trainer_class)
    dataset = token_dataset()
    trainer = trainer_class(model=model, args=args, train_dataset=dataset, eval_dataset=dataset, callbacks=list(callbacks), **extra)
    return trainer, model


def record_losses(trainer) -> list:
    """This rank's loss of every micro-step, unrounded (the Trainer's logs round it to 4 decimals)."""
    losses, training_step = [], trainer.training_step

    def recorded(*args, **kwargs):
        loss = training_step(*args, **kwargs)
        losses.append(loss.item())
        return loss

    trainer.training_step = recorded
    return losses


def full_weights(model) -> dict:
    """Every parameter as a full tensor, by its name in the unwrapped model."""
    return {name: full(param.detach()) for name, param in model.named_parameters()}


def trainer_matches_fsdp2_and_ddp_case(name: str, trainer_kind: str, lora: bool, save_dir: str, checkpointing: bool | None = None):
    """``checkpointing`` None: the trainer's default (off for Trainer, on for SFTTrainer)."""
    join_launched_ranks()
    rank = dist.get_rank()
    runs = {}
    for strategy in ("ddp", "fsdp", "rsdp"):
        fused_head = ("lm_head.weight",) if strategy == "rsdp" and trainer_kind == "sft" else ()
        check = GradientsUnreducedBetweenSteps(exempt=fused_head)
        overrides = {} if checkpointing is None else {"gradient_checkpointing": checkpointing}
        args = training_args(os.path.join(save_dir, strategy), trainer_kind, **overrides)
        trainer, model = make_trainer(strategy, name, trainer_kind, args, lora, [check] if strategy != "ddp" else [])
        micro_step_losses = record_losses(trainer)
        trainer.train()
        assert strategy == "ddp" or check.checked == trainer.state.global_step  # one non-final micro-step per step
        history = [entry for entry in trainer.state.log_history if "loss" in entry]
        assert len(history) == 3
        runs[strategy] = {
            "losses": torch.tensor(micro_step_losses, dtype=torch.float64),
            "grad_norms": torch.tensor([entry["grad_norm"] for entry in history], dtype=torch.float64),
            "eval_loss": torch.tensor(trainer.evaluate()["eval_loss"], dtype=torch.float64),
            "weights": full_weights(model),
        }
        if strategy == "rsdp":
            assert trainer.args.should_log == (rank == 0)  # the Trainer logs from rank 0 only
            trainer.save_model(os.path.join(save_dir, "saved"))
    for strategy in ("fsdp", "ddp"):
        for key in ("losses", "grad_norms", "eval_loss"):
            assert_close(runs["rsdp"][key], runs[strategy][key], what=f"{key} against {strategy}", **TOLERANCE)
        assert runs["rsdp"]["weights"].keys() == runs[strategy]["weights"].keys()
        for param_name, weight in runs["rsdp"]["weights"].items():
            assert_close(weight, runs[strategy]["weights"][param_name], what=f"{param_name} against {strategy}", **TOLERANCE)
    # The gradient norms were clipped (max_grad_norm 0.05): the clipping, not only the norm, is compared.
    assert bool((runs["rsdp"]["grad_norms"] > 0.05).all())
    if rank == 0:
        reloaded = reload_in_one_process(name, lora, os.path.join(save_dir, "saved"))
        tokens = torch.tensor(token_dataset()["input_ids"][:4])
        with torch.no_grad():
            expected = reloaded_reference(runs, name, lora)(input_ids=tokens).logits
            assert_close(reloaded(input_ids=tokens).logits, expected, what="reloaded logits", rtol=0, atol=0)
    dist.barrier()
    return True


def reload_in_one_process(name: str, lora: bool, path: str):
    if lora:
        return peft.PeftModel.from_pretrained(build_model(name, lora=False), path)
    # float64, as config.json says; the attention and experts kernels are not part of the config.
    experts = {"experts_implementation": MOE_EXPERTS} if name == "qwen3_moe" else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation=attention_for(name), **experts)
    assert model.config.architectures == [type(model).__name__], model.config.architectures
    return model


def reloaded_reference(runs, name: str, lora: bool):
    """The unsharded model with the rsdp run's trained weights, built in this process."""
    model = build_model(name, lora)
    model.load_state_dict(runs["rsdp"]["weights"], strict=False)  # tied weights appear under one name
    assert all(torch.equal(param, runs["rsdp"]["weights"][n]) for n, param in model.named_parameters())
    return model


@pytest.mark.parametrize(
    "name, world, lora, checkpointing",
    [("tied", 2, False, False), ("qwen2", 4, False, False), ("qwen2-ring", 2, False, False), ("llama-ring", 4, False, False),
     ("llama", 4, True, True), ("qwen2-ring", 2, True, False), ("qwen3_moe", 2, False, False)],  # fmt: skip
)
def test_trainer_matches_fsdp2_and_ddp(ranks, tmp_path, name, world, lora, checkpointing):
    """Gradient accumulation without reduction on the first micro-step, clipping, evaluate(), and
    save_model() that from_pretrained (or peft's) loads with identical logits; LoRA with the Trainer's
    gradient checkpointing."""
    assert all(ranks.run(world, trainer_matches_fsdp2_and_ddp_case, name, "trainer", lora, str(tmp_path), checkpointing))


@pytest.mark.parametrize("name, world, lora", [("qwen2", 2, True), ("llama-ring", 4, True)])
def test_sft_trainer_matches_fsdp2_and_ddp(ranks, tmp_path, name, world, lora):
    """SFTTrainer as a user runs it: its fused LM-head loss and SFTConfig's gradient checkpointing; LoRA
    on every Linear with the model's plan as ring plan."""
    pytest.importorskip("trl")
    assert all(ranks.run(world, trainer_matches_fsdp2_and_ddp_case, name, "sft", lora, str(tmp_path)))


def preferences():
    """DPO's prompts with a chosen and a rejected completion, texts of the tiny tokenizer's words."""
    generator = torch.Generator().manual_seed(3)

    def words(count: int) -> str:
        return " ".join(f"t{int(i)}" for i in torch.randint(3, VOCAB, (count,), generator=generator))

    rows = [(words(4), words(3) + " t2", words(3) + " t2") for _ in range(8)]  # t2: the EOS
    return datasets.Dataset.from_dict({key: [row[i] for row in rows] for i, key in enumerate(("prompt", "chosen", "rejected"))})


def dpo_matches_fsdp2_case(save_dir: str):
    """A stock DPOTrainer whose ``ref_model`` is a second model, built and sharded like the policy and
    frozen; its forwards run under no_grad beside the policy's."""
    import trl

    join_launched_ranks()
    runs = {}
    for strategy in ("fsdp", "rsdp"):
        policy = shard(build_model("llama", lora=False), strategy, "llama")
        reference = shard(build_model("llama", lora=False), strategy, "llama").requires_grad_(False)
        args = trl.DPOConfig(output_dir=os.path.join(save_dir, strategy), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             max_steps=2, learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                             seed=0, disable_tqdm=True)  # fmt: skip
        trainer = rsdp_trainer(trl.DPOTrainer)(model=policy, ref_model=reference, args=args, train_dataset=preferences(),
                                               processing_class=tiny_tokenizer())  # fmt: skip
        losses = record_losses(trainer)
        trainer.train()
        runs[strategy] = {"losses": torch.tensor(losses, dtype=torch.float64), "weights": full_weights(policy)}
    assert_close(runs["rsdp"]["losses"], runs["fsdp"]["losses"], what="DPO losses", **TOLERANCE)
    assert not torch.equal(runs["rsdp"]["losses"][0], runs["rsdp"]["losses"][-1]), "the policy did not move"
    for param_name, weight in runs["rsdp"]["weights"].items():
        assert_close(weight, runs["fsdp"]["weights"][param_name], what=f"{param_name} against fsdp", **TOLERANCE)
    return True


def test_dpo_trainer_with_a_sharded_reference_matches_fsdp2(ranks, tmp_path):
    pytest.importorskip("trl")
    assert all(ranks.run(2, dpo_matches_fsdp2_case, str(tmp_path)))


class StopAfter(transformers.TrainerCallback):
    """Ends training after ``step`` steps, as an interruption would, with the schedule of the whole run."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = state.global_step >= self.step


def resume_case(name: str, lora: bool, save_dir: str):
    """Four steps straight, against two steps, a checkpoint, and a fresh trainer resuming from it for the
    other two: the same losses and weights. Dropout makes the per-rank RNG states part of the trajectory."""
    join_launched_ranks()
    runs = {}
    for run in ("straight", "interrupted"):
        args = training_args(os.path.join(save_dir, run), max_steps=4, save_strategy="steps", save_steps=2, data_seed=3)
        if run == "interrupted":
            trainer, _ = make_trainer("rsdp", name, "trainer", args, lora, [StopAfter(2)], dropout=0.1)
            trainer.train()
            assert trainer.state.global_step == 2
            # A fresh model and trainer, as a restarted job builds them.
            trainer, model = make_trainer("rsdp", name, "trainer", args, lora, dropout=0.1)
            losses = record_losses(trainer)
            trainer.train(resume_from_checkpoint=os.path.join(save_dir, run, "checkpoint-2"))
        else:
            trainer, model = make_trainer("rsdp", name, "trainer", args, lora, dropout=0.1)
            losses = record_losses(trainer)
            trainer.train()
        assert len(losses) == (4 if run == "interrupted" else 8)  # 2 micro-steps per step
        # The micro-steps of steps 3 and 4.
        runs[run] = {"losses": torch.tensor(losses[-4:], dtype=torch.float64), "weights": full_weights(model), "step": trainer.state.global_step}
    assert runs["interrupted"]["step"] == runs["straight"]["step"] == 4
    # Equal to float64's rounding: the optimizer's state makes a round trip through DCP.
    assert_close(runs["interrupted"]["losses"], runs["straight"]["losses"], what="losses after resuming", rtol=1e-12, atol=0)
    for param_name, weight in runs["straight"]["weights"].items():
        assert_close(runs["interrupted"]["weights"][param_name], weight, what=param_name, rtol=1e-12, atol=1e-15)
    return True


@pytest.mark.parametrize("name, world, lora", [("qwen2", 2, False), ("llama", 4, True)])
def test_resume_from_checkpoint_continues_the_same_trajectory(ranks, tmp_path, name, world, lora):
    assert all(ranks.run(world, resume_case, name, lora, str(tmp_path)))


def refusal_case(problem: str, save_dir: str):
    join_launched_ranks()
    model = build_model("qwen2", lora=False)
    args = training_args(save_dir)
    if problem == "unsharded_root":
        for layer in model.model.layers:
            rsdp_shard(layer)  # the root call forgotten: embeddings, final norm and head stay plain
    else:
        shard(model, "rsdp", "qwen2")
    if problem == "not_data_parallel":
        args = training_args(save_dir, use_cpu=False)  # on CPU, accelerate then runs each rank alone
    try:
        if problem == "fp16":  # the Trainer itself refuses fp16 on CPU: the check as it runs on GPUs
            args.fp16 = True
            check_training_setup(model, args)
        trainer = rsdp_trainer(transformers.Trainer)(model=model, args=args, train_dataset=token_dataset())
        if problem == "checkpoint_without_dcp":  # e.g. saved with save_only_model=True
            trainer.train(resume_from_checkpoint=save_dir)
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.parametrize(
    "problem, message",
    [
        ("unsharded_root", "are not sharded: each rank would train its own copy"),
        ("not_data_parallel", "pass TrainingArguments(use_cpu=True)"),
        ("fp16", "Train in bf16"),
        ("checkpoint_without_dcp", "has no rsdp_checkpoint/"),
    ],
)
def test_refused_configurations_say_what_to_do(ranks, tmp_path, problem, message):
    errors = ranks.run(2, refusal_case, problem, str(tmp_path))
    assert all(error is not None and message in error for error in errors), errors
