"""What torchtitan 0.3.0 needs to run on CPU ranks with gloo (docs/torchtitan.md). Only the CPU
launcher (``rsdp.torchtitan.train``) applies these; the GPU path runs torchtitan untouched.

Two kinds: import-time (before torchtitan is imported) and config-time (on the parsed config).
"""

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
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

    config.parallelism.spmd_backend = "partial_dtensor"
    config.training.disable_cuda_graphs = True
    config.compile.enable = False
    # FlexAttention has no CPU backward; SDPA with is_causal attends across document boundaries, which
    # changes the numbers (not the strategies being compared).
    for _, _, parent, attr in list(config.model_spec.model.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    config.model_spec.parallelize_fn = _summing(config.model_spec.parallelize_fn)


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
