"""torchtitan's mixture-of-experts models (qwen3 MoE, DeepSeek-V3, gpt-oss) under rsdp, replicate, auto
and per-module overrides: trained on 2 gloo ranks by the CPU launcher, each against torchtitan's own
FSDP from one seed checkpoint per model; one MoE layer on rank pools, its ``GroupedExperts`` on the
expert ring (``_grouped_experts.py``), against the unsharded float64 layer and FSDP2 on 2, 3 and 4 ranks,
with its peak against FSDP2's; and the refusals, without processes.

The debug configs' experts (64 of 768 x 256 a layer in qwen3's) take tens of seconds a step on 2 cores,
so the runs here use this module's shrunk configs (:func:`shrunk`: 2 blocks, 8 experts of hidden 64,
top 2), which torchtitan's config loader finds in this module (``--module`` is its name). Each run
forks from this process (see ``test_torchtitan.py``).
"""

import functools
import re

import pytest
import torch
import torch.utils.checkpoint

from test_torchtitan import assert_losses_match, launch_training, logged_losses, train

from torchtitan.distributed import ParallelDims  # noqa: E402  (test_torchtitan put the CPU shims in first)
from torchtitan.models.common.moe import MoE  # noqa: E402
from torchtitan.models.deepseek_v3 import model_registry as deepseek_v3_model  # noqa: E402
from torchtitan.models.qwen3 import model_registry as qwen3_model  # noqa: E402

from rsdp.torchtitan import config_registry  # noqa: E402
from rsdp.torchtitan.config import ParallelismConfig  # noqa: E402
from rsdp.torchtitan.parallelize import _check_supported  # noqa: E402

STEPS = 3
RTOL = 2e-4  # as test_torchtitan's: 5 printed digits of fp32 runs that differ only in sharding


def shrunk(config, *, layers: int = 2, experts: int = 8, top_k: int = 2, expert_hidden: int = 64):
    """torchtitan's config with its model cut to ``layers`` blocks of ``experts`` experts each."""
    model = config.model_spec.model
    del model.layers[layers:]
    for _, moe, _, _ in model.traverse(MoE.Config):
        inner, router, dispatcher = moe.routed_experts.inner_experts, moe.router, moe.routed_experts.token_dispatcher
        moe.num_experts = inner.num_experts = router.num_experts = router.gate.out_features = dispatcher.num_experts = experts
        router.top_k = dispatcher.top_k = top_k
        inner.hidden_dim = expert_hidden
    return config


def qwen3_moe_small_rsdp():
    return shrunk(config_registry.qwen3_moe_debug_rsdp())


def deepseek_v3_small_rsdp():
    return shrunk(config_registry.deepseek_v3_debugmodel_rsdp())  # block 0 is dense, block 1 MoE with shared experts


def gpt_oss_small_rsdp():
    return shrunk(config_registry.gpt_oss_debugmodel_rsdp())  # sliding-window and full attention, sinks, expert biases


# model config -> what the run under test sets: rsdp everywhere; auto with the MoE block pinned to rsdp;
# fsdp with block 0 replicated and block 1's MoE rsdp inside its fsdp block (under activation
# checkpointing, whose wrapper fully_shard wraps). Every MoE under rsdp rotates its experts on the expert ring.
RUNS = {
    "qwen3_moe_small_rsdp": ["--parallelism.dp_strategy=rsdp"],
    "deepseek_v3_small_rsdp": ["--parallelism.dp_strategy=auto", "--parallelism.dp_memory_budget=150MiB",
                               "--parallelism.dp_overrides=layers.1=rsdp"],
    "gpt_oss_small_rsdp": ["--parallelism.dp_strategy=fsdp", "--parallelism.dp_overrides=layers.0=replicate,layers.1.moe=rsdp"],
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    from rsdp.torchtitan.assets import write_assets

    folder = tmp_path_factory.mktemp("torchtitan_moe")
    write_assets(folder / "assets")
    return folder


def from_seed(workdir, config: str) -> list[str]:
    """Start from ``config``'s seed checkpoint (written by the first call), writing none of its own."""
    seed = workdir / f"seed-{config}"
    if not seed.exists():
        train(workdir, seed.name, "--checkpoint.enable", "--checkpoint.create_seed_checkpoint", "--debug.seed=0",
              nproc=1, module=__name__, config=config)
    return ["--checkpoint.enable", "--checkpoint.load_only", f"--checkpoint.initial_load_path={seed / 'checkpoint' / 'step-0'}"]


@pytest.mark.parametrize("config", RUNS)
def test_moe_model_trains_like_torchtitan_fsdp(workdir, config):
    """Each rank routes its own tokens (its experts' token counts differ), and every step's loss and
    gradient norm are torchtitan FSDP's: its own parallelize function runs for dp_strategy=fsdp. The
    load-balancing expert biases, updated from the ranks' summed token counts before each optimizer
    step, change the routing of steps 2 and 3 alike."""
    seed = from_seed(workdir, config)
    fsdp = train(workdir, f"{config}-fsdp", *seed, "--parallelism.dp_strategy=fsdp", steps=STEPS, module=__name__, config=config)
    output = launch_training(workdir, f"{config}-run", *seed, *RUNS[config], steps=STEPS, module=__name__, config=config)
    ours = logged_losses(output)
    print(f"{config}: fsdp {fsdp}\n{' ' * len(config)}  ours {ours}")
    assert sorted(fsdp) == sorted(ours) == list(range(1, STEPS + 1)), output[-3000:]
    assert_losses_match(ours, fsdp)
    assert "rsdp: applied data parallelism" in output, "rsdp's parallelize function ran, not torchtitan's"


# One MoE layer (router, experts, shared experts) on rank pools: its experts on the expert ring.

# torchtitan's experts compute in bfloat16 whatever the parameters' dtype (float64 here), and each ring
# step's rows are bit for bit the whole layer's: rsdp differs from the reference, and from FSDP2, only in
# the order it sums the ranks' float64 gradients. After an optimizer step, a weight that this order moved
# by a float64 rounding may round to another bfloat16, so later steps' gradients differ in a few entries,
# by a millionth of the largest.
LAYER_TOLERANCE = {"rtol": 1e-9, "atol": 1e-12}
LATER_STEPS_ATOL = 1e-6  # times the largest entry of what is expected


def layer_tolerance(step: int, expected: torch.Tensor) -> dict:
    return LAYER_TOLERANCE if step == 0 else {"rtol": 0, "atol": LATER_STEPS_ATOL * expected.abs().max().item()}
REGISTRY = {
    "qwen3": config_registry.qwen3_moe_debug_rsdp,  # routed experts only
    "deepseek_v3": config_registry.deepseek_v3_debugmodel_rsdp,  # shared experts beside the routed ones
    "gpt_oss": config_registry.gpt_oss_debugmodel_rsdp,  # expert biases, clamped activation
}


def moe_layer(family: str, experts: int = 8, dtype=torch.float64, expert_hidden: int = 64) -> torch.nn.Module:
    """The first MoE layer of ``family``'s shrunk debug model (``experts`` experts of ``expert_hidden``),
    seeded, in ``dtype``; gpt-oss's experts cast their output back, as the CPU launcher builds them."""
    from torchtitan.models.gpt_oss.moe import GptOssGroupedExperts

    from rsdp.torchtitan._cpu import _gpt_oss_experts_cast_back, _replace_configs

    model = shrunk(REGISTRY[family](), experts=experts, expert_hidden=expert_hidden).model_spec.model
    _replace_configs(model, GptOssGroupedExperts, _gpt_oss_experts_cast_back())
    moe = next(config for _, config, _, _ in model.traverse(MoE.Config))
    torch.manual_seed(0)
    layer = moe.build().to(dtype)
    for param in layer.parameters():
        torch.nn.init.normal_(param, std=0.1)
    return layer


def layer_tokens(step: int, rank: int, world: int, dim: int, dtype=torch.float64) -> torch.Tensor:
    """Rank ``rank``'s tokens at ``step``: rank 0 has 3 (2 experts each: at most 6 of 8 get any), the
    others 11 times their rank."""
    count = 3 if rank == 0 else 11 * rank
    return torch.randn(1, count, dim, generator=torch.Generator().manual_seed(100 * step + rank), dtype=dtype)


def moe_layer_case(family: str, experts: int = 8, steps: int = 2, checkpointing: bool = False, ring_group_size: int = 1) -> int:
    """``steps`` SGD steps of one MoE layer under rsdp and FSDP2, each rank on its own tokens, against the
    unsharded float64 layer run on every rank's tokens (gradients averaged over ranks, as both average):
    outputs, every gradient (see ``layer_tolerance``), the token counts the load balancing reads, then the
    parameters. No expert weight may be gathered op by op. ``ring_group_size``: rsdp's (a ring of groups).
    Returns the most experts that got none of this rank's tokens in a step."""
    import copy
    import warnings

    from models import assert_close, rank_and_world

    from rsdp import rsdp_shard
    from rsdp._compat import fully_shard

    rank, world = rank_and_world()
    reference = moe_layer(family, experts)
    models = {"rsdp": rsdp_shard(copy.deepcopy(reference), ring_group_size=ring_group_size), "fsdp": fully_shard(copy.deepcopy(reference))}
    assert hasattr(models["rsdp"].routed_experts.inner_experts, "_rsdp_sub_block"), "the experts are not on a ring"
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=1e-3) for name, m in [*models.items(), ("reference", reference)]}
    dim = reference.router.gate.in_features
    unrouted = 0  # the most experts that got none of this rank's tokens in one step
    for step in range(steps):
        tokens = [layer_tokens(step, r, world, dim) for r in range(world)]
        counted = models["rsdp"].tokens_per_expert_E.clone()
        outputs = {}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for name, model in models.items():
                run = functools.partial(torch.utils.checkpoint.checkpoint, model, use_reentrant=False) if checkpointing else model
                outputs[name] = run(tokens[rank])
                (outputs[name] * outputs[name]).sum().backward()
        gathered = [str(w.message) for w in caught if "has no ring form" in str(w.message)]
        assert not gathered, gathered
        expected = [reference(x) for x in tokens]
        # Averaged after the backward, as the ranks average: scaling the loss by 1/3 would change what the
        # experts' bfloat16 products round to.
        sum((e * e).sum() for e in expected).backward()
        for param in reference.parameters():
            param.grad.div_(world)
        for name, output in outputs.items():
            assert_close(output, expected[rank], what=f"{name} output at step {step}", **layer_tolerance(step, expected[rank]))
        grads = {name: {n: p.grad.full_tensor() for n, p in m.named_parameters()} for name, m in models.items()}
        for n, param in reference.named_parameters():
            for name in models:
                assert_close(grads[name][n], param.grad, what=f"{name} gradient of {n} at step {step}", **layer_tolerance(step, param.grad))
        unrouted = max(unrouted, int((models["rsdp"].tokens_per_expert_E == counted).sum()))
        for optimizer in optimizers.values():
            optimizer.step()
            optimizer.zero_grad()
    for n, param in reference.named_parameters():
        for name, model in models.items():
            assert_close(model.get_parameter(n).full_tensor(), param, what=f"{name} {n} after {steps} steps", **layer_tolerance(steps, param))
    counts = models["rsdp"].tokens_per_expert_E
    assert torch.equal(counts, models["fsdp"].tokens_per_expert_E), counts
    forwards = 2 if checkpointing else 1  # recomputation counts the tokens again (torchtitan's own note)
    assert counts.sum() == forwards * steps * tokens[rank].shape[1] * reference.router.top_k, counts
    return unrouted


@pytest.mark.parametrize("family, world", [("qwen3", 2), ("gpt_oss", 3), ("deepseek_v3", 4)])
def test_moe_layer_experts_rotate_exactly(ranks, family, world):
    """8 experts in blocks of 4 (2 ranks), 3, 3 and 2 (3 ranks) or 2 (4 ranks); rank 0's 3 tokens reach at
    most 6 experts a step, so some experts get none of them, and the ranks route differently."""
    empty_on_rank_0 = ranks.run(world, moe_layer_case, family)[0]
    assert empty_on_rank_0 >= 2


@pytest.mark.parametrize("family", ["qwen3", "gpt_oss"])
def test_moe_layer_on_a_ring_of_groups(ranks, family):
    """4 ranks in 2 groups of 2: blocks of 4 experts gathered within a group, their partials summed
    within it and carried between the groups; qwen3's w1 and w3, gpt-oss's biases."""
    ranks.run(4, moe_layer_case, family, ring_group_size=2)


def test_moe_layer_with_fewer_experts_than_ranks(ranks):
    """2 experts on 3 ranks: blocks of 1, 1 and none; the last rank's steps over its empty block do nothing."""
    ranks.run(3, moe_layer_case, "qwen3", experts=2)


def test_moe_layer_under_activation_checkpointing(ranks):
    ranks.run(2, moe_layer_case, "gpt_oss", steps=1, checkpointing=True)


def mixed_precision_layer_case() -> None:
    """bfloat16 parameters and compute, float32 gradient reduction (``MixedPrecisionPolicy``, as torchtitan
    sets it): rsdp's output and gradients against FSDP2's under the same policy, each rank on its own
    tokens. Both run the same bfloat16 products; they differ in the order they sum float32 gradients."""
    import copy

    from models import assert_close, rank_and_world

    from rsdp import rsdp_shard
    from rsdp._compat import MixedPrecisionPolicy, fully_shard

    rank, world = rank_and_world()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    reference = moe_layer("gpt_oss", dtype=torch.float32)
    models = {"rsdp": rsdp_shard(copy.deepcopy(reference), mp_policy=policy), "fsdp": fully_shard(copy.deepcopy(reference), mp_policy=policy)}
    x = layer_tokens(0, rank, world, reference.router.gate.in_features, torch.float32)
    outputs = {name: model(x) for name, model in models.items()}
    for output in outputs.values():
        (output.float() ** 2).sum().backward()
    assert outputs["rsdp"].dtype == outputs["fsdp"].dtype == torch.bfloat16
    assert_close(outputs["rsdp"], outputs["fsdp"], what="output", rtol=0, atol=0)
    for name, param in models["rsdp"].named_parameters():
        expected = models["fsdp"].get_parameter(name).grad.full_tensor()
        assert_close(param.grad.full_tensor(), expected, what=f"gradient of {name}", rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_moe_layer_in_bfloat16_matches_fsdp2(ranks):
    ranks.run(3, mixed_precision_layer_case)


def moe_layer_peak(strategy: str, experts: int, tokens: int) -> int:
    """Peak bytes above the sharded parameters in one forward+backward of one qwen3 MoE layer (``experts``
    experts of 256 x 128, float32 parameters, torchtitan's bfloat16 products) on ``tokens`` tokens of this
    rank, after a warm-up step, gradients freed as ``zero_grad()`` does."""
    from models import forward_backward_peak

    from rsdp import rsdp_shard
    from rsdp._compat import fully_shard

    layer = (rsdp_shard if strategy == "rsdp" else fully_shard)(moe_layer("qwen3", experts, torch.float32, expert_hidden=128))
    x = torch.randn(1, tokens, layer.router.gate.in_features, generator=torch.Generator().manual_seed(torch.distributed.get_rank()))
    return forward_backward_peak(layer, lambda: layer(x).pow(2).sum())


def moe_layer_peaks_case(experts: int, tokens: int) -> dict:
    return {strategy: moe_layer_peak(strategy, experts, tokens) for strategy in ("fsdp", "rsdp")}


def test_moe_layer_peak_against_fsdp2_on_four_ranks(ranks):
    """One layer: FSDP2 gathers the experts whole and keeps them (a lone root reshards nothing after
    forward), then adds their unsharded gradient: 2 layers of experts. The expert rings' backward holds
    its up-projection ring's two messages and the owner's reduced shard (w1 and w3; ``test_experts.py``'s
    peak test says which); torchtitan's products are bfloat16 and the partials float32, so a step adds
    its weight gradient into them one expert's product at a time, never a block's: 5/W of the up
    projection, measured 0.425 of FSDP2's peak on 4 ranks."""
    for rank, peaks in enumerate(ranks.run(4, moe_layer_peaks_case, 16, 16)):
        ratio = peaks["rsdp"] / peaks["fsdp"]
        print(f"rank {rank}: fsdp {peaks['fsdp'] / 2**20:.3f} MiB, rsdp {peaks['rsdp'] / 2**20:.3f} MiB, ratio {ratio:.3f}")
        assert ratio <= 0.43, f"rank {rank}: rsdp peak {peaks['rsdp']} B is {ratio:.3f} of fsdp's {peaks['fsdp']} B"


def wrong_call_case() -> str:
    """The error rsdp raises, on this rank, when torchtitan's experts are called with token counts that
    are not one per expert (before the ring starts: no rank waits on another)."""
    from rsdp import rsdp_shard

    experts = rsdp_shard(moe_layer("qwen3").routed_experts.inner_experts)
    with pytest.raises(ValueError) as refused:
        experts(torch.randn(4, experts.w1_EFD.shape[2], dtype=torch.float64), torch.tensor([2, 2]))
    return str(refused.value)


def test_experts_called_without_one_count_per_expert_are_refused_on_every_rank(ranks):
    for text in ranks.run(2, wrong_call_case):
        assert re.search(r"experts 'GroupedExperts' must be called with \(x_RD, num_tokens_per_expert_E\).*each of the 8 "
                         r"experts' token count.*got \[\(4, 256\), \(2,\)\]", text), text


def changed_forward_case() -> str:
    """The error rsdp_shard raises, on this rank, for a GroupedExperts subclass whose grouped GEMM is its
    own (as a low-precision converter's is): the expert rings compute the stock forward."""
    from rsdp import rsdp_shard

    experts = moe_layer("qwen3").routed_experts.inner_experts

    class MyExperts(type(experts)):
        def _grouped_mm(self, *, A, B_t, offs):
            return super()._grouped_mm(A=A, B_t=B_t, offs=offs) * 2

    experts.__class__ = MyExperts
    with pytest.raises(ValueError) as refused:
        rsdp_shard(experts)
    return str(refused.value)


def test_experts_whose_forward_a_subclass_changes_are_refused(ranks):
    for text in ranks.run(2, changed_forward_case):
        assert re.search(r"experts '.*MyExperts' \(MyExperts\) change GroupedExperts's forward or grouped GEMM.*"
                         r"fully_shard instead", text), text


# Configuration errors and rules, without processes.


def meta_model(registry, flavor: str = "debugmodel", **options):
    with torch.device("meta"):
        return registry(flavor, attn_backend="varlen", **options).model.build()


def dims(ep: int = 1) -> ParallelDims:
    return ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, ep=ep, world_size=2)


def parallelism(**fields) -> ParallelismConfig:
    return ParallelismConfig(spmd_backend="partial_dtensor", **fields)


def test_moe_trains_under_every_strategy_but_expert_parallelism_stays_fsdp():
    model = meta_model(qwen3_model, "debugmodel_moe")
    for strategy in ("rsdp", "replicate", "fsdp"):
        _check_supported(model, dims(), parallelism(dp_strategy=strategy))
    with pytest.raises(ValueError, match=r"expert parallelism \(expert_parallel_degree=2\) composes with dp_strategy=fsdp "
                                         r"only .*--parallelism.expert_parallel_degree 1"):
        _check_supported(model, dims(ep=2), parallelism(dp_overrides="layers.0=replicate", dp_strategy="fsdp"))
    _check_supported(model, dims(ep=2), parallelism(dp_strategy="fsdp"))
    with pytest.raises(ValueError, match="multi-token prediction composes with dp_strategy=fsdp only"):
        _check_supported(meta_model(deepseek_v3_model, num_mtp_layers=1), dims(), parallelism())


def test_rsdp_configs_train_experts_by_data_parallelism():
    """The real flavors beside the debug ones; DeepSeek-V3 16B's expert parallelism (8) becomes 1."""
    for name in ("qwen3_30b_a3b_rsdp", "deepseek_v3_16b_rsdp", "deepseek_v3_671b_rsdp", "gpt_oss_20b_rsdp", "gpt_oss_120b_rsdp"):
        config = getattr(config_registry, name)()
        assert config.parallelism.dp_strategy == "rsdp" and config.parallelism.expert_parallel_degree == 1, name


def test_cpu_varlen_attention_masks_documents_and_windows_and_returns_the_lse():
    """The CPU launcher's stand-in for torch's CUDA-only varlen attention, against SDPA on each
    document (float64): causal, within a sliding window, and the log-sum-exp gpt-oss's sinks read."""
    import torch.nn.functional as F
    from torchtitan.models.common.attention import create_varlen_metadata_for_document

    from rsdp.torchtitan._cpu import _cpu_varlen_attention

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 7, 4, 8, dtype=torch.float64), torch.randn(2, 7, 2, 8, dtype=torch.float64), torch.randn(2, 7, 2, 8, dtype=torch.float64)
    masks = create_varlen_metadata_for_document(torch.tensor([[0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 0, 1, 2, 3]]))
    position = torch.arange(7)
    window = (position[:, None] >= position[None, :]) & (position[:, None] - position[None, :] <= 2)

    def reference(row, start, mask):
        q_, k_, v_ = (t[row, start:].transpose(0, 1) for t in (q, k, v))  # (heads, sequence, head_dim)
        k_, v_ = k_.repeat_interleave(2, dim=0), v_.repeat_interleave(2, dim=0)
        scores = (q_ @ k_.transpose(1, 2)) / 8**0.5
        return F.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask[start:, start:]).transpose(0, 1), scores.masked_fill(
            ~mask[start:, start:], float("-inf")).logsumexp(-1).transpose(0, 1)

    causal = position[:, None] >= position[None, :]
    for window_size, mask in (((-1, 0), causal), ((2, 0), window)):
        attention = _cpu_varlen_attention().Config(window_size=window_size).build()
        out, lse = attention(q, k, v, attention_masks=masks, out_transform=lambda out, lse: (out, lse))
        for row, start in ((0, 0), (1, 3)):  # row 1's second document starts at position 3
            expected_out, expected_lse = reference(row, start, mask)
            torch.testing.assert_close(out[row, start:], expected_out)
            torch.testing.assert_close(lse[row, start:], expected_lse)
