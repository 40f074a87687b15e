"""A managed weight handed to someone else's ``torch.autograd.Function`` (``_operand.py``).

Fused losses (Liger's fused linear cross-entropy, TRL's default SFT loss) read ``lm_head.weight``
inside their own Function in the model's forward and return its gradient from that Function's
backward. rsdp installs a ``RingOperand`` there; autograd accumulates the Function's full gradient into
it, and rsdp reduce-scatters it to the shards' owners. Checked against the single-process fp64
reference: a Liger-style Function of our own (chunked over tokens, gradients computed in forward),
TRL's Function through its own ``add_fused_lm_head``, and every other route by which a managed weight
is gathered for an op (grad mode, no_grad inside a Function, both kinds of activation checkpointing).
Where the gradient cannot reach the shard (``torch.autograd.grad`` with respect to the weight), every
rank raises.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from models import (
    TinyLM,
    assert_close,
    assert_param_grads_match,
    assert_params_match,
    local_rows,
    rank_and_world,
    twin,
)
from rsdp import rsdp_shard

# Tokens per chunk of the fused loss: fewer than a rank's tokens, and not a divisor of them.
CHUNK = 5


class FusedLinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``hidden @ weight.T`` without the full logits, as Liger computes it: per
    chunk of tokens, the loss and the gradients with respect to ``hidden`` and ``weight`` are computed in
    forward and stashed; backward only scales them."""

    @staticmethod
    def forward(ctx, hidden, weight, targets):
        grad_hidden = torch.zeros_like(hidden)
        grad_weight = torch.zeros_like(weight)
        loss = hidden.new_zeros(())
        for start in range(0, hidden.shape[0], CHUNK):
            chunk, target = hidden[start : start + CHUNK], targets[start : start + CHUNK]
            logits = chunk @ weight.t()
            loss += (logits.logsumexp(-1) - logits.gather(1, target[:, None]).squeeze(1)).sum()
            grad_logits = logits.softmax(-1)
            grad_logits[torch.arange(len(target)), target] -= 1
            grad_hidden[start : start + CHUNK] = grad_logits @ weight
            grad_weight += grad_logits.t() @ chunk
        count = max(hidden.shape[0], 1)
        ctx.save_for_backward(grad_hidden / count, grad_weight / count)
        return loss / count

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_loss, grad_weight * grad_loss, None


class FusedLossLM(TinyLM):
    """TinyLM whose forward returns the fused loss of its head (tied to the embedding, or not)."""

    def __init__(self, tied: bool):
        super().__init__()
        if not tied:
            self.lm_head.weight = nn.Parameter(torch.randn_like(self.embed.weight) * 0.3)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        hidden = self.norm(x)[:, :-1].flatten(0, 1)
        return FusedLinearCrossEntropy.apply(hidden, self.lm_head.weight, tokens[:, 1:].flatten())


def shard_lm(model):
    for layer in model.layers:
        rsdp_shard(layer)
    return rsdp_shard(model)


def fused_loss_case(tied, steps=2):
    rank, world = rank_and_world()
    torch.manual_seed(0)
    model = FusedLossLM(tied).double()
    reference = twin(model)
    shard_lm(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for step in range(steps):
        tokens = torch.randint(1, 37, (world * 2, 7), generator=torch.Generator().manual_seed(step))
        loss = model(local_rows(tokens, rank, world))
        loss.backward()
        reference_loss = sum(reference(local_rows(tokens, r, world)) for r in range(world)) / world
        reference_loss.backward()
        assert_close(loss, reference(local_rows(tokens, rank, world)).detach(), what=f"loss at step {step}")
        assert_param_grads_match(model, reference, 1.0)
        for opt in (optimizer, reference_optimizer):
            opt.step()
            opt.zero_grad()
    assert_params_match(model, reference)


@pytest.mark.parametrize("world, tied", [(1, True), (2, False), (3, True), (4, False), (4, True)])
def test_a_fused_loss_function_reading_the_head_trains_exactly(ranks, world, tied):
    ranks.run(world, fused_loss_case, tied)


def trl_fused_head_case(model_name):
    import transformers
    from trl.trainer.utils import add_fused_lm_head

    rank, world = rank_and_world()
    torch.manual_seed(0)
    if model_name == "qwen2":  # grouped KV heads, embeddings tied to the head
        config = transformers.Qwen2Config(
            vocab_size=37, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True, attn_implementation="eager",
        )
        model = transformers.Qwen2ForCausalLM(config).double()
    else:
        config = transformers.LlamaConfig(
            vocab_size=37, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32, attn_implementation="eager",
        )
        model = transformers.LlamaForCausalLM(config).double()
    reference = twin(model)
    for layer in model.model.layers:
        rsdp_shard(layer)
    rsdp_shard(model)
    for m in (model, reference):  # as SFTTrainer does, after the model is wrapped
        add_fused_lm_head(m, outputs=("log_probs", "entropy", "is_top1"))
    tokens = torch.randint(1, 37, (world * 2, 7), generator=torch.Generator().manual_seed(0))

    def loss_of(m, ids):
        return m(input_ids=ids, labels=ids, fused_lm_head=True, use_cache=False).loss

    loss = loss_of(model, local_rows(tokens, rank, world))
    loss.backward()
    (sum(loss_of(reference, local_rows(tokens, r, world)) for r in range(world)) / world).backward()
    # TRL's kernel accumulates its statistics in float32.
    tolerance = {"rtol": 1e-5, "atol": 1e-6}
    assert_close(loss, loss_of(reference, local_rows(tokens, rank, world)).detach(), what="loss", **tolerance)
    assert_param_grads_match(model, reference, 1.0, **tolerance)


@pytest.mark.parametrize("world, model_name", [(2, "qwen2"), (4, "llama")])
def test_trl_fused_lm_head_trains_exactly(ranks, world, model_name):
    pytest.importorskip("trl")
    ranks.run(world, trl_fused_head_case, model_name)


class Scaled(torch.autograd.Function):
    """``x * w`` elementwise, its gradients computed by hand: a Function that reads a weight with an op
    that has no ring form (an elementwise product gathers it, here under the forward's no_grad)."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight * 1)
        return x * weight

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return grad * weight, grad * x


class Fallbacks(nn.Module):
    """A matrix used by ops with no ring form along every route: under grad mode, inside a Function's
    forward, inside both kinds of activation checkpointing (read from the module, and passed in)."""

    def __init__(self, route):
        super().__init__()
        self.route = route
        self.table = nn.Parameter(torch.randn(5, 4))
        self.proj = nn.Linear(4, 4)

    def mixed(self, x, table):
        return self.proj(x * table + table.sin())

    def forward(self, x):
        if self.route == "grad":
            y = x * self.table
        elif self.route == "function":
            y = Scaled.apply(x, self.table)
        elif self.route == "function_transposed":  # the operand's transpose is the Function's leaf
            y = Scaled.apply(x.transpose(-1, -2), self.table.t()).transpose(-1, -2)
        elif self.route == "function_under_autocast":  # (float64 is left alone: exact)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = Scaled.apply(x, self.table)
        elif self.route == "function_in_checkpoint":
            y = checkpoint(lambda x: Scaled.apply(x, self.table), x, use_reentrant=False)
        elif self.route in ("reentrant", "non_reentrant"):
            reentrant = self.route == "reentrant"
            y = checkpoint(self.mixed, x, self.table, use_reentrant=reentrant)
            y = y + checkpoint(lambda x: self.mixed(x, self.table), x, use_reentrant=reentrant)
        return self.proj(y)


FALLBACK_ROUTES = ["grad", "function", "function_transposed", "function_under_autocast", "function_in_checkpoint", "reentrant", "non_reentrant"]


def fallback_route_case(route):
    rank, world = rank_and_world()
    torch.manual_seed(0)
    module = Fallbacks(route).double()
    reference, this_rank_reference = twin(module), twin(module)
    rsdp_shard(module)
    x = torch.randn(world * 2, 3, 5, 4, dtype=torch.float64)
    for _ in range(2):  # gradients accumulate over two backwards
        mine = local_rows(x, rank, world).detach().requires_grad_()
        out = module(mine)
        out.square().sum().backward()
    for _ in range(2):
        # Inputs that need a gradient, as the rank's: reentrant checkpointing drops the parameters' gradients otherwise.
        inputs = [local_rows(x, r, world).detach().requires_grad_() for r in range(world)]
        sum(reference(xr).square().sum() for xr in inputs).div(world).backward()
    expected = local_rows(x, rank, world).detach().requires_grad_()
    expected_out = this_rank_reference(expected)
    expected_out.square().sum().backward()  # (reentrant checkpointing refuses torch.autograd.grad)
    assert_close(out, expected_out.detach(), what="output")
    assert_close(mine.grad, expected.grad, what="input gradient")
    assert_param_grads_match(module, reference, 1.0)


@pytest.mark.filterwarnings("ignore:rsdp.*no ring form")
@pytest.mark.parametrize("route", FALLBACK_ROUTES)
def test_every_gathered_fallback_route_trains_exactly(ranks, route):
    ranks.run(2, fallback_route_case, route)


class GradOfWeight(nn.Module):
    """A loss that differentiates with respect to the weight itself: the full gradient of one rank's
    batch does not exist under rsdp (the ring sends gradients to the shards' owners)."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.head = nn.Linear(4, 6, bias=False)

    def forward(self, x):
        weight = self.head.weight
        with torch.enable_grad():
            loss = F.linear(x, weight).square().sum()
            if self.how == "grad":
                (grad,) = torch.autograd.grad(loss, [weight], allow_unused=True)
            else:
                loss.backward(inputs=[weight])
                grad = weight.grad
        return grad


def grad_of_weight_case(how):
    rank, world = rank_and_world()
    module = GradOfWeight(how).double()
    rsdp_shard(module)
    with pytest.raises(RuntimeError, match=rf"torch.autograd.{how} was asked for the gradient of head, a weight rsdp manages"):
        module(torch.randn(2, 4, dtype=torch.float64))
    # The process group is still usable: nothing was left half-done.
    return module.head(torch.ones(1, 4, dtype=torch.float64)).detach()


@pytest.mark.parametrize("how", ["grad", "backward"])
def test_a_gradient_with_respect_to_a_managed_weight_raises_on_every_rank(ranks, how):
    outputs = ranks.run(2, grad_of_weight_case, how)
    assert_close(outputs[0], outputs[1], what="the module still works after the error")
