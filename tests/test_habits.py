"""DDP habits that would train wrongly under rsdp without a word are refused, with the fix named:
an optimizer built before ``rsdp_shard``, ranks whose weights differ when it shards them, one rank's
``torch.save(model.state_dict())`` loaded by every rank, and accelerate's own sharding plugins under
the Hugging Face mixin. Each refusal changes nothing, and the fix it names then trains exactly against
the single-process fp64 reference."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh

from models import TinyLM, assert_close, assert_params_match, full, rank_and_world, train_and_compare, twin
from rsdp import rsdp_shard

CONFIG = dict(vocab=13, dim=6, heads=2, hidden=9, layers=2)


def _raises(match, fn):
    with pytest.raises(RuntimeError, match=match) as error:
        fn()
    return str(error.value)


def shard_whole(model, mesh=None):
    for layer in model.layers:
        rsdp_shard(layer, mesh=mesh)
    return rsdp_shard(model, mesh=mesh)


def seeded_lm(seed: int = 0):
    torch.manual_seed(seed)
    model = TinyLM(**CONFIG).double()
    return model, twin(model)


def one_step_of_gradients(model):
    rank, world = rank_and_world()
    tokens = torch.randint(0, CONFIG["vocab"], (world, 5), generator=torch.Generator().manual_seed(3))
    model(tokens[rank : rank + 1]).sum().backward()


def optimizer_built_before_sharding_case():
    """Built before: its step raises on every rank and changes nothing; built after the blocks but
    before the root: raises naming the root's parameters; stepped once before sharding: its next step
    still raises. Built after sharding, training is exact."""
    model, reference = seeded_lm()
    count = len(list(model.parameters()))
    early = torch.optim.AdamW(model.parameters(), lr=1e-2)
    early.step()  # no gradients yet: a step that changes nothing, before anything was replaced
    for layer in model.layers:
        rsdp_shard(layer)
    between = torch.optim.SGD(model.parameters(), lr=1.0)
    rsdp_shard(model)
    one_step_of_gradients(model)
    _raises(rf"this AdamW holds {count} of its {count} parameters as they were before rsdp_shard replaced them with "
            r"sharded ones \(TinyLM.embed.weight, Block.attn_norm.weight, .*Build the optimizer after rsdp_shard.*"
            r"torch.optim.AdamW\(model.parameters\(\)", early.step)
    _raises(rf"this SGD holds 3 of its {count} parameters .*\(TinyLM.embed.weight, TinyLM.norm.weight, TinyLM.norm.bias\)",
            between.step)
    _raises("this AdamW holds", early.step)  # refused again, not only once
    assert_params_match(model, reference, rtol=0, atol=0)  # nothing changed
    model.zero_grad(set_to_none=True)
    train_and_compare(model, reference, steps=2, rows=1, seq=5)


def test_an_optimizer_built_before_sharding_is_refused(ranks, world):
    ranks.run(world, optimizer_built_before_sharding_case)


def ranks_with_different_weights_case():
    """Every rank its own seed: the first rsdp_shard raises on every rank, naming the parameters, and
    shards nothing; one small parameter differing on one rank is named alone. With equal weights
    (here: rank 0's, broadcast), it shards and trains exactly."""
    rank, world = rank_and_world()
    model, _ = seeded_lm(seed=rank)
    block = model.layers[0]
    plain = {name: param for name, param in block.named_parameters()}
    message = _raises(r"the weights of this Block differ between ranks \(q.weight, q.bias, k.weight, .*checksums compared over "
                      rf"{world} ranks\).*seed every rank alike.*RSDP_CHECK_SAME_WEIGHTS=0", lambda: rsdp_shard(block))
    assert "attn_norm" not in message  # ones and zeros on every rank: equal
    assert dict(block.named_parameters()) == plain and type(block) is type(model.layers[1])  # nothing sharded

    model, reference = seeded_lm()
    if rank == world - 1:
        with torch.no_grad():
            model.norm.bias.add_(1e-3)  # one small parameter, on one rank
    for layer in model.layers:
        rsdp_shard(layer)  # equal: no error
    _raises(r"the weights of this TinyLM differ between ranks \(norm.bias; checksums", lambda: rsdp_shard(model))
    with torch.no_grad():
        model.norm.bias.copy_(reference.norm.bias)
    rsdp_shard(model)
    train_and_compare(model, reference, steps=2, rows=1, seq=5)


def test_ranks_with_different_weights_are_refused(ranks, world):
    ranks.run(world, ranks_with_different_weights_case)


def hsdp_replicas_with_different_weights_case():
    """A 2x2 mesh whose shard groups agree within but not between them: the replicas would train
    different models; the check spans both mesh dimensions."""
    rank, _ = rank_and_world()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(rank // 2)  # ranks 0, 1 form shard group 0; ranks 2, 3 shard group 1
    model = TinyLM(**CONFIG).double()
    _raises("differ between ranks .*compared over 4 ranks", lambda: rsdp_shard(model.layers[0], mesh=mesh))
    torch.manual_seed(0)  # the ranks' random streams alike again, as later tests expect


def test_hsdp_replicas_with_different_weights_are_refused(ranks):
    ranks.run(4, hsdp_replicas_with_different_weights_case)


def weights_loaded_after_sharding_case():
    """The ways to shard first and load the weights after: on the meta device (nothing to compare;
    to_empty then a full state dict broadcast from rank 0), and a model materialised before sharding
    whose memory differs between ranks, with the check skipped as the error says. Both are exact."""
    rank, _ = rank_and_world()
    _, reference = seeded_lm()
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)

    def load_from_rank0(model):  # set_model_state_dict takes the dict it is given apart: a new one each time
        set_model_state_dict(model, twin(reference).state_dict() if rank == 0 else {}, options=options)

    with torch.device("meta"):
        model = TinyLM(**CONFIG).double()
    shard_whole(model)
    model.to_empty(device="cpu")
    load_from_rank0(model)
    train_and_compare(model, twin(reference), steps=2, rows=1, seq=5)

    unloaded = TinyLM(**CONFIG).double()
    with torch.no_grad():
        for param in unloaded.parameters():
            param.fill_(rank)  # what uninitialised memory may hold: another value per rank
    os.environ["RSDP_CHECK_SAME_WEIGHTS"] = "0"
    try:
        shard_whole(unloaded)
    finally:
        del os.environ["RSDP_CHECK_SAME_WEIGHTS"]
    load_from_rank0(unloaded)
    train_and_compare(unloaded, twin(reference), steps=2, rows=1, seq=5)


def test_weights_loaded_after_sharding_pass(ranks, world):
    ranks.run(world, weights_loaded_after_sharding_case)


def one_ranks_saved_state_dict_case(directory: str):
    """Rank 0's ``torch.save(model.state_dict())``, loaded by every rank: rank 0 gets its own shards
    back; every other rank raises before anything is copied (with 4 ranks and 13 rows, rank 3's shard
    is shorter: the same error, not a size mismatch). Each rank's own file, a distributed checkpoint
    and a full state dict load exactly."""
    rank, world = rank_and_world()
    model, reference = seeded_lm()
    shard_whole(model)
    path = os.path.join(directory, "rank0.pt")
    if rank == 0:
        torch.save(model.state_dict(), path)
    dist.barrier()
    target, _ = seeded_lm(seed=1)
    shard_whole(target)
    before = _local_shards(target)
    saved = torch.load(path)
    if rank == 0:
        target.load_state_dict(saved)
        expected, outcome = _local_shards(model), None
    else:
        outcome = _raises(rf"load_state_dict was given another rank's shard of embed.weight \(shard 0 of {world}; this rank "
                          rf"holds shard {rank} of {world}\).*dcp.save", lambda: target.load_state_dict(saved))
        expected = before  # nothing copied
    for name, shard in _local_shards(target).items():
        assert torch.equal(shard, expected[name]), name

    own = os.path.join(directory, f"rank{rank}-own.pt")
    torch.save(model.state_dict(), own)
    target.load_state_dict(torch.load(own))
    assert_params_match(target, reference, rtol=0, atol=0)

    dcp.save(model.state_dict(), checkpoint_id=os.path.join(directory, "dcp"))
    other, _ = seeded_lm(seed=2)
    shard_whole(other)
    state = other.state_dict()
    dcp.load(state, checkpoint_id=os.path.join(directory, "dcp"))
    other.load_state_dict(state)
    assert_params_match(other, reference, rtol=0, atol=0)

    full_state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    third, _ = seeded_lm(seed=3)
    shard_whole(third)
    set_model_state_dict(third, full_state if rank == 0 else {}, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    assert_params_match(third, reference, rtol=0, atol=0)
    assert_close(full(third.embed.weight.detach()), reference.embed.weight, what="embedding", rtol=0, atol=0)
    return outcome


def _local_shards(model) -> dict:
    return {name: param.to_local().clone() for name, param in model.named_parameters()}


def test_one_ranks_saved_state_dict_is_refused_where_it_holds_other_rows(ranks, tmp_path, world):
    outcomes = ranks.run(world, one_ranks_saved_state_dict_case, str(tmp_path))
    assert outcomes[0] is None and all(outcome is not None for outcome in outcomes[1:]), outcomes


@pytest.fixture(params=[2, 4])
def world(request):
    return request.param


def accelerate_sharding_case(how: str, save_dir: str):
    """accelerate's FSDP or DeepSpeed asked for beside a sharded model: refused on every rank when the
    trainer is built (DeepSpeed, not installed here, is checked as it runs where it is)."""
    from test_hf_trainer import build_model, join_launched_ranks, shard, token_dataset, training_args
    import transformers

    from rsdp.integrations.transformers import check_training_setup, rsdp_trainer

    join_launched_ranks()
    model = shard(build_model("qwen2", lora=False), "rsdp", "qwen2")
    environment = dict(os.environ)
    try:
        if how == "deepspeed":
            args = training_args(save_dir)
            args.deepspeed = {"zero_optimization": {"stage": 3}}
            check_training_setup(model, args)
        else:
            if how == "launch_use_fsdp":
                os.environ["ACCELERATE_USE_FSDP"] = "true"
            args = training_args(save_dir, **({"fsdp": "full_shard"} if how == "fsdp" else {}))
            rsdp_trainer(transformers.Trainer)(model=model, args=args, train_dataset=token_dataset())
    except ValueError as error:
        return str(error)
    finally:
        os.environ.clear()
        os.environ.update(environment)
    return None


@pytest.mark.parametrize(
    "how, named",
    [
        ("fsdp", "TrainingArguments(fsdp=...)"),
        ("deepspeed", "TrainingArguments(deepspeed=...)"),
        ("launch_use_fsdp", "accelerate launch --use_fsdp (ACCELERATE_USE_FSDP=true)"),
    ],
)
def test_accelerates_own_sharding_is_refused_under_the_mixin(ranks, tmp_path, world, how, named):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    errors = ranks.run(world, accelerate_sharding_case, how, str(tmp_path))
    expected = f"{named} asks accelerate to shard the model"
    assert all(error is not None and expected in error and "Leave accelerate's FSDP and DeepSpeed off" in error for error in errors), errors
