"""Two rsdp models in one process: DPO's policy and frozen reference, a distillation teacher, an EMA copy.

rsdp's engine keeps state between passes (the ring buffers, the order of rings a pass predicts for
prefetch, gathers riding rings, deferred hops) in one ``RingContext`` per model, so two models whose
passes interleave must not read each other's predictions or overwrite each other's messages. Checked against the
single-process fp64 reference on 2, 3 and 4 ranks, with and without a ring plan, with a frozen
(``requires_grad=False``) reference and with two trained models:

- ``dpo``: the reference's forward under ``no_grad`` (or ``inference_mode``) between the policy's
  forward and backward;
- ``alternate``: the two trained in turn, each its own forward, backward and step;
- ``joint``: both forwards, then one backward through both;
- ``nested``: the teacher's forward inside the student's forward (and so before its backward);
- ``shard_between``: a third model sharded between the policy's forward and backward.
"""

import pytest
import torch
import torch.nn.functional as F

from models import assert_close, assert_param_grads_match, assert_params_match, lm_loss, local_rows, rank_and_world
from models import planned_llama, rsdp_lm, twin
from host_overhead import LLAMA_PLAN, LlamaBlock  # noqa: E402  benchmarks/ is on the path once models is imported
from rsdp import rsdp_shard
from rsdp.memory import CommCounter


def build(planned, seed, group=1):
    """A planned Llama or a TinyLM (in rings of groups of ``group``), and its fp64 reference."""
    torch.manual_seed(seed)
    return planned_llama(vocab=37) if planned else rsdp_lm(seed, ring_group_size=group)


def _pair_loss(policy_logits, other_logits, tokens):
    """A loss of the policy's logits that reads the other model's (DPO's log-ratio, a distillation KL)."""
    return lm_loss(policy_logits, tokens) + (policy_logits.log_softmax(-1) * other_logits.softmax(-1)).sum(-1).mean() * -0.5


class Student(torch.nn.Module):
    """Calls the teacher inside its own forward: the teacher is not a submodule, only a callee."""

    def __init__(self, model, teacher):
        super().__init__()
        self.model = model
        self.teacher = [teacher]

    def forward(self, tokens):
        with torch.no_grad():
            teacher_logits = self.teacher[0](tokens)
        return self.model(tokens), teacher_logits


def two_models_case(pattern, planned, frozen, steps=3, group=1):
    rank, world = rank_and_world()
    policy, policy_reference = build(planned, 0, group)
    other, other_reference = build(planned, 1, group)
    if frozen:
        for m in (other, other_reference):
            m.requires_grad_(False)
    trained = [(policy, policy_reference)] + ([] if frozen else [(other, other_reference)])
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for pair in trained for m in pair]
    student = Student(policy, other)

    for step in range(steps):
        tokens = torch.randint(1, 37, (world * 2, 6), generator=torch.Generator().manual_seed(step))
        mine = local_rows(tokens, rank, world)
        if pattern in ("dpo", "dpo_inference_mode", "shard_between"):
            logits = policy(mine)
            if pattern == "shard_between":
                build(planned, 2 + step)
            with torch.inference_mode() if pattern == "dpo_inference_mode" else torch.no_grad():
                other_logits = other(mine)
            _pair_loss(logits, other_logits, mine).backward()
        elif pattern == "nested":
            logits, other_logits = student(mine)
            _pair_loss(logits, other_logits, mine).backward()
        elif pattern == "joint":
            logits, other_logits = policy(mine), other(mine)
            (_pair_loss(logits, other_logits.detach(), mine) + lm_loss(other_logits, mine)).backward()
        elif pattern == "alternate":
            logits = policy(mine)
            lm_loss(logits, mine).backward()
            other_logits = other(mine)
            lm_loss(other_logits, mine).backward()

        total = 0
        for r in range(world):
            theirs = local_rows(tokens, r, world)
            reference_logits = policy_reference(theirs)
            if pattern == "alternate":
                total = total + lm_loss(reference_logits, theirs) + lm_loss(other_reference(theirs), theirs)
            elif pattern == "joint":
                reference_other = other_reference(theirs)
                total = total + _pair_loss(reference_logits, reference_other.detach(), theirs) + lm_loss(reference_other, theirs)
            else:
                with torch.no_grad():
                    reference_other = other_reference(theirs)
                total = total + _pair_loss(reference_logits, reference_other, theirs)
        (total / world).backward()
        outputs = [("policy logits", logits, policy_reference, mine), ("other logits", other_logits, other_reference, mine)]
        _compare_and_step(step, outputs, trained, optimizers)
    for model, reference in trained:
        assert_params_match(model, reference)


def _compare_and_step(step, outputs, trained, optimizers):
    """``outputs``: (what, output, reference model, this rank's input) per model, each output against its
    reference's; then every trained model's gradients, and one step of every optimizer."""
    with torch.no_grad():
        for what, output, reference, mine in outputs:
            assert_close(output, reference(mine), what=f"{what} at step {step}")
    for model, reference in trained:
        assert_param_grads_match(model, reference, 1.0)
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad()


CASES = [
    ("dpo", 2, False, True),
    ("dpo", 3, True, True),
    ("dpo", 4, True, True),
    ("dpo_inference_mode", 4, False, True),
    ("nested", 2, True, True),
    ("nested", 4, False, True),
    ("joint", 3, False, False),
    ("joint", 4, True, False),
    ("alternate", 2, False, False),
    ("alternate", 4, True, False),
    ("shard_between", 3, True, True),
]


@pytest.mark.parametrize("pattern, world, planned, frozen", CASES)
def test_two_models_whose_passes_interleave_stay_exact(ranks, pattern, world, planned, frozen):
    ranks.run(world, two_models_case, pattern, planned, frozen)


def exchanges_case(pattern, group=1):
    """Sends per pass of TinyLM on 4 ranks from the fourth step on (when a lone model's are steady:
    ``test_prefetch.py``), alone or with a second model whose passes interleave with its own."""
    rank, world = rank_and_world()
    policy, _ = build(False, 0, group)
    other, _ = build(False, 1, group)
    other.requires_grad_(pattern == "alternate")
    tokens = local_rows(torch.randint(1, 37, (world * 2, 6), generator=torch.Generator().manual_seed(0)), rank, world)
    counts = []
    for _ in range(5):
        with CommCounter() as forward:
            loss = lm_loss(policy(tokens), tokens)
        if pattern == "dpo":
            with torch.no_grad():
                other(tokens)
        with CommCounter() as backward:
            loss.backward()
        if pattern == "alternate":
            lm_loss(other(tokens), tokens).backward()
        counts.append((dict(forward.calls), dict(backward.calls)))
    return counts[3:]


def test_a_second_model_leaves_the_first_ones_exchanges_as_they_are_alone(ranks):
    """Each model's passes predict the next from its own last one (the order of rings for prefetch,
    the ring buffers' sizes, which gathers and reductions ride rings): a reference's forward between
    the policy's forward and backward, or a second model trained in turn, costs the policy no exchange."""
    alone = ranks.run(4, exchanges_case, "alone")
    for pattern in ("dpo", "alternate"):
        assert ranks.run(4, exchanges_case, pattern) == alone, pattern


def teacher_exchanges_case(pattern):
    """Sends per step, from the fourth on, of a student (TinyLM on 4 ranks: forward and backward) and
    of a frozen teacher's no_grad forward: run one after the other (``alone``), the teacher called
    inside the student's forward between two of its blocks (``nested``), or alone with a third model
    sharded between the student's forward and backward (``shard_between``)."""
    rank, world = rank_and_world()
    student, _ = build(False, 0)
    teacher, _ = build(False, 1)
    teacher.requires_grad_(False)
    tokens = local_rows(torch.randint(1, 37, (world * 2, 6), generator=torch.Generator().manual_seed(0)), rank, world)
    teacher_counter = CommCounter()

    def run_teacher(*_):
        with torch.no_grad(), teacher_counter:
            teacher(tokens)

    if pattern == "nested":
        student.layers[1].register_forward_pre_hook(run_teacher)
    counts = []
    for step in range(5):
        teacher_counter.calls.clear()
        with CommCounter() as forward:
            loss = lm_loss(student(tokens), tokens)
        if pattern == "shard_between":
            build(False, 2 + step)
        with CommCounter() as backward:
            loss.backward()
        if pattern != "nested":
            run_teacher()
        student_forward = forward.calls.copy()
        if pattern == "nested":
            student_forward.subtract(teacher_counter.calls)  # the outer counter saw the teacher's too
        counts.append((dict(+student_forward), dict(backward.calls), dict(teacher_counter.calls)))
    return counts[3:]


def test_each_model_keeps_its_lone_exchanges_when_one_runs_inside_the_other(ranks):
    """Each model has its own ring context: a teacher's forward inside the student's forward is a pass
    of its own (its gathers, prefetch and buffers), and neither model's passes cost the other an
    exchange; sharding another model between a forward and its backward leaves both as they were."""
    alone = ranks.run(4, teacher_exchanges_case, "alone")
    for pattern in ("nested", "shard_between"):
        assert ranks.run(4, teacher_exchanges_case, pattern) == alone, pattern


def plain_root_case(pattern, planned):
    """Two models whose blocks are sharded one by one under a plain root (no rsdp root: a context per
    block): DPO's reference forward between the policy's forward and backward, or the two trained in
    turn; each step exact against the fp64 reference."""
    rank, world = rank_and_world()
    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(*(LlamaBlock(8, 2 * world, 4 * world) for _ in range(2))).double()
        reference = twin(model)
        for block in model:
            rsdp_shard(block, ring_plan=LLAMA_PLAN if planned else None)
        models.append((model, reference))
    (policy, policy_reference), (other, other_reference) = models
    trained = models if pattern == "alternate" else models[:1]
    if pattern == "dpo":
        other.requires_grad_(False)
        other_reference.requires_grad_(False)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for pair in trained for m in pair]
    for step in range(3):
        x = torch.randn(world * 2, 5, 8, generator=torch.Generator().manual_seed(step), dtype=torch.float64)
        mine = local_rows(x, rank, world)
        y = policy(mine)
        if pattern == "dpo":
            with torch.no_grad():
                other_y = other(mine)
            (y * other_y).mean().backward()
            expected = (policy_reference(x) * other_reference(x)).mean()
        else:
            y.pow(2).mean().backward()
            other_y = other(mine)
            other_y.pow(2).mean().backward()
            expected = policy_reference(x).pow(2).mean() + other_reference(x).pow(2).mean()
        expected.backward()
        outputs = [("policy output", y, policy_reference, mine), ("other output", other_y, other_reference, mine)]
        _compare_and_step(step, outputs, trained, optimizers)
    for model, reference in trained:
        assert_params_match(model, reference)


@pytest.mark.parametrize("pattern, world, planned", [("dpo", 2, True), ("alternate", 3, False), ("dpo", 4, False)])
def test_two_models_of_blocks_under_plain_roots_stay_exact(ranks, pattern, world, planned):
    ranks.run(world, plain_root_case, pattern, planned)
