"""Activation checkpointing without re-rotation (``_checkpoint.py``): under selective activation
checkpointing a ring layer's outputs are kept, so the recomputation in backward sends nothing.

Against the single-process fp64 reference: training under full checkpointing made ring-aware
(``rsdp.ring_checkpoint_context``), under a SAC policy that saves matmuls (torchtitan's kind), with a
ring plan, and with an in-place op on a kept output (the recomputation must run that ring again).
Bytes and exchanges per step, counted: equal to a step without checkpointing under both SAC forms;
plain full checkpointing rotates every ring weight again (4(W-1)/W of the parameters).
"""

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from models import (
    LlamaLM,
    TinyLM,
    lm_loss,
    local_rows,
    planned_llama,
    rank_and_world,
    shard_lm,
    train_and_compare,
    twin,
)
from rsdp import ring_checkpoint_context, rsdp_shard
from rsdp.memory import CommCounter

SAVE_MATMULS = functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
CONTEXTS = {"none": None, "full": None, "ring": ring_checkpoint_context, "sac-mm": SAVE_MATMULS}


def tiny_lm(seed, context, **config):
    torch.manual_seed(seed)
    model = TinyLM(checkpointing=context != "none", checkpoint_context=CONTEXTS[context], **config).double()
    reference = twin(model)
    shard_lm(model, ["rsdp"] * len(model.layers))
    rsdp_shard(model)
    return model, reference


def training_case(context, seed=4):
    model, reference = tiny_lm(seed, context, vocab=11, dim=6, heads=2, hidden=9, layers=2)
    train_and_compare(model, reference, steps=3, rows=1, seq=5)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("context", ["ring", "sac-mm"])
def test_training_with_kept_ring_outputs_matches_reference(ranks, world, context):
    ranks.run(world, training_case, context)


class CheckpointedLlama(LlamaLM):
    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False, context_fn=ring_checkpoint_context)
        return self.lm_head(self.norm(x))


def planned_case(seed=5):
    """Ring plans (whole attention and MLP sub-blocks) keep their summed outputs too."""
    torch.manual_seed(seed)
    model, reference = planned_llama(CheckpointedLlama)
    train_and_compare(model, reference, steps=2, rows=1, seq=5)


def test_planned_sub_blocks_keep_their_outputs(ranks):
    ranks.run(3, planned_case)


class InPlaceBlock(nn.Module):
    """A kept output modified in place after the forward (a scale, then ReLU(inplace), on a Linear's
    output): handed back as it is, the recomputation would scale it twice."""

    def __init__(self, dim):
        super().__init__()
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x):
        return x + self.down(F.relu(self.up(x).mul_(2.0), inplace=True))


def in_place_case(seed=6):
    rank, world = rank_and_world()
    torch.manual_seed(seed)
    model = nn.Sequential(InPlaceBlock(5), InPlaceBlock(5)).double()
    reference = twin(model)
    for block in model:
        rsdp_shard(block)
    x = torch.randn(world * 2, 5, dtype=torch.float64)
    out = x[2 * rank : 2 * rank + 2]
    for block in model:
        out = checkpoint(block, out, use_reentrant=False, context_fn=ring_checkpoint_context)
    out.pow(2).sum().backward()
    reference(x).pow(2).sum().div(world).backward()
    for (name, param), expected in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad.full_tensor(), expected.grad, rtol=1e-9, atol=1e-11, msg=name)


def test_in_place_op_on_a_kept_output_runs_its_ring_again(ranks):
    ranks.run(2, in_place_case)


def bytes_case(context):
    rank, world = rank_and_world()
    model, _ = tiny_lm(7, context, vocab=23, dim=8, heads=2, hidden=12, layers=2)
    tokens = local_rows(torch.randint(0, 23, (world * 2, 6)), rank, world)
    lm_loss(model(tokens), tokens).backward()  # warm-up: forms the shared-input groups
    with CommCounter() as comm:
        lm_loss(model(tokens), tokens).backward()
    return comm.bytes_sent, comm.calls["c10d::send"]


def test_kept_ring_outputs_send_what_a_step_without_checkpointing_sends(ranks):
    world = 4
    sent = {context: ranks.run(world, bytes_case, context)[0] for context in CONTEXTS}
    print({context: f"{nbytes} B, {sends} sends" for context, (nbytes, sends) in sent.items()})
    assert sent["ring"] == sent["sac-mm"] == sent["none"]
    (full_bytes, full_sends), (plain_bytes, plain_sends) = sent["full"], sent["none"]
    assert full_bytes > plain_bytes and full_sends > plain_sends  # the recomputation rotates again


class Flip(nn.Module):
    """Calls its two Linears in an order set from outside: a recomputation that differs from its forward."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.a_first = nn.Linear(4, 4), nn.Linear(4, 4), True

    def forward(self, x):
        first, second = (self.a, self.b) if self.a_first else (self.b, self.a)
        return second(torch.tanh(first(x)))


def diverging_recomputation_case():
    torch.manual_seed(0)
    module = rsdp_shard(Flip())
    out = checkpoint(module, torch.randn(2, 4), use_reentrant=False, context_fn=ring_checkpoint_context)
    module.a_first = False
    try:
        out.sum().backward()
    except RuntimeError as error:
        return str(error)
    return None


def test_a_recomputation_that_reorders_ring_layers_raises(ranks):
    for message in ranks.run(2, diverging_recomputation_case):
        assert message is not None and "recomputed ring layer 'b' where the forward ran 'a'" in message, message
