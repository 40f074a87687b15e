import pytest
from hypothesis import settings

from forked_scripts import ScriptRunner
from rank_pool import RankPools

settings.register_profile("rsdp", deadline=None, max_examples=8, derandomize=True, print_blob=True)
settings.load_profile("rsdp")


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
