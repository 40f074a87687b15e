"""torchtitan parallelize functions: torchtitan's own TP, activation checkpointing and compile steps,
then a data-parallel step that takes rsdp, FSDP or replication per module.

:func:`parallelize_decoder` reads like torchtitan's ``parallelize_llama`` because it is it, with
``apply_fsdp_to_decoder`` replaced by :func:`apply_data_parallel`. When every module is FSDP, the
model family's own function runs instead (:func:`with_data_parallel_strategies`), so ``fsdp`` is
exactly torchtitan, with everything it composes with.
"""

import copy
import functools

import torch
import torch.nn as nn
from torchtitan.config import TORCH_DTYPE_MAP, CompileConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import ActivationCheckpointingConfig
from torchtitan.distributed.compile import apply_compile

from .._compat import FSDPModule, MixedPrecisionPolicy
from .._fully_shard import RSDPModule
from ..planner import plan
from ..planner._models import (
    chunked_next_token_loss,
    flash_attention_for_counting,
    next_token_loss,
    torchtitan_moe_for_counting,
)
from ..policy import Strategy, name_matches, parallelize
from .config import ROOT, ParallelismConfig, log_once


def with_data_parallel_strategies(torchtitan_parallelize):
    """The ``parallelize_fn`` for a dense decoder family whose own function is ``torchtitan_parallelize``."""

    @functools.wraps(torchtitan_parallelize)
    def parallelize_fn(model: nn.Module, *, parallelism: ParallelismConfig, **kwargs) -> nn.Module:
        if strategies_in_use(parallelism) == {Strategy.FSDP}:
            return torchtitan_parallelize(model, parallelism=parallelism, **kwargs)
        return parallelize_decoder(model, parallelism=parallelism, **kwargs)

    return parallelize_fn


def strategies_in_use(parallelism: ParallelismConfig) -> set[Strategy]:
    uses = set(Strategy) if parallelism.dp_strategy == "auto" else {Strategy(parallelism.dp_strategy)}
    return uses | set(parallelism.overrides().values())


def parallelize_decoder(
    model: nn.Module,
    *,
    parallel_dims: ParallelDims,
    training: TrainingConfig,
    parallelism: ParallelismConfig,
    compile_config: CompileConfig,
    ac_config: ActivationCheckpointingConfig | None,
    dump_folder: str,
) -> nn.Module:
    """torchtitan's ``parallelize_llama`` (qwen3's is the same for dense models) with rsdp, FSDP or
    replication per module as its data-parallel step."""
    _check_supported(model, parallel_dims, parallelism)
    rules = data_parallel_rules(model, parallel_dims, training, parallelism, ac_config, dump_folder)

    if parallel_dims.tp_enabled:
        model.parallelize(parallel_dims)

    if ac_config is not None:
        ac_config.build(dump_folder=dump_folder).apply(model)

    if compile_config.enable and "model" in compile_config.components:
        apply_compile(model, compile_config=compile_config, parallel_dims=parallel_dims)

    apply_data_parallel(model, rules, parallel_dims, training, parallelism.dp_ring_group_size)
    return model


def data_parallel_rules(
    model: nn.Module, parallel_dims: ParallelDims, training: TrainingConfig, parallelism: ParallelismConfig,
    ac_config: ActivationCheckpointingConfig | None = None, dump_folder: str = "",
) -> dict[str, Strategy]:
    """Module name -> strategy, the root as ``""``: the overrides first (the first matching name wins),
    then the planner's choice (``auto``) or ``dp_strategy`` for the embeddings, every block and the head.

    torchtitan's chunked loss calls ``lm_head`` after the model's forward, and calls FSDP's
    ``set_reshard_after_forward``/``unshard`` on it when it is an FSDP module, which torch's replicate
    module is but does not implement. So a replicated ``lm_head`` joins the root, as does a tied one
    (it must stay with its embedding; torchtitan groups them too), and the root takes the head's
    strategy: only FSDP's and replicate's root parameters stay usable after the forward. ``auto`` plans
    a replicated head so (``rsdp.plan``'s ``replicated_in_root``: a replicate root, counted holding it).
    """
    if parallelism.dp_strategy == "auto":
        chosen = _plan(model, parallel_dims, training, parallelism, ac_config, dump_folder)
        log_once(
            f"rsdp: dp_strategy=auto planned with the cost model for {parallelism.hardware_name(_dp_world(parallel_dims))} "
            "(activations in mixed_precision_param, under "
            f"the run's activation checkpointing, {_loss_counted(parallelism)}, optimizer {parallelism.dp_optimizer}, "
            f"frozen parameters as the model has them); it chose\n{chosen}"
        )
        defaults = chosen.strategies
    else:
        defaults = dict.fromkeys(["", "tok_embeddings", "layers.*", "lm_head"], Strategy(parallelism.dp_strategy))
    overrides = parallelism.overrides()
    rules = {**overrides, **{name: s for name, s in defaults.items() if name not in overrides}}

    head = next(s for name, s in rules.items() if name_matches(name, "lm_head"))
    if not model.enable_weight_tying and head is not Strategy.REPLICATE:
        return rules
    if model.enable_weight_tying and head is Strategy.RSDP:
        head = Strategy.FSDP
    in_root = ["lm_head", "tok_embeddings"] if model.enable_weight_tying else ["lm_head"]
    if overrides.get("") is Strategy.RSDP:
        raise ValueError(
            f"rsdp.torchtitan: {' and '.join(in_root)} must join the root here (see data_parallel_rules), "
            f"and the root cannot be rsdp then; drop root=rsdp from --parallelism.dp_overrides."
        )
    root = overrides.get("", head if rules[""] is Strategy.RSDP else rules[""])
    kept = {name: s for name, s in rules.items() if name and not any(name_matches(name, m) for m in in_root)}
    return {"": root, **kept}


def apply_data_parallel(
    model: nn.Module, rules: dict[str, Strategy], parallel_dims: ParallelDims, training: TrainingConfig, ring_group_size: int = 1,
) -> None:
    names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
    mp_policy = MixedPrecisionPolicy(
        param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
        reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
        cast_forward_inputs=False,
    )
    parallelize(model, {name: s for name, s in rules.items() if name}, default=rules.get("", Strategy.RSDP),
                mesh=parallel_dims.get_mesh(names), mp_policy=mp_policy, ring_group_size=ring_group_size)
    # torchtitan divides the loss by the global token count: gradients must be summed, not averaged.
    for module in model.modules():
        if isinstance(module, (FSDPModule, RSDPModule)):
            module.set_gradient_divide_factor(1.0)
    summary = ", ".join(f"{name or ROOT}={s.value}" for name, s in rules.items())
    log_once(f"rsdp: applied data parallelism ({summary}) on mesh {names}")


def _plan(
    model: nn.Module, parallel_dims: ParallelDims, training: TrainingConfig, parallelism: ParallelismConfig,
    ac_config: ActivationCheckpointingConfig | None, dump_folder: str,
):
    world, group = _dp_world(parallel_dims), parallelism.dp_ring_group_size
    hardware = parallelism.hardware(world)
    try:
        cost_model = _cost_model(hardware, world, group, training, parallelism)
    except ValueError as error:
        raise ValueError(f"parallelism.dp_ring_group_size={group} with dp_strategy=auto: {error}") from None
    sample = torch.zeros(training.local_batch_size, training.seq_len + 1, dtype=torch.long, device="meta")
    counted = torchtitan_moe_for_counting(flash_attention_for_counting(copy.deepcopy(model)))  # on the meta device: no memory
    if ac_config is not None:  # counted as the step will run it: what each block saves and recomputes
        ac_config.build(dump_folder=dump_folder).apply(counted)
    return plan(
        counted, memory_budget=parallelism.memory_budget_bytes(), sample_input=sample, cost_model=cost_model,
        loss_fn=chunked_next_token_loss(parallelism.dp_loss_chunks) if parallelism.dp_loss_chunks > 1 else next_token_loss,
        replicated_in_root=("lm_head",),  # as data_parallel_rules applies a replicated head
    )


def _cost_model(hardware, world: int, group: int, training: TrainingConfig, parallelism: ParallelismConfig):
    """auto's cost model of ``world`` ranks of ``hardware``, whose rsdp modules run in rings of groups of
    ``group`` (the plan is applied with one ``ring_group_size`` for every rsdp module, so the search
    chooses the strategies for that size alone). Hardware of one level is one machine of ``world``
    ranks: a group anywhere in it is one of consecutive ranks."""
    return hardware.cost_model(
        world,
        param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
        reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
        flops_per_s=parallelism.dp_flops_per_s,
        bandwidth_bytes_per_s=parallelism.dp_bandwidth_bytes_per_s,
        latency_s=parallelism.dp_latency_s,
        gpus_per_node=hardware.gpus_per_node or world,
        allowed_ring_group_sizes=(group,),
    ).with_optimizer(parallelism.dp_optimizer)


def _loss_counted(parallelism: ParallelismConfig) -> str:
    chunks = parallelism.dp_loss_chunks
    return f"torchtitan's chunked loss in {chunks} chunks" if chunks > 1 else "the cross-entropy over the whole logits"


def _dp_world(parallel_dims: ParallelDims) -> int:
    return parallel_dims.get_mesh(["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]).size()


def _check_supported(model: nn.Module, parallel_dims: ParallelDims, parallelism: ParallelismConfig) -> None:
    if parallelism.spmd_backend != "partial_dtensor":
        raise ValueError(
            f"rsdp.torchtitan: rsdp and replicate modules need --parallelism.spmd_backend partial_dtensor (got "
            f"{parallelism.spmd_backend!r}): they shard DTensor parameters, not spmd_types local tensors."
        )
    uses = strategies_in_use(parallelism)
    for enabled, what in (
        (parallel_dims.tp_enabled, "tensor parallelism"),
        (parallel_dims.cp_enabled, "context parallelism"),
        (parallel_dims.pp_enabled, "pipeline parallelism"),
        (getattr(model, "mtp_layers", None) is not None, "multi-token prediction"),
    ):
        if enabled and uses != {Strategy.FSDP}:
            raise ValueError(
                f"rsdp.torchtitan: {what} composes with dp_strategy=fsdp only (asked for "
                f"{sorted(s.value for s in uses)}); set --parallelism.dp_strategy fsdp with no rsdp or "
                "replicate overrides, or turn it off."
            )
    if parallel_dims.ep_enabled and uses != {Strategy.FSDP}:
        raise ValueError(
            f"rsdp.torchtitan: expert parallelism (expert_parallel_degree={parallel_dims.ep}) composes with "
            f"dp_strategy=fsdp only (asked for {sorted(s.value for s in uses)}); set "
            "--parallelism.expert_parallel_degree 1 to train the experts under rsdp, or --parallelism.dp_strategy "
            "fsdp with no rsdp or replicate overrides."
        )
    if model.enable_weight_tying and parallelism.dp_strategy == "auto":
        raise ValueError(
            "rsdp.torchtitan: dp_strategy=auto plans untied models only (a tied lm_head joins the root); "
            "pick a dp_strategy and overrides by hand."
        )
