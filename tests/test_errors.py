"""Bad input gets a clear error that names the problem and the fix; a dead peer is an error, not a hang."""

import copy
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor

import rsdp
from models import (
    LlamaBlock,
    ScaledMLP,
    TITAN_PLAN,
    TinyLM,
    assert_close,
    assert_param_grads_match,
    rank_and_world,
    rsdp_lm,
    train_and_compare,
    twin,
)
from rank_pool import RankFailure, RankPool
from rsdp import Strategy, parallelize, rsdp_shard
from rsdp._compat import Shard, fully_shard


def test_no_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        rsdp_shard(nn.Linear(2, 2))


def _raises(error, match, fn):
    with pytest.raises(error, match=match):
        fn()


def sharded_twice_case():
    model = nn.Linear(3, 5)
    rsdp_shard(model)
    _raises(ValueError, "already applied", lambda: rsdp_shard(model))


def fully_shard_then_rsdp_case():
    model = nn.Linear(3, 5)
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    _raises(ValueError, "already managed by", lambda: rsdp_shard(model))


def three_dimensional_mesh_case():
    mesh = init_device_mesh("cpu", (1, 1, dist.get_world_size()))
    _raises(ValueError, "3 dimensions", lambda: rsdp_shard(nn.Linear(3, 5), mesh=mesh))


def dtensor_on_another_mesh_case():
    model = nn.Linear(4, 4)
    other = init_device_mesh("cpu", (2, 2))
    model.weight = nn.Parameter(distribute_tensor(model.weight.detach(), other, [Shard(0), Shard(1)]))
    _raises(ValueError, "already a DTensor on another mesh", lambda: rsdp_shard(model))


def module_list_case():
    _raises(ValueError, "no forward of its own", lambda: rsdp_shard(nn.ModuleList([nn.Linear(2, 2)])))


def embedding_options_case():
    _raises(ValueError, "max_norm", lambda: rsdp_shard(nn.Embedding(5, 3, max_norm=1.0)))


def scalar_parameter_case():
    module = nn.Module()
    module.temperature = nn.Parameter(torch.tensor(1.0))
    _raises(ValueError, "0-dimensional", lambda: rsdp_shard(module))


def index_out_of_range_case():
    """Only rank 1 has a bad token; every rank raises (the verdict travels the ring with the table),
    so none is left waiting for the others."""
    model = rsdp_shard(nn.Embedding(5, 3))
    tokens = torch.tensor([[1, 5]]) if dist.get_rank() == 1 else torch.tensor([[1, 2]])
    _raises(RuntimeError, r"out of range \[0, 5\) on at least one rank", lambda: model(tokens))
    _raises(RuntimeError, "out of range", lambda: model(torch.tensor([[-1]])))
    assert model(torch.tensor([[4, 0]])).shape == (1, 2, 3)  # the ring is still in step


def reassigned_parameter_case():
    model = rsdp_shard(nn.Linear(3, 5))
    model.weight = nn.Parameter(torch.zeros(5, 3))
    _raises(RuntimeError, "no longer the sharded DTensor", lambda: model(torch.zeros(2, 3)))


class WritesItsWeight(nn.Linear):
    """A Linear whose forward writes its own weight in place, the way ``write`` says."""

    def __init__(self, write):
        super().__init__(3, 5)
        self.write = write

    def forward(self, x):
        with torch.no_grad():
            self.write(self.weight)
        return super().forward(x)


def _add_one(weight):
    weight += 1


def _set_first_row(weight):
    weight[0] = 1.0


WEIGHT_WRITES = [  # (how, the op that reaches the weight)
    (lambda w: w.mul_(2), "mul_"),
    (nn.init.zeros_, "zero_"),
    (_add_one, "add_"),
    (_set_first_row, "__setitem__"),
    (lambda w: torch.add(w.detach().clone(), 1, out=w), "add"),
]


def weight_written_in_forward_case():
    """Refused on every rank, with nothing changed: the same model then runs the unsharded result."""
    torch.manual_seed(0)
    x = torch.randn(4, 3)
    for write, name in WEIGHT_WRITES:
        reference = WritesItsWeight(lambda w: None)
        model = rsdp_shard(copy.deepcopy(reference))
        model.write = write
        _raises(RuntimeError, rf"weight is modified in place \({name}\) inside the forward", lambda: model(x))
        model.write = lambda w: None
        torch.testing.assert_close(model(x), reference(x), rtol=0, atol=1e-6)


def bad_divide_factor_case():
    model = rsdp_shard(nn.Linear(3, 5))
    _raises(ValueError, "must be positive", lambda: model.set_gradient_divide_factor(0))


def mesh_of_wrong_type_case():
    _raises(TypeError, "must be a DeviceMesh", lambda: rsdp_shard(nn.Linear(3, 5), mesh=dist.group.WORLD))


def tensor_parallel_parameter_case():
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = nn.Linear(4, 4)
    model.weight = nn.Parameter(distribute_tensor(model.weight.detach(), mesh, [Shard(1)]))
    _raises(ValueError, "does not compose with tensor parallelism", lambda: rsdp_shard(model, mesh=mesh))


def mixed_dtype_gathered_case():
    model = nn.Sequential(nn.LayerNorm(4), nn.LayerNorm(4).double())
    _raises(ValueError, "must share a dtype", lambda: rsdp_shard(model))


def wrong_feature_size_case():
    model = rsdp_shard(nn.Linear(3, 5))
    _raises(ValueError, "in_features=3", lambda: model(torch.zeros(2, 4)))


def integer_input_to_linear_case():
    model = rsdp_shard(nn.Linear(3, 5))
    _raises(TypeError, "must be floating point", lambda: model(torch.zeros(2, 3, dtype=torch.long)))


def float_indices_case():
    model = rsdp_shard(nn.Embedding(5, 3))
    _raises(TypeError, "int32 or int64", lambda: model(torch.zeros(2, 3)))


def double_backward_case():
    model = rsdp_shard(nn.Linear(3, 5))
    x = torch.randn(2, 3, requires_grad=True)
    (grad_x,) = torch.autograd.grad(model(x).pow(2).sum(), x, create_graph=True)
    _raises(RuntimeError, "trying to differentiate twice", lambda: grad_x.sum().backward())


def input_on_wrong_device_case():
    model = rsdp_shard(nn.Linear(3, 5))
    _raises(ValueError, "input is on meta", lambda: model(torch.zeros(2, 3, device="meta")))


def root_sharded_before_blocks_case():
    model = TinyLM(layers=2)
    rsdp_shard(model)
    _raises(ValueError, "already sharded on this mesh by an rsdp_shard .*bottom-up", lambda: rsdp_shard(model.layers[0]))
    # The same after a meta-device model is materialised (to_empty replaces the parameters' data).
    with torch.device("meta"):
        model = TinyLM(layers=2)
    rsdp_shard(model)
    model.to_empty(device="cpu")
    _raises(ValueError, "already sharded on this mesh by an rsdp_shard .*bottom-up", lambda: rsdp_shard(model.layers[0]))


def root_not_sharded_case():
    """Blocks sharded, the root (embedding, norm, tied head) left plain: the first forward that records
    gradients raises on every rank, before any communication; inference runs; frozen, or with the root
    sharded too, it trains. Every rank has the same tokens, so the fp64 reference's gradients are the
    sharded model's."""
    torch.manual_seed(0)
    model = TinyLM(layers=2).double()
    reference = twin(model)
    for layer in model.layers:
        rsdp_shard(layer)
    tokens = torch.randint(1, 37, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_close(model(tokens), reference(tokens), what="inference output")
    _raises(RuntimeError, r"the TinyLM that calls it holds trainable parameters that nothing shards \(embed.weight, "
            r"norm.weight, norm.bias\).*rsdp_shard on the root", lambda: model(tokens))
    for frozen in (model, reference):  # the refused step left nothing open: the next one is exact
        frozen.embed.requires_grad_(False)
        frozen.norm.requires_grad_(False)
    out, reference_out = model(tokens), reference(tokens)
    assert_close(out, reference_out, what="output after the refused step")
    out.sum().backward()
    reference_out.sum().backward()
    assert_param_grads_match(model, reference, 1.0)
    model = TinyLM(layers=2)
    for layer in model.layers:
        rsdp_shard(layer)
    rsdp_shard(model)
    model(tokens).sum().backward()


class UsesShared(nn.Module):
    def __init__(self, shared):
        super().__init__()
        self.shared, self.own = shared, nn.Linear(4, 4)

    def forward(self, x):
        return self.own(self.shared(x))


class SharesASubmodule(nn.Module):
    """``a`` and ``b`` call one submodule (both hold it)."""

    def __init__(self):
        super().__init__()
        shared = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        self.a, self.b = UsesShared(shared), UsesShared(shared)

    def forward(self, x):
        return self.b(self.a(x))


def submodule_shared_by_two_units_case():
    model = SharesASubmodule()
    rsdp_shard(model.a)
    _raises(ValueError, "shares this submodule.*two modules share once, with its own rsdp_shard call", lambda: rsdp_shard(model.b))
    # The fix the message names: the shared submodule's own call first; then it is exact.
    rank, world = rank_and_world()
    torch.manual_seed(0)
    model = SharesASubmodule().double()
    reference = twin(model)
    for module in (model.a.shared, model.a, model.b, model):
        rsdp_shard(module)
    x = torch.randn(2 * world, 4, dtype=torch.float64)
    model(x[2 * rank : 2 * rank + 2]).pow(2).sum().backward()
    expected = reference(x)
    expected.pow(2).sum().backward()
    assert_close(model(x[2 * rank : 2 * rank + 2]), expected[2 * rank : 2 * rank + 2], what="output")
    assert_param_grads_match(model, reference, 1 / world)


def deepcopy_case():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.LayerNorm(5))
    rsdp_shard(model[0])
    rsdp_shard(model)
    _raises(TypeError, "deepcopy of an rsdp module.*not supported.*load_state_dict", lambda: copy.deepcopy(model))
    _raises(TypeError, "deepcopy of an rsdp module", lambda: copy.deepcopy(nn.ModuleList([model])))
    # The fix the message names: a second model sharded the same way, loaded from the first.
    other = nn.Sequential(nn.Linear(3, 5), nn.LayerNorm(5))
    rsdp_shard(other[0])
    rsdp_shard(other)
    other.load_state_dict(model.state_dict())
    x = torch.randn(2, 3)
    torch.testing.assert_close(other(x), model(x))


def bad_strategy_case():
    _raises(ValueError, r"'fsdp2' is not a strategy; use one of \['replicate', 'fsdp', 'rsdp'\]", lambda: Strategy("fsdp2"))
    _raises(ValueError, r"'ddp' is not a strategy; use one of", lambda: parallelize(TinyLM(layers=1), {"layers.*": "ddp"}))
    assert Strategy("FSDP") is Strategy.FSDP


def plan_with_empty_batch_case():
    tokens = torch.randint(0, 37, (2, 5))
    _raises(ValueError, r"batch sizes must be positive, got \[0\]", lambda: rsdp.plan(TinyLM(layers=1), memory_budget=2**30, sample_input=tokens, batch_sizes=[0]))
    _raises(ValueError, "batch sizes must be positive", lambda: rsdp.plan(TinyLM(layers=1), memory_budget=2**30, sample_input=tokens[:0]))


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(4, 8), nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.body(x))


class TokensToVector(Regressor):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(7, 4)

    def forward(self, tokens):
        return super().forward(self.embed(tokens)).mean(1)


def plan_without_language_model_loss_case():
    _raises(ValueError, r"default loss_fn is next-token.*Regressor was given a torch.float32 tensor.*Pass loss_fn=",
            lambda: rsdp.plan(Regressor(), memory_budget=2**30, sample_input=torch.randn(2, 4)))
    _raises(ValueError, r"TokensToVector returned a torch.float32 tensor of shape \(2, 1\).*Pass loss_fn=",
            lambda: rsdp.plan(TokensToVector(), memory_budget=2**30, sample_input=torch.randint(0, 7, (2, 3))))
    # With its own loss it plans.
    chosen = rsdp.plan(Regressor(), memory_budget=2**30, sample_input=torch.randn(2, 4), loss_fn=lambda model, x: model(x).sum())
    assert chosen.batch_size == 2


@pytest.mark.parametrize(
    "world, case",
    [
        (2, sharded_twice_case),
        (2, fully_shard_then_rsdp_case),
        (2, three_dimensional_mesh_case),
        (4, dtensor_on_another_mesh_case),
        (1, module_list_case),
        (1, embedding_options_case),
        (1, scalar_parameter_case),
        (2, index_out_of_range_case),
        (1, reassigned_parameter_case),
        (2, weight_written_in_forward_case),
        (1, bad_divide_factor_case),
        (1, mesh_of_wrong_type_case),
        (2, tensor_parallel_parameter_case),
        (1, mixed_dtype_gathered_case),
        (2, wrong_feature_size_case),
        (1, integer_input_to_linear_case),
        (1, float_indices_case),
        (1, input_on_wrong_device_case),
        (2, double_backward_case),
        (2, root_sharded_before_blocks_case),
        (2, root_not_sharded_case),
        (2, submodule_shared_by_two_units_case),
        (2, deepcopy_case),
        (1, bad_strategy_case),
        (1, plan_with_empty_batch_case),
        (1, plan_without_language_model_loss_case),
    ],
    ids=lambda value: value.__name__.removesuffix("_case") if callable(value) else str(value),
)
def test_bad_input(ranks, world, case):
    ranks.run(world, case)


# Short, as every test below waits it out in full; the steps before the timeout take milliseconds, and
# the bounds are fractions and multiples of it.
PEER_TIMEOUT_S = 2


def run_with_short_timeout(world_size, case, *args):
    """Run ``case`` on a pool of its own whose collectives time out after PEER_TIMEOUT_S; return the
    per-rank results and errors (a failing rank leaves its pool unusable)."""
    pool = RankPool(world_size, collective_timeout_s=PEER_TIMEOUT_S, grace_after_failure_s=PEER_TIMEOUT_S * 3)
    try:
        return pool.run(case, *args, timeout_s=60), {}
    except RankFailure as failure:
        return failure.results, failure.errors
    finally:
        pool.close()


def _timed_step(step):
    start = time.monotonic()
    try:
        step()
    except Exception as error:  # noqa: BLE001 - the point is that *some* error surfaces
        return {"raised": type(error).__name__, "message": str(error)[:300], "seconds": time.monotonic() - start}
    return {"raised": None, "seconds": time.monotonic() - start}


def peer_dies_mid_ring_case(victim):
    """``victim`` is SIGKILLed between two ring steps; the others must raise, not wait forever."""
    from rsdp._fully_shard import _ring

    rank, _ = rank_and_world()
    torch.manual_seed(0)
    model = rsdp_shard(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)))
    model(torch.randn(2, 8)).sum().backward()  # a healthy step first

    if rank == victim:
        real_exchange = _ring.send_and_receive  # every ring exchange's
        calls = []

        def exchange_then_die(*args):
            in_flight = real_exchange(*args)
            calls.append(None)
            if len(calls) == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            return in_flight

        _ring.send_and_receive = exchange_then_die
    return _timed_step(lambda: model(torch.randn(2, 8)).sum().backward())


def test_dead_peer_raises_within_timeout():
    results, errors = run_with_short_timeout(4, peer_dies_mid_ring_case, 1)
    assert list(errors) == [1] and "died" in errors[1]
    for rank, result in enumerate(results):
        if rank != 1:
            assert result["raised"] is not None, f"rank {rank} finished the step without its peer: {result}"
            assert result["seconds"] < PEER_TIMEOUT_S * 3, result


def mismatched_layer_order_case():
    """Two ranks run different layers of the same shape: tags keep them from exchanging each
    other's weights, and both raise after the timeout."""
    rank, _ = rank_and_world()
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    for layer in model:
        rsdp_shard(layer)
    return _timed_step(lambda: model[rank](torch.randn(2, 4)))


def test_ranks_running_different_layers_raise_instead_of_mixing_weights():
    results, errors = run_with_short_timeout(2, mismatched_layer_order_case)
    assert not errors, errors
    for result in results:
        assert result["raised"] is not None, result
        assert PEER_TIMEOUT_S * 0.8 <= result["seconds"] < PEER_TIMEOUT_S * 3, result


def one_rank_bad_input_case(kind):
    """Only rank 1's input is wrong (shape, dtype or device checks, made before the ring starts): rank 1
    raises at once; rank 0 is already in the ring and raises after the process group's timeout."""
    rank, _ = rank_and_world()
    if kind == "linear_features":
        model, good, bad = rsdp_shard(nn.Linear(3, 5)), torch.zeros(2, 3), torch.zeros(2, 4)
    else:
        model, good, bad = rsdp_shard(nn.Embedding(5, 3)), torch.zeros(2, dtype=torch.long), torch.zeros(2)
    return _timed_step(lambda: model(bad if rank == 1 else good))


@pytest.mark.parametrize("kind", ["linear_features", "embedding_float_indices"])
def test_bad_input_on_one_rank_raises_there_and_after_the_timeout_on_its_peers(kind):
    results, errors = run_with_short_timeout(2, one_rank_bad_input_case, kind)
    assert not errors, errors
    assert results[1]["raised"] in ("ValueError", "TypeError") and results[1]["seconds"] < 1, results[1]
    assert results[0]["raised"] is not None, results[0]
    assert PEER_TIMEOUT_S * 0.8 <= results[0]["seconds"] < PEER_TIMEOUT_S * 3, results[0]


def error_inside_a_ring_step_case():
    """Every rank raises inside a ring step (a planned sub-block that does not return its rowwise
    output), after that step's exchange was posted: the exchange is still completed, so the process
    group stays usable and idle (left unwaited, gloo's transport thread spun on the socket, a core
    per rank, and a later collective timed out)."""
    torch.manual_seed(0)
    block = LlamaBlock(6, 2, 2, 3, 4)
    block.mlp = ScaledMLP(6, 4)
    rsdp_shard(block, ring_plan=TITAN_PLAN)
    _raises(ValueError, "must return its rowwise Linear's output", lambda: block(torch.randn(1, 3, 6)))
    start = time.process_time()
    time.sleep(1.0)
    idle_cpu_s = time.process_time() - start
    assert idle_cpu_s < 0.25, f"the process used {idle_cpu_s:.2f} s of CPU in 1 s idle after the error"
    linear = rsdp_shard(nn.Linear(3, 5))
    linear(torch.randn(2, 3)).sum().backward()


def test_an_error_inside_a_ring_step_leaves_the_process_group_usable(ranks):
    ranks.run(2, error_inside_a_ring_step_case)


def _rsdp_blocks_under_a_plain_root():
    """A TinyLM whose blocks are sharded one by one under a plain root, each block the outermost rsdp
    module of its forward; the root's own parameters (embedding, final norm, head) are frozen in both,
    as they are not sharded (each rank would train its own copy)."""
    torch.manual_seed(0)
    model = TinyLM(vocab=13, dim=6, heads=2, hidden=9, layers=2).double()
    for module in (model.embed, model.norm):
        module.requires_grad_(False)
    reference = twin(model)
    for layer in model.layers:
        rsdp_shard(layer)
    return model, reference


def user_hook_raising_case(root, kind):
    """A user's forward pre-hook (run after rsdp's pre-forward) or forward hook (after rsdp's
    post-forward) raises once on an outermost rsdp module: a whole-model root, or a block under a plain
    root. The forward raises the user's error; the module's forwards are closed exactly once (every
    later forward is an outermost one again, its buffers freed) and training afterwards is exact."""
    rank, world = rank_and_world()
    if root == "model":
        model, reference = rsdp_lm(0, vocab=13, dim=6, heads=2, hidden=9, layers=2)
        target = model
    else:
        model, reference = _rsdp_blocks_under_a_plain_root()
        target = model.layers[0]
    failures = ["a user hook failed"]

    def fail_once(*_):
        if failures:
            raise RuntimeError(failures.pop())

    register = target.register_forward_pre_hook if kind == "pre" else target.register_forward_hook
    register(fail_once)  # stays registered: it raises once, then passes
    tokens = torch.randint(0, 13, (world, 5))
    _raises(RuntimeError, "a user hook failed", lambda: model(tokens[rank : rank + 1]))
    state = target._get_rsdp_state()
    assert (state.ring.context.open_forwards, state.forward_depth) == (0, 0)
    assert state.ring.context.buffers.nbytes == 0  # the outermost forward's end freed them, once
    train_and_compare(model, reference, steps=3, rows=1, seq=5)


@pytest.mark.parametrize("root", ["model", "block"])
@pytest.mark.parametrize("kind", ["pre", "post"])
def test_a_user_forward_hook_raising_on_a_root_leaves_training_exact(ranks, root, kind):
    ranks.run(2, user_hook_raising_case, root, kind)
