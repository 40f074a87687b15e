"""The recorded schedule of each pass kind (``_schedule.py``), through public entry points: a step that
of another sequence length keeps the record (no ring message depends on the batch), a pass that
raised records nothing: each step exact, with its steady exchanges at once. (A pass whose rings
change, and its re-recording, is tests/test_prefetch.py's ``changing_order_case``.) Counted (sends and prefetches taken), and checked against the
single-process fp64 reference at every step.
"""

import torch

from models import assert_close, assert_param_grads_match, lm_loss, local_rows, rank_and_world, rsdp_lm
from rsdp.memory import CommCounter

VOCAB = 23


def _step(model, reference, tokens, rank, world):
    """One exact forward and backward of both; returns (prefetches taken, sends)."""
    context = model._get_rsdp_state().ring.context
    used = context.forward_prefetch.used + context.backward_prefetch.used
    mine = local_rows(tokens, rank, world)
    with CommCounter() as counter:
        loss = lm_loss(model(mine), mine)
        loss.backward()
    reference_loss = lm_loss(reference(tokens), tokens)
    reference_loss.backward()
    assert_close(full_mean(loss, world), reference_loss.detach(), what="loss")
    assert_param_grads_match(model, reference, 1.0)
    for module in (model, reference):
        module.zero_grad()
    return context.forward_prefetch.used + context.backward_prefetch.used - used, counter.calls["c10d::send"]


def full_mean(loss, world):
    total = loss.detach().clone()
    torch.distributed.all_reduce(total)
    return total / world


def changing_shape_case(lengths):
    rank, world = rank_and_world()
    model, reference = rsdp_lm(0, vocab=VOCAB, dim=8, heads=2, hidden=12, layers=2)
    counts = []
    for step, length in enumerate(lengths):
        tokens = torch.randint(0, VOCAB, (world, length), generator=torch.Generator().manual_seed(step))
        counts.append(_step(model, reference, tokens, rank, world))
    return counts


def test_a_step_of_another_shape_keeps_the_schedule(ranks):
    # Ring messages hold weights and their gradients' partials, whose layouts do not depend on the
    # batch: a step of another sequence length asks what the record holds, and keeps its exchanges.
    lengths = [5, 5, 5, 7, 7, 5]
    for counts in ranks.run(4, changing_shape_case, lengths):
        steady = counts[2]
        assert steady[0] > 0 and counts[2:] == [steady] * 4, counts


class _Raised(Exception):
    pass


def raising_passes_case():
    """Steady steps, then a step whose backward raises after some rings ran, normal steps, a step whose
    forward raises there, normal steps: each normal one exact, with its steady exchanges at once."""
    rank, world = rank_and_world()
    model, reference = rsdp_lm(0, vocab=VOCAB, dim=8, heads=2, hidden=12, layers=2)
    tokens = torch.randint(0, VOCAB, (world, 5), generator=torch.Generator().manual_seed(0))
    counts = [_step(model, reference, tokens, rank, world) for _ in range(4)]

    def fail(*_):
        raise _Raised

    norm = model.layers[1].mlp_norm  # between the block's attention rings and its MLP's
    mine = local_rows(tokens, rank, world)
    for hook in (norm.register_full_backward_pre_hook, norm.register_forward_pre_hook):
        handle = hook(fail)
        try:
            lm_loss(model(mine), mine).backward()
        except _Raised:
            pass
        else:
            raise AssertionError("the hook did not raise")
        handle.remove()
        model.zero_grad()
        counts += [_step(model, reference, tokens, rank, world) for _ in range(2)]
    return counts


def test_a_pass_that_raised_records_nothing(ranks):
    """A backward that raised, then a forward that raised, each followed by two normal steps."""
    for counts in ranks.run(4, raising_passes_case):
        steady = counts[3]
        assert steady[0] > 0 and counts[2] == steady, counts
        assert counts[4:] == [steady] * 4, counts
