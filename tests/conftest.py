import gc

import pytest
from hypothesis import settings

from forked_scripts import ScriptRunner
from rank_pool import RankPools

settings.register_profile("rsdp", deadline=None, max_examples=8, derandomize=True, print_blob=True)
settings.load_profile("rsdp")


def pytest_collection_finish(session):
    """What collection imported (torch, transformers, torchtitan, the test modules: ~580k objects) lives
    as long as pytest: frozen, it is left out of every later collection in this process (each ~0.3 s:
    the planner's measure_peak and profile collect before every measured step, and in-process tests run
    them on the fake process group). The ranks freeze it too (``rank_pool``)."""
    gc.collect()
    gc.freeze()


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
