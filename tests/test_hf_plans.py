"""Every causal-LM tensor-parallel plan transformers ships, used as it is as a ring plan.

The walk takes each model type whose causal-LM config carries a ``base_model_tp_plan``, builds it tiny
(hidden 32, 2 layers, 4 heads and 4 KV heads of 8, vocabulary 64, small experts) from its config class,
shards each decoder layer with ``ring_plan=config.base_model_tp_plan`` and the root, and runs one
training step against the unsharded fp64 model: loss and every gradient. A plan that rsdp refuses must
name the entries to drop; the walk drops exactly those and the step must then be exact, so the advice
is checked too. Models are built from config objects (no downloads).
"""

import ast
import copy
import functools
import re

import pytest
import torch

from models import assert_close, assert_param_grads_match, draw_lora_b, local_rows, rank_and_world
from rsdp import rsdp_shard
from rsdp._compat import fully_shard

transformers = pytest.importorskip("transformers")

VOCAB = 64
# Values for whichever of these a config has: small enough for a step in well under a second, heads
# that divide by 2 and 4 ranks.
TINY = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=4, head_dim=8, max_position_embeddings=64, moe_intermediate_size=16, num_experts=4,
    num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
    shared_expert_intermediate_size=16, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
    mamba_d_state=8, mamba_chunk_size=8, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1, sliding_window=16,
    pad_token_id=0, bos_token_id=1, eos_token_id=2, use_cache=False,
)  # fmt: skip
# Larger than this with TINY's values, a model's config has sizes of its own TINY does not reach: left out.
MAX_PARAMETERS = 700_000
# Left out of the step for its time alone (its plan is still read by ``_planned_model_types``).
TOO_SLOW = {
    "falcon_h1": "its Mamba mixer's torch path takes ~26 s a step on CPU; its plan holds only "
    "'embedding_rowwise', which leaves the Embedding to rsdp's own ring",
}
# Norms and rotary embeddings compute in float32 in a float64 model: results agree to float32's precision.
TOLERANCE = {"rtol": 1e-5, "atol": 1e-7}
REFUSAL_ADVICE = "Drop these ring_plan entries: "


def _has(config, name: str) -> bool:
    try:
        return hasattr(config, name)
    except Exception:  # a per-layer attribute of a heterogeneous config refuses a global read
        return False


def _planned_model_types() -> list[str]:
    """Model types with a causal-LM class whose default config carries a tensor-parallel plan."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    found = []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            config = CONFIG_MAPPING[model_type]()
        except Exception:  # a config that cannot be built by default (an assistant model) has no plan to read
            continue
        if getattr(config, "base_model_tp_plan", None):
            found.append(model_type)
    return found


@functools.cache
def tiny_model(model_type: str):
    """The tiny causal LM of ``model_type`` in float64 (seeded), or a string saying why there is none."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type in TOO_SLOW:
        return TOO_SLOW[model_type]
    config_class = CONFIG_MAPPING[model_type]
    default = config_class()
    values = {name: value for name, value in TINY.items() if _has(default, name)}
    # No dropout anywhere: a ring sub-block runs once per shard, and the reference must see the same.
    values.update({name: 0.0 for name, value in default.to_dict().items() if ("dropout" in name or "pdrop" in name) and isinstance(value, float)})
    model_class = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    try:
        with torch.device("meta"):  # counted before it is built: some configs keep sizes of their own
            count = sum(p.numel() for p in model_class(config_class(**values)).parameters())
    except Exception as error:  # noqa: BLE001 - reported per model type by the test
        return f"its config does not take the tiny values ({type(error).__name__}: {str(error).splitlines()[0][:120]})"
    if count > MAX_PARAMETERS:
        return f"tiny, it still has {count} parameters (sizes of its own)"
    # Experts as a loop of matmuls (the grouped kernel takes no float64); sdpa attention, which returns
    # no attention weights (a planned sub-block returns only its output), where the model has it.
    for attention in ("sdpa", None):
        try:
            config = config_class(**values, experts_implementation="eager", attn_implementation=attention)
            torch.manual_seed(0)
            model = model_class(config).double().eval()
            tokens = torch.randint(3, VOCAB, (1, 6))
            model(input_ids=tokens, labels=tokens)
            break
        except Exception as error:  # noqa: BLE001 - reported per model type by the test
            reason = f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
    else:
        return f"its tiny config does not build and run unsharded ({reason})"
    return model


@functools.cache
def tiny_lora_model(model_type: str):
    """The tiny ``model_type`` with peft's LoRA on every Linear but the LM head ("all-linear": q/k/v/o and
    gate/up/down), its ``lora_B`` made non-zero (peft starts it at zero, which would leave ``lora_A``
    without a gradient)."""
    import peft

    model = peft.get_peft_model(copy.deepcopy(tiny_model(model_type)), peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    torch.manual_seed(2)
    draw_lora_b(model, 0.1)
    return model


def _decoder_layers(model) -> list:
    """The decoder layers the plan's per-layer keys start from (``layers.*.``, ``h.*.``,
    ``L_module.layers.*.``); none where the plan names no layer's modules (an Embedding only)."""
    prefixes = {key.split(".*.")[0] for key in model.config.base_model_tp_plan if ".*." in key}
    found = [m for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and any(f".{n}".endswith(f".{p}") for p in prefixes)]
    assert len(found) == len(prefixes), f"{type(model).__name__}: layers {prefixes} not found"
    return [layer for layers in found for layer in layers]


def _entries_to_drop(error: Exception, plan: dict) -> list[str]:
    """The plan entries a refusal names (it must name some, all of them the plan's)."""
    message = str(error)
    assert REFUSAL_ADVICE in message, message
    entries = ast.literal_eval(message.split(REFUSAL_ADVICE, 1)[1].split(" (", 1)[0])
    assert entries and set(entries) <= set(plan), (entries, plan)
    return entries


def _step(model, tokens):
    """The loss of one forward and backward of ``model`` on ``tokens``."""
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    return loss.detach()


def plan_step_case(model_type: str, checkpointing: bool = False, lora: bool = False, ring_group_size: int = 1):
    """One step of the tiny ``model_type`` under its own plan against fp64: a refusal (when sharding or at
    the first forward) drops the entries it names, and the step starts again on a fresh copy. Returns the
    entries dropped and how many sub-blocks rotate as one ring. ``checkpointing``: with gradient
    checkpointing on both models (each sub-block recomputed in backward); ``lora``: with LoRA on every
    Linear (``tiny_lora_model``), only the adapters trained; ``ring_group_size``: every ring in groups of
    that many ranks. A model type without a tiny model returns
    why (``tiny_model``'s reason): the ranks decide, so that the test's own process builds no model."""
    if isinstance(tiny_model(model_type), str):
        return tiny_model(model_type)
    rank, world = rank_and_world()
    original = tiny_lora_model(model_type) if lora else tiny_model(model_type)
    plan, dropped, fsdp_experts = dict(original.config.base_model_tp_plan), [], []
    torch.manual_seed(1)
    tokens = torch.randint(3, VOCAB, (world * 2, 6))
    while True:
        model = copy.deepcopy(original)
        try:
            for layer in _decoder_layers(model):
                for name in fsdp_experts:
                    fully_shard(layer.get_submodule(name))
                rsdp_shard(layer, ring_plan=plan, ring_group_size=ring_group_size)
            rsdp_shard(model, ring_group_size=ring_group_size)
            if checkpointing:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            loss = _step(model, local_rows(tokens, rank, world))
            break
        except (ValueError, TypeError) as error:  # TypeError: an argument a sub-block cannot take per shard
            experts = re.search(r"fully_shard\(layer\.([\w.]+)\), then rsdp_shard\(layer\)", str(error))
            if experts:  # routed experts no expert ring runs (LongCat-Flash's): FSDP2's, as the refusal says
                fsdp_experts.append(experts.group(1))
                continue
            entries = _entries_to_drop(error, plan)
            dropped += entries
            plan = {key: style for key, style in plan.items() if key not in entries}
    reference = copy.deepcopy(original)
    if checkpointing:
        reference.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    reference_loss = _step(reference, tokens)
    torch.distributed.all_reduce(loss)
    assert_close(loss / world, reference_loss, what=f"{model_type} loss", **TOLERANCE)
    assert_param_grads_match(model, reference, 1.0, **TOLERANCE)
    sub_blocks = sum(hasattr(m, "_rsdp_sub_block") for m in model.modules())
    return dropped, sub_blocks


MODEL_TYPES = _planned_model_types()
# On 4 ranks: per-head q/k norms (qwen3, gemma3_text), gathered outputs (olmo2, phi3), MoE experts beside a
# planned attention (qwen3_moe), a refused MLA attention (deepseek_v2), and Llama.
FOUR_RANKS = ["llama", "qwen3", "gemma3_text", "olmo2", "phi3", "qwen3_moe", "deepseek_v2"]


@pytest.mark.parametrize(
    "model_type, world", [(t, 2) for t in MODEL_TYPES] + [(t, 4) for t in FOUR_RANKS if t in MODEL_TYPES]
)
def test_a_models_own_plan_trains_exactly_as_a_ring_plan(ranks, model_type, world):
    first, *others = ranks.run(world, plan_step_case, model_type)
    assert all(other == first for other in others)
    if isinstance(first, str):
        pytest.skip(f"{model_type}: {first}")
    dropped, sub_blocks = first
    print(f"{model_type} on {world} ranks: {sub_blocks} sub-blocks as one ring, dropped {dropped}")


def test_qwen3_and_gemma3_keep_their_per_head_norms_in_the_planned_attention():
    """The issue's two models: nothing dropped, both attention and MLP planned, q/k norms per shard."""
    from rsdp._fully_shard._sub_block import plan_sub_blocks

    for model_type in ("qwen3", "gemma3_text"):
        model = tiny_model(model_type)
        blocks = plan_sub_blocks(_decoder_layers(model)[0], model.config.base_model_tp_plan, 4)
        names = {block.name: [f"{type(m).__name__}.{n}" for m, n in block.per_shard] for block in blocks}
        assert set(names) == {"self_attn", "mlp"}, names
        assert len(names["self_attn"]) == 2 and not names["mlp"], names


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("model_type", ["qwen3", "gemma3_text"])
def test_per_head_norms_in_a_planned_attention_are_exact_under_gradient_checkpointing(ranks, model_type, world):
    """The recomputation in backward runs each shard's attention again, its norms' leaves with it."""
    for dropped, sub_blocks in ranks.run(world, plan_step_case, model_type, True):
        assert dropped == [] and sub_blocks == 4, (dropped, sub_blocks)


def test_a_norm_over_all_heads_inside_a_planned_attention_is_refused_naming_the_entries():
    """OLMo2's q/k norms span all heads; its plan gathers q/k/v (the attention is no sub-block). Planned
    as a pair instead, with its norms per shard, the attention is refused, naming the entries to drop."""
    from rsdp._fully_shard._sub_block import plan_sub_blocks

    model = tiny_model("olmo2")
    plan = {key: "colwise" if style == "colwise_gather_output" else "rowwise" if style == "rowwise_split_input" else style
            for key, style in model.config.base_model_tp_plan.items()}  # fmt: skip
    plan.update({"layers.*.self_attn.q_norm": "replicated_with_grad_allreduce", "layers.*.self_attn.k_norm": "replicated_with_grad_allreduce"})
    with pytest.raises(ValueError, match=r"\['self_attn.q_norm.weight', 'self_attn.k_norm.weight'\] span a colwise Linear's whole output") as refused:
        plan_sub_blocks(_decoder_layers(model)[0], plan, 2)
    assert _entries_to_drop(refused.value, plan) == sorted(key for key in plan if ".self_attn." in key)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("model_type, checkpointing", [("llama", False), ("qwen3", True)])
def test_lora_on_every_planned_linear_trains_exactly_as_a_ring_plan(ranks, model_type, world, checkpointing):
    """peft's LoRA on q/k/v/o and gate/up/down: both sub-blocks still rotate as one ring each (Qwen3's
    per-head norms with them), the adapters used whole at each step but for the shard's rows of a colwise
    ``lora_B`` and columns of a rowwise ``lora_A``; loss and every adapter gradient exact against fp64."""
    pytest.importorskip("peft")
    for dropped, sub_blocks in ranks.run(world, plan_step_case, model_type, checkpointing, True):
        assert dropped == [] and sub_blocks == 4, (dropped, sub_blocks)


def second_adapter_and_disabled_adapters_case():
    """A second adapter, with a bias, on the colwise Linears (a rowwise one's bias is refused), active (the
    first frozen, unused), then a forward under ``disable_adapter()`` (the base alone): as the unsharded
    fp64 model computes them."""
    import peft

    rank, world = rank_and_world()
    model = copy.deepcopy(tiny_lora_model("llama"))
    columns = ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"]
    model.add_adapter("second", peft.LoraConfig(r=2, lora_alpha=6, target_modules=columns, lora_bias=True))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B.second" in name:  # its weight and bias
                param.normal_(std=0.1, generator=torch.Generator().manual_seed(len(name)))
    model.set_adapter("second")
    reference = copy.deepcopy(model)
    for layer in _decoder_layers(model):
        rsdp_shard(layer, ring_plan=model.config.base_model_tp_plan)
    rsdp_shard(model)
    torch.manual_seed(1)
    tokens = torch.randint(3, VOCAB, (world * 2, 6))
    loss = _step(model, local_rows(tokens, rank, world))
    torch.distributed.all_reduce(loss)
    assert_close(loss / world, _step(reference, tokens), what="loss with the second adapter", **TOLERANCE)
    assert_param_grads_match(model, reference, 1.0, **TOLERANCE)
    with torch.no_grad(), model.disable_adapter(), reference.disable_adapter():
        logits = model(input_ids=local_rows(tokens, rank, world)).logits
        assert_close(logits, local_rows(reference(input_ids=tokens).logits, rank, world), what="logits, adapters disabled", **TOLERANCE)
    return True


def test_a_second_adapter_and_disabled_adapters_under_a_plan_are_exact(ranks):
    pytest.importorskip("peft")
    assert all(ranks.run(2, second_adapter_and_disabled_adapters_case))


def float32_adapters_on_a_bfloat16_model_case():
    """peft's default on a bf16 model: float32 adapters, which a planned sub-block gathers with the bf16 norms."""
    import peft

    model = peft.get_peft_model(copy.deepcopy(tiny_model("llama")).to(torch.bfloat16), peft.LoraConfig(r=2, target_modules="all-linear"))
    with pytest.raises(ValueError, match=r"must share a dtype.*autocast_adapter_dtype=False"):
        rsdp_shard(_decoder_layers(model)[0], ring_plan=model.config.base_model_tp_plan)
    return True


def test_float32_adapters_on_a_bfloat16_model_with_a_plan_are_refused_naming_the_fix(ranks):
    pytest.importorskip("peft")
    assert all(ranks.run(2, float32_adapters_on_a_bfloat16_model_case))


@pytest.mark.parametrize(
    "lora_config, target, message",
    [
        (dict(use_dora=True), "q_proj", r"'self_attn.q_proj' carries a LoRA variant \(\['DoraLinearVariant'\]\).*use_dora=False"),
        (dict(lora_bias=True), "o_proj", r"'self_attn.o_proj' is rowwise and its LoRA adapter has a bias.*without lora_bias"),
        (dict(lora_dropout=0.1), "q_proj", r"sub-block 'self_attn' has dropout"),
    ],
)
def test_what_a_ring_step_cannot_compute_of_lora_is_refused_naming_the_entries(lora_config, target, message):
    """DoRA's weight norm, a rowwise adapter's bias and LoRA dropout: refused, naming the attention's plan
    entries; without them the MLP is still one ring."""
    peft = pytest.importorskip("peft")
    from rsdp._fully_shard._sub_block import plan_sub_blocks

    model = copy.deepcopy(tiny_model("llama"))
    plan = dict(model.config.base_model_tp_plan)
    layer = _decoder_layers(peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=[target], **lora_config)))[0]
    with pytest.raises(ValueError, match=message) as refused:
        plan_sub_blocks(layer, plan, 2)
    entries = _entries_to_drop(refused.value, plan)
    assert entries == sorted(key for key in plan if ".self_attn." in key)
    kept = {key: style for key, style in plan.items() if key not in entries}
    assert [block.name for block in plan_sub_blocks(layer, kept, 2)] == ["mlp"]
