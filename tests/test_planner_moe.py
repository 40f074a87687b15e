"""The planner on mixture-of-experts models: each strategy's expert transients against measured peaks
(FSDP2 gathers a layer's experts whole and holds their unsharded gradient; rsdp's expert rings hold
blocks of whole experts of one projection at a time), the published MoE configs, and
every model torchtitan ships planned without a traceback; frozen experts under LoRA (no gradient transients)."""

import contextlib
import copy
import dataclasses
import importlib
import io
import pkgutil
import warnings

import pytest
import torch
import torch.distributed as dist

from rsdp import Strategy, parallelize
from rsdp.planner import cli, measure_peak
from rsdp.planner._cost_model import count
from rsdp.planner._models import next_token_loss
from rsdp.planner._profile import find_units
from test_planner_training import CONFIGS, MiB, TOLERANCE, cluster, counted_as_planned, predicted

transformers = pytest.importorskip("transformers")

# Tiny causal LMs whose weights are mostly experts (16 of 64 x 128 a layer, 2 layers), with a vocabulary
# and a batch (2 x 64 tokens) large enough that the activations count too. gpt-oss runs eager attention
# (it has no SDPA), which keeps the scores that the count's flash attention does not: short sequences.
SHAPE = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=4, head_dim=16, max_position_embeddings=128, num_experts_per_tok=2, pad_token_id=0,
    bos_token_id=1, eos_token_id=2, use_cache=False, experts_implementation="grouped_mm",
)  # fmt: skip
FAMILIES = {
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(num_local_experts=16)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(num_experts=16, moe_intermediate_size=128)),
    "gpt_oss": ("GptOssForCausalLM", "GptOssConfig", dict(num_local_experts=16, layer_types=["full_attention"] * 2)),
}  # fmt: skip


def tiny_moe(family: str):
    model_name, config_name, values = FAMILIES[family]
    config = getattr(transformers, config_name)(**SHAPE, **values)
    torch.manual_seed(0)
    return getattr(transformers, model_name)(config)


def moe_tokens() -> torch.Tensor:
    """The batch every test here runs: 2 rows of 65 tokens."""
    return torch.randint(3, SHAPE["vocab_size"], (2, 65), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def moe_counts():
    """Each family's count: made on the meta device, whatever the world size or plan, so once here
    rather than on every rank of every world size."""
    tokens = moe_tokens()
    counted = {}
    for family in FAMILIES:
        model = tiny_moe(family)
        counted[family] = count(counted_as_planned(model), find_units(model), tokens, next_token_loss)
    return counted


def moe_peaks_case(counted: dict) -> list[tuple[str, float, float]]:
    """Every family, FSDP and rsdp everywhere: (label, predicted, measured) on this world size."""
    results = []
    tokens = moe_tokens()
    for family in FAMILIES:
        model = tiny_moe(family)
        names = ["", *find_units(model)]
        counts = counted[family]
        for strategy in (Strategy.FSDP, Strategy.RSDP):
            policy = dict.fromkeys(names, strategy)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a model built outside a mesh, rotary scaling notes
                measured = measure_peak(parallelize(copy.deepcopy(model), policy), tokens, next_token_loss)
            results.append((f"{family} {strategy.value}", predicted(model, policy, tokens, cluster(dist.get_world_size()), counts), measured))
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_moe_peak_is_within_15_percent_of_the_measured_peak(ranks, moe_counts, world):
    """Tiny Mixtral, Qwen3-MoE and gpt-oss (grouped_mm experts), FSDP2 and rsdp everywhere: the cost
    model's peak against the measured one (parameters, AdamW state and the step's peak; the most of any
    rank), within the dense tests' tolerance."""
    for label, prediction, measured in ranks.run(world, moe_peaks_case, moe_counts)[0]:
        print(f"{world} ranks, {label}: predicted {prediction / MiB:.3f} MiB, measured {measured / MiB:.3f} MiB ({measured / prediction:.3f})")
        assert 1 - TOLERANCE <= measured / prediction <= 1 + TOLERANCE, f"{world} ranks, {label}: {measured} vs {prediction}"


@pytest.mark.parametrize("world,group", [(4, 1), (4, 2), (4, 4)])
def test_expert_rings_of_groups_send_and_hold_what_the_planner_counts(moe_counts, world, group):
    """Tiny Mixtral (16 experts a layer, rsdp everywhere) on the fake process group, its expert rings on
    rings of groups as the rest: the exchanges between groups and collectives within them per pass are
    what the cost model counts (a block's attention 2 rings, its experts 1 forward, both projections
    on one, and 2 backward, one per projection, beside the Embedding and the head; W/g = 2 leaves one exchange a ring, where every other prefetched ring
    carries one: the model's half of an odd count is rounded down by the pass), the bytes but for
    the 16-byte alignment of what rides behind a message, and the peak within the dense tests'
    tolerance (last run at W=4: g=1 0.863, g=2 0.906, g=4 0.915; 1.152 at g=4 when an expert ring
    of groups was counted as a flat one)."""
    from rsdp import CostModel
    from rsdp.memory import CommCounter
    from rsdp.planner._calibrate import _fake_group
    from rsdp.planner._cost_model import RingTraffic, _Parallelism
    from rsdp.planner._plan import predict_uniform

    model, tokens, counts = tiny_moe("mixtral"), moe_tokens(), moe_counts["mixtral"]
    units = find_units(model)
    cost = CostModel(world, flops_per_s=1e12, bandwidth_bytes_per_s=1e10, latency_s=1e-5, gpus_per_node=world)
    predicted_peak = predict_uniform(counts, units, Strategy.RSDP, cost, group)[0]
    parts = [counts.before, *counts.units.values(), counts.after]
    assert [part.rings for part in counts.units.values()] == [1, 3, 3, 0, 1]  # embedding, 2 blocks, norm, head (forward)
    with _fake_group(world, "expert rings of groups") as mesh, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the router's matrix has no ring form: gathered whole
        sharded = parallelize(copy.deepcopy(model), dict.fromkeys(["", *units], Strategy.RSDP), mesh=mesh, ring_group_size=group)
        measured_peak = measure_peak(sharded, tokens, next_token_loss)
        for _ in range(2):  # the second pass follows the first's record (prefetch)
            with CommCounter() as forward:
                loss = next_token_loss(sharded, tokens)
            with CommCounter() as backward:
                loss.backward()
    for is_backward, measured in ((False, forward), (True, backward)):
        traffic = [_Parallelism(part, Strategy.RSDP, cost, group).ring_traffic(is_backward) for part in parts]
        total = {field.name: sum(getattr(t, field.name) for t in traffic) for field in dataclasses.fields(RingTraffic)}
        parity = 0.5 if world // group == 2 and not is_backward else 0
        assert total["exchanges"] - parity == measured.between_groups.messages, (total, measured.between_groups)
        assert total["collectives"] == measured.within_groups.messages, (total, measured.within_groups)
        sent = measured.between_groups.nbytes + measured.within_groups.nbytes
        alignment = 16 * len(list(model.parameters()))  # a piece behind a message starts at a 16-byte boundary
        assert 0 <= sent - total["exchange_bytes"] - total["collective_bytes"] <= alignment
    assert 1 - TOLERANCE <= measured_peak / predicted_peak <= 1 + TOLERANCE, (measured_peak, predicted_peak)


def _torchtitan_flavors() -> list[tuple[str, str]]:
    """(family, flavor) of every model torchtitan's registries hold (a family whose imports fail is one
    entry with flavor None: ``rsdp plan`` must say so in one line too)."""
    from rsdp.planner import _models

    _models._prepare_torchtitan_imports()
    models = pytest.importorskip("torchtitan.models")
    found = []
    for family in sorted(m.name for m in pkgutil.iter_modules(models.__path__) if m.ispkg and m.name != "common"):
        try:
            module = importlib.import_module(f"torchtitan.models.{family}")
        except ImportError:
            found.append((family, None))
            continue
        found += [(family, flavor) for name, configs in vars(module).items()
                  if name.endswith("_configs") and isinstance(configs, dict) for flavor in configs]
    return found


def _cut_to_four_blocks(registry):
    """``registry`` whose model configs keep their first three blocks and their last, as the count runs
    a stack of alike blocks: what fails on a model fails on it cut, in a fraction of the time."""
    import dataclasses

    def cut(flavor, *args, **kwargs):
        spec = registry(flavor, *args, **kwargs)
        layers = getattr(spec.model, "layers", None)
        if isinstance(layers, list) and len(layers) > 4:
            spec = dataclasses.replace(spec, model=dataclasses.replace(spec.model, layers=layers[:3] + layers[-1:]))
        return spec

    return cut


MOE_FLAVORS = [("qwen3", "30B-A3B"), ("deepseek_v3", "16B"), ("gpt_oss", "20b"), ("gpt_oss", "120b")]
# Each family's debug flavor (flavor None: the family's imports fail), and what planning it gives: "planned",
# or what its one line says.
DEBUG_FLAVORS = {
    ("llama3", "debugmodel"): "planned",
    ("qwen3", "debugmodel"): "planned",
    ("qwen3", "debugmodel_moe"): "planned",
    ("deepseek_v3", "debugmodel"): "planned",
    ("gpt_oss", "debugmodel"): "planned",
    ("kimi_k2_7", "debugmodel"): "never ran in the training step (a multimodal model's encoder",
    ("muse_glimmer", "debugmodel"): "cannot be counted on the meta device (SpmdTypeError",
    ("flux", "flux-debug"): "has no token embedding",
    ("qwen3_5", None): "needs the package 'fla'",
}


@pytest.mark.parametrize("activation_checkpoint", ["none", "selective", "full"])
def test_every_torchtitan_model_is_planned_or_refused_in_one_line(monkeypatch, activation_checkpoint):
    """Every flavor of every model family torchtitan 0.3 ships, through ``rsdp plan`` on the meta device
    (8 devices, 64 tokens, blocks cut to four): a plan, or an exit with one line that names the reason;
    never a traceback. Without checkpointing every flavor, under bf16 mixed precision; under
    checkpointing (which wraps the blocks alike in every flavor of a family) each family's debug flavor,
    in bf16. The MoE flavors also in fp32, under every mode. Each debug flavor plans or says why as
    DEBUG_FLAVORS states, the MoE flavors plan, and no family is left out."""
    flavors = _torchtitan_flavors()
    assert {family for family, _ in flavors} == {family for family, _ in DEBUG_FLAVORS}, "a family is not walked"
    walked = flavors if activation_checkpoint == "none" else [entry for entry in flavors if entry in DEBUG_FLAVORS]
    outcomes = {}
    for (family, flavor), precision in [*((entry, "bf16") for entry in walked), *((entry, "fp32") for entry in MOE_FLAVORS)]:
        if flavor is not None:
            module = importlib.import_module(f"torchtitan.models.{family}")
            monkeypatch.setattr(module, "model_registry", _cut_to_four_blocks(module.model_registry))
        argv = ["plan", "--model", f"torchtitan:{family}:{flavor or 'any'}", "--world-size", "8", "--seq-len", "64",
                "--budget", "1TiB", "--activation-checkpoint", activation_checkpoint, "--mixed-precision", precision]
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                cli.main(argv)
                outcomes[family, flavor, precision] = "planned"
            except SystemExit as exit:
                message = str(exit.code)
                assert exit.code != 0 and "\n" not in message and message.startswith("rsdp"), f"{family}:{flavor}, {precision}: {message!r}"
                outcomes[family, flavor, precision] = message
    print("\n".join(f"{family}:{flavor}, {precision}: {outcome}" for (family, flavor, precision), outcome in outcomes.items()))
    for (family, flavor), expected in DEBUG_FLAVORS.items():
        assert expected in outcomes[family, flavor, "bf16"], (family, flavor, outcomes[family, flavor, "bf16"])
    assert all(outcomes[name] == "planned" for name in outcomes if name[:2] in MOE_FLAVORS), outcomes


@pytest.mark.parametrize("activation_checkpoint", ["none", "selective", "full"])
def test_a_torchtitan_moe_stack_is_counted_by_four_blocks_to_the_byte(activation_checkpoint):
    """torchtitan's MoE blocks (each with its own token dispatcher object) are alike, so their stack is
    counted by four blocks, and that count is counting every block: experts' bytes and their larger
    ring's included."""
    import dataclasses

    from rsdp.planner import _cost_model, _models

    _models._prepare_torchtitan_imports()
    qwen3 = importlib.import_module("torchtitan.models.qwen3")
    config = qwen3.model_registry("debugmodel_moe").model
    config = dataclasses.replace(config, layers=[config.layers[0]] * 6)
    with torch.device("meta"):
        model = _models.torchtitan_moe_for_counting(_models.flash_attention_for_counting(config.build()))
    model = _models.apply_activation_checkpointing(model, activation_checkpoint)
    units = find_units(model)
    tokens = torch.zeros(1, 33, dtype=torch.long)
    every_block = _cost_model.count_step(_cost_model.meta_copy(model), units, tokens.to("meta"), next_token_loss)
    assert every_block.units["layers.1"].experts_bytes > every_block.units["layers.1"].up_bytes > 0
    assert _cost_model.repeated_blocks(model, units) is not None
    assert _cost_model.count(model, units, tokens, next_token_loss) == every_block


@pytest.mark.parametrize("name", ["mixtral-8x7b-v0.1", "qwen3-30b-a3b", "gpt-oss-20b"])
def test_a_published_moe_configs_experts_are_counted_from_its_config(name, tmp_path):
    """Mixtral-8x7B, Qwen3-30B-A3B and gpt-oss-20b as published: each block's experts module holds the
    config's experts (gate, up and down projections, gpt-oss's biases), in the training dtype (fp32),
    whatever the file's torch_dtype; its up projection's ring (gate and up, gpt-oss's bias) is the larger.
    The config is cut to its first two decoder layers (every one of these is a MoE block, and a block's
    count does not depend on the blocks after it): Hugging Face's blocks differ (the count's four-block
    shortcut does not apply), and a meta-device step of all 24 to 48 takes ~10 s."""
    import json

    from rsdp.planner import _models, _training

    config = json.loads((CONFIGS / name / "config.json").read_text())
    experts = config.get("num_local_experts") or config["num_experts"]
    hidden, inner = config["hidden_size"], config.get("moe_intermediate_size") or config["intermediate_size"]
    per_expert = 3 * hidden * inner + (2 * inner + hidden if config["model_type"] == "gpt_oss" else 0)  # gpt-oss: biases
    assert not config.get("mlp_only_layers") and config.get("decoder_sparse_step", 1) == 1, "a dense block among the first two"
    two_blocks = {**config, "num_hidden_layers": 2, **({"layer_types": config["layer_types"][:2]} if "layer_types" in config else {})}
    (tmp_path / "config.json").write_text(json.dumps(two_blocks))
    model, loss_fn, _ = _models.build(f"hf:{tmp_path / 'config.json'}", {})
    model = _training.as_trained(model, training_dtype="fp32", lora_rank=0, lora_targets=None, frozen=[])
    units = find_units(model)
    counted = count(model, units, torch.zeros(1, 17, dtype=torch.long), loss_fn).units["model.layers.1"]
    assert (counted.experts, counted.experts_bytes, counted.trainable_experts_bytes) == (experts, 4 * experts * per_expert, 4 * experts * per_expert)
    per_expert_up = 2 * hidden * inner + (2 * inner if config["model_type"] == "gpt_oss" else 0)
    assert (counted.up_bytes, counted.trainable_up_bytes) == (4 * experts * per_expert_up, 4 * experts * per_expert_up)


def test_frozen_experts_under_lora_carry_no_gradient_transients(tmp_path):
    """``rsdp plan --model hf:<a Qwen3-MoE config.json> --lora-rank 16`` (peft's adapters on the blocks'
    Linears; the experts, 3-D parameters, frozen), counted on the meta device: no expert gradient is
    stored, and on 8 ranks rsdp's expert rings hold their weights alone, two blocks of both projections
    in forward (their one ring) and of the up projection in backward (no partials, no step gradient),
    where the same experts trained would hold their partials too."""
    import dataclasses
    import json

    from rsdp.planner import _models, _training
    from rsdp.planner._cost_model import _Parallelism

    config = {**SHAPE, **FAMILIES["qwen3_moe"][2], "model_type": "qwen3_moe", "num_experts": 12}  # blocks of 2 on 8 ranks
    (tmp_path / "config.json").write_text(json.dumps(config))
    model, loss_fn, _ = _models.build(f"hf:{tmp_path / 'config.json'}", {})
    model = _training.as_trained(model, training_dtype="bf16", lora_rank=16, lora_targets=None, frozen=[])
    units = find_units(model)
    layer = next(name for name in units if name.endswith("layers.1"))
    counted = count(model, units, torch.zeros(1, 17, dtype=torch.long), loss_fn).units[layer]
    assert counted.experts == 12 and counted.experts_bytes > counted.up_bytes > 0
    assert (counted.trainable_experts_bytes, counted.trainable_up_bytes) == (0, 0)
    lora = _Parallelism(counted, Strategy.RSDP, cluster(8))
    trained = _Parallelism(
        dataclasses.replace(counted, trainable_experts_bytes=counted.experts_bytes, trainable_up_bytes=counted.up_bytes), Strategy.RSDP, cluster(8)
    )
    block = counted.up_bytes * 2 // 12  # the up projection's 2 experts of 12, in the stored dtype
    both = counted.experts_bytes * 2 // 12  # both projections' (the forward's one ring)
    assert lora.expert_step == 0
    rider = -(-counted.model_vector_bytes // 8)  # the model's vectors' shard rides behind a message
    assert lora.ring == 2 * (block + rider) < trained.ring
    assert lora.ring_forward == trained.ring_forward == 2 * (both + rider) > lora.ring


def lora_moe_peaks_case() -> list[tuple[str, float, float]]:
    """Tiny Qwen3-MoE with peft's LoRA on the attention (experts frozen), FSDP and rsdp everywhere:
    (label, predicted, measured), AdamW over the adapters."""
    from rsdp.planner._training import with_lora

    tokens = moe_tokens()
    model = with_lora(tiny_moe("qwen3_moe"), 8, ["q_proj", "k_proj", "v_proj", "o_proj"])
    names = ["", *find_units(model)]
    counts = count(counted_as_planned(model), names[1:], tokens, next_token_loss)
    results = []
    for strategy in (Strategy.FSDP, Strategy.RSDP):
        policy = dict.fromkeys(names, strategy)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a model built outside a mesh, rotary scaling notes
            trained = parallelize(copy.deepcopy(model), policy)
            measured = measure_peak(trained, tokens, next_token_loss, lambda params: torch.optim.AdamW([p for p in params if p.requires_grad]))
        results.append((f"qwen3_moe LoRA {strategy.value}", predicted(model, policy, tokens, cluster(dist.get_world_size()), counts), measured))
    return results


def test_moe_peak_under_lora_is_within_15_percent_of_the_measured_peak(ranks):
    """Frozen experts beside trained adapters, on 4 ranks: rsdp's expert rings carry weights and no
    gradient partials, FSDP2 gathers the experts and makes no unsharded expert gradient."""
    for label, prediction, measured in ranks.run(4, lora_moe_peaks_case)[0]:
        print(f"4 ranks, {label}: predicted {prediction / MiB:.3f} MiB, measured {measured / MiB:.3f} MiB ({measured / prediction:.3f})")
        assert 1 - TOLERANCE <= measured / prediction <= 1 + TOLERANCE, f"{label}: {measured} vs {prediction}"
