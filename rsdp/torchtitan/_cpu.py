"""What torchtitan 0.3.0 needs to run on CPU ranks with gloo (docs/torchtitan.md). Only the CPU
launcher (``rsdp.torchtitan.train``) applies these; the GPU path runs torchtitan untouched.

Two kinds: import-time (before torchtitan is imported) and config-time (on the parsed config).
"""

import dataclasses
import functools
import importlib.util
import os
import sys
import types

import torch
import torch.distributed as dist

from .._compat import set_process_group_timeout


_prepared = False


def prepare_imports() -> None:
    """Call before anything imports torchtitan; again, it does nothing (a forked rank inherits them)."""
    global _prepared
    if _prepared:
        return
    if "torchtitan" in sys.modules:
        raise RuntimeError("rsdp.torchtitan CPU shims must be installed before torchtitan is imported")
    import torchtitan.tools.utils as utils

    # torchtitan falls back to "cuda" when no accelerator is found; its modules copy the value at import.
    utils.device_type, utils.device_module = "cpu", _CPUDeviceModule()

    if importlib.util.find_spec("triton") is None:
        # The MoE all-to-all kernels are triton-only and imported by every model; dense models never call them.
        kernels = types.ModuleType("torchtitan.distributed.minimal_async_ep.kernels")

        def __getattr__(name: str):
            if name.startswith("__"):
                raise AttributeError(name)

            def unavailable(*args, **kwargs):
                raise RuntimeError(f"{name} needs triton, which this CPU machine does not have")

            return unavailable

        kernels.__getattr__ = __getattr__
        sys.modules[kernels.__name__] = kernels

    if not hasattr(dist, "set_timeout"):  # torchtitan 0.3.0 calls it after the first step; torch 2.13 has the private one
        dist.set_timeout = set_process_group_timeout
    _prepared = True


class _CPUDeviceModule(types.ModuleType):
    """``torch.cpu`` plus the memory-monitor calls torchtitan makes on its device module (no CPU
    allocator statistics exist: the monitor reports -1)."""

    def __init__(self):
        super().__init__("torch.cpu")

    def __getattr__(self, name: str):
        return getattr(torch.cpu, name)

    def current_device(self) -> int:
        return 0  # torchtitan passes it to barrier(device_ids=...), which takes integers

    def get_device_name(self, device=None) -> str:
        return "cpu"

    def get_device_properties(self, device=None) -> types.SimpleNamespace:
        return types.SimpleNamespace(total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))

    def memory_stats(self, device=None) -> dict:
        return {}

    def reset_peak_memory_stats(self, device=None) -> None:
        pass

    def empty_cache(self) -> None:
        pass


def adapt_config(config) -> None:
    """Edit a parsed ``Trainer.Config`` in place for CPU ranks."""
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention, VarlenAttention
    from torchtitan.models.gpt_oss.moe import GptOssGroupedExperts

    config.parallelism.spmd_backend = "partial_dtensor"
    config.training.disable_cuda_graphs = True
    config.compile.enable = False
    # FlexAttention has no CPU backward; SDPA with is_causal attends across document boundaries, which
    # changes the numbers (not the strategies being compared).
    for _, _, parent, attr in list(config.model_spec.model.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    # torch's varlen_attn is CUDA-only (gpt-oss's debug model uses it, with sliding windows and sinks).
    _replace_configs(config.model_spec.model, VarlenAttention, _cpu_varlen_attention())
    _replace_configs(config.model_spec.model, GptOssGroupedExperts, _gpt_oss_experts_cast_back())
    config.model_spec.parallelize_fn = _summing(config.model_spec.parallelize_fn)


def _replace_configs(model_config, module_cls: type, replacement_cls: type) -> None:
    """Build every ``module_cls`` of the model as ``replacement_cls`` (a subclass), with the same fields."""
    for _, config, parent, attr in list(model_config.traverse(module_cls.Config)):
        values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
        setattr(parent, attr, replacement_cls.Config(**values))


@functools.cache
def _gpt_oss_experts_cast_back() -> type:
    """gpt-oss's experts return bf16 whatever the activations' dtype (the other families' cast back with
    ``type_as``), and torchtitan's combine cannot scatter bf16 into fp32 activations: with the launcher's
    fp32 parameters the model would not run. These cast their output back to their input's dtype."""
    from torchtitan.models.gpt_oss.moe import GptOssGroupedExperts

    class GptOssGroupedExpertsCastBack(GptOssGroupedExperts):
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(GptOssGroupedExperts.Config):
            pass

        rsdp_output_like_input = True  # what the expert rings need to know of it (``_grouped_experts.py``)

        def forward(self, x_RD, num_tokens_per_expert_E):
            return super().forward(x_RD, num_tokens_per_expert_E).type_as(x_RD)

    return GptOssGroupedExpertsCastBack


@functools.cache
def _cpu_varlen_attention() -> type:
    """torchtitan's ``VarlenAttention`` computed with plain ops: the same masks (packed documents from
    the ``VarlenMetadata`` torchtitan builds for it, causal or windowed by ``window_size``) and the
    log-sum-exp its ``out_transform`` reads (gpt-oss's attention sinks), in the inputs' dtype. A
    (batch, heads, sequence, sequence) score tensor: for the short sequences of CPU runs."""
    from torchtitan.models.common.attention import VarlenAttention

    class CPUVarlenAttention(VarlenAttention):
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(VarlenAttention.Config):
            pass

        def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks, scale=None, out_transform=None, **kwargs):
            batch, length, heads, head_dim = q_BLNH.shape
            repeats = heads // k_BLNH.shape[2]  # grouped-query attention: each kv head serves `repeats` heads
            k_BLNH, v_BLNH = (t.repeat_interleave(repeats, dim=2) for t in (k_BLNH, v_BLNH))
            packed = torch.arange(batch * length, device=q_BLNH.device)
            document = torch.searchsorted(attention_masks.cu_seq_q, packed, right=True).view(batch, length)
            position = torch.arange(length, device=q_BLNH.device)
            behind = position[:, None] - position[None, :]  # query minus key position
            left, right = self.window_size
            allowed = document[:, :, None] == document[:, None, :]
            allowed &= (behind <= left if left >= 0 else True) & (-behind <= right if right >= 0 else True)
            scores = torch.einsum("blnh,bmnh->bnlm", q_BLNH, k_BLNH) * (scale if scale is not None else head_dim**-0.5)
            scores = scores.masked_fill(~allowed[:, None], float("-inf"))
            lse_BNL = scores.logsumexp(dim=-1)
            out_BLNH = torch.einsum("bnlm,bmnh->blnh", (scores - lse_BNL[..., None]).exp(), v_BLNH)
            return out_BLNH if out_transform is None else out_transform(out_BLNH, lse_BNL.transpose(1, 2))

    return CPUVarlenAttention


def _summing(parallelize_fn):
    """gloo has no PREMUL_SUM; FSDP2 must divide locally and sum."""

    def parallelize_then_sum(model, **kwargs):
        from torch.distributed.fsdp import FSDPModule

        model = parallelize_fn(model, **kwargs)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
        return model

    return parallelize_then_sum
