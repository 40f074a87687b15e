"""Hugging Face models under rsdp, as a fine-tuner uses them: gradient checkpointing on, against the
single-process fp64 reference. Models are built from config objects (no downloads).

transformers >= 5 checkpoints a layer's ``forward`` inside its module hooks, so the recomputation in
backward runs without rsdp's hooks and must find the full parameters installed by the pre-backward
hook; 4.x checkpoints ``__call__``, hooks included, and stops recomputation early by raising.
"""

import copy
import functools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from models import (
    assert_close,
    assert_param_grads_match,
    assert_params_match,
    draw_lora_b,
    full,
    local_rows,
    rank_and_world,
    training_step_transient,
)
from rsdp import rsdp_shard
from rsdp._compat import DTensor, fully_shard

transformers = pytest.importorskip("transformers")

VOCAB = 37
# Llama's RMSNorm computes in float32 even in a float64 model, so results agree to float32's precision.
TOLERANCE = {"rtol": 1e-5, "atol": 1e-7}


def _llama(planned=False):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        # A ring plan splits the KV heads over up to 4 ranks, and its attention may return only its
        # output (eager attention also returns its weights).
        num_key_value_heads=4 if planned else 2,
        max_position_embeddings=32,
        attn_implementation="sdpa" if planned else "eager",
    )
    return transformers.LlamaForCausalLM(config), lambda model: model.model.layers


def _gpt2():
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=16,
        n_layer=2,
        n_head=4,
        n_positions=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        attn_implementation="eager",
    )
    return transformers.GPT2LMHeadModel(config), lambda model: model.transformer.h


MODELS = {"llama": _llama, "llama-ring": functools.partial(_llama, planned=True), "gpt2": _gpt2}


def _with_lora(model):
    import peft

    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    draw_lora_b(model, 0.1)
    return model


def checkpointed_training_case(model_name, use_reentrant, steps=2, lora=False, no_grad_forward_between=False, ring_group_size=1):
    """``no_grad_forward_between``: a second forward of the model, under ``no_grad``, between each
    forward and its backward (TRL's SFTTrainer computes its metrics so); the recomputation in backward
    must redo what the first forward did, whatever the second changed. ``ring_group_size``: every
    ``rsdp_shard``'s."""
    rank, world = rank_and_world()
    torch.manual_seed(0)
    model, layers_of = MODELS[model_name]()
    model = model.double().train()
    base = model
    if lora:
        model = _with_lora(model)
    reference = copy.deepcopy(model)
    ring_plan = base.config.base_model_tp_plan if model_name.endswith("-ring") else None
    for layer in layers_of(base):
        rsdp_shard(layer, ring_plan=ring_plan, ring_group_size=ring_group_size)
    rsdp_shard(model, ring_group_size=ring_group_size)
    for m in (model, reference):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(steps):
        tokens = torch.randint(0, VOCAB, (world * 2, 7))
        mine = local_rows(tokens, rank, world)
        loss = model(input_ids=mine, labels=mine).loss
        if no_grad_forward_between:
            with torch.no_grad():
                logits = model(input_ids=mine).logits
            assert_close(logits, reference(input_ids=mine).logits, what=f"no_grad logits at step {step}", **TOLERANCE)
        loss.backward()
        reference_loss = reference(input_ids=tokens, labels=tokens).loss
        reference_loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        assert_close(total / world, reference_loss.detach(), what=f"loss at step {step}", **TOLERANCE)
        assert_param_grads_match(model, reference, 1.0, **TOLERANCE)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        assert_close(full(norm), torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0), what="grad norm", **TOLERANCE)
        optimizer.step()
        reference_optimizer.step()
        optimizer.zero_grad()
        reference_optimizer.zero_grad()
    assert_params_match(model, reference, **TOLERANCE)
    # After backward every parameter is the sharded one again: state_dict and the optimizer see them.
    assert all(isinstance(value, DTensor) for value in model.state_dict().values() if value.is_floating_point())
    assert all(isinstance(param, DTensor) for param in model.parameters())
    return True


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_llama_trains_with_gradient_checkpointing(ranks, world, use_reentrant):
    assert all(ranks.run(world, checkpointed_training_case, "llama", use_reentrant))


@pytest.mark.parametrize("model_name, world, lora", [("llama", 2, True), ("llama", 4, False), ("llama-ring", 4, False)])
def test_a_no_grad_forward_between_forward_and_backward_keeps_the_recomputation_exact(ranks, model_name, world, lora):
    """The first step's forward records which Linears share an input (``_fusion.py``); the no_grad
    forward before its backward must not fuse them in that forward's recomputation (a CheckpointError
    before), nor any later state change alter it."""
    if lora:
        pytest.importorskip("peft")
    assert all(ranks.run(world, checkpointed_training_case, model_name, False, 3, lora, True))


@pytest.mark.parametrize("world", [2, 3])
def test_gpt2_conv1d_trains_with_gradient_checkpointing(ranks, world):
    """GPT-2's Conv1D weights rotate op by op (``torch.addmm`` on an ``[in, out]`` weight: an
    input-dimension split), also in the recomputation; its head is tied to ``wte``."""
    assert all(ranks.run(world, checkpointed_training_case, "gpt2", False))


def gpt2_transient_case(strategy):
    """Transient bytes of one AdamW step of a Hugging Face GPT-2 (Conv1D blocks, head tied to ``wte``)
    at batch 1, above the sharded parameters and optimizer state, after a warm-up step."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=1500, n_embd=320, n_layer=2, n_head=4, n_positions=16, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager",
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    if strategy == "rsdp":
        shard = rsdp_shard
    else:
        shard = functools.partial(fully_shard, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    for block in model.transformer.h:
        shard(block)
    shard(model)
    tokens = torch.randint(0, config.vocab_size, (1, 8))
    return training_step_transient(model, lambda: model(input_ids=tokens, labels=tokens).loss)


def test_gpt2_transient_memory_is_under_a_third_of_fsdp2s_on_4_ranks(ranks):
    """Every GPT-2 matrix rotates (Conv1D op by op, the tied head and ``wte`` as ring layers), and the
    backward frees the head's ring buffers once only the blocks' and the Embedding's rings are left:
    0.24x FSDP2's transient (0.32x while the head's buffers stayed to the end of the backward)."""
    rsdp = max(ranks.run(4, gpt2_transient_case, "rsdp"))
    fsdp = max(ranks.run(4, gpt2_transient_case, "fsdp"))
    print(f"GPT-2 transient: rsdp {rsdp} B, FSDP2 {fsdp} B, ratio {rsdp / fsdp:.3f}")
    assert rsdp <= 0.3 * fsdp, (rsdp, fsdp)


def saved_architectures_case(save_dir):
    """``save_pretrained`` on the sharded model writes the model's own class in ``config.architectures``
    (vLLM and TGI dispatch on it); rsdp's class names stay visible in the module's repr."""
    import json

    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, use_cache=False)  # fmt: skip
    model = transformers.Qwen2ForCausalLM(config)
    for layer in model.model.layers:
        rsdp_shard(layer, ring_plan=config.base_model_tp_plan)
    rsdp_shard(model)
    state_dict = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        model.save_pretrained(save_dir, state_dict=state_dict)
    dist.barrier()
    with open(f"{save_dir}/config.json") as file:
        architectures = json.load(file)["architectures"]
    return architectures, type(model).__name__, repr(model).split("(")[0], type(model.model.layers[0].self_attn).__qualname__


@pytest.mark.parametrize("world", [2, 4])
def test_save_pretrained_names_the_models_own_class(ranks, tmp_path, world):
    for architectures, name, shown, attention in ranks.run(world, saved_architectures_case, str(tmp_path)):
        assert architectures == ["Qwen2ForCausalLM"] and name == "Qwen2ForCausalLM"
        assert shown == "RSDPQwen2ForCausalLM" and attention == "RingSubQwen2Attention", (shown, attention)
