"""Hugging Face models with a ring plan (``base_model_tp_plan``) and their KV cache, against the unsharded
fp64 model: a cached forward (prefill, then decode steps), ``generate()`` (greedy, sampled with a fixed
seed, a static cache, beam search, ranks whose sequences end at different lengths) and training with the
model's default ``use_cache=True``.

Each rank generates from its own rows, and its reference is the unsharded model on those rows (with
the same seed when sampling): a sampler draws per batch, so one global reference batch would draw
other numbers. The models have grouped KV heads (a shard's k/v hold fewer heads than its q), and the
Qwen2 model ties its head to its embedding and has a sliding-window layer, whose cache keeps only the
window (the sequences outgrow it).
"""

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
from torch.nn.attention.flex_attention import BlockMask

from models import assert_close, assert_param_grads_match, assert_params_match, local_rows, rank_and_world
from rsdp import rsdp_shard

transformers = pytest.importorskip("transformers")

VOCAB = 37
PROMPT = 5
NEW_TOKENS = 4
# Llama's RMSNorm computes in float32 even in a float64 model, so results agree to float32's precision.
TOLERANCE = {"rtol": 1e-5, "atol": 1e-7}


def _config(model_name: str, world: int):
    """Heads and kv heads over the ranks (a plan splits heads, as tensor parallelism does)."""
    shape = dict(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=8 * world, num_hidden_layers=2, head_dim=4,
        num_attention_heads=2 * world, num_key_value_heads=world, max_position_embeddings=32, initializer_range=0.3,
        bos_token_id=0, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    if model_name == "llama":
        return transformers.LlamaConfig(**shape)
    # The second layer attends over a window of 4: the cache keeps the last 3 tokens.
    return transformers.Qwen2Config(
        **shape, tie_word_embeddings=True, use_sliding_window=True, sliding_window=4, max_window_layers=1
    )


def planned_model(model_name: str, ring_group_size: int = 1):
    """An fp64 model sharded with its own ``base_model_tp_plan`` (rings in groups of ``ring_group_size``),
    and its unsharded twin."""
    world = rank_and_world()[1]
    torch.manual_seed(0)
    config = _config(model_name, world)
    model_class = transformers.LlamaForCausalLM if model_name == "llama" else transformers.Qwen2ForCausalLM
    model = model_class(config).double()
    reference = copy.deepcopy(model)
    for layer in model.model.layers:
        rsdp_shard(layer, ring_plan=config.base_model_tp_plan, ring_group_size=ring_group_size)
    rsdp_shard(model, ring_group_size=ring_group_size)
    return model, reference


def _prompts(world: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (2 * world, PROMPT), generator=generator)


def assert_caches_match(cache, reference_cache, what: str):
    for index, (layer, expected) in enumerate(zip(cache.layers, reference_cache.layers, strict=True)):
        assert_close(layer.keys, expected.keys, what=f"{what}: keys of layer {index}", **TOLERANCE)
        assert_close(layer.values, expected.values, what=f"{what}: values of layer {index}", **TOLERANCE)


def cached_forward_case(model_name: str, ring_group_size: int = 1):
    """A prefill, then decode steps one token at a time, each step's logits and the cache's contents."""
    rank, world = rank_and_world()
    model, reference = planned_model(model_name, ring_group_size)
    model.eval(), reference.eval()
    tokens = local_rows(torch.randint(1, VOCAB, (2 * world, PROMPT + 3)), rank, world)
    cache, reference_cache = (transformers.DynamicCache(config=model.config) for _ in range(2))
    with torch.no_grad():
        for start, end in [(0, PROMPT), (PROMPT, PROMPT + 1), (PROMPT + 1, PROMPT + 2), (PROMPT + 2, PROMPT + 3)]:
            chunk = tokens[:, start:end]
            logits = model(input_ids=chunk, cache=cache, use_cache=True).logits
            expected = reference(input_ids=chunk, cache=reference_cache, use_cache=True).logits
            assert_close(logits, expected, what=f"logits of tokens {start}:{end}", **TOLERANCE)
            assert_caches_match(cache, reference_cache, f"cache after tokens {start}:{end}")
    return True


def generate_case(model_name: str, ring_group_size: int = 1):
    """Greedy (under ``torch.inference_mode()``, as serving code runs it), sampled (fixed seed), static-cache and
    beam-search ``generate()`` match the unsharded model's, token for token; so does a run where this rank's sequences stop at an EOS another rank's never reach."""
    rank, world = rank_and_world()
    model, reference = planned_model(model_name, ring_group_size)
    model.eval(), reference.eval()
    prompts = _prompts(world, seed=1)
    mine = local_rows(prompts, rank, world)
    runs = {
        "greedy": dict(do_sample=False),
        "sampled": dict(do_sample=True, top_k=0, temperature=1.5),
        "static cache": dict(do_sample=False, cache_implementation="static"),
        "beam search": dict(do_sample=False, num_beams=2),
    }
    outputs = {}
    for what, options in runs.items():
        torch.manual_seed(7 + rank)
        with torch.inference_mode(what == "greedy"):
            outputs[what] = model.generate(mine, max_new_tokens=NEW_TOKENS, **options)
        torch.manual_seed(7 + rank)
        expected = reference.generate(mine, max_new_tokens=NEW_TOKENS, **options)
        assert torch.equal(outputs[what], expected), f"{what}: {outputs[what].tolist()} != {expected.tolist()}"
    assert not torch.equal(outputs["sampled"], outputs["greedy"]), "sampling drew the greedy tokens"
    # One row per rank, and an EOS that rank 0's row produces and no other rank's: rank 0 stops early and
    # the others go on, which runs forwards on some ranks only unless generate keeps them in step.
    rows = prompts[:world]
    with torch.no_grad():
        continuations = reference.generate(rows, max_new_tokens=NEW_TOKENS, do_sample=False)[:, PROMPT:].tolist()
    others = {token for continuation in continuations[1:] for token in continuation}
    first = continuations[0]
    ends = [token for at, token in enumerate(first[:-1]) if token not in others and token not in first[:at]]
    assert ends, f"no token ends rank 0's row only ({continuations}); change the seed"
    options = dict(do_sample=False, eos_token_id=ends[0], pad_token_id=0)
    generated = model.generate(rows[rank : rank + 1], max_new_tokens=NEW_TOKENS, **options)
    expected = reference.generate(rows[rank : rank + 1], max_new_tokens=NEW_TOKENS, **options)
    assert torch.equal(generated, expected), f"early EOS: {generated.tolist()} != {expected.tolist()}"
    lengths = [None] * world
    dist.all_gather_object(lengths, generated.shape[1])
    assert lengths[0] < min(lengths[1:]), f"rank 0 did not stop first: {lengths}"
    return True


def training_case(model_name: str, ring_group_size: int = 1):
    """AdamW steps with the model's default config (``use_cache=True``: each forward fills a cache),
    then one on a continuation of a prefix cached under ``no_grad`` whose backward recomputes the
    attention (saved-tensor hooks keep no graphs), so it asks the cache after its update."""
    rank, world = rank_and_world()
    model, reference = planned_model(model_name, ring_group_size)
    model.train(), reference.train()
    assert model.config.use_cache
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for step, prefix in enumerate([0, 0, PROMPT]):
        tokens = torch.randint(1, VOCAB, (2 * world, PROMPT + 3))
        mine = local_rows(tokens, rank, world)
        cache, reference_cache = None, None
        if prefix:
            cache, reference_cache = (transformers.DynamicCache(config=model.config) for _ in range(2))
            with torch.no_grad():
                model(input_ids=mine[:, :prefix], cache=cache)
                reference(input_ids=tokens[:, :prefix], cache=reference_cache)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t) if prefix else contextlib.nullcontext():
            output = model(input_ids=mine[:, prefix:], labels=mine[:, prefix:], cache=cache)
        assert output.cache is not None
        output.loss.backward()
        reference_loss = reference(input_ids=tokens[:, prefix:], labels=tokens[:, prefix:], cache=reference_cache).loss
        reference_loss.backward()
        total = output.loss.detach().clone()
        dist.all_reduce(total)
        assert_close(total / world, reference_loss.detach(), what=f"loss at step {step}", **TOLERANCE)
        assert_param_grads_match(model, reference, 1.0, **TOLERANCE)
        optimizer.step(), reference_optimizer.step()
        optimizer.zero_grad(), reference_optimizer.zero_grad()
    assert_params_match(model, reference, **TOLERANCE)
    return True


class AttentionWithAMaskAndACache(torch.nn.Module):
    """A sub-block that takes a mask object (which it does not need) and asks its cache, if it gets one,
    for more than ``update``."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(4, 4, dtype=torch.float64) for _ in range(4))

    def forward(self, x, mask=None, cache=None):
        if cache is not None:
            cache.get_seq_length()
        return self.o(self.q(x) * self.k(x) + self.v(x))


def refusals_case():
    """What a planned sub-block cannot make exact raises at its first call, on every rank, and leaves
    the model usable."""
    torch.manual_seed(0)
    model, reference = planned_model("llama")
    tokens = torch.randint(1, VOCAB, (1, PROMPT))
    encoder_decoder = transformers.EncoderDecoderCache(transformers.DynamicCache(), transformers.DynamicCache())
    with pytest.raises(TypeError, match="called with a EncoderDecoderCache.*DynamicCache and StaticCache"):
        model(input_ids=tokens, cache=encoder_decoder)
    with pytest.raises(TypeError, match="called with a object"):
        model(input_ids=tokens, use_cache=False, counter=object())
    # Training's default fills a cache with states that require grad; reading it in a differentiable
    # forward would drop their gradient.
    filled = model(input_ids=tokens).cache
    with pytest.raises(RuntimeError, match="keys or values require grad"):
        model(input_ids=tokens, cache=filled)
    model.config._attn_implementation = "eager"  # returns its attention weights with its output
    with pytest.raises(ValueError, match="must return its rowwise Linear's output"):
        model(input_ids=tokens, use_cache=False)
    model.config._attn_implementation = "sdpa"
    with torch.no_grad():
        logits, expected = model(input_ids=tokens).logits, reference(input_ids=tokens).logits
        assert_close(logits, expected, what="logits after the refusals", **TOLERANCE)
    block = AttentionWithAMaskAndACache()
    unsharded = copy.deepcopy(block)
    rsdp_shard(block, ring_plan={"q": "colwise", "k": "colwise", "v": "colwise", "o": "rowwise"})
    x = torch.randn(1, 2, 4, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="read cache.get_seq_length"):
        block(x, cache=transformers.DynamicCache())
    # Flex attention's mask is an object the runs cannot change: taken.
    mask = BlockMask.from_kv_blocks(torch.ones(1, 1, 1, dtype=torch.int32), torch.zeros(1, 1, 1, 1, dtype=torch.int32))
    assert_close(block(x, mask=mask), unsharded(x), what="a sub-block given a BlockMask", **TOLERANCE)
    return True


def test_what_cannot_be_made_exact_is_refused_on_every_rank(ranks):
    assert all(ranks.run(2, refusals_case))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("model_name", ["llama", "qwen2"])
def test_cached_forward_matches_the_unsharded_model(ranks, world, model_name):
    assert all(ranks.run(world, cached_forward_case, model_name))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("model_name", ["llama", "qwen2"])
def test_generate_matches_the_unsharded_model(ranks, world, model_name):
    assert all(ranks.run(world, generate_case, model_name))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("model_name", ["llama", "qwen2"])
def test_training_with_the_default_cache_matches_the_unsharded_model(ranks, world, model_name):
    assert all(ranks.run(world, training_case, model_name))
