"""Three habits from DDP that would train wrongly under rsdp without a word, refused with the fix.

DDP leaves a model's parameters in place and makes every rank's copy equal by broadcasting rank 0's
weights when it wraps the model. ``rsdp_shard`` does neither: it *replaces* every parameter by a new
``Shard(0)`` DTensor of this rank's rows of *this rank's* full value, and ``state_dict()`` then holds
each rank's own rows. So:

- **An optimizer built before sharding** holds the replaced parameters, which no forward reads any
  more: its ``step()`` trains nothing the model computes with. Every replaced original is recorded
  (``replaced``, weakly: an original nothing holds is gone, and no optimizer can hold it), and a global
  optimizer step pre-hook refuses a step whose optimizer holds one, before it changes anything. The
  verdict is kept per optimizer until its parameter groups or the set of replaced parameters change, so
  a step costs one dictionary lookup.
- **Ranks whose weights differ** at sharding (a different seed per rank, a head initialised per rank
  unseeded) would train a model stitched from different ranks' rows. ``rsdp_shard`` compares two checksums
  per parameter it shards (sum and sum of squares) across the mesh, in one all-reduce per mesh
  dimension (MAX of the checksums and of their negatives), and every rank raises the same verdict
  before any parameter is replaced. The tolerance (``SAME_WEIGHTS_RTOL`` of each parameter's own scale) absorbs summation
  order only (float32 accumulation: ~1e-7); ranks initialised from different seeds differ by about
  ``1/sqrt(numel)``, which is above it for any parameter of fewer than ~2e9 elements.
- **``torch.save(model.state_dict())`` on one rank**, loaded by every rank, would copy that rank's rows
  into every rank's shard (or fail on ranks whose shard has another size). Each sharded DTensor in a
  state dict carries the shard (index, count) of the rank that made it (an attribute, which pickling
  keeps); ``load_state_dict`` refuses one that is not the loading rank's, before anything is copied.
  DCP and ``get_model_state_dict`` / ``set_model_state_dict`` load each rank's own shards (or full
  tensors, which carry no mark) and pass.

Pitfalls:
- The weight check is a collective: every rank must call ``rsdp_shard`` the same number of times on the
  same structure (as the ring needs anyway). It runs even where this rank's parameters are on the meta
  device, so that ranks never disagree about whether it runs; parameters on meta on any rank are not
  compared (they have no data; ``to_empty`` and a load fill them later).
- A model materialised with ``to_empty`` *before* sharding holds uninitialised memory, which differs
  between ranks until the weights are loaded after sharding: ``RSDP_CHECK_SAME_WEIGHTS=0`` skips the
  check (on every rank alike) for that order.
- A rank whose own shards the saved state dict holds (rank 0 loading rank 0's ``torch.save``) loads
  correctly and does not raise; only the ranks it would corrupt do.
"""

import functools
import os
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from .._compat import DTensor

# Original parameter -> the DTensor parameter that replaced it (``_api.py`` also keeps a parameter tied
# across two rsdp_shard calls one parameter with it), and -> its name where it was sharded. Keyed weakly
# by the originals only: the sharded parameters must carry no weakref, or ``module.to_empty()`` cannot
# swap them in place.
replaced: WeakIdKeyDictionary = WeakIdKeyDictionary()
_replaced_names: WeakIdKeyDictionary = WeakIdKeyDictionary()
_replacements = 0  # how many were recorded: a step's cached verdict is stale once it grows
_checked_optimizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_step_hook = None

SAME_WEIGHTS_ENV = "RSDP_CHECK_SAME_WEIGHTS"
SAME_WEIGHTS_RTOL = 1e-5
_SHARD_MARK = "_rsdp_shard"  # (index, count) of the rank that made a state dict's DTensor


def record_replacement(original: nn.Parameter, sharded: nn.Parameter, where: str) -> None:
    """``sharded`` replaces ``original`` (named ``where``) in the model: an optimizer holding
    ``original`` is refused from now on."""
    global _replacements, _step_hook
    replaced[original] = sharded
    _replaced_names[original] = where
    _replacements += 1
    if _step_hook is None:
        _step_hook = register_optimizer_step_pre_hook(_refuse_replaced_parameters)


def _refuse_replaced_parameters(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    verdict_key = (_replacements, len(optimizer.param_groups))
    if _checked_optimizers.get(optimizer) == verdict_key:
        return
    held = [param for group in optimizer.param_groups for param in group["params"]]
    stale = [param for param in held if param in replaced]
    if stale:
        names = [_replaced_names.get(param, "?") for param in stale]
        shown = first_names(names)
        kind = type(optimizer).__name__
        raise RuntimeError(
            f"rsdp: this {kind} holds {len(stale)} of its {len(held)} parameters as they were before rsdp_shard "
            f"replaced them with sharded ones ({shown}): the model no longer uses them, so step() would train "
            f"nothing it computes with. Build the optimizer after rsdp_shard, from the sharded model: "
            f"torch.optim.{kind}(model.parameters(), ...)."
        )
    _checked_optimizers[optimizer] = verdict_key


def first_names(names: list[str], shown: int = 4) -> str:
    """The first ``shown`` of ``names`` and how many more, for an error message."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def check_same_weights(module: nn.Module, named_params: list[tuple[str, nn.Parameter]], mesh: DeviceMesh, device: torch.device) -> None:
    """Raise on every rank if the parameters ``rsdp_shard`` is about to shard (``named_params``, plain
    tensors) differ between the ranks of ``mesh``: one all-reduce per mesh dimension of two checksums
    per parameter."""
    if os.environ.get(SAME_WEIGHTS_ENV, "1") == "0" or mesh.size() == 1 or not named_params:
        return
    checksums = torch.stack([_checksums(param, device) for _, param in named_params])
    extremes = torch.cat([checksums, -checksums])
    for dim in range(mesh.ndim):
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))
    high, low = extremes[: len(named_params)].cpu(), -extremes[len(named_params) :].cpu()
    numel = torch.tensor([float(param.numel()) for _, param in named_params], dtype=torch.float64)
    # |sum| <= sqrt(numel * sum of squares): the sum's own scale; the sum of squares is its own.
    scale = torch.stack([(numel * high[:, 1]).sqrt(), high[:, 1]], dim=1)
    differs = ((high[:, :2] - low[:, :2]) > SAME_WEIGHTS_RTOL * scale).any(dim=1) & (high[:, 2] == 0)
    if differs.any():
        names = [name for (name, _), bad in zip(named_params, differs.tolist()) if bad]
        shown = first_names(names)
        raise RuntimeError(
            f"rsdp_shard: the weights of this {type(module).__qualname__} differ between ranks ({shown}; checksums "
            f"compared over {mesh.size()} ranks). rsdp_shard keeps each rank's own rows of its own copy (DDP would "
            "broadcast rank 0's), so the model would be stitched from different ranks' rows. Give every rank the "
            "same weights: seed every rank alike before building the model (torch.manual_seed), or build it on "
            "the meta device, shard it, then to_empty and load the weights (set_model_state_dict(..., "
            "options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)) or dcp.load). If you load "
            f"them after sharding anyway, set {SAME_WEIGHTS_ENV}=0 on every rank to skip this check."
        )


def _checksums(param: torch.Tensor, device: torch.device) -> torch.Tensor:
    """(sum, sum of squares, 1 if on meta) on ``device``, in float64, accumulated in float32 (float64 for a
    float64 parameter): float64 accumulation of a float32 tensor is ~20x slower on CPU, and float32's
    rounding stays far below ``SAME_WEIGHTS_RTOL``."""
    if param.is_meta:
        return torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64, device=device)
    data = param.detach()
    if data.is_complex():
        data = torch.view_as_real(data)
    if not data.is_floating_point():
        data = data.to(torch.float32)
    accumulate = torch.float64 if data.dtype == torch.float64 else torch.float32
    total = data.sum(dtype=accumulate)
    squares = torch.linalg.vector_norm(data, dtype=accumulate).square()
    return torch.stack([total, squares, torch.zeros((), dtype=accumulate, device=data.device)]).to(device, torch.float64)


def watch_state_dicts(module: nn.Module, keys: list[str], mesh: DeviceMesh) -> None:
    """Mark the sharded DTensors that ``module``'s state dicts hold under ``keys`` (the names of the
    parameters it manages, each sharded on ``mesh``'s last dimension) with this rank's shard (index,
    count), and refuse a ``load_state_dict`` of another rank's there. Only its own keys, with a mark
    computed once: every rsdp module of a model runs these hooks at every ``state_dict()``."""
    keys = tuple(keys)
    shard = (mesh.get_local_rank(mesh.ndim - 1), mesh.size(mesh.ndim - 1))
    module.register_state_dict_post_hook(functools.partial(_mark_shards, keys, shard))
    module.register_load_state_dict_pre_hook(functools.partial(_refuse_other_ranks_shards, keys, shard))


def _mark_shards(keys: tuple[str, ...], shard: tuple[int, int], module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    for key in keys:
        value = state_dict.get(prefix + key)
        if isinstance(value, DTensor):
            setattr(value, _SHARD_MARK, shard)


def _refuse_other_ranks_shards(keys: tuple[str, ...], shard: tuple[int, int], module: nn.Module, state_dict: dict, prefix: str, *_) -> None:
    for key in keys:
        saved = getattr(state_dict.get(prefix + key), _SHARD_MARK, None)
        if saved is None or saved == shard:
            continue
        raise RuntimeError(
            f"rsdp: load_state_dict was given another rank's shard of {prefix}{key} (shard {saved[0]} of {saved[1]}; "
            f"this rank holds shard {shard[0]} of {shard[1]}). model.state_dict() holds each rank's own rows, so a "
            "torch.save of it on one rank, loaded by every rank, would copy that rank's rows into every rank's shard. "
            "Save and load with torch.distributed.checkpoint from every rank (dcp.save(model.state_dict(), "
            "checkpoint_id=path), then dcp.load), or save one full state dict (get_model_state_dict(model, "
            "options=StateDictOptions(full_state_dict=True, cpu_offload=True))) and load it with "
            "set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))."
        )
