"""Per-module rsdp state: settings, the ring, and the forward hooks.

Rotation needs no hooks: the Linear and Embedding modules run their ring inside their own forward and
backward. The hooks only (1) cast forward inputs under a mixed-precision policy, (2) install the
gathered non-rotating parameters for the duration of the module's forward and (3) cast its output.
The post-forward hook also ends the forward for ``SharedInputFusion`` (``_fusion.py``). Backward is
driven entirely by autograd, so there is no final callback and nothing to finish.
"""

import functools
import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.utils import _apply_to_tensors

from .._compat import FSDPState, MixedPrecisionPolicy, in_backward
from ._collectives import GatheredParams
from ._fusion import SharedInputFusion
from ._ring import Ring, release_ring_buffers


# rsdp forwards running now on this thread (nested modules count once each).
_open_forwards = 0


def _cast_floating(dtype: torch.dtype, tensor: torch.Tensor) -> torch.Tensor:
    if not torch.is_floating_point(tensor) or tensor.dtype == dtype:
        return tensor
    return tensor.to(dtype)


class RSDPState(FSDPState):
    """The state of one ``rsdp_shard`` call.

    It subclasses FSDP2's state class only so that a parent ``fully_shard`` sees this module as
    already managed and leaves its parameters alone (design.md §3); it has no FSDP parameter groups,
    so FSDP2's root treats it as an empty FSDP module.
    """

    _state_name = "RSDP"

    def __init__(self, module: nn.Module, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy):
        super().__init__()
        self._modules = (module,)
        self.mesh = mesh
        self.mp_policy = mp_policy
        self.device = (
            torch.device(mesh.device_type, torch.cuda.current_device())
            if mesh.device_type == "cuda"
            else torch.device(mesh.device_type)
        )
        self.ring = Ring(mesh.get_group(mesh.ndim - 1), self.device)
        self.replicate_group = mesh.get_group(0) if mesh.ndim == 2 else None
        self.ring_modules: list[nn.Module] = []
        self.fusion = SharedInputFusion(self)
        # Per ring parameter: its contributions while gradient sync was off.
        self._unsynced: dict[tuple[int, str], torch.Tensor] = {}
        self.gradient_divide_factor: float | None = None
        self.requires_gradient_sync = True
        self.gathered: GatheredParams | None = None
        self._gathered_slots: list[tuple[nn.Module, str, int]] = []

    def compute_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        return self.mp_policy.param_dtype or param_dtype

    def reduce_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        return self.mp_policy.reduce_dtype or self.compute_dtype(param_dtype)

    def finish_gradient(self, reduced: torch.Tensor) -> torch.Tensor:
        """Sum across replica groups (HSDP), then divide: the mean over all data-parallel ranks unless
        a divide factor was set."""
        if self.replicate_group is not None:
            dist.all_reduce(reduced, group=self.replicate_group)
        factor = self.gradient_divide_factor or self.mesh.size()
        if factor != 1:
            reduced.div_(factor)
        return reduced

    def unsynced_gradient(self, key, segment) -> torch.Tensor:
        """The full-size gradient (every shard, ``[W, padded shard]``) accumulated for one parameter of a
        ring while gradient sync is off: the memory cost of skipping sync, as with FSDP2. Keyed per
        parameter, so it survives a change of grouping between micro-batches."""
        if key not in self._unsynced:
            numel = segment.layout.chunk * math.prod(segment.trailing)
            self._unsynced[key] = torch.zeros(self.ring.size, numel, dtype=segment.dtype, device=self.device)
        return self._unsynced[key]

    @staticmethod
    def unsynced_shard(total: torch.Tensor, shard: int, like: torch.Tensor) -> torch.Tensor:
        """Shard ``shard`` of an accumulator from ``unsynced_gradient``, shaped like its message view."""
        return total[shard, : like.numel()].view(like.shape)

    def take_unsynced(self, key) -> torch.Tensor | None:
        return self._unsynced.pop(key, None)

    def set_gathered(self, params: list[nn.Parameter], slots: list[tuple[nn.Module, str, int]]) -> None:
        """``slots`` lists (module, attribute, index into ``params``) for every place a gathered
        parameter is registered."""
        self.gathered = GatheredParams(self, params) if params else None
        self._gathered_slots = slots

    def register_hooks(self, module: nn.Module) -> None:
        module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
        module.register_forward_hook(self._post_forward, prepend=False)

    @torch.compiler.disable
    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        global _open_forwards
        _open_forwards += 1
        if self.mp_policy.cast_forward_inputs and self.mp_policy.param_dtype is not None:
            cast = functools.partial(_cast_floating, self.mp_policy.param_dtype)
            args, kwargs = _apply_to_tensors(cast, args), _apply_to_tensors(cast, kwargs)
        if self.gathered is not None:
            full = self.gathered.gather()
            for owner, name, index in self._gathered_slots:
                owner._parameters[name] = full[index]
        return args, kwargs

    def end_forward(self) -> None:
        """Put the sharded parameters back and close the forward (also when it raised). The ring
        buffers are freed when the outermost rsdp forward ends, unless it is a recomputation inside
        backward (the backward frees them when it ends)."""
        global _open_forwards
        self.fusion.end_forward()
        self.restore_sharded_params()
        _open_forwards -= 1
        if _open_forwards == 0 and not in_backward():
            release_ring_buffers()

    def restore_sharded_params(self) -> None:
        if self.gathered is not None:
            for owner, name, index in self._gathered_slots:
                owner._parameters[name] = self.gathered.params[index]

    @torch.compiler.disable
    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        self.end_forward()
        if self.mp_policy.output_dtype is not None:
            output = _apply_to_tensors(functools.partial(_cast_floating, self.mp_policy.output_dtype), output)
        return output
