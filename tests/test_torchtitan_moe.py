"""torchtitan's mixture-of-experts models (qwen3 MoE, DeepSeek-V3, gpt-oss) under rsdp, replicate, auto
and per-module overrides: trained on 2 gloo ranks by the CPU launcher, each against torchtitan's own
FSDP from one seed checkpoint per model; and the refusals, without processes.

The debug configs' experts (64 of 768 x 256 a layer in qwen3's) take tens of seconds a step on 2 cores,
so the runs here use this module's shrunk configs (:func:`shrunk`: 2 blocks, 8 experts of hidden 64,
top 2), which torchtitan's config loader finds in this module (``--module`` is its name). Each run
forks from this process (see ``test_torchtitan.py``).
"""

import pytest
import torch

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


# model config -> what the run under test sets: rsdp everywhere; auto (with an override inside the MoE
# block; planned over fsdp and replicate, the experts having no ring yet); replicate for block 0 and rsdp
# elsewhere
RUNS = {
    "qwen3_moe_small_rsdp": ["--parallelism.dp_strategy=rsdp"],
    "deepseek_v3_small_rsdp": ["--parallelism.dp_strategy=auto", "--parallelism.dp_memory_budget=150MiB",
                               "--parallelism.dp_overrides=layers.0=rsdp"],
    "gpt_oss_small_rsdp": ["--parallelism.dp_overrides=layers.0=replicate"],
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
    if "--parallelism.dp_strategy=auto" in RUNS[config]:
        assert "plans this mixture-of-experts model over fsdp and replicate only" in output, output[-3000:]


def moe_routing_case() -> int:
    """torchtitan's MoE layer (the shrunk qwen3 one: 8 experts, top 2) under rsdp, each rank on its own
    tokens, 3 on rank 0 (so most experts get none there) and 40 on rank 1, against the unsharded layer
    on both ranks' tokens: output, gradients (averaged over ranks, as FSDP2's), and the token counts the
    load balancing reads. The ranks' routing differs, and no rank waits on another: every rank gathers
    each expert weight once, whatever its tokens. Returns how many experts got no token here."""
    import copy

    import torch.distributed as dist

    from rsdp import rsdp_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = shrunk(config_registry.qwen3_moe_debug_rsdp()).model_spec.model.layers[0].moe.build()
    for param in reference.parameters():
        torch.nn.init.normal_(param, std=0.1)
    sharded = rsdp_shard(copy.deepcopy(reference))
    tokens = [torch.randn(1, count, reference.router.gate.in_features) for count in (3, 40)]
    out = sharded(tokens[rank])
    (out * out).sum().backward()
    expected = [reference(x) for x in tokens]
    sum((e * e).sum() for e in expected).div(world).backward()
    torch.testing.assert_close(out, expected[rank])
    for (name, param), reference_param in zip(sharded.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(param.grad.full_tensor(), reference_param.grad, msg=name)
    counts = sharded.tokens_per_expert_E
    assert counts.sum() == tokens[rank].shape[1] * reference.router.top_k, counts
    return int((counts == 0).sum())


def test_moe_layer_is_exact_when_ranks_route_differently(ranks):
    empty_on_rank_0, _ = ranks.run(2, moe_routing_case)
    assert empty_on_rank_0 >= 2  # 3 tokens, 2 experts each: at most 6 of 8 experts get any


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
