"""Per-module rsdp state: settings, the ring, and the forward and backward hooks.

The rings run inside the ring layers' own forward and backward (a stock Linear's or Embedding's, a
planned sub-block's), and any other matrix rotates op by op while it is installed as a
``RingOperand``. The hooks (1) cast forward inputs under a mixed-precision policy, (2) gather the
non-rotating parameters (``_collectives.py``; the outermost module's pre-forward gathers those of every
module under it at once) and install them, and the ring weights as operands (``_operand.py``), for the
module's forward and again for its backward, (3)
queue their gradients for reduction after the module's backward and (4) cast its output. The
post-forward hook also ends the forward for ``SharedInputFusion`` (``_fusion.py``).

The backward hooks follow FSDP2's: a hook on each forward output that needs a gradient runs before the
module's backward (gather again if resharded, install: a recomputation by activation checkpointing,
which may run the module's ``forward`` without its hooks, as Hugging Face's does, finds the full
parameters in place); an identity autograd function on the forward inputs runs after it (reduce,
restore the sharded parameters, free); and a callback at the end of the backward finishes any module
whose inputs needed no gradient.

Pitfalls:
- A forward that runs inside backward is a recomputation: it neither refreshes nor uninstalls the
  gathered parameters (the module's backward still needs them) and registers no backward hooks.
- Collectives must run in the same order on every rank: the end-of-backward callback finishes modules
  in the order their backward began, which the autograd graph fixes.
"""

import functools
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from .._compat import (
    DTensor,
    FSDPState,
    MixedPrecisionPolicy,
    apply_to_tensors,
    calling_modules,
    current_graph_task_id,
    get_module_state,
    in_backward,
    outside_inference_mode,
)
from ._collectives import GatheredParams, gather_together
from ._context import LIVE_CONTEXTS, RingContext
from ._ddp_habits import first_names
from ._fusion import SharedInputFusion
from ._grad import RingGradients
from ._operand import RingOperand
from ._param import Precision
from ._ring_function import sharded
from ._ring import Ring


def _cast_floating(dtype: torch.dtype, tensor: torch.Tensor) -> torch.Tensor:
    if not torch.is_floating_point(tensor) or tensor.dtype == dtype:
        return tensor
    return tensor.to(dtype)


class RSDPState(FSDPState):
    """The state of one ``rsdp_shard`` call.

    It subclasses FSDP2's state class only so that a parent ``fully_shard`` sees this module as
    already managed and leaves its parameters alone (docs/design.md, "Interop with fully_shard"); it
    has no FSDP parameter groups,
    so FSDP2's root treats it as an empty FSDP module.
    """

    _state_name = "RSDP"

    def __init__(self, module: nn.Module, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy, ring_group_size: int = 1):
        super().__init__()
        self._modules = (module,)
        self.mesh = mesh
        self._data_parallel_ranks = mesh.size()  # read at every outermost forward; DeviceMesh.size() is Python calls
        self._callers_checked = False  # whether its callers were checked (_check_callers_are_sharded)
        self.mp_policy = mp_policy
        self.device = (
            torch.device(mesh.device_type, torch.cuda.current_device())
            if mesh.device_type == "cuda"
            else torch.device(mesh.device_type)
        )
        # A context of its own until a root's rsdp_shard (or parallelize) gives it the model's.
        self.ring = Ring(mesh.get_group(mesh.ndim - 1), self.device, RingContext(), ring_group_size)
        # Handed to its ring layers and gathered parameters when they are made.
        self.precision = Precision(mp_policy.param_dtype, mp_policy.reduce_dtype, self.device.type)
        self.gradients = RingGradients(self.ring, self.precision, mesh.get_group(0) if mesh.ndim == 2 else None, self._data_parallel_ranks)
        self.ring_modules: list[nn.Module] = []
        self.fusion = SharedInputFusion(self)
        self.gathered: GatheredParams | None = None
        self._nested: list[RSDPState] | None = None  # the rsdp states under this module, found at its first outermost forward
        self._gathered_slots: list[tuple[nn.Module, str, int]] = []
        # (module, attribute, ring layer) of every weight installed as a RingOperand while it runs.
        self.operand_slots: list[tuple[nn.Module, str, Any]] = []
        # slot index -> (the RingOperand installed there last, whether it requires grad): made once,
        # not at every forward. (A RingOperand's own attributes go through its __torch_function__.)
        self._operands: dict[int, tuple[RingOperand, bool]] = {}
        # The backward (graph task) whose post-backward this state awaits, None when none does.
        self._post_backward_task: int | None = None
        self.forward_depth = 0  # this module's forwards running now (nested calls count)

    def set_gathered(
        self, params: list[nn.Parameter], slots: list[tuple[nn.Module, str, int]], reshard_after_forward: bool
    ) -> None:
        """``slots`` lists (module, attribute, index into ``params``) for every place a gathered
        parameter is registered."""
        self.gathered = GatheredParams(self.ring, self.precision, self.gradients, params, reshard_after_forward) if params else None
        self._gathered_slots = slots

    def register_hooks(self, module: nn.Module) -> None:
        module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
        module.register_forward_hook(self._post_forward, prepend=False)

    @torch.compiler.disable
    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        context = self.ring.context
        outermost = context.open_forwards == 0 and not in_backward()
        if outermost and not self._callers_checked and torch.is_grad_enabled():  # training only: no drift without it
            _check_callers_are_sharded(module, self._data_parallel_ranks)
            self._callers_checked = True
        # Opened before anything that can raise: a forward that raises is closed (``end_forward``),
        # and one closed without being opened would leave every later forward "nested".
        context.open_forwards += 1
        self.forward_depth += 1
        if outermost:
            context.begin_forward(self)
            self.gather_nested(module)
        if self.mp_policy.cast_forward_inputs and self.mp_policy.param_dtype is not None:
            cast = functools.partial(_cast_floating, self.mp_policy.param_dtype)
            args, kwargs = apply_to_tensors(cast, args), apply_to_tensors(cast, kwargs)
        if not self.installs_params:
            return args, kwargs
        if in_backward():  # a recomputation: the module's backward needs what it installs
            self._install_params()
            self._await_post_backward()
            return args, kwargs
        if self.gathered is not None:
            context.pending_gathers.needs(self.gathered)
        if self.gathered is not None and self.gathered.gathered_in_pass != context.forward_pass:
            self._adopt_replaced_params()
            self.gathered.gather()
        self._install_params()
        if torch.is_grad_enabled():
            args, kwargs = _RunAfterBackward.wrap(self, args, kwargs)
        return args, kwargs

    def gather_nested(self, module: nn.Module) -> None:
        """At the start of an outermost forward: gather the parameters of every rsdp module under
        ``module`` (itself included) that keeps them until its backward, in one collective per
        ``gather_key`` (usually one), in module order, which every rank shares; those whose forward
        began after the carrier ring in the recorded forward are left to that ring (``PendingGathers``).
        Their own forwards then find them current; a module resharded after forward gathers its own,
        as before."""
        if self._nested is None:
            self._nested = [
                state
                for state in (get_module_state(m) for m in module.modules())
                if isinstance(state, RSDPState) and state.gathered is not None
            ]
        candidates = []
        for state in self._nested:
            gathered = state.gathered
            if gathered is not None and not gathered.reshard_after_forward:
                state._adopt_replaced_params()
                candidates.append(gathered)
        context = self.ring.context
        batches: dict[tuple, list] = {}
        for gathered in context.pending_gathers.begin_pass(context.forward_pass, candidates):
            batches.setdefault(gathered.gather_key, []).append(gathered)
        for batch in batches.values():
            gather_together(batch, context.forward_pass)

    def end_forward(self, backward_follows: bool = False, raised: bool = False) -> None:
        """Put the sharded parameters back and close the forward (also when it raised). The full
        parameters stay allocated only if a backward through the module follows (autograd saved them,
        whether or not they need a gradient) and they are not resharded. The ring buffers are freed
        when the outermost rsdp forward ends, unless it is a recomputation inside backward (the
        backward frees them when it ends)."""
        self.fusion.end_forward()
        if self.installs_params and not in_backward():
            self.restore_sharded_params()
            if self.gathered is not None and (self.gathered.reshard_after_forward or not backward_follows):
                self.gathered.free()
        context = self.ring.context
        context.open_forwards -= 1
        self.forward_depth -= 1
        if context.open_forwards == 0 and not in_backward():
            context.end_forward(raised)

    def close_raised_forward(self, depth: int) -> None:
        """A call of the module begun at ``forward_depth`` ``depth`` raised: close its forward, unless
        its post-forward did already (a forward hook registered after rsdp's raised), so that it is
        never closed twice."""
        if self.forward_depth > depth:
            self.fusion.forward_raised()
            self.end_forward(raised=True)

    @torch.compiler.disable
    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        needs_grad = []
        if self.installs_params and torch.is_grad_enabled() and not in_backward():
            needs_grad = _needing_grad(output)
        self.end_forward(backward_follows=bool(needs_grad))
        for tensor in needs_grad:
            tensor.register_hook(self._pre_backward)
        if self.mp_policy.output_dtype is not None:
            output = apply_to_tensors(functools.partial(_cast_floating, self.mp_policy.output_dtype), output)
        return output

    @torch.compiler.disable
    def _pre_backward(self, grad: torch.Tensor) -> torch.Tensor:
        if self._post_backward_task != current_graph_task_id():
            self._install_params()
            self._await_post_backward()
        return grad

    @property
    def installs_params(self) -> bool:
        return self.gathered is not None or bool(self.operand_slots)

    def _install_params(self) -> None:
        """The full gathered parameters and the ring operands, under the parameters' names."""
        if self.gathered is not None:
            full = self.gathered.full if self.gathered.is_gathered else self.gathered.gather()
            for owner, name, index in self._gathered_slots:
                owner._parameters[name] = full[index]
        for slot, (owner, name, layer) in enumerate(self.operand_slots):
            current = owner._parameters.get(name)
            if not isinstance(current, RingOperand):
                sharded(current, owner, name)  # raises if it is no longer a sharded parameter
                operand, requires_grad = self._operands.get(slot, (None, None))
                if operand is None or operand.sharded_param is not current or requires_grad != current.requires_grad:
                    with outside_inference_mode():
                        operand = RingOperand(current, layer)
                    self._operands[slot] = (operand, current.requires_grad)
                owner._parameters[name] = operand

    def _await_post_backward(self) -> None:
        task = current_graph_task_id()
        if self._post_backward_task == task:
            return
        self._post_backward_task = task
        self.ring.context.await_post_backward(self)

    def post_backward(self) -> None:
        """Reduce the gathered parameters' gradients, write the module's gradients (``_grad.py``), put the
        sharded parameters back, free the full ones."""
        if self._post_backward_task is None:
            return
        self._post_backward_task = None
        self.fusion.backward_ended()
        if self.gathered is not None:
            self.gathered.reduce_gradients()
        self.gradients.flush()
        self.restore_sharded_params()
        if self.gathered is not None:
            self.gathered.free()

    def abandon_backward(self) -> None:
        """Its backward raised, and its post-backward never came (``RingContext.reset``): drop the
        gathered parameters' gradients, put the sharded parameters back, free the full ones."""
        self._post_backward_task = None
        self.fusion.backward_ended()
        if self.gathered is not None and self.gathered.full is not None:
            for full in self.gathered.full:
                full.grad = None
        self.restore_sharded_params()
        if self.gathered is not None:
            self.gathered.free()

    def restore_sharded_params(self) -> None:
        if self.gathered is not None:
            for owner, name, index in self._gathered_slots:
                owner._parameters[name] = self.gathered.params[index]
        for owner, name, _ in self.operand_slots:
            current = owner._parameters.get(name)
            if isinstance(current, RingOperand):
                owner._parameters[name] = current.sharded_param

    def _adopt_replaced_params(self) -> None:
        """Honour a gathered parameter replaced since the last forward (``load_state_dict(assign=True)``)
        by a DTensor laid out like it; refuse anything else rather than silently undo it."""
        replaced: dict[int, set] = {}
        for owner, name, index in self._gathered_slots:
            current = owner._parameters.get(name)
            if current is not self.gathered.params[index]:
                replaced.setdefault(index, set()).add(id(current))
                self._check_replacement(owner, name, index, current)
        for owner, name, index in self._gathered_slots:
            if index in replaced:
                if len(replaced[index]) > 1 or id(owner._parameters.get(name)) not in replaced[index]:
                    raise RuntimeError(
                        f"rsdp: {type(owner).__qualname__}.{name} is shared by several modules but was replaced in "
                        "only some of them; replace it everywhere, or assign new values in place."
                    )
                self.gathered.params[index] = owner._parameters[name]

    def _check_replacement(self, owner: nn.Module, name: str, index: int, current) -> None:
        expected = self.gathered.params[index]
        if (
            isinstance(current, nn.Parameter)
            and isinstance(current, DTensor)
            and current.device_mesh == expected.device_mesh
            and current.placements == expected.placements
            and current.shape == expected.shape
            and current.dtype == expected.dtype
        ):
            return
        raise RuntimeError(
            f"rsdp: {type(owner).__qualname__}.{name} is no longer the sharded DTensor parameter that rsdp_shard "
            f"installed, and its replacement ({_describe(current)}) is not a DTensor parameter sharded like it "
            f"({tuple(expected.placements)} on the same mesh, shape {tuple(expected.shape)}, {expected.dtype}). "
            "Assign new values in place, e.g. `with torch.no_grad(): param.copy_(value)`, or load them with "
            "load_state_dict (assign=True takes the DTensors of a sharded state dict)."
        )


def _describe(value) -> str:
    if isinstance(value, DTensor):
        return f"DTensor {tuple(value.placements)} of shape {tuple(value.shape)}, {value.dtype}"
    if isinstance(value, torch.Tensor):
        return f"{type(value).__name__} of shape {tuple(value.shape)}, {value.dtype}"
    return type(value).__name__


class _RunAfterBackward(torch.autograd.Function):
    """Identity on a module's forward inputs whose backward runs once the module's own backward is done
    (FSDP2's ``RegisterPostBackwardFunction``): the point to reduce its gathered parameters' gradients."""

    @staticmethod
    def forward(ctx, state: RSDPState, *inputs: torch.Tensor):
        ctx.state = state
        return inputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.state.post_backward()
        return (None, *grads)

    @classmethod
    def wrap(cls, state: RSDPState, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        inputs = _needing_grad((args, kwargs))
        if not inputs:
            return args, kwargs
        outputs = list(cls.apply(state, *inputs))
        del inputs
        # Consumed to the end: see _needing_grad.
        return apply_to_tensors(lambda t: outputs.pop(0) if t.requires_grad else t, (args, kwargs))


def _needing_grad(value) -> list[torch.Tensor]:
    """The tensors in ``value`` (nested containers, dataclasses) that need a gradient.

    torch's ``_apply_to_tensors`` keeps the function it is given in a reference cycle until the garbage
    collector runs, so that function must not be left holding tensors: a module's outputs (the logits)
    would stay alive until the next collection.
    """
    found: list[torch.Tensor] = []
    apply_to_tensors(lambda t: found.append(t) if t.requires_grad else None, value)
    tensors = found.copy()
    found.clear()
    return tensors


def rsdp_states_under(module: nn.Module) -> list:
    """The rsdp states of the modules in ``module``'s subtree."""
    return [state for state in (get_module_state(m) for m in module.modules()) if isinstance(state, RSDPState)]


def _check_callers_are_sharded(module: nn.Module, ranks: int) -> None:
    """Raise, before any communication, if the model calling ``module`` (an rsdp module whose forward is
    the outermost) holds trainable parameters that nothing shards or replicates: each rank would train
    its own copy of them on its own batch, and the copies would drift apart with no error. The model is
    the outermost module calling it below any that ``fully_shard``, ``replicate``, ``rsdp_shard`` or DDP
    manages; its modules that one of those manages are skipped."""
    if ranks == 1:
        return
    model = None
    for caller in calling_modules():
        if caller is module:
            continue
        if isinstance(get_module_state(caller), FSDPState):
            # fully_shard manages every parameter below it that no nested unit does, and its forward
            # holds them unsharded, as plain tensors: those between it and ``module`` (the block an
            # activation-checkpoint wrapper that fully_shard wraps holds) are its own.
            return
        if _managed(caller):
            break
        model = caller
    if model is None:
        return
    plain, seen, skip = [], set(), set()
    for name, submodule in model.named_modules():
        if any(name.startswith(prefix) for prefix in skip):
            continue
        if submodule is not model and _managed(submodule):
            skip.add(name + ".")
            continue
        for n, param in submodule.named_parameters(recurse=False):
            if param.requires_grad and not isinstance(param, DTensor) and id(param) not in seen:  # tied: once
                seen.add(id(param))
                plain.append(f"{name}.{n}" if name else n)
    if plain:
        shown = first_names(plain)
        raise RuntimeError(
            f"rsdp: {type(module).__qualname__} is rsdp_shard-ed, but the {type(model).__qualname__} that calls it holds "
            f"trainable parameters that nothing shards ({shown}): every rank would train its own copy of them on its "
            "own batch. Call rsdp_shard on the root after its blocks (or fully_shard / replicate it), or freeze them "
            "(requires_grad_(False))."
        )


def _managed(module: nn.Module) -> bool:
    return get_module_state(module) is not None or isinstance(module, DistributedDataParallel)


def release_ring_buffers(module: nn.Module | None = None) -> int:
    """Free the ring's message buffers of ``module``'s model (of every model when ``None``); the next
    ring step allocates them again, at the size they had. Returns the bytes they held. Useful before
    measuring memory, or to hand their memory to something else for a while."""
    if module is None:
        contexts = list(LIVE_CONTEXTS)
    else:
        contexts = list({id(state.ring.context): state.ring.context for state in rsdp_states_under(module)}.values())
    nbytes = 0
    for context in contexts:
        nbytes += context.buffers.nbytes
        context.buffers.release()
    return nbytes
