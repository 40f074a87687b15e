"""Per-module strategies with parallelize: mixed models and group sharding against the reference."""

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from models import Block, TinyLM, twin
from rsdp import Strategy, parallelize
from rsdp.policy import name_matches
from test_training import train_and_compare


@pytest.mark.parametrize(
    "pattern, name, expected",
    [
        ("layers.*", "layers.0", True),
        ("layers.*", "layers.0.attn", False),
        ("layers.**", "layers.0.attn", True),
        ("**.q", "layers.3.q", True),
        ("lm_head", "lm_head", True),
        ("", "", True),
        ("", "lm_head", False),
        ("layers.[02]", "layers.2", True),
    ],
)
def test_name_patterns(pattern, name, expected):
    assert name_matches(pattern, name) is expected


def policy_training_case(seed, policy, default, mesh_shape):
    torch.manual_seed(seed)
    model = TinyLM(vocab=21, dim=8, heads=2, hidden=12, layers=3).double()
    reference = twin(model)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard")[-len(mesh_shape) :])
    parallelize(model, policy, default=default, mesh=mesh)
    train_and_compare(model, reference, steps=3, rows=1, seq=5)


MIXED = {"layers.0": "rsdp", "layers.1": Strategy.FSDP, "layers.2": Strategy.REPLICATE}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("default", ["rsdp", "fsdp"])
def test_mixed_policy_trains_like_reference(ranks, world, default):
    ranks.run(world, policy_training_case, 20, MIXED, default, (world,))


@pytest.mark.parametrize("default", ["rsdp", "fsdp", "replicate"])
def test_group_sharding_two_by_two(ranks, default):
    """Every strategy on a (replicate=2, shard=2) mesh."""
    ranks.run(4, policy_training_case, 21, MIXED, default, (2, 2))


@pytest.mark.parametrize(
    "policy",
    [
        {"layers.1": "fsdp", Block: "rsdp", nn.LayerNorm: "replicate"},
        {"embed": "rsdp", "lm_head": "rsdp", "layers.*": "fsdp"},
    ],
    ids=["type-rules-with-name-override", "tied-weight-across-two-rsdp-units"],
)
def test_rules(ranks, policy):
    ranks.run(2, policy_training_case, 22, policy, "fsdp", (2,))


def bad_policy_case(policy, error, match):
    with pytest.raises(error, match=match):
        parallelize(TinyLM(layers=2), policy)


@pytest.mark.parametrize(
    "policy, error, match",
    [
        ({"layer.*": "rsdp"}, ValueError, "match no module"),
        ({"layers": "rsdp"}, ValueError, "no forward of its own"),
        ({"embed": "fsdp", "lm_head": "fsdp"}, ValueError, "tied"),
        ({"layers.*": "zero3"}, ValueError, r"'zero3' is not a strategy; use one of \['replicate', 'fsdp', 'rsdp'\]"),
        ({3: "rsdp"}, TypeError, "module names or module types"),
        (["layers.*"], TypeError, "must map module names"),
    ],
    ids=["unmatched", "container", "tied-across-units", "unknown-strategy", "bad-key", "not-a-mapping"],
)
def test_bad_policy(ranks, policy, error, match):
    ranks.run(1, bad_policy_case, policy, error, match)
