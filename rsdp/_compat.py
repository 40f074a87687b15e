"""Every torch name rsdp needs that moved between releases or is private, behind one version guard.

rsdp is written against torch's public API (DTensor, DeviceMesh, torch.distributed P2P). What is not
public lives here, so that a torch upgrade breaks one file, not the engine: the composable-state
registry that lets a parent ``fully_shard`` recognise an rsdp module as already managed, FSDP2's state
class that its traversal stops at, the autograd engine's graph-task queries, the tensor-subclass and
dispatch-mode machinery the ring operand uses, torch's pytree, and a few private functions and ops.
A name that moved or is missing in some supported release is looked up with a fallback (``try``, or
``getattr`` with a default) and commented with the releases it covers.

Used in place, not here, as torch's own public code uses them: ``nn.Module``'s ``_parameters`` and
``_modules`` dicts, a tensor's ``_version`` counter, and an ATen op's ``_schema`` /
``_overloadpacket`` seen by a ``TorchDispatchMode``.
"""

import contextlib
import functools
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

MIN_TORCH = (2, 4)


def _release(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()))


if _release(torch.__version__) < MIN_TORCH:
    raise ImportError(
        f"rsdp needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]} (DTensor and FSDP2); found {torch.__version__}. "
        "Upgrade torch, e.g. `pip install 'torch>=2.4'`."
    )

try:  # torch >= 2.5
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # torch 2.4
    from torch.distributed._tensor import DTensor, Replicate, Shard

try:  # torch >= 2.6
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
except ImportError:  # torch 2.4 and 2.5
    from torch.distributed._composable.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    from torch.distributed._composable.fsdp._fsdp_state import FSDPState

try:  # tensor parallelism's styles: a ring plan may be written with them
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
except ImportError:
    ColwiseParallel = RowwiseParallel = None

try:  # torch >= 2.9: the FSDP2-based replicate, whose parameters are Replicate DTensors
    from torch.distributed._composable.replicate_with_fsdp import replicate
except ImportError:
    replicate = None

from torch.distributed._composable_state import _get_module_state, _insert_module_state
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper
from torch.distributed.utils import _apply_to_tensors as apply_to_tensors
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode_stack,
    is_traceable_wrapper_subclass,
)
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

# A tensor subclass with no storage of its own (``RingOperand``), and ops on it without its
# ``__torch_function__``.
make_wrapper_subclass = torch.Tensor._make_wrapper_subclass
DisableTorchFunctionSubclass = torch._C.DisableTorchFunctionSubclass

# Causal flash attention as the planner's FLOP counter sees it (an ATen op with no public name).
flash_attention_op = torch.ops.aten._scaled_dot_product_flash_attention

# ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` were renamed ``*_single`` (the old names warn).
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ``ProcessGroup``'s own single-tensor collectives (torch >= 2.10); ``_allgather_base`` /
# ``_reduce_scatter_base`` before.
_gather_single = getattr(dist.ProcessGroup, "all_gather_single", None) or dist.ProcessGroup._allgather_base
_scatter_single = getattr(dist.ProcessGroup, "reduce_scatter_single", None) or dist.ProcessGroup._reduce_scatter_base


def group_collectives(group) -> tuple[Callable, Callable]:
    """``(all_gather, sum_scatter)`` of ``group``: ``all_gather_flat`` and ``reduce_scatter_flat`` (a
    sum) straight on the process group, without ``torch.distributed``'s checks and logging wrapper, as
    ``(output, input) -> work`` callables that run no Python frame (C ``functools.partial``s of the
    process group's own methods): a ring of groups runs one or two at every step. The caller waits
    (on CUDA: the stream waits). No options are passed: the defaults are the ones wanted (a reduce-scatter's
    ``ReduceOp`` is ``SUM``), and a keyword the partial adds costs about half a microsecond of
    argument matching per call (a kwargs dict, which pybind11 matches by name)."""
    return functools.partial(_gather_single, group), functools.partial(_scatter_single, group)


def send_and_receive(group, send: torch.Tensor, to: int, receive: torch.Tensor, source: int, tag: int) -> list:
    """Start sending ``send`` to group rank ``to`` and receiving ``receive`` from group rank ``source``
    as one batch (NCCL runs them as one group, which W=2, where both peers are one rank, needs);
    returns the works. For CPU tensors this is what ``batch_isend_irecv`` does, without its per-call
    checks and ``P2POp`` objects (their share of a step's host time: docs/benchmarks.md)."""
    if send.device.type == "cpu":
        return [group.send([send], to, tag), group.recv([receive], source, tag)]
    return batched_send_and_receive(group, send, to, receive, source, tag)


def batched_send_and_receive(group, send: torch.Tensor, to: int, receive: torch.Tensor, source: int, tag: int) -> list:
    """``send_and_receive`` as ``batch_isend_irecv`` (group ranks mapped to the global ranks it takes):
    the GPU path, which gloo runs too (``tests/test_nccl_semantics.py`` runs it so)."""
    return dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, send, dist.get_global_rank(group, to), group, tag),
            dist.P2POp(dist.irecv, receive, dist.get_global_rank(group, source), group, tag),
        ]
    )


def local_of(tensor: DTensor) -> torch.Tensor:
    """A DTensor's local tensor with no autograd op (``to_local()`` is a differentiable op)."""
    return tensor._local_tensor


def gradient_hooks(param: torch.Tensor) -> tuple[list, list]:
    """A leaf's ``register_hook`` hooks and its post-accumulate-grad hooks, for code that accumulates its
    gradient itself (FSDP2 runs the latter so)."""
    return list((param._backward_hooks or {}).values()), list((getattr(param, "_post_accumulate_grad_hooks", None) or {}).values())


def sharded_like(local: torch.Tensor, param: DTensor) -> DTensor:
    """``local`` as a DTensor laid out like ``param``, made without autograd (FSDP2's
    ``_from_local_no_grad``; ``DTensor.from_local`` is a differentiable op with checks): a gradient."""
    return DTensor(local, param._spec, requires_grad=False)


# A grouped GEMM over row offsets (float32, bfloat16, float16), as torchtitan's experts call it; None
# where torch has none (then an expert ring multiplies expert by expert).
grouped_mm = getattr(torch, "_grouped_mm", None)

# Refills a tensor autograd saved without bumping its version (FSDP2 refills its unsharded parameters so).
preserve_version_counter = torch.autograd._unsafe_preserve_version_counter

# A check of a device value that does not wait for the device (a device-side assert on CUDA).
assert_async = torch._assert_async


def storage_use_count(storage: torch.UntypedStorage) -> int:
    """How many references hold ``storage``: its tensors, and its Python object while one refers to it."""
    return torch._C._storage_Use_Count(storage._cdata)


def tensor_use_count(tensor: torch.Tensor) -> int:
    """How many references hold ``tensor``'s C++ object (its Python object's one among them)."""
    return tensor._use_count()


def unowned_alias(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s elements through a storage that does not own their memory (nor keep it alive): what
    ``MemoryTracker`` lends a collective, so that the communication backend's worker thread, which lets
    go of a finished collective's tensors when it next runs, never frees a program's memory."""
    storage = tensor.untyped_storage()
    unowned = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), tensor.device, storage.nbytes())
    return torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(
        unowned, tensor.storage_offset(), tensor.size(), tensor.stride()
    )


def flatten_mesh(mesh):
    """A 1-D mesh over all ranks of ``mesh`` (the replicate strategy spans both dims of an HSDP mesh)."""
    return mesh if mesh.ndim == 1 else mesh._flatten()


def unwrap_activation_checkpoint(module: torch.nn.Module) -> torch.nn.Module:
    """The module a ``checkpoint_wrapper`` wraps (torchtitan's activation checkpointing), else ``module``:
    recomputation in backward calls the wrapped module, so hooks that must run then go there."""
    while isinstance(module, ActivationWrapper):
        module = module._checkpoint_wrapped_module
    return module


# The attribute a wrapper keeps its module under, which ``named_modules()`` puts in the wrapped module's
# name: activation checkpointing's ``checkpoint_wrapper`` (torchtitan's) and ``torch.compile``'s module.
WRAPPER_NAME_SEGMENTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod"})


# The id of the backward autograd's engine is running on this thread, -1 outside backward (private;
# bound as it is: ring code asks at every buffer request, and a wrapper would double the call).
current_graph_task_id = torch._C._current_graph_task_id


def outside_inference_mode():
    """The context in which rsdp makes what later passes reuse (ring buffers and the views of them it
    caches, gathered parameters, ring operands, gradient leaves): under ``torch.inference_mode()`` a new
    tensor is an inference tensor, with no version counter, and a view is one that may not be modified
    in place outside inference mode, so training after an evaluation under it would fail."""
    return torch.inference_mode(False) if torch.is_inference_mode_enabled() else contextlib.nullcontext()


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (activation checkpointing
    recomputes forwards there)."""
    return current_graph_task_id() != -1


def saved_tensors_hooks_active() -> bool:
    """Whether a ``saved_tensors_hooks`` context decides what autograd saves now: activation
    checkpointing's (which saves nothing and recomputes) or CPU offloading's (private:
    ``torch.autograd.graph.saved_tensors_hooks`` sets the default hooks this reads)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


_engine = torch.autograd.Variable._execution_engine


def profiler_enabled() -> bool:
    """Whether a profiler records ``record_function`` ranges now (private: the check the C++ side makes)."""
    check = getattr(torch.autograd, "_profiler_enabled", None)
    return True if check is None else check()  # guard: without the check, always open the ranges


def gradients_of(output: torch.Tensor, inputs: list[torch.Tensor], grad_output: torch.Tensor) -> tuple:
    """``torch.autograd.grad(output, inputs, grad_output, allow_unused=True)`` as the engine call it makes
    (private: ``run_backward``), without its argument handling, which a planned sub-block's backward
    would pay once per shard. ``grad_output`` must match ``output`` in shape and
    dtype (``torch.autograd.grad`` checks that)."""
    if not hasattr(_engine, "run_backward"):  # guard: the engine's Python binding changed
        return torch.autograd.grad(output, inputs, grad_output, allow_unused=True)
    return _engine.run_backward((output,), (grad_output,), False, False, tuple(inputs), True, False)


def at_end_of_backward(callback) -> None:
    """Run ``callback`` when the backward pass now running ends (FSDP2's root post-backward uses the same
    engine callback)."""
    _engine.queue_callback(callback)


try:  # the modes of selective activation checkpointing (torch.utils.checkpoint, torch >= 2.4)
    from torch.utils.checkpoint import _CachedTorchDispatchMode, _CachingTorchDispatchMode

    _SELECTIVE_CHECKPOINT_MODES: tuple[type, ...] = (_CachingTorchDispatchMode, _CachedTorchDispatchMode)
except ImportError:
    _SELECTIVE_CHECKPOINT_MODES = ()


# How many dispatch modes are active (private): a builtin, so ``dispatch_modes() and
# in_selective_checkpoint()`` costs no Python frame in the common case (none active), which every ring
# pass meets several times; where torch lacks it, 1, so that ``in_selective_checkpoint`` decides.
dispatch_modes: Callable[[], int] = getattr(torch._C, "_len_torch_dispatch_stack", None) or (lambda: 1)


def in_selective_checkpoint() -> bool:
    """Whether selective activation checkpointing records or replays ops now: it matches the ops of a
    recomputation to those of the original forward one by one, so their sequence must not depend on
    state such as whether a buffer already exists. Hot paths ask ``dispatch_modes()`` first."""
    if dispatch_modes() == 0:  # the common case, cheaply
        return False
    return any(isinstance(mode, _SELECTIVE_CHECKPOINT_MODES) for mode in _get_current_dispatch_mode_stack())


def selective_checkpoint_region():
    """The innermost selective-activation-checkpoint region now running, as ``(storage, op_counts,
    recomputing)``, or None outside one (or on a torch whose SAC modes lack these attributes).

    ``storage`` is the dict a region's forward and its recomputation share (torch keys it by op; other
    keys are left alone); ``op_counts`` counts each op's calls so far, which is how the recomputation
    finds each op's saved output (``func_counter``; torch versions without it get None)."""
    for mode in reversed(_get_current_dispatch_mode_stack()):
        if isinstance(mode, _SELECTIVE_CHECKPOINT_MODES):
            if not hasattr(mode, "storage") or not hasattr(mode, "func_counter"):
                return None
            return mode.storage, mode.func_counter, isinstance(mode, _CachedTorchDispatchMode)
    return None


def set_process_group_timeout(timeout, group=None) -> None:
    """``dist.set_timeout`` as torchtitan 0.3 calls it; torch 2.13 has only the private one."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(timeout, group)


def selective_checkpoint_policy():
    """The policy function of the innermost selective-activation-checkpoint region whose forward is now
    running (``create_selective_checkpoint_contexts``' ``policy_fn``), or None outside one."""
    for mode in reversed(_get_current_dispatch_mode_stack()):
        if isinstance(mode, _SELECTIVE_CHECKPOINT_MODES):
            return getattr(mode, "policy_fn", None)
    return None


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype ``torch.autocast`` runs matrix products in on ``device_type`` now, or None where it is off
    (``torch.is_autocast_enabled(device_type)`` and ``torch.get_autocast_dtype``: torch >= 2.4)."""
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def get_module_state(module: torch.nn.Module):
    """The composable state (FSDP2's, torch replicate's or rsdp's) that manages ``module``, or None."""
    return _get_module_state(module)


def insert_module_state(module: torch.nn.Module, state) -> None:
    _insert_module_state(module, state)


_MODULE_CALL = getattr(torch.nn.Module._call_impl, "__code__", None)


def calling_modules() -> list[torch.nn.Module]:
    """The modules whose call is on this thread's stack, innermost first (private: the frames of
    ``nn.Module._call_impl``, the method every module call goes through); empty where that changed."""
    modules, frame = [], sys._getframe(1)
    while frame is not None and _MODULE_CALL is not None:  # guard: no such method on another torch
        if frame.f_code is _MODULE_CALL and isinstance(frame.f_locals.get("self"), torch.nn.Module):
            modules.append(frame.f_locals["self"])
        frame = frame.f_back
    return modules


def share_fsdp_contexts(states: list) -> bool:
    """Make FSDP2 (and torch ``replicate``) states that no FSDP root reaches share one state context and
    one communication context, as the states below one FSDP root do; returns whether it could.

    FSDP2 makes the first FSDP module to run forward a root, and a root reaches only the FSDP modules
    below it: under an rsdp or replicate root every FSDP unit is a root of its own, with contexts of its
    own. A unit's reduce-scatter input (a copy of its whole unsharded gradient) is released when the
    next unit of the same context reduces, or when the backward ends; with a context per unit each was
    held to the end of the backward, so every FSDP unit's whole gradient would be alive at once
    (measured: docs/benchmarks.md). Shared contexts give FSDP2's one-root behaviour: each reduce-scatter input
    is released at the next unit's, one end-of-backward callback finishes every unit, and one forward
    order drives the backward prefetch. Each root initialises the communication context at its first
    forward; the shared one is initialised once, so that a later root does not replace its streams or
    drop an earlier unit's all-gather result in the middle of a step.

    Private surface (``FSDPState._state_ctx`` / ``_comm_ctx``, ``FSDPCommContext.lazy_init``, present in
    torch 2.4 to 2.13): where it is missing nothing is changed and the units keep a context each, correct
    but holding more memory at the end of the backward.
    """
    states = [state for state in states if isinstance(state, FSDPState)]
    if len(states) < 2:
        return False
    first = states[0]
    if not all(hasattr(first, name) for name in ("_state_ctx", "_comm_ctx")) or not hasattr(first._comm_ctx, "lazy_init"):
        return False
    state_context, communication_context = first._state_ctx, first._comm_ctx
    initialise = communication_context.lazy_init

    def initialise_once(device) -> None:
        if not hasattr(communication_context, "reduce_scatter_stream"):
            initialise(device)

    communication_context.lazy_init = initialise_once
    for state in states:
        state._state_ctx, state._comm_ctx = state_context, communication_context
    return True


__all__ = [
    "WRAPPER_NAME_SEGMENTS",
    "ActivationWrapper",
    "ColwiseParallel",
    "DTensor",
    "FSDPModule",
    "FSDPState",
    "MixedPrecisionPolicy",
    "Replicate",
    "RowwiseParallel",
    "Shard",
    "TorchDispatchMode",
    "DisableTorchFunctionSubclass",
    "all_gather_flat",
    "apply_to_tensors",
    "assert_async",
    "at_end_of_backward",
    "autocast_dtype",
    "calling_modules",
    "current_graph_task_id",
    "dispatch_modes",
    "flatten_mesh",
    "flash_attention_op",
    "fully_shard",
    "get_module_state",
    "in_backward",
    "in_selective_checkpoint",
    "outside_inference_mode",
    "selective_checkpoint_region",
    "send_and_receive",
    "set_process_group_timeout",
    "share_fsdp_contexts",
    "sharded_like",
    "gradient_hooks",
    "group_collectives",
    "local_of",
    "make_wrapper_subclass",
    "tree_flatten",
    "tree_leaves",
    "tree_unflatten",
    "insert_module_state",
    "storage_use_count",
    "tensor_use_count",
    "unowned_alias",
    "is_traceable_wrapper_subclass",
    "preserve_version_counter",
    "reduce_scatter_flat",
    "replicate",
]


def fake_store():
    """A store for torch's fake process group (``init_process_group("fake", store=...)``: one rank,
    every message returns at once and moves nothing), for the benchmarks; ``None`` where this torch has
    none. Imported here, not at rsdp's import: the module is torch's test code."""
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError:
        return None
    return FakeStore()
