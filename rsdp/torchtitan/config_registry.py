"""Configs for ``--module rsdp.torchtitan --config <name>``: torchtitan's own, with the data-parallel
strategy flags of :class:`rsdp.torchtitan.config.ParallelismConfig` (default ``dp_strategy=rsdp``).

    torchrun --nproc_per_node 8 -m torchtitan.train --module rsdp.torchtitan --config llama3_8b_rsdp \\
        --parallelism.dp_overrides "lm_head=fsdp"
"""

import dataclasses

from torchtitan.models.deepseek_v3 import config_registry as deepseek_v3
from torchtitan.models.gpt_oss import config_registry as gpt_oss
from torchtitan.models.llama3 import config_registry as llama3
from torchtitan.models.qwen3 import config_registry as qwen3

from .config import RSDPTrainer, from_torchtitan
from .parallelize import with_data_parallel_strategies


def _rsdp(config) -> RSDPTrainer.Config:
    spec = config.model_spec
    config.model_spec = dataclasses.replace(spec, parallelize_fn=with_data_parallel_strategies(spec.parallelize_fn))
    # rsdp's data-parallel step works on DTensor parameters, which the spmd_types backend does not use.
    # Expert parallelism composes with dp_strategy=fsdp only: the MoE configs that set it (DeepSeek-V3
    # 16B and 671B) shard their experts by data parallelism here instead.
    return from_torchtitan(config, spmd_backend="partial_dtensor", dp_strategy="rsdp", expert_parallel_degree=1)


def llama3_debugmodel_rsdp() -> RSDPTrainer.Config:
    return _rsdp(llama3.llama3_debugmodel())


def llama3_8b_rsdp() -> RSDPTrainer.Config:
    return _rsdp(llama3.llama3_8b())


def llama3_70b_rsdp() -> RSDPTrainer.Config:
    return _rsdp(llama3.llama3_70b())


def qwen3_debugmodel_rsdp() -> RSDPTrainer.Config:
    return _rsdp(qwen3.qwen3_debugmodel())


def qwen3_14b_rsdp() -> RSDPTrainer.Config:
    return _rsdp(qwen3.qwen3_14b())


def qwen3_moe_debug_rsdp() -> RSDPTrainer.Config:
    return _rsdp(qwen3.qwen3_moe_debug())


def qwen3_30b_a3b_rsdp() -> RSDPTrainer.Config:
    return _rsdp(qwen3.qwen3_30b_a3b())


def deepseek_v3_debugmodel_rsdp() -> RSDPTrainer.Config:
    return _rsdp(deepseek_v3.deepseek_v3_debugmodel())


def deepseek_v3_16b_rsdp() -> RSDPTrainer.Config:
    return _rsdp(deepseek_v3.deepseek_v3_16b())


def deepseek_v3_671b_rsdp() -> RSDPTrainer.Config:
    return _rsdp(deepseek_v3.deepseek_v3_671b())


def gpt_oss_debugmodel_rsdp() -> RSDPTrainer.Config:
    return _rsdp(gpt_oss.gpt_oss_debugmodel())


def gpt_oss_20b_rsdp() -> RSDPTrainer.Config:
    return _rsdp(gpt_oss.gpt_oss_20b())


def gpt_oss_120b_rsdp() -> RSDPTrainer.Config:
    return _rsdp(gpt_oss.gpt_oss_120b())
