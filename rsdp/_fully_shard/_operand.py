"""Rotation at the op level: a ring weight rotates however its module's code uses it.

While an rsdp module runs (its forward, and its backward for a recomputation), every ``Shard(0)`` weight
it manages that has a ring form is installed as a :class:`RingOperand`: a tensor subclass carrying the
sharded parameter, with no data of its own. Its ``__torch_function__`` runs the ring when an op with a
ring form consumes it, whatever the module's class:

- ``F.linear(x, w, b)`` and ``x @ w.t()`` (``w`` stored ``[out, in]``, rows split): the Linear ring,
  output columns concatenated (``_linear.py``);
- ``torch.addmm(b, x, w)``, ``x @ w``, ``torch.mm`` / ``torch.matmul`` (``w`` stored ``[in, out]``, rows
  split: Hugging Face's ``Conv1D``): the input-split ring (``_linear.py``), partial products summed;
- ``F.embedding(i, w)``: the Embedding ring;
- ``w.t()`` / ``w.T`` / ``w.transpose(0, 1)`` give a transposed operand, ``w.to_local()`` the operand itself
  (torchtitan's Embedding calls ``F.embedding`` on ``weight.to_local()``).

It works for a weight reached from another module too (``F.linear(x, self.wte.weight)``, a tied head in
the root's forward), because the root installs operands for every ring weight it manages.

Why a tensor subclass and not a ``TorchFunctionMode`` scoped to the module: a mode lives on a
thread-local stack that hooks cannot enter in pre-forward and leave in post-backward, whereas an operand
sits in the module's ``_parameters`` exactly like FSDP2's unsharded parameter, so recomputation by
activation checkpointing (which may run ``forward`` without the hooks) finds it in place.

Any other op on an operand (``conv2d``, an elementwise use of a weight) runs on the full weight,
gathered for that op and recomputed in backward (a checkpoint around the op), so no full weight outlives
the op; rsdp warns once per parameter and op. Shape and dtype queries answer for the full weight, and
so do ``torch.zeros_like`` / ``w.new_zeros`` and friends, which read nothing else (no gather).

Code that hands the operand itself to autograd — its own ``torch.autograd.Function``, as fused
linear-cross-entropy losses do with ``lm_head.weight`` (Liger's, TRL's default SFT loss) — bypasses
``__torch_function__``: inside that Function's forward the ops on the operand still rotate or gather it,
and the full gradient its backward returns is accumulated by autograd into the operand, a leaf. A
post-accumulate-grad hook reduce-scatters it to the shards' owners and hands it to the parameter like a
ring function's gradient. ``torch.autograd.grad`` (or ``backward(inputs=...)``) asked for the gradient
of the operand itself has no answer under rsdp (the ring sends each rank's gradient to the shards'
owners; no full gradient of one rank's batch exists) and raises, rather than return None.

Pitfalls:
- An operand is not an ``nn.Parameter``; code that needs the parameter object itself (an optimizer built
  during forward) must run outside the module's forward.
- An operand has no storage to write: an in-place op on it inside forward (``w.mul_(2)``, an ``nn.init``
  function, ``w[0] = 1``, ``out=w``) raises, since it could only change a gathered copy.
- The ring runs inside the op: every rank must make the same sequence of ring ops, as with any
  collective. So must a Function that takes the operand: its gradient's reduce-scatter runs when
  autograd reaches the operand, on every rank (with a zero where the Function returned None).
"""

import warnings

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

from .._compat import (
    DisableTorchFunctionSubclass,
    all_gather_flat,
    make_wrapper_subclass,
    reduce_scatter_flat,
    tree_flatten,
    tree_unflatten,
)
from ._embedding import RingEmbeddingFunction
from ._linear import LinearMember, RingInputSplitFunction, RingLinearFunction
from ._param import shard_layout
from ._ring_function import RingLayer, autocast_like

_warned: set[tuple[int, str]] = set()


class RingOperand(torch.Tensor):
    """A ring weight while its module runs: ``sharded_param`` (``Shard(0)``, rows over the ring) seen as
    its full shape, or its transpose."""

    sharded_param: torch.nn.Parameter
    layer: RingLayer
    transposed: bool

    @staticmethod
    def __new__(cls, sharded_param, layer: RingLayer, transposed: bool = False):
        shape = sharded_param.shape if not transposed else sharded_param.shape[::-1]
        operand = make_wrapper_subclass(
            cls,
            shape,
            dtype=sharded_param.dtype,
            device=sharded_param.device,
            requires_grad=sharded_param.requires_grad,
        )
        operand.sharded_param, operand.layer, operand.transposed = sharded_param, layer, transposed
        if operand.requires_grad:
            # Code that hands the operand itself to autograd (its own autograd.Function, as fused
            # linear-cross-entropy losses do) makes it a leaf of that graph: its full gradient lands here.
            # (Also when made under no_grad: a module's operand is made once and kept.)
            with DisableTorchFunctionSubclass():
                operand.register_post_accumulate_grad_hook(_reduce_to_shard)
        return operand

    def __repr__(self):
        return f"RingOperand({self.layer.name}, shape={tuple(self.shape)}, transposed={self.transposed})"

    def to_local(self) -> "RingOperand":
        return self

    def local(self) -> torch.Tensor:
        """The local shard, as the gradient leaf ring functions compute with (``_grad.py``)."""
        return self.layer.gradients.leaf(self.sharded_param)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        _refuse_in_place(func, args, kwargs)
        handler = _HANDLERS.get(func)
        if handler is not None:
            result = handler(*args, **kwargs)
            if result is not NotImplemented:
                return result
        if func in _METADATA or getattr(func, "__name__", "") in _METADATA_NAMES:
            with DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        return _on_full_weights(func, args, kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"rsdp: {func} reached a RingOperand below torch functions; this is a bug in rsdp")


_METADATA = {
    torch.Tensor.size,
    torch.Tensor.dim,
    torch.Tensor.numel,
    torch.Tensor.is_floating_point,
    torch.Tensor.element_size,
    torch.Tensor.stride,
    torch.Tensor.__len__,
}
# Property getters (shape, dtype, device, requires_grad, ndim, ...) arrive as their __get__ methods.
_METADATA_NAMES = {"__get__"}


_IN_PLACE_METADATA = {"requires_grad_", "retain_grad"}  # change autograd's view of a tensor, not its values


def _refuse_in_place(func, args, kwargs) -> None:
    """An operand written in place (``w.mul_(2)``, ``nn.init.zeros_(w)``, ``w[0] = 1``, ``out=w``) would
    change a gathered copy while the parameter's shards, which the ring reads, stay as they were: the
    forward would compute with both. Refused, on every rank alike (every rank runs the same forward)."""
    name = getattr(func, "__name__", "")
    # `w += 1` arrives as add_, `w[0] = 1` as __setitem__
    in_place = name == "__setitem__" or (name.endswith("_") and not name.startswith("__") and name not in _IN_PLACE_METADATA)
    written = args[0] if in_place and args else kwargs.get("out")
    operand = next((w for w in (written if isinstance(written, (tuple, list)) else (written,)) if isinstance(w, RingOperand)), None)
    if operand is not None:
        raise RuntimeError(
            f"rsdp: {operand.layer.name} is modified in place ({name}) inside the forward of a module rsdp "
            "shards, where it stands for shards rotating over the ring: the change would reach a gathered "
            "copy, not the parameter the ring reads. Change it outside forward (between steps, e.g. "
            "`with torch.no_grad(): module.weight.mul_(2)` on the sharded parameter, which updates every "
            "rank's shard), or compute with a new tensor inside forward (`w * 2`)."
        )


def _reduce_to_shard(operand: RingOperand) -> None:
    """The full gradient autograd accumulated into an operand (a leaf of someone else's autograd
    Function), reduce-scattered to the shard's owners and handed to the parameter like a ring function's.
    The hook runs on every rank even where the Function returned no gradient (a zero then takes part),
    so no rank is left waiting in the collective."""
    with DisableTorchFunctionSubclass():
        grad, operand.grad = operand.grad, None
        shape = operand.shape
    if grad is None:
        grad = torch.zeros(shape, dtype=operand.dtype, device=operand.device)
    if operand.transposed:
        grad = grad.t()
    param, layer = operand.sharded_param, operand.layer
    reduced = _reduce_full_gradient(layer, shard_layout(param.shape[0], layer.ring.size), grad, param.dtype)
    layer.gradients.receive(param, reduced)


def _reduce_full_gradient(layer: RingLayer, layout, grad: torch.Tensor, local_dtype: torch.dtype) -> torch.Tensor:
    """This rank's rows of the reduced (summed, then divided) full-weight gradient ``grad``."""
    ring = layer.ring
    padded = grad.new_zeros(ring.size * layout.chunk, *grad.shape[1:], dtype=layer.precision.reduce_dtype(local_dtype))
    padded[: layout.rows].copy_(grad)
    reduced = padded.new_empty(layout.chunk, *grad.shape[1:])
    reduce_scatter_flat(reduced, padded, group=ring.group)
    layer.gradients.divide(reduced)
    return reduced[: layout.rows_of(ring.rank)].to(local_dtype)


def _full_weight(operand: RingOperand) -> torch.Tensor:
    full = _GatherShards.apply(operand.local(), operand.layer, operand.sharded_param.shape[0])
    return full.t() if operand.transposed else full


def _on_full_weights(func, args, kwargs):
    """An op with no ring form: run it on the gathered weights inside a checkpoint, so that backward
    gathers them again instead of keeping them."""
    # Operands may sit inside lists (``torch.cat([bias, ...])``, gpt-oss's experts): fill every leaf.
    leaves, spec = tree_flatten((args, kwargs))
    for operand in (a for a in leaves if isinstance(a, RingOperand)):
        name = getattr(func, "__name__", str(func))
        if (id(operand.sharded_param), name) not in _warned:
            _warned.add((id(operand.sharded_param), name))
            warnings.warn(
                f"rsdp: {operand.layer.name} is used by {name}, which has no ring form; it is all-gathered for "
                "that op (and again in backward). Use it through F.linear / matmul / F.embedding to rotate it.",
                stacklevel=3,
            )

    def run():
        full_args, full_kwargs = tree_unflatten([_full_weight(a) if isinstance(a, RingOperand) else a for a in leaves], spec)
        return func(*full_args, **full_kwargs)

    if not torch.is_grad_enabled():
        return run()
    return checkpoint(run, use_reentrant=False)


class _GatherShards(torch.autograd.Function):
    """The full weight from every rank's shard (one all-gather); backward reduce-scatters its gradient."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, layer: RingLayer, rows: int):
        ring = layer.ring
        layout = shard_layout(rows, ring.size)
        trailing = local.shape[1:]
        dtype = layer.precision.compute_dtype(local.dtype)
        send = torch.zeros(layout.chunk, *trailing, dtype=dtype, device=local.device)
        send[: local.shape[0]].copy_(local)
        received = torch.empty(ring.size * layout.chunk, *trailing, dtype=dtype, device=local.device)
        all_gather_flat(received, send, group=ring.group)
        ctx.layer, ctx.layout, ctx.local_dtype = layer, layout, local.dtype
        return received[: layout.rows]

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        return _reduce_full_gradient(ctx.layer, ctx.layout, grad, ctx.local_dtype), None, None


def _check_input(x, operand: RingOperand, features: int) -> None:
    # Checked before the ring starts: a rank that failed half-way through a ring step would leave its
    # peers waiting for the process group's timeout.
    if not isinstance(x, torch.Tensor) or isinstance(x, RingOperand) or not x.is_floating_point():
        raise TypeError(f"rsdp {operand.layer.name}: the input multiplied by this ring weight must be a floating-point tensor")
    if x.dim() == 0 or x.shape[-1] != features:
        raise ValueError(
            f"rsdp {operand.layer.name}: input of shape {tuple(x.shape)} does not end in the weight's {features} input features"
        )
    if x.device != operand.device:
        raise ValueError(
            f"rsdp {operand.layer.name}: input is on {x.device} but the parameters are on {operand.device}; move the input there first."
        )


def _times(x, operand) -> torch.Tensor | type(NotImplemented):
    """``x @ operand`` by the ring that fits how the weight is stored."""
    if not isinstance(operand, RingOperand) or isinstance(x, RingOperand) or operand.dim() != 2:
        return NotImplemented
    return _product(x, operand, operand.transposed)


def _product(x, operand: RingOperand, transposed: bool) -> torch.Tensor:
    """``x @ operand`` (``x @ operand.T`` if ``transposed`` differs from ``operand.transposed``; no
    transposed operand is made for it, as one made under grad mode registers a hook)."""
    stored = operand.sharded_param.shape
    _check_input(x, operand, stored[1] if transposed else stored[0])
    if transposed:  # stored [out, in]: a Linear's weight
        member = LinearMember(stored[0], id(operand.layer))
        return RingLinearFunction.apply(x, operand.layer, (member,), operand.local(), None)[0]
    # stored [in, out]: Conv1D
    return RingInputSplitFunction.apply(x, operand.layer, tuple(stored), operand.local())


def _plain(tensor):
    return _full_weight(tensor) if isinstance(tensor, RingOperand) else tensor


def _linear(input, weight, bias=None):
    if not isinstance(weight, RingOperand) or weight.dim() != 2:
        return NotImplemented
    if not weight.transposed and isinstance(bias, RingOperand) and input.is_floating_point():
        # A stock Linear's weight and bias read by other code: they rotate together.
        _check_input(input, weight, weight.shape[1])
        member = LinearMember(weight.shape[0], id(weight.layer))
        return RingLinearFunction.apply(input, weight.layer, (member,), weight.local(), bias.local())[0]
    if isinstance(input, RingOperand):
        return NotImplemented
    out = _product(input, weight, not weight.transposed)
    return out if bias is None else out + autocast_like(_plain(bias), out)


def _transposed(operand: RingOperand, dim0: int = 0, dim1: int = 1):
    if not isinstance(operand, RingOperand) or operand.dim() != 2 or {dim0 % 2, dim1 % 2} != {0, 1}:
        return NotImplemented
    return RingOperand(operand.sharded_param, operand.layer, not operand.transposed)


def _addmm(input, mat1, mat2, *, beta=1, alpha=1, out=None):
    if out is not None or isinstance(input, RingOperand):
        return NotImplemented
    product = _times(mat1, mat2)
    if product is NotImplemented:
        return NotImplemented
    input = autocast_like(input, product)
    return beta * input + alpha * product if (beta, alpha) != (1, 1) else input + product


def _matmul(input, other, *, out=None):
    return NotImplemented if out is not None else _times(input, other)


def _embedding(input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False, sparse=False):
    if not isinstance(weight, RingOperand) or weight.transposed or max_norm is not None or scale_grad_by_freq or sparse:
        return NotImplemented
    if input.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"rsdp {weight.layer.name}: indices must be int32 or int64, got {input.dtype}")
    if padding_idx is not None and padding_idx < 0:
        padding_idx += weight.shape[0]
    return RingEmbeddingFunction.apply(input, weight.local(), weight.layer, weight.shape[0], padding_idx)


def _like(factory):
    """``torch.zeros_like(w)`` and friends need the weight's shape, not its values: no gather."""

    def handler(operand, *args, **kwargs):
        if not isinstance(operand, RingOperand):
            return NotImplemented
        return factory(torch.empty(operand.shape, dtype=operand.dtype, device=operand.device), *args, **kwargs)

    return handler


def _new(factory):
    """``w.new_zeros(shape)`` and friends take the weight's dtype and device only: no gather."""

    def handler(operand, *args, **kwargs):
        if not isinstance(operand, RingOperand):
            return NotImplemented
        return factory(torch.empty(0, dtype=operand.dtype, device=operand.device), *args, **kwargs)

    return handler


def _gradient_of_operand(name: str):
    def handler(*args, **kwargs):
        operands = {a.layer.name for a in _flattened((args, kwargs)) if isinstance(a, RingOperand)}
        raise RuntimeError(
            f"rsdp: torch.autograd.{name} was asked for the gradient of {', '.join(sorted(operands))}, a weight rsdp "
            "manages (each rank holds a shard; its products run on the ring and send their gradients to the "
            "shards' owners, so no full gradient of this rank's alone exists to return). Compute that gradient "
            "by hand, as fused losses do (e.g. grad_output.t() @ hidden), or differentiate with respect to the "
            "other inputs only and let rsdp handle the weight's."
        )

    return handler


def _flattened(value):
    if isinstance(value, (list, tuple)):
        return [leaf for item in value for leaf in _flattened(item)]
    if isinstance(value, dict):
        return _flattened(list(value.values()))
    return [value]


def _on_sharded_param(method):
    """Hooks go to the sharded parameter: it is the leaf whose ``.grad`` receives the gradient."""

    def handler(operand, *args, **kwargs):
        return method(operand.sharded_param, *args, **kwargs)

    return handler


_HANDLERS = {
    torch.Tensor.register_hook: _on_sharded_param(torch.Tensor.register_hook),
    torch.Tensor.register_post_accumulate_grad_hook: _on_sharded_param(torch.Tensor.register_post_accumulate_grad_hook),
    torch.autograd.grad: _gradient_of_operand("grad"),
    torch.autograd.backward: _gradient_of_operand("backward"),
    torch.zeros_like: _like(torch.zeros_like),
    torch.ones_like: _like(torch.ones_like),
    torch.empty_like: _like(torch.empty_like),
    torch.full_like: _like(torch.full_like),
    torch.rand_like: _like(torch.rand_like),
    torch.randn_like: _like(torch.randn_like),
    torch.Tensor.new_zeros: _new(torch.Tensor.new_zeros),
    torch.Tensor.new_ones: _new(torch.Tensor.new_ones),
    torch.Tensor.new_empty: _new(torch.Tensor.new_empty),
    torch.Tensor.new_full: _new(torch.Tensor.new_full),
    F.linear: _linear,
    F.embedding: _embedding,
    torch.addmm: _addmm,
    torch.mm: _matmul,
    torch.matmul: _matmul,
    torch.Tensor.matmul: _matmul,
    torch.Tensor.mm: _matmul,
    torch.Tensor.__matmul__: _matmul,
    torch.Tensor.t: _transposed,
    torch.t: _transposed,
    torch.Tensor.transpose: _transposed,
    torch.transpose: _transposed,
    torch.Tensor.T.__get__: _transposed,
}

