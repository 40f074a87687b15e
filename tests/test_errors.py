"""Bad input gets a clear error that names the problem and the fix; a dead peer is an error, not a hang."""

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor

from models import rank_and_world
from rank_pool import RankFailure, RankPool
from rsdp import rsdp_shard
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
    model = rsdp_shard(nn.Embedding(5, 3))
    _raises(IndexError, "num_embeddings is 5", lambda: model(torch.tensor([[1, 5]])))


def reassigned_parameter_case():
    model = rsdp_shard(nn.Linear(3, 5))
    model.weight = nn.Parameter(torch.zeros(5, 3))
    _raises(RuntimeError, "no longer the sharded DTensor", lambda: model(torch.zeros(2, 3)))


def bad_divide_factor_case():
    model = rsdp_shard(nn.Linear(3, 5))
    _raises(ValueError, "must be positive", lambda: model.set_gradient_divide_factor(0))


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
        (1, bad_divide_factor_case),
    ],
    ids=lambda value: value.__name__.removesuffix("_case") if callable(value) else str(value),
)
def test_bad_input(ranks, world, case):
    ranks.run(world, case)


PEER_TIMEOUT_S = 5


def peer_dies_mid_ring_case(victim):
    """``victim`` is SIGKILLed between two ring steps; the others must raise, not wait forever."""
    from rsdp._fully_shard._ring import Ring

    rank, _ = rank_and_world()
    torch.manual_seed(0)
    model = rsdp_shard(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)))
    model(torch.randn(2, 8)).sum().backward()  # a healthy step first

    if rank == victim:
        real_exchange = Ring.exchange
        calls = []

        def exchange_then_die(self, transfers):
            in_flight = real_exchange(self, transfers)
            calls.append(None)
            if len(calls) == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            return in_flight

        Ring.exchange = exchange_then_die
    start = time.monotonic()
    try:
        model(torch.randn(2, 8)).sum().backward()
    except Exception as error:  # noqa: BLE001 - the point is that *some* error surfaces
        return {"raised": type(error).__name__, "message": str(error)[:300], "seconds": time.monotonic() - start}
    return {"raised": None, "seconds": time.monotonic() - start}


def test_dead_peer_raises_within_timeout():
    pool = RankPool(4, collective_timeout_s=PEER_TIMEOUT_S, grace_after_failure_s=PEER_TIMEOUT_S * 3)
    try:
        with pytest.raises(RankFailure) as failure:
            pool.run(peer_dies_mid_ring_case, 1, timeout_s=60)
    finally:
        pool.close()
    assert list(failure.value.errors) == [1] and "died" in failure.value.errors[1]
    survivors = [result for rank, result in enumerate(failure.value.results) if rank != 1]
    for result in survivors:
        assert result["raised"] is not None, f"a survivor finished the step without its peer: {result}"
        assert result["seconds"] < PEER_TIMEOUT_S * 3, result
