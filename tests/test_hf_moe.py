"""Hugging Face MoE models under rsdp's expert rings, beyond one training step (``test_experts.py``): the
router's load-balancing loss, DCP checkpoints exchanged with FSDP2 across world sizes, ``generate()``
with the KV cache on ranks whose sequences end apart, and peft's LoRA on the experts (against float64
and against FSDP2, in float32 and in bfloat16 mixed precision).

Tiny Mixtral, Qwen3-MoE and gpt-oss causal LMs with 8 experts, built from config objects
(``test_experts.tiny_moe``), ``rsdp_shard`` on each decoder layer then the root. References: the
unsharded float64 model, run on each rank's rows as DDP would (the load-balancing loss is per batch,
not per token, so the global batch would be another loss); FSDP2 (``fully_shard`` the same way) for
checkpoints and LoRA. 3 ranks hold the 8 experts in blocks of 3, 3 and 2.
"""

import copy
import functools
import re
import warnings

import pytest
import torch
import torch.distributed as dist

from models import assert_close, assert_param_grads_match, assert_params_match, draw_lora_b, local_rows, rank_and_world
from rsdp import rsdp_shard
from rsdp._compat import MixedPrecisionPolicy, fully_shard
from test_checkpoint import load, save, train
from test_experts import FLOAT32_TOLERANCE, TOLERANCE, VOCAB, tiny_llama4, tiny_moe

pytest.importorskip("transformers")


def shard_moe(model, strategy: str, experts_first: bool = False, ring_group_size: int = 1):
    """Each decoder layer, then the root (a peft model's, after ``get_peft_model``), with ``rsdp_shard``
    (on a ring of groups of ``ring_group_size``) or FSDP2's ``fully_shard``; ``experts_first``: each
    layer's ``mlp.experts`` by a call of its own before its layer (under peft's LoRA on the experts, the
    outermost wrapper)."""
    shard = functools.partial(rsdp_shard, ring_group_size=ring_group_size) if strategy == "rsdp" else fully_shard
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for layer in base.model.layers:
        if experts_first:
            shard(layer.mlp.experts)
        shard(layer)
    shard(model)
    return model


def router_loss_case(family: str, implementation: str) -> float:
    """``output_router_logits=True``: the loss is the LM loss plus ``router_aux_loss_coef`` times the
    load-balancing loss of this rank's batch; the loss, the load-balancing loss and every gradient
    (the router's through both) against the unsharded float64 model on each rank's rows."""
    rank, world = rank_and_world()
    dtype = torch.float32 if implementation == "grouped_mm" else torch.float64
    router = dict(output_router_logits=True, router_aux_loss_coef=0.5)
    reference = tiny_moe(family, implementation if dtype == torch.float64 else "eager", **router)
    model = shard_moe(copy.deepcopy(reference).to(dtype), "rsdp")
    model.config._experts_implementation = implementation
    tolerance = TOLERANCE if dtype == torch.float64 else FLOAT32_TOLERANCE
    tokens = torch.randint(3, VOCAB, (world * 2, 6), generator=torch.Generator().manual_seed(1))
    output = model(input_ids=local_rows(tokens, rank, world), labels=local_rows(tokens, rank, world))
    output.loss.backward()
    references = [reference(input_ids=rows, labels=rows) for rows in (local_rows(tokens, r, world) for r in range(world))]
    assert_close(output.aux_loss.double(), references[rank].aux_loss.double(), what=f"{family} load-balancing loss", **tolerance)
    (sum(r.loss for r in references) / world).backward()  # DDP's gradient: the mean of the ranks'
    total = output.loss.detach().double().clone()
    dist.all_reduce(total)
    expected = sum(r.loss.detach().double() for r in references) / world
    assert_close(total / world, expected, what=f"{family} loss", **tolerance)
    assert_param_grads_match(model, reference, 1.0, **tolerance)
    return output.aux_loss.item()


@pytest.mark.parametrize(
    "family, implementation, world",
    [("qwen3_moe", "grouped_mm", 2), ("mixtral", "eager", 3), ("gpt_oss", "batched_mm", 4)],
)
def test_router_load_balancing_loss_is_exact(ranks, family, implementation, world):
    aux_losses = ranks.run(world, router_loss_case, family, implementation)
    assert len(set(aux_losses)) == world  # each rank's batch balances its own way: per-rank losses differ


GLOBAL_ROWS = 12  # divisible by 2, 3 and 4: every world size trains on the same global batches


def _global_batch(step: int, world: int | None = None) -> torch.Tensor:
    """The global batch of ``step``, the same rows on every number of ranks (``world``)."""
    return torch.randint(3, VOCAB, (GLOBAL_ROWS, 6), generator=torch.Generator().manual_seed(100 + step))


def _lm_loss(model, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens, labels=tokens).loss


def _train_moe(model, optimizer, steps: range) -> list[float]:
    """AdamW steps on the global batches; returns the global mean losses."""
    return train(model, optimizer, steps, _global_batch, _lm_loss)


def _probe_logits(model) -> torch.Tensor:
    """The same batch on every rank, so every rank returns the full logits."""
    with torch.no_grad():
        return model(input_ids=_global_batch(-1)).logits


def checkpoint_case(strategy: str, path: str, role: str) -> dict:
    """``save``: two AdamW steps, a DCP checkpoint of model and optimizer, then two more steps.
    ``load``: a differently initialised model loads it, then runs those two steps. The second of them
    moves the weights by the loaded optimizer state, so its loss checks that state too."""
    torch.manual_seed(0 if role == "save" else 7)
    model = tiny_moe("qwen3_moe", "eager")
    if role == "load":
        with torch.no_grad():
            for param in model.parameters():
                param.normal_()
    model = shard_moe(model, strategy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if role == "save":
        _train_moe(model, optimizer, range(2))
        save(model, optimizer, path)
    else:
        load(model, optimizer, path)
    return {"logits": _probe_logits(model), "losses": _train_moe(model, optimizer, range(2, 4))}


@pytest.mark.parametrize("saved, loaded", [(("rsdp", 2), ("fsdp", 3)), (("fsdp", 4), ("rsdp", 3))], ids=lambda side: f"{side[0]}x{side[1]}")
def test_moe_checkpoint_loads_across_strategies_and_world_sizes(ranks, tmp_path, saved, loaded):
    """The experts are ``Shard(0)`` DTensors under both (blocks of 4, 4 on 2 ranks; 3, 3, 2 on 3; 2 each on 4):
    DCP reshards them like any parameter, Adam's moments with them."""
    path = str(tmp_path / "checkpoint")
    before = ranks.run(saved[1], checkpoint_case, saved[0], path, "save")[0]
    after = ranks.run(loaded[1], checkpoint_case, loaded[0], path, "load")[0]
    assert_close(after["logits"], before["logits"], what="logits after loading", **TOLERANCE)
    assert_close(torch.tensor(after["losses"]), torch.tensor(before["losses"]), what="losses after loading", **TOLERANCE)


def generate_case(family: str, implementation: str) -> list:
    """Greedy (under ``torch.inference_mode()``) and sampled ``generate()`` with the KV cache, each rank
    on its own prompt: token for token the unsharded model's. Then rank 0 stops at an EOS that no other
    rank's sequence produces, and the others go on: ``generate`` keeps the ranks' forwards in step."""
    rank, world = rank_and_world()
    dtype = torch.float32 if implementation == "grouped_mm" else torch.float64
    reference = tiny_moe(family, implementation, dtype, use_cache=True)
    model = shard_moe(copy.deepcopy(reference), "rsdp")
    prompts = torch.randint(3, VOCAB, (world, 5), generator=torch.Generator().manual_seed(0))
    mine = prompts[rank : rank + 1]
    for what, options in {"greedy": dict(do_sample=False), "sampled": dict(do_sample=True, top_k=0, temperature=1.5)}.items():
        torch.manual_seed(7 + rank)
        with torch.inference_mode(what == "greedy"):
            generated = model.generate(mine, max_new_tokens=4, pad_token_id=0, **options)
        torch.manual_seed(7 + rank)
        expected = reference.generate(mine, max_new_tokens=4, pad_token_id=0, **options)
        assert torch.equal(generated, expected), f"{what}: {generated.tolist()} != {expected.tolist()}"
    with torch.no_grad():
        continuations = reference.generate(prompts, max_new_tokens=4, do_sample=False, pad_token_id=0)[:, 5:].tolist()
    others = {token for continuation in continuations[1:] for token in continuation}
    first = continuations[0]
    ends = [token for at, token in enumerate(first[:-1]) if token not in others and token not in first[:at]]
    assert ends, f"no token ends rank 0's row only ({continuations}); change the seed"
    options = dict(max_new_tokens=4, do_sample=False, eos_token_id=ends[0], pad_token_id=0)
    generated = model.generate(mine, **options)
    assert torch.equal(generated, reference.generate(mine, **options)), f"early EOS: {generated.tolist()}"
    lengths = [None] * world
    dist.all_gather_object(lengths, generated.shape[1])
    assert lengths[0] < min(lengths[1:]), f"rank 0 did not stop first: {lengths}"
    return generated.tolist()


@pytest.mark.parametrize("family, implementation, world", [("gpt_oss", "grouped_mm", 3), ("qwen3_moe", "eager", 4)])
def test_moe_generate_with_the_kv_cache_matches_the_unsharded_model(ranks, family, implementation, world):
    ranks.run(world, generate_case, family, implementation)


EXPERT_WEIGHTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def lora_moe(family: str, implementation: str, dtype, experts: int, adapters: tuple[str, ...]):
    """The tiny MoE with peft LoRA on both expert weights (``target_parameters``: peft's ``ParamWrapper``,
    nested), one adapter per name in ``adapters``, each of rank 2; ``lora_B`` drawn (peft starts it at
    zero)."""
    peft = pytest.importorskip("peft")
    model = tiny_moe(family, implementation, dtype, experts=experts)
    config = dict(r=2, lora_alpha=4, target_modules=[], target_parameters=EXPERT_WEIGHTS)
    model = peft.get_peft_model(model, peft.LoraConfig(**config), adapter_name=adapters[0])
    for name in adapters[1:]:
        model.add_adapter(name, peft.LoraConfig(**config))
    torch.manual_seed(2)
    draw_lora_b(model, 0.2)
    return model


def lora_case(
    family: str, implementation: str, experts: int, adapters: tuple[str, ...], checkpointing: bool, experts_first: bool, ring_group_size: int = 1,
) -> None:
    """An SGD step of LoRA on the experts, every adapter active, against the unsharded float64 model:
    loss, every adapter's gradient, the adapters after the steps; then the logits with the adapters
    disabled (``disable_adapter()``: the base experts alone). ``checkpointing``: the decoder layers
    recomputed in backward (Hugging Face's gradient checkpointing), the wrapper's rings called again.
    ``experts_first``: ``rsdp_shard(layer.mlp.experts)`` (peft's outermost wrapper) before each layer.
    ``ring_group_size``: rsdp's (a ring of groups)."""
    rank, world = rank_and_world()
    dtype = torch.float32 if implementation == "grouped_mm" else torch.float64
    reference = lora_moe(family, implementation if dtype == torch.float64 else "eager", torch.float64, experts, adapters)
    model = copy.deepcopy(reference).to(dtype)
    model.base_model.set_adapter(list(adapters))
    reference.base_model.set_adapter(list(adapters))
    model.get_base_model().config._experts_implementation = implementation
    shard_moe(model, "rsdp", experts_first, ring_group_size)
    if checkpointing:
        for m in (model, reference):
            m.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    tolerance = TOLERANCE if dtype == torch.float64 else FLOAT32_TOLERANCE
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    reference_optimizer = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.5)
    tokens = torch.randint(3, VOCAB, (world * 2, 6), generator=torch.Generator().manual_seed(10))
    mine = local_rows(tokens, rank, world)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = model(input_ids=mine, labels=mine).loss
        loss.backward()
    gathered = [str(w.message) for w in caught if "has no ring form" in str(w.message)]
    assert not gathered, gathered  # the experts rotate on their rings, not gathered op by op for peft's code
    reference_loss = reference(input_ids=tokens, labels=tokens).loss
    reference_loss.backward()
    total = loss.detach().double().clone()
    dist.all_reduce(total)
    assert_close(total / world, reference_loss.detach().double(), what="loss", **tolerance)
    assert_param_grads_match(model, reference, 1.0, **tolerance)
    optimizer.step(), reference_optimizer.step()
    assert_params_match(model, reference, **tolerance)
    probe = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(rank))
    with torch.no_grad(), model.disable_adapter(), reference.disable_adapter():
        assert_close(model(input_ids=probe).logits.double(), reference(input_ids=probe).logits, what="logits, adapters disabled", **tolerance)


@pytest.mark.parametrize(
    "family, implementation, world, experts, adapters, checkpointing, experts_first",
    [
        ("mixtral", "eager", 3, 8, ("default",), True, False),  # blocks of 3, 3, 2 experts: lora_B's columns are strided
        ("gpt_oss", "grouped_mm", 2, 8, ("default", "other"), False, False),  # [experts, in, out] weights; two adapters at once
        ("qwen3_moe", "batched_mm", 4, 2, ("default",), False, True),  # blocks of 1, 1 and none; the wrapper sharded alone
    ],
)
def test_lora_on_experts_matches_the_unsharded_model(ranks, family, implementation, world, experts, adapters, checkpointing, experts_first):
    ranks.run(world, lora_case, family, implementation, experts, adapters, checkpointing, experts_first)


def test_lora_on_experts_on_a_ring_of_groups(ranks):
    """4 ranks in 2 groups of 2: each step's block of 4 experts takes its adapters' part for the group's
    experts."""
    ranks.run(4, lora_case, "mixtral", "eager", 8, ("default",), False, False, ring_group_size=2)


def lora_against_fsdp2_case(family: str, implementation: str, experts: int, precision: str) -> list[float]:
    """LoRA on the experts, ``rsdp_shard`` per decoder layer against FSDP2's ``fully_shard`` per decoder
    layer, from the same weights and batches: loss and every trainable gradient over two SGD steps.
    ``"fp32"``: float32 throughout, to float32's precision. ``"bf16"``: bfloat16 compute and float32
    gradient reduction (``MixedPrecisionPolicy``) under both, judged against the unsharded float64 model
    trained beside them: rsdp's distance from it is at most FSDP2's, doubled, plus 0.5% of its norm
    (bfloat16 products summed in another order). Returns rsdp's distances over FSDP2's (bf16)."""
    rank, world = rank_and_world()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if precision == "bf16" else None
    options = {"mp_policy": policy} if policy else {}
    models = {}
    for strategy, shard in (("rsdp", rsdp_shard), ("fsdp", fully_shard)):
        model = lora_moe(family, implementation, torch.float32, experts, ("default",))
        for layer in model.get_base_model().model.layers:
            shard(layer, **options)
        models[strategy] = shard(model, **options)
    if policy:
        models["float64"] = lora_moe(family, "eager", torch.float64, experts, ("default",))
    optimizers = {s: torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.5) for s, m in models.items()}
    ratios = []
    for step in range(2):
        tokens = torch.randint(3, VOCAB, (world * 2, 6), generator=torch.Generator().manual_seed(20 + step))
        mine = local_rows(tokens, rank, world)
        losses = {}
        for strategy, model in models.items():
            optimizers[strategy].zero_grad()
            rows = tokens if strategy == "float64" else mine  # equal rows per rank: the ranks' mean loss
            losses[strategy] = model(input_ids=rows, labels=rows).loss
            losses[strategy].backward()
        fsdp_params = dict(models["fsdp"].named_parameters())
        trained = [(name, param) for name, param in models["rsdp"].named_parameters() if param.requires_grad]
        assert trained and all("lora_" in name for name, _ in trained), [name for name, _ in trained]
        if not policy:
            assert_close(losses["rsdp"], losses["fsdp"], what=f"loss at step {step}", **FLOAT32_TOLERANCE)
            for name, param in trained:
                expected = fsdp_params[name].grad.full_tensor()
                assert_close(param.grad.full_tensor(), expected, what=f"grad of {name} at step {step}", **FLOAT32_TOLERANCE)
        else:
            exact = dict(models["float64"].named_parameters())
            for name, param in trained:
                truth = exact[name].grad
                rsdp_error = (param.grad.full_tensor().double() - truth).norm().item()
                fsdp_error = (fsdp_params[name].grad.full_tensor().double() - truth).norm().item()
                ratios.append(rsdp_error / fsdp_error)
                assert rsdp_error <= 2 * fsdp_error + 5e-3 * truth.norm().item(), (
                    f"grad of {name} at step {step}: rsdp {rsdp_error:.3g} from float64, FSDP2 {fsdp_error:.3g}"
                )
        for optimizer in optimizers.values():
            optimizer.step()
    return ratios


@pytest.mark.parametrize(
    "family, implementation, world, experts, precision",
    [
        ("qwen3_moe", "grouped_mm", 2, 8, "fp32"),
        ("mixtral", "eager", 3, 8, "fp32"),  # blocks of 3, 3, 2 experts
        ("gpt_oss", "grouped_mm", 4, 8, "bf16"),
        ("qwen3_moe", "grouped_mm", 3, 8, "bf16"),
    ],
)
def test_lora_on_experts_matches_fsdp2(ranks, family, implementation, world, experts, precision):
    ratios = ranks.run(world, lora_against_fsdp2_case, family, implementation, experts, precision)[0]
    if ratios:
        print(f"{family} {precision} on {world} ranks: rsdp's distance from float64 over FSDP2's {min(ratios):.4f}..{max(ratios):.4f}")


def lora_refusal_case(kind: str) -> str:
    """The error, on this rank, for LoRA on experts that the expert rings cannot apply per block (merged,
    on a 2-D bias, on Llama-4's experts), or cannot see (a call of its own on the experts or an inner
    wrapper)."""
    peft = pytest.importorskip("peft")
    if kind in ("merged", "experts", "inner wrapper"):
        model = lora_moe("mixtral", "eager", torch.float64, 8, ("default",))
    if kind == "merged":
        model.merge_adapter()
    elif kind == "bias":  # gpt-oss's expert bias, [experts, out]: peft adapts it as one 2-D weight across the experts
        model = peft.get_peft_model(
            tiny_moe("gpt_oss", "eager"), peft.LoraConfig(r=2, target_modules=[], target_parameters=["mlp.experts.gate_up_proj_bias"])
        )
    elif kind == "llama4":  # experts on rings of their own, without Hugging Face's markers
        targets = ["feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"]
        model = peft.get_peft_model(tiny_llama4(torch.float64), peft.LoraConfig(r=2, target_modules=[], target_parameters=targets))
    tokens = torch.randint(3, VOCAB, (1, 6))
    try:
        if kind in ("experts", "inner wrapper"):  # a call of its own inside the wrappers, then the layers
            for layer in model.get_base_model().model.layers:
                rsdp_shard(layer.mlp.experts.base_layer if kind == "inner wrapper" else layer.mlp.experts.get_base_layer())
        shard_moe(model, "rsdp")(input_ids=tokens, labels=tokens)
    except ValueError as error:
        return str(error)
    raise AssertionError(f"{kind}: LoRA on experts was not refused")


@pytest.mark.parametrize(
    "kind, message",
    [
        ("merged", r"experts 'mlp.experts' have LoRA adapters merged into \['gate_up_proj', 'down_proj'\].*Call unmerge_adapter\(\) first"),
        ("bias", r"experts 'mlp.experts' has peft LoRA on \['gate_up_proj_bias'\], which are not 3-D.*Drop them from target_parameters"),
        ("experts", r"peft's LoRA wrapper 'mlp.experts.base_layer' is around 'mlp.experts.base_layer.base_layer', which an earlier rsdp_shard .*Shard the decoder layer \(or 'mlp.experts', the outermost wrapper\)"),
        ("llama4", r"peft's LoRA on parameters of 'feed_forward.experts.base_layer.base_layer' \(Llama4TextExperts; target_parameters\) runs on the expert rings of Hugging Face's use_experts_implementation experts only.*fully_shard\(layer.feed_forward.experts\), then rsdp_shard\(layer\)"),
        ("inner wrapper", r"peft's LoRA wrapper 'mlp.experts' is around 'mlp.experts.base_layer', which an earlier .*Shard the decoder layer \(or 'mlp.experts', the outermost wrapper\)"),
    ],
)
def test_lora_on_experts_that_the_ring_cannot_apply_is_refused_on_every_rank(ranks, kind, message):
    errors = ranks.run(2, lora_refusal_case, kind)
    assert all(re.search(message, error) for error in errors), errors
