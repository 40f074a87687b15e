"""Outputs, input gradients and every parameter gradient against a single-process fp64 reference.

Each rank builds the same model, keeps an fp64 twin, shards the original, and runs its own rows of one
global batch; the reference runs the whole batch. The loss is ``sum(out * upstream)`` with a fixed
random ``upstream``, so input gradients match exactly and parameter gradients are the reference's
divided by the world size (rsdp's default is the mean over data-parallel ranks, as FSDP2's).
"""

import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from hypothesis import example, given
from hypothesis import strategies as st

from models import MLP, assert_close, assert_param_grads_match, check_against_reference, own_rows, rank_and_world, twin
from rsdp import rsdp_shard
from rsdp._fully_shard._wire import Views

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from host_overhead import OpCounter  # noqa: E402

worlds = st.sampled_from([1, 2, 3, 4])
sizes = st.integers(1, 9)


def shard_and_check(model, inputs, upstream):
    reference = twin(model)
    rsdp_shard(model)
    check_against_reference(model, reference, inputs, upstream)


def linear_case(seed, in_features, out_features, bias, rows):
    torch.manual_seed(seed)
    _, world = rank_and_world()
    shard_and_check(
        nn.Linear(in_features, out_features, bias=bias, dtype=torch.float64),
        torch.randn(world * rows, 3, in_features, dtype=torch.float64),
        torch.randn(world * rows, 3, out_features, dtype=torch.float64),
    )


@given(world=worlds, in_features=sizes, out_features=sizes, bias=st.booleans(), rows=st.integers(1, 3))
def test_linear_matches_reference(ranks, world, in_features, out_features, bias, rows):
    ranks.run(world, linear_case, 0, in_features, out_features, bias, rows)


def embedding_case(seed, num_embeddings, dim, padding_idx, rows):
    torch.manual_seed(seed)
    _, world = rank_and_world()
    shard_and_check(
        nn.Embedding(num_embeddings, dim, padding_idx=padding_idx, dtype=torch.float64),
        torch.randint(0, num_embeddings, (world * rows, 5)),
        torch.randn(world * rows, 5, dim, dtype=torch.float64),
    )


@given(world=worlds, num_embeddings=sizes, dim=sizes, rows=st.integers(1, 3), data=st.data())
def test_embedding_matches_reference(ranks, world, num_embeddings, dim, rows, data):
    padding_idx = data.draw(st.one_of(st.none(), st.integers(0, num_embeddings - 1)), label="padding_idx")
    ranks.run(world, embedding_case, 1, num_embeddings, dim, padding_idx, rows)


class Mixed(nn.Module):
    """Every kind of parameter rsdp handles: rotated (Linear, Embedding, a tied head), gathered
    (LayerNorm, a free parameter, a Conv1d), a nested rsdp_shard child, and a frozen Linear."""

    def __init__(self, vocab, dim, hidden):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.inner = nn.Sequential(nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, dim))
        self.norm = nn.LayerNorm(dim)
        self.scale = nn.Parameter(torch.randn(dim))
        self.conv = nn.Conv1d(dim, dim, kernel_size=1)
        self.frozen = nn.Linear(dim, dim)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        x = self.embed(tokens)
        x = self.norm(x + self.inner(x)) * self.scale
        x = x + self.conv(x.transpose(1, 2)).transpose(1, 2) + self.frozen(x)
        return self.head(x)


def mixed_case(seed, vocab, dim, hidden, rows):
    torch.manual_seed(seed)
    _, world = rank_and_world()
    model = Mixed(vocab, dim, hidden).double()
    reference = twin(model)
    rsdp_shard(model.inner)
    rsdp_shard(model)
    tokens = torch.randint(0, vocab, (world * rows, 4))
    check_against_reference(model, reference, tokens, torch.randn(world * rows, 4, vocab, dtype=torch.float64))
    assert model.head.weight is model.embed.weight, "tied weight was untied"


@given(world=worlds, vocab=sizes, dim=sizes, hidden=sizes, rows=st.integers(1, 2))
def test_mixed_module_matches_reference(ranks, world, vocab, dim, hidden, rows):
    ranks.run(world, mixed_case, 2, vocab, dim, hidden, rows)


def multihead_attention_case(seed, embed_dim, heads, rows):
    """nn.MultiheadAttention passes out_proj.weight to a functional op itself: its Linear must be
    gathered, not rotated."""
    torch.manual_seed(seed)
    _, world = rank_and_world()

    class SelfAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(embed_dim, heads, batch_first=True, dtype=torch.float64)

        def forward(self, x):
            return self.attn(x, x, x, need_weights=False)[0]

    shard_and_check(
        SelfAttention(),
        torch.randn(world * rows, 3, embed_dim, dtype=torch.float64),
        torch.randn(world * rows, 3, embed_dim, dtype=torch.float64),
    )


@given(world=worlds, heads=st.integers(1, 3), head_dim=st.integers(1, 3), rows=st.integers(1, 2))
def test_multihead_attention_matches_reference(ranks, world, heads, head_dim, rows):
    ranks.run(world, multihead_attention_case, 14, heads * head_dim, heads, rows)


class InPlaceAfterRing(nn.Module):
    """In-place ops on ring outputs (issue 12.4): ReLU(inplace) after a Linear, ``*=`` and ``+=``
    after an Embedding, ``masked_fill_`` on logits."""

    def __init__(self, vocab, dim):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Parameter(torch.randn(dim))
        self.up = nn.Linear(dim, dim)
        self.act = nn.ReLU(inplace=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        x *= 2.0
        x += self.position
        logits = self.head(self.act(self.up(x)))
        return logits.masked_fill_(tokens.unsqueeze(-1) == 0, 0.0)


def in_place_case(seed, vocab, dim, rows):
    torch.manual_seed(seed)
    _, world = rank_and_world()
    shard_and_check(
        InPlaceAfterRing(vocab, dim).double(),
        torch.randint(0, vocab, (world * rows, 4)),
        torch.randn(world * rows, 4, vocab, dtype=torch.float64),
    )


@given(world=worlds, vocab=st.integers(2, 9), dim=sizes, rows=st.integers(1, 2))
def test_in_place_ops_on_ring_outputs(ranks, world, vocab, dim, rows):
    ranks.run(world, in_place_case, 3, vocab, dim, rows)


def uneven_batches(world, empty):
    """Per-rank batch sizes for issue 12.6: 0 on the ranks in ``empty``, 1, 2, 1, ... on the others
    (ranks may have different batch sizes, and one may have none)."""
    return [0 if rank in empty else 1 + rank % 2 for rank in range(world)]


class SharedInput(nn.Module):
    """Three Linears on one input: after the first forward they share one ring (a fused group)."""

    def __init__(self, dim):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim)

    def forward(self, x):
        return self.q(x) * self.k(x) + self.v(x)


class Group(nn.Module):
    """Linears of any widths on one input, each with or without a bias: one ring after the first forward,
    each ring step one GEMM for all of them (an ``addmm`` when every one has a bias)."""

    def __init__(self, dim, widths, biases):
        super().__init__()
        self.members = nn.ModuleList(nn.Linear(dim, width, bias=bias) for width, bias in zip(widths, biases))

    def forward(self, x):
        return torch.cat([member(x) for member in self.members], -1)


def fused_group_case(dim, widths, biases, frozen):
    torch.manual_seed(7)
    _, world = rank_and_world()
    model = Group(dim, widths, biases).double()
    if frozen:  # a frozen member: the weight gradients are not adjacent in the message, one GEMM each
        model.members[0].weight.requires_grad_(False)
    reference = twin(model)
    rsdp_shard(model)
    sizes = uneven_batches(world, set())
    inputs = torch.randn(sum(sizes), 3, dim, dtype=torch.float64)
    for _ in range(2):  # the second step runs the group's one ring
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        check_against_reference(model, reference, inputs, torch.randn(sum(sizes), 3, sum(widths), dtype=torch.float64), sizes)
    assert len(model._get_rsdp_state().fusion._group_of) == len(widths), "the members did not share a ring"


@given(
    world=worlds,
    dim=sizes,
    widths=st.lists(sizes, min_size=2, max_size=3),
    biases=st.lists(st.booleans(), min_size=3, max_size=3),
    frozen=st.booleans(),
)
# Widths that divide by the world: no padding rows, so the input gradient's term is one GEMM per shard too.
@example(world=4, dim=5, widths=[4, 8], biases=[True, False, True], frozen=False)
@example(world=3, dim=2, widths=[6, 3, 9], biases=[True, True, True], frozen=True)
def test_fused_group_of_any_widths_and_biases_matches_reference(ranks, world, dim, widths, biases, frozen):
    ranks.run(world, fused_group_case, dim, widths, biases[: len(widths)], frozen)


def empty_batch_case(kind, empty):
    torch.manual_seed(5)
    _, world = rank_and_world()
    sizes = uneven_batches(world, empty)
    total = sum(sizes)
    if kind == "linear":
        model = nn.Linear(4, 5, dtype=torch.float64)
        inputs, out_shape = torch.randn(total, 3, 4, dtype=torch.float64), (total, 3, 5)
    elif kind == "embedding":
        model = nn.Embedding(7, 3, padding_idx=2, dtype=torch.float64)
        inputs, out_shape = torch.randint(0, 7, (total, 4)), (total, 4, 3)
    elif kind == "fused":
        model = SharedInput(4).double()
        inputs, out_shape = torch.randn(total, 3, 4, dtype=torch.float64), (total, 3, 4)
    else:
        model = Mixed(7, 4, 5).double()
        inputs, out_shape = torch.randint(0, 7, (total, 4)), (total, 4, 7)
    reference = twin(model)
    if kind == "mixed":
        rsdp_shard(model.inner)
    rsdp_shard(model)
    for _ in range(2):  # the second step runs the fused group's one ring
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        check_against_reference(model, reference, inputs, torch.randn(out_shape, dtype=torch.float64), sizes)
    if kind == "fused":
        assert len(model._get_rsdp_state().fusion._group_of) == 3, "q, k and v did not share a ring"


@pytest.mark.parametrize("kind", ["linear", "embedding", "fused", "mixed"])
@pytest.mark.parametrize("world, empty", [(1, {0}), (2, {0}), (2, {0, 1}), (3, {1}), (4, {0, 3})])
def test_empty_batch_on_some_ranks_matches_reference(ranks, kind, world, empty):
    ranks.run(world, empty_batch_case, kind, empty)


def empty_batch_training_case(empty_per_step, checkpointing):
    """Full TinyLM steps (every block and the root sharded, AdamW) where some ranks have no rows: the
    loss is summed over tokens and divided by the global token count times the mean over ranks rsdp
    applies, so every step equals the reference's on the whole batch."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from models import TinyLM, assert_params_match

    torch.manual_seed(6)
    rank, world = rank_and_world()
    model = TinyLM(vocab=13, dim=8, heads=2, hidden=10, layers=2, checkpointing=checkpointing).double()
    reference = twin(model)
    for block in model.layers:
        rsdp_shard(block)
    rsdp_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)

    def summed_loss(logits, tokens):
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten(), reduction="sum")

    for step, empty in enumerate(empty_per_step):
        sizes = uneven_batches(world, empty)
        tokens = torch.randint(0, 13, (sum(sizes), 5))
        predicted = max(tokens.shape[0] * (tokens.shape[1] - 1), 1)  # a step with no rows has loss 0
        loss = summed_loss(model(own_rows(tokens, sizes, rank)), own_rows(tokens, sizes, rank)) * world / predicted
        loss.backward()
        reference_loss = summed_loss(reference(tokens), tokens) / predicted
        reference_loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        assert_close(total / world, reference_loss.detach(), what=f"loss at step {step}", rtol=1e-7)
        assert_param_grads_match(model, reference, 1.0, rtol=1e-7, atol=1e-9)
        optimizer.step()
        reference_optimizer.step()
        optimizer.zero_grad()
        reference_optimizer.zero_grad()
    assert_params_match(model, reference, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("world, empty_per_step", [(1, [{0}, set()]), (2, [{1}, {0, 1}, set()]), (3, [{0}, {2}])])
def test_training_steps_with_empty_batches_match_reference(ranks, world, empty_per_step, checkpointing):
    ranks.run(world, empty_batch_training_case, empty_per_step, checkpointing)


def steady_ops_case():
    """The aten ops of one steady-state training step of a SwiGLU MLP (gate/up share a ring, down is
    alone): (all of them, the views among them, by op)."""
    torch.manual_seed(0)
    model = MLP(8, 12)
    rsdp_shard(model)
    x = torch.randn(3, 8, requires_grad=True)
    for _ in range(3):  # the ring buffers' sizes and the views cached of them settle
        model(x).sum().backward()
    with OpCounter() as ops:
        model(x).sum().backward()
    return ops.ops, ops.views, ops.by_op


def test_a_ring_step_issues_its_arithmetic_and_no_view(ranks):
    """Each ring step dispatches only what it computes: a rank more adds, per ring (gate/up's, down's),
    one forward GEMM, one input-gradient GEMM, one gradient-contribution GEMM and one add of the
    arrived partials (gate's and up's in one): 4 × 2 = 8 ops, none of them a view. Every view a step
    uses (shard columns, transposed and stacked weights) is made once per pass or cached with the
    ring's buffers: each op is a host dispatch, a kernel launch on a GPU."""
    ops2, views2, by_op2 = ranks.run(2, steady_ops_case)[0]
    ops4, views4, by_op4 = ranks.run(4, steady_ops_case)[0]
    assert views4 == views2, (by_op2, by_op4)
    assert ops4 - ops2 == 2 * 8, (by_op2, by_op4)


def test_views_written_whole_or_in_part_copy_into_their_own_rows_only():
    """``Views.write`` joins back-to-back views into one ``cat`` when every view is written; a write of
    the first views only (a planned backward's weights ahead of its partials) copies those alone, leaves
    the rest and the joined view as they were, and warns of no resize."""
    buffer = torch.zeros(2 * 3 * 4)
    views = Views([buffer[:12].view(3, 4), buffer[12:].view(3, 4)], cached=False)
    first, second = torch.randn(3, 4), torch.randn(3, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        views.write([first])
        assert torch.equal(views[0], first) and not views[1].any()
        views.write([second, first])
        assert torch.equal(views[0], second) and torch.equal(views[1], first)
        views.write([first])
        assert torch.equal(views[0], first) and torch.equal(views[1], first)
