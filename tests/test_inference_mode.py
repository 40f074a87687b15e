"""Evaluation under ``torch.inference_mode()`` between training steps.

What rsdp keeps from pass to pass — the ring's message buffers and the views of them that messages cache,
the gathered vectors, a planned sub-block's cached arguments — must not be made under inference mode
and then reused by training: an inference tensor has no version counter, and a view made under
inference mode may not be modified in place outside it. Checked against the single-process fp64
reference: evaluation, then training steps, then evaluation and training again, with and without a ring
plan, on 2 and 4 ranks.
"""

import pytest
import torch

from models import assert_close, assert_param_grads_match, assert_params_match, lm_loss, local_rows, rank_and_world
from models import planned_llama, rsdp_lm


def eval_then_train_case(planned, order):
    rank, world = rank_and_world()
    torch.manual_seed(0)
    model, reference = planned_llama(vocab=37) if planned else rsdp_lm(0)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference)]

    def evaluate(step):
        tokens = torch.randint(1, 37, (world, 6), generator=torch.Generator().manual_seed(100 + step))
        with torch.inference_mode():
            logits = model(local_rows(tokens, rank, world))
        assert_close(logits, reference(local_rows(tokens, rank, world)).detach(), what=f"eval logits at {step}")

    def train(step):
        tokens = torch.randint(1, 37, (world * 2, 6), generator=torch.Generator().manual_seed(step))
        loss = lm_loss(model(local_rows(tokens, rank, world)), local_rows(tokens, rank, world))
        loss.backward()
        sum(lm_loss(reference(local_rows(tokens, r, world)), local_rows(tokens, r, world)) for r in range(world)).div(world).backward()
        assert_param_grads_match(model, reference, 1.0)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()

    for step, kind in enumerate(order):
        (evaluate if kind == "eval" else train)(step)
    assert_params_match(model, reference)


EVAL_FIRST = ("eval", "train", "train", "eval", "train")
TRAIN_FIRST = ("train", "eval", "eval", "train")


@pytest.mark.parametrize(
    "world, planned, order",
    [(2, False, EVAL_FIRST), (4, True, EVAL_FIRST), (2, True, TRAIN_FIRST), (4, False, TRAIN_FIRST)],
)
def test_evaluation_under_inference_mode_does_not_break_training(ranks, world, planned, order):
    ranks.run(world, eval_then_train_case, planned, order)
