"""``torch.autocast`` reaches ring layers as it reaches stock ones (issue 12.3).

Under ``torch.autocast("cpu", dtype=torch.bfloat16)`` a stock ``nn.Linear``, ``F.linear`` and
``torch.addmm`` compute in bfloat16 and return bfloat16, while ``F.embedding`` and float64 tensors are
left alone. The same model under rsdp — stock Linears (q/k/v fused into one ring), a ring plan's
sub-blocks, Conv1D's ``addmm``, a Linear subclass's ``F.linear`` with a gathered bias, ``x @ w.t()``,
torchtitan's Embedding and a tied head — must return the dtypes the unsharded model returns and be as
close to exact as FSDP2 under the same autocast (full-precision parameters, no mixed-precision policy),
measured as the distance of each from the exact float64 answer: the loss, the logits, every parameter
gradient, and the parameters after two steps.
"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from models import HF_PLAN, GPTLike, LlamaLM, assert_close, full, local_rows, loss_of, rank_and_world
from rsdp import rsdp_shard
from rsdp._compat import fully_shard

VOCAB = 29


def build(kind: str, world: int):
    if kind == "gpt":
        return GPTLike(vocab=VOCAB, dim=12, hidden=20, layers=2)
    return LlamaLM(vocab=VOCAB, dim=10, heads=2 * world, kv_heads=world, head_dim=3, hidden=4 * world, layers=2)


def shard(model, strategy: str, ring_plan):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    blocks = model.blocks if hasattr(model, "blocks") else model.layers
    for block in blocks:
        if strategy == "rsdp":
            rsdp_shard(block, mesh=mesh, ring_plan=ring_plan)
        else:
            fully_shard(block, mesh=mesh)
    return rsdp_shard(model, mesh=mesh) if strategy == "rsdp" else fully_shard(model, mesh=mesh)


def error(actual: torch.Tensor, exact: torch.Tensor) -> float:
    return (actual.double() - exact).abs().max().item()


def autocast_case(kind: str, planned: bool, seed: int = 3, steps: int = 2, lr: float = 0.5):
    """Two SGD steps under autocast for rsdp and for FSDP2, and in float64 on one process (the exact
    answer for the global batch): rsdp's distance from the exact logits, gradients, losses and
    parameters is at most FSDP2's (1.5x, plus a floor of 1% of the quantity's scale for when FSDP2
    lands close by luck). SGD, not AdamW: AdamW's first steps move every parameter by about ``lr``
    whatever the gradient's size, so they would hide gradient errors."""
    rank, world = rank_and_world()
    batches = [torch.randint(0, VOCAB, (world * 2, 6), generator=torch.Generator().manual_seed(seed + s)) for s in range(steps)]
    torch.manual_seed(seed)
    exact = build(kind, world).double()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        stock_dtype = build(kind, world)(local_rows(batches[0], rank, world)).dtype
    exact_optimizer = torch.optim.SGD(exact.parameters(), lr=lr)
    expected = {"logits": [], "loss": []}
    for step, tokens in enumerate(batches):
        logits = exact(tokens)
        loss = loss_of(logits, tokens) / tokens.numel()
        loss.backward()
        expected["logits"].append(local_rows(logits.detach(), rank, world))
        expected["loss"].append(loss.detach())
        if step == 0:
            expected["grads"] = {n: p.grad.clone() for n, p in exact.named_parameters()}
        exact_optimizer.step()
        exact_optimizer.zero_grad()
    expected["params"] = {n: p.detach() for n, p in exact.named_parameters()}

    errors = {}
    for strategy in ("rsdp", "fsdp"):
        torch.manual_seed(seed)
        model = shard(build(kind, world), strategy, HF_PLAN if planned else None)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        found = {"logits": [], "loss": []}
        for step, tokens in enumerate(batches):
            mine = local_rows(tokens, rank, world)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(mine)
                loss = loss_of(logits.float(), mine) / mine.numel()
            loss.backward()  # outside autocast, as torch's recipe has it
            assert logits.dtype == stock_dtype == torch.bfloat16, (strategy, logits.dtype, stock_dtype)
            found["logits"].append(logits.detach())
            loss = loss.detach().clone()
            dist.all_reduce(loss)
            found["loss"].append(loss / world)
            if step == 0:
                found["grads"] = {n: full(p.grad) for n, p in model.named_parameters()}
                assert all(g.dtype == torch.float32 for g in found["grads"].values())
            optimizer.step()
            optimizer.zero_grad()
        found["params"] = {n: full(p.detach()) for n, p in model.named_parameters()}
        errors[strategy] = {
            **{f"{what} at step {s}": error(found[what][s], expected[what][s]) for what in ("logits", "loss") for s in range(steps)},
            **{f"{what} of {n}": error(t, expected[what][n]) for what in ("grads", "params") for n, t in found[what].items()},
        }
    scales = {
        **{f"{what} at step {s}": expected[what][s].abs().max().item() for what in ("logits", "loss") for s in range(steps)},
        **{f"{what} of {n}": t.abs().max().item() for what in ("grads", "params") for n, t in expected[what].items()},
    }
    for what, rsdp_error in errors["rsdp"].items():
        allowed = 1.5 * errors["fsdp"][what] + 1e-2 * max(scales[what], 1e-3)
        assert rsdp_error <= allowed, f"{what}: rsdp is {rsdp_error:.3g} from the exact answer, FSDP2 {errors['fsdp'][what]:.3g}"


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind, planned", [("gpt", False), ("llama", False), ("llama", True)], ids=["gpt-ops", "llama", "llama-plan"])
def test_autocast_matches_fsdp2_under_autocast(ranks, world, kind, planned):
    ranks.run(world, autocast_case, kind, planned)


def float64_case():
    """Autocast leaves float64 alone, for stock layers and ring layers alike: still exact."""
    rank, world = rank_and_world()
    torch.manual_seed(0)
    model = GPTLike(vocab=VOCAB, dim=7, hidden=9).double()
    reference = GPTLike(vocab=VOCAB, dim=7, hidden=9).double()
    reference.load_state_dict(model.state_dict())
    shard(model, "rsdp", None)
    tokens = torch.randint(0, VOCAB, (world, 5))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(local_rows(tokens, rank, world))
        expected = reference(local_rows(tokens, rank, world))
    assert logits.dtype == expected.dtype == torch.float64
    assert_close(logits, expected, what="float64 logits under autocast")


def test_autocast_leaves_float64_alone(ranks):
    ranks.run(2, float64_case)
