import os

import pytest
import torch
from hypothesis import settings

from forked_scripts import ScriptRunner
from rank_pool import RankPools

settings.register_profile("rsdp", deadline=None, max_examples=8, derandomize=True, print_blob=True)
settings.load_profile("rsdp")


def pytest_configure(config):
    # Under pytest-xdist (``-n N``) the N workers share the cores: each takes its share of intra-op
    # threads, as a rank does, instead of every worker starting one thread per core.
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))


@pytest.fixture(scope="session")
def ranks():
    """``ranks.run(world_size, fn, *args)`` runs ``fn`` on every rank of a forked gloo pool."""
    pools = RankPools()
    yield pools
    pools.close()


@pytest.fixture(scope="session")
def scripts():
    """``scripts.run([script, *args])`` runs ``python script *args`` forked from a process that has
    imported torch, rsdp and transformers (``forked_scripts``)."""
    return ScriptRunner()
