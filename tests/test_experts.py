"""Expert rings: a Hugging Face MoE layer's experts rotate in blocks of whole experts (``_experts.py``).

Tiny Mixtral, Qwen2-MoE (a shared expert beside the routed ones) and gpt-oss (expert biases, clamped
activation) causal LMs with 8 experts, built from config objects, ``rsdp_shard`` on each decoder layer
then the root, as the README says, and nothing else: loss, every gradient (router included) and
optimizer steps against the unsharded model, in each experts implementation transformers ships (eager
and batched_mm in float64; grouped_mm, whose kernel takes no float64, in float32 against the float64
reference), on 2, 3 (8 experts in blocks of 3, 3, 2; 2 experts in blocks of 1, 1, none) and 4 ranks;
activation checkpointing, ``generate()`` with the KV cache, bfloat16 against FSDP2, refusals, and the
peak against FSDP2's.
"""

import copy
import re
import warnings

import pytest
import torch

from models import assert_close, assert_param_grads_match, assert_params_match, forward_backward_peak, local_rows, rank_and_world
from rsdp import rsdp_shard
from rsdp._compat import MixedPrecisionPolicy, fully_shard

transformers = pytest.importorskip("transformers")

VOCAB = 64
EXPERTS = 8
TINY = dict(
    vocab_size=VOCAB, hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=64, num_experts_per_tok=2, pad_token_id=0,
    bos_token_id=1, eos_token_id=2, use_cache=False,
)  # fmt: skip
FAMILIES = {
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(num_local_experts=EXPERTS)),
    "qwen2_moe": (
        "Qwen2MoeForCausalLM", "Qwen2MoeConfig",
        dict(num_experts=EXPERTS, moe_intermediate_size=16, shared_expert_intermediate_size=16),
    ),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(num_experts=EXPERTS, moe_intermediate_size=16, norm_topk_prob=True)),
    "gpt_oss": ("GptOssForCausalLM", "GptOssConfig", dict(num_local_experts=EXPERTS, layer_types=["full_attention"] * 2)),
}  # fmt: skip
# float64 everywhere but grouped_mm's kernel (float32); norms and rotary embeddings of Hugging Face models
# compute in float32 even in a float64 model, so results agree to float32's precision.
TOLERANCE = {"rtol": 1e-5, "atol": 1e-7}
FLOAT32_TOLERANCE = {"rtol": 2e-4, "atol": 2e-6}


def tiny_moe(family: str, implementation: str, dtype=torch.float64, experts: int = EXPERTS, **config_values):
    """The tiny causal LM of ``family`` (seeded) with ``experts`` experts a layer, run by ``implementation``;
    ``config_values`` override the config's (``output_router_logits=True``)."""
    model_name, config_name, values = FAMILIES[family]
    values = {name: experts if value == EXPERTS else value for name, value in values.items()}
    config = getattr(transformers, config_name)(**{**TINY, **values, **config_values}, experts_implementation=implementation)
    torch.manual_seed(0)
    return getattr(transformers, model_name)(config).to(dtype)


def experts_modules(model) -> list:
    return [m for m in model.modules() if hasattr(m, "gate_up_proj")]


def training_case(
    family: str, implementation: str, steps: int, checkpointing: bool = False, one_rank_routes: bool = False, experts: int = EXPERTS,
    micro_batches: int = 1, ring_group_size: int = 1,
):
    """``steps`` optimizer steps of the sharded model against its unsharded float64 twin: loss, every
    gradient, then the parameters; no expert weight may be gathered op by op. ``one_rank_routes``: rank
    0's tokens are one token repeated, so they reach two experts and most blocks get none of them.
    ``micro_batches``: gradients accumulated over that many, reduced in the last one's backward only.
    ``ring_group_size``: every ``rsdp_shard`` call's (a ring of groups)."""
    rank, world = rank_and_world()
    dtype = torch.float32 if implementation == "grouped_mm" else torch.float64
    reference = tiny_moe(family, implementation if dtype == torch.float64 else "eager", experts=experts)
    model = copy.deepcopy(reference).to(dtype)
    model.config._experts_implementation = implementation
    for layer in model.model.layers:
        rsdp_shard(layer, ring_group_size=ring_group_size)
    rsdp_shard(model, ring_group_size=ring_group_size)
    assert all(hasattr(m, "_rsdp_sub_block") for m in experts_modules(model)), "experts are not on a ring"
    if checkpointing:
        for m in (model, reference):
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    tolerance = TOLERANCE if dtype == torch.float64 else FLOAT32_TOLERANCE
    routed = []  # the experts each call of the first layer's experts was given
    experts_modules(model)[0].register_forward_pre_hook(lambda module, args: routed.append(set(args[1].unique().tolist())))
    torch.manual_seed(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(model, reference, family, steps, tolerance, one_rank_routes, routed, micro_batches)
    gathered = [str(w.message) for w in caught if "has no ring form" in str(w.message)]
    assert not gathered, gathered  # no expert weight gathered op by op


def _train(model, reference, family, steps, tolerance, one_rank_routes, routed, micro_batches):
    rank, world = rank_and_world()
    # SGD with momentum, not Adam: Hugging Face's norms compute in float32 even in a float64 model, and
    # Adam would normalise a gradient entry that is zero but for rounding (a key bias's, which softmax
    # ignores) into a full step, in each model differently.
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-1, momentum=0.9)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=1e-1, momentum=0.9)
    for step in range(steps):
        batches = [torch.randint(3, VOCAB, (world * 2, 6)) for _ in range(micro_batches)]
        losses = []
        for index, tokens in enumerate(batches):
            if one_rank_routes:
                tokens[:2] = 3  # one token, repeated: every pair of rank 0 goes to the same two experts
            if micro_batches > 1:  # gradient accumulation: reduced only in the last micro-batch's backward
                model.set_requires_gradient_sync(index == micro_batches - 1)
            mine = local_rows(tokens, rank, world)
            loss = model(input_ids=mine, labels=mine).loss
            (loss / micro_batches).backward()
            losses.append(loss.detach().double())
            if one_rank_routes and rank == 0:  # rank 0's tokens reach two experts: at most two blocks
                assert len(routed[-1]) <= 2, routed[-1]
        reference_loss = sum(reference(input_ids=tokens, labels=tokens).loss for tokens in batches) / micro_batches
        reference_loss.backward()
        loss = torch.stack(losses).mean()
        torch.distributed.all_reduce(loss)
        assert_close(loss / world, reference_loss.detach().double(), what=f"{family} loss at step {step}", **tolerance)
        assert_param_grads_match(model, reference, 1.0, **tolerance)
        optimizer.step()
        reference_optimizer.step()
        optimizer.zero_grad()
        reference_optimizer.zero_grad()
    assert_params_match(model, reference, **tolerance)


@pytest.mark.parametrize("family", ["gpt_oss", "mixtral", "qwen2_moe"])
@pytest.mark.parametrize("implementation", ["eager", "grouped_mm", "batched_mm"])
def test_experts_rotate_exactly_on_two_ranks(ranks, family, implementation):
    ranks.run(2, training_case, family, implementation, 2)


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_eight_experts_in_uneven_blocks_on_three_ranks(ranks, family):
    ranks.run(3, training_case, family, "grouped_mm", 2)


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
def test_fewer_experts_than_ranks_leave_a_rank_without_a_block(ranks, implementation):
    """2 experts on 3 ranks: blocks of 1, 1 and none; the last rank's steps over its empty block do nothing."""
    ranks.run(3, training_case, "mixtral", implementation, 2, experts=2)


def test_experts_on_four_ranks_with_a_rank_whose_tokens_miss_most_blocks(ranks):
    ranks.run(4, training_case, "qwen2_moe", "eager", 2, one_rank_routes=True)


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
def test_experts_with_gradient_accumulation(ranks, implementation):
    """``set_requires_gradient_sync(False)`` for all but the last micro-batch: each rank keeps its
    contributions to every block locally, reduced with the last backward's."""
    ranks.run(2, training_case, "gpt_oss", implementation, 2, micro_batches=2)


def test_experts_on_a_ring_of_groups(ranks):
    """4 ranks in 2 groups of 2 (``ring_group_size=2``): each group all-gathers its block of experts
    (4 of 8) and reduce-scatters its contributions to the partials travelling between the groups; gpt-oss's
    biases in float64, Mixtral's grouped GEMMs with gradients accumulated over two micro-batches."""
    ranks.run(4, training_case, "gpt_oss", "eager", 2, ring_group_size=2)
    ranks.run(4, training_case, "mixtral", "grouped_mm", 1, micro_batches=2, ring_group_size=2)


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
def test_experts_under_activation_checkpointing(ranks, implementation):
    ranks.run(2, training_case, "mixtral", implementation, 1, checkpointing=True)


def tiny_llama4(dtype):
    """A tiny Llama-4 text model (every layer MoE, 8 experts, one routed per token, a shared expert), seeded."""
    config = transformers.Llama4TextConfig(
        **{**TINY, "intermediate_size": 16, "num_experts_per_tok": 1}, intermediate_size_mlp=32, num_local_experts=EXPERTS,
        moe_layers=[0, 1], attention_chunk_size=64,
    )
    torch.manual_seed(0)
    return transformers.Llama4ForCausalLM(config).to(dtype)


def llama4_case(dtype, checkpointing: bool) -> None:
    """Llama-4's experts (dense routing, ``bmm`` over ``[experts, in, out]`` weights) on their expert rings:
    an optimizer step against the unsharded float64 model, no expert weight gathered op by op."""
    reference = tiny_llama4(torch.float64)
    model = copy.deepcopy(reference).to(dtype)
    for layer in model.model.layers:
        rsdp_shard(layer)
    rsdp_shard(model)
    assert all(hasattr(layer.feed_forward.experts, "_rsdp_sub_block") for layer in model.model.layers), "experts are not on a ring"
    if checkpointing:
        for m in (model, reference):
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    torch.manual_seed(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tolerance = TOLERANCE if dtype == torch.float64 else FLOAT32_TOLERANCE
        _train(model, reference, "llama4", 1, tolerance, one_rank_routes=False, routed=[], micro_batches=1)
    gathered = [str(w.message) for w in caught if "has no ring form" in str(w.message)]
    assert not gathered, gathered


@pytest.mark.parametrize(
    "world, dtype, checkpointing",
    [(3, torch.float64, False), (2, torch.float32, True)],  # 8 experts in blocks of 3, 3, 2; float32: grouped GEMMs
)
def test_llama4_experts_rotate_exactly(ranks, world, dtype, checkpointing):
    ranks.run(world, llama4_case, dtype, checkpointing)


def experts_peak(strategy: str, implementation: str) -> int:
    """Peak bytes above the sharded parameters in one forward+backward of a Mixtral whose weights are
    mostly experts (16 experts of 64 x 128 a layer), at batch 1, after a warm-up step, gradients freed as
    ``zero_grad()`` does."""
    rank = rank_and_world()[0]
    config = transformers.MixtralConfig(
        **{**TINY, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
           "head_dim": 16}, num_local_experts=16, experts_implementation=implementation,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config)
    shard = rsdp_shard if strategy == "rsdp" else fully_shard
    for layer in model.model.layers:
        shard(layer)
    shard(model)
    tokens = torch.randint(3, VOCAB, (1, 16), generator=torch.Generator().manual_seed(rank))
    return forward_backward_peak(model, lambda: model(input_ids=tokens, labels=tokens).loss)


def experts_peaks_case(implementation: str) -> dict:
    return {strategy: experts_peak(strategy, implementation) for strategy in ("fsdp", "rsdp")}


def test_experts_peak_against_fsdp2_on_four_ranks(ranks):
    """FSDP2 gathers a layer's experts whole, prefetches the next layer's, and holds their unsharded
    gradient in backward: 3 layers of experts above the sharded gradients (1/W of the model) here. The
    expert rings' backward peaks in the first layer's up-projection ring (gate_up_proj, 2/3 of the
    experts): its two messages ([gradient partials | weights], 2/W of gate_up_proj each) and, as it
    ends, the owner's reduced shard copied out (1/W); each step's weight gradient is written into the
    partials expert by expert, so nothing else of the experts' size: 5/W of gate_up_proj, 0.83 of a
    layer's experts on 4 ranks. Measured 0.365 of FSDP2's peak (CPU counts are exact)."""
    for rank, peaks in enumerate(ranks.run(4, experts_peaks_case, "grouped_mm")):
        ratio = peaks["rsdp"] / peaks["fsdp"]
        print(f"rank {rank}: fsdp {peaks['fsdp'] / 2**20:.3f} MiB, rsdp {peaks['rsdp'] / 2**20:.3f} MiB, ratio {ratio:.3f}")
        assert ratio <= 0.38, f"rank {rank}: rsdp peak {peaks['rsdp']} B is {ratio:.3f} of fsdp's {peaks['fsdp']} B"


def aligned_operands_case() -> list:
    """The operands the expert rings hand torch's grouped GEMM in one forward+backward of gpt-oss (biases
    beside each block of weights; in backward the messages are ``[gradient partials | weights]``, and on 4
    ranks a ring's first message lies behind the ring before's, exchanged ahead). Returns every tensor
    operand's address mod 16: CUDA's grouped GEMM requires 16-byte-aligned operands."""
    from rsdp._fully_shard import _experts

    model = tiny_moe("gpt_oss", "grouped_mm", torch.float32)
    for layer in model.model.layers:
        rsdp_shard(layer)
    rsdp_shard(model)
    addresses = []
    stock = _experts.grouped_mm

    def recording(a, b, offs):
        addresses.extend(t.data_ptr() % 16 for t in (a, b, offs))
        return stock(a, b, offs=offs)

    _experts.grouped_mm = recording
    try:
        tokens = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(rank_and_world()[0]))
        for _ in range(2):  # the second pass follows the first's record: its first messages go ahead
            model(input_ids=tokens, labels=tokens).loss.backward()
    finally:
        _experts.grouped_mm = stock
    return addresses


def test_expert_rings_hand_the_grouped_gemm_16_byte_aligned_operands(ranks):
    """8 experts on 4 ranks: every forward and backward step's grouped GEMMs."""
    for rank, addresses in enumerate(ranks.run(4, aligned_operands_case)):
        assert addresses and not any(addresses), f"rank {rank}: operand addresses mod 16: {addresses}"


def refusal_case(kind: str) -> str:
    """The error rsdp raises, on this rank, for an experts module it cannot rotate."""
    if kind == "longcat":  # routed experts without Hugging Face's markers: no expert ring runs them
        config = transformers.LongcatFlashConfig(
            **TINY, num_layers=2, ffn_hidden_size=16, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=8,
            v_head_dim=8, moe_topk=2, n_routed_experts=EXPERTS, zero_expert_num=2, expert_ffn_hidden_size=16,
        )
        model = transformers.LongcatFlashForCausalLM(config)
    elif kind == "llama4_forward":  # a subclass changing the forward the rings compute
        model = tiny_llama4(torch.float64)
        stock = type(model.model.layers[0].feed_forward.experts)
        for layer in model.model.layers:
            layer.feed_forward.experts.__class__ = type("MyExperts", (stock,), {"forward": lambda self, rows: stock.forward(self, 2 * rows)})
    else:
        model = tiny_moe("mixtral", "eager")
    if kind == "post_expert_norm":
        model.model.layers[0].mlp.experts.post_expert_norm = torch.nn.LayerNorm(TINY["hidden_size"], dtype=torch.float64)
    elif kind == "implementation":
        model.config._experts_implementation = "sonicmoe"  # a kernel of its own: no masking rsdp knows
    with pytest.raises(ValueError) as refused:
        for layer in model.model.layers:
            rsdp_shard(layer)
        rsdp_shard(model)
        tokens = torch.randint(3, VOCAB, (1, 6))
        model(input_ids=tokens, labels=tokens)
    return str(refused.value)


@pytest.mark.parametrize(
    "kind, message",
    [
        ("post_expert_norm", r"experts 'mlp.experts' holds parameters in submodules \(\['post_expert_norm.weight', 'post_expert_norm.bias'\], a post-expert norm\).* fully_shard instead"),
        ("implementation", r"experts 'mlp.experts' run with experts implementation 'sonicmoe'.*experts_implementation='grouped_mm'"),
        ("llama4_forward", r"experts 'feed_forward.experts' \(MyExperts\) change Llama4TextExperts's forward.*fully_shard instead"),
        ("longcat", r"experts 'mlp.experts' \(LongcatFlashExperts\) are routed \(top_k_index\) but are not a kind the expert rings run.*fully_shard\(layer.mlp.experts\), then rsdp_shard\(layer\)"),
    ],
)
def test_experts_an_expert_ring_cannot_run_are_refused_on_every_rank(ranks, kind, message):
    for text in ranks.run(2, refusal_case, kind):
        assert re.search(message, text), text


def generate_case(implementation: str) -> list:
    """Greedy ``generate()`` with the KV cache: each rank's continuation of its own prompt, token for
    token the unsharded model's."""
    rank, world = rank_and_world()
    dtype = torch.float32 if implementation == "grouped_mm" else torch.float64
    reference = tiny_moe("mixtral", implementation, dtype)
    reference.config.use_cache = True
    model = copy.deepcopy(reference)
    for layer in model.model.layers:
        rsdp_shard(layer)
    rsdp_shard(model)
    prompt = torch.randint(3, VOCAB, (world, 5), generator=torch.Generator().manual_seed(0))[rank : rank + 1]
    generated = model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert generated.tolist() == reference.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0).tolist()
    return generated.tolist()


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
def test_experts_generate_with_the_kv_cache(ranks, implementation):
    continuations = ranks.run(2, generate_case, implementation)
    assert continuations[0] != continuations[1]  # the ranks' prompts, and so their routing, differ


def mixed_precision_case() -> None:
    """bfloat16 compute, float32 gradient reduction (``MixedPrecisionPolicy``): rsdp's loss and gradients
    against FSDP2's under the same policy, to bfloat16's precision."""
    rank, world = rank_and_world()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    models = {}
    for strategy, shard in (("rsdp", rsdp_shard), ("fsdp", fully_shard)):
        model = tiny_moe("mixtral", "grouped_mm", torch.float32)
        for layer in model.model.layers:
            shard(layer, mp_policy=policy)
        shard(model, mp_policy=policy)
        models[strategy] = model
    tokens = torch.randint(3, VOCAB, (world * 2, 6), generator=torch.Generator().manual_seed(1))
    mine = local_rows(tokens, rank, world)
    losses = {strategy: model(input_ids=mine, labels=mine).loss for strategy, model in models.items()}
    for loss in losses.values():
        loss.backward()
    assert_close(losses["rsdp"], losses["fsdp"], what="loss", rtol=1e-2, atol=1e-3)
    fsdp_grads = {name: p.grad.full_tensor() for name, p in models["fsdp"].named_parameters()}
    for name, param in models["rsdp"].named_parameters():
        expected = fsdp_grads[name]
        # bfloat16 products summed in another order: each gradient within 2% of its largest entry.
        assert_close(param.grad.full_tensor(), expected, what=f"grad of {name}", rtol=0, atol=2e-2 * expected.abs().max().item())


def test_experts_in_bfloat16_match_fsdp2(ranks):
    ranks.run(2, mixed_precision_case)
