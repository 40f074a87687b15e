"""A mixture-of-experts layer's experts on rings of blocks of whole experts: one ring of both
projections forward, one per projection backward; the weights rotate, the tokens stay.

A MoE layer's routed experts are 3-D parameters ``[experts, out, in]`` (Hugging Face's ``gate_up_proj``
and ``down_proj``, torchtitan's ``w1``/``w3`` and ``w2``; biases ``[experts, out]``). rsdp stores each
``Shard(0)``, so rank r owns the same block of experts in every one: ``torch.chunk`` rows, so 8 experts
on 3 ranks are blocks of 3, 3 and 2.

A call runs in three parts, written once here for both kinds of experts module (``ExpertRing``):

1. **Routing** (plain autograd ops): the rank's token-expert pairs sorted by expert (``routed``), each
   expert's count read to the host once, so every block's rows are known (``Routing``).
2. **One forward ring** (``_ExpertsForward``) whose message is a block's up projection (``gate_up_proj``
   with its bias; torchtitan's ``w1`` and ``w3``) then its down projection: at step k the rank takes the
   rows routed to the block it holds through the block's up weights, one grouped GEMM per weight over
   the block's whole experts (``expert_product``), the activation (the module's own: ``_apply_gate``,
   gpt-oss's clamped SwiGLU, row by row as the stock forward runs it) and the block's down weights, into
   its rows of the call's up-projection output (kept for the backward) and output, allocated once.
3. **Combining**: the pairs are weighted by the router and summed back per token (``combine``).

The backward (``_ExpertsFunction``) is two rings, each a planned sub-block's ring backward
(``_sub_block.py``) of one projection (``ExpertStage``), in reverse: the down projection's yields the
activation's gradient; the activation's backward, the activation computed again from the kept
up-projection output; then the up projection's ring yields the input's. Each rotates its weights again
with its gradient partials, summed on their way to the owner. A step's weight gradients need no weights
(a product's weight gradient is its input times its output's gradient, a bias's the sum of its rows), so
the ring computes them itself (``ExpertStage.weight_gradients``) and the partials travel as a Linear's:
from the owner's neighbour to the owner in the ring's W-1 exchanges, with no last hop, each rank writing
its contribution into a partial as it arrives, expert by expert (``mm`` with ``out=``, or ``addmm_``), so
that no gradient of a block's size exists beside the ring buffers. The input's gradient is the ring's
own too (``input_gradients``: ``dy @ w^T`` with the weights held), so no step's graph is kept and no
forward runs again, under activation checkpointing either. One backward ring of both projections would
not be weights-free: the up projection's weight gradient needs the intermediate's gradient, which needs
the block's down weights, and a ring's partial of a block reaches each rank one step before that block's
weights do; its partials would follow the weights with a deferred last hop, in messages of both
projections' weights and partials. So the backward's ring buffers hold two messages of the larger ring
(weights and partials), about 4/W of the up projection's experts (and, as the ring ends, the owner's
reduced shards copied out, 1/W, its gradient shard); the forward's, two blocks of both projections, 2/W
of the experts. Every rank runs all W steps of every ring whatever its routing, so ranks that route
differently make the same exchanges; a block that got none of a rank's tokens multiplies no rows.

What each kind says (``ExpertsBlock`` here for Hugging Face, ``GroupedExpertsBlock`` in
``_grouped_experts.py`` for torchtitan): its projections' parameters, how a call's tokens are routed and
combined, and what a step and the activation compute, as the stock forward computes them. peft's LoRA on
Hugging Face's experts adds each step's update to the weights it carries (``_expert_lora.py``).

Pitfalls:
- ``input_gradients`` and ``weight_gradients`` compute what autograd would through a step's products
  (bit for bit: the same products, in the same dtypes), so a kind whose product
  differs from ``x @ w`` (plus a bias per expert) over all its output's columns says how
  (``ExpertRing.gradient_term``: torchtitan's ``w1``/``w3`` each make half of the columns, in bfloat16).
- Hugging Face's experts implementations (the eager loop, ``batched_mm``, ``grouped_mm``) compute one
  function; the ring computes it as ``grouped_mm`` does (the module's ``_apply_gate`` or ``act_fn``, its
  biases and weight layout), so results match the implementation set up to the order of float sums.
  A kernel of its own (``sonicmoe``, ``deepgemm``), a post-expert norm, and parameters that are not
  ``[experts, ...]`` are refused at ``rsdp_shard`` or the first call, naming what to change.
- torch's grouped GEMM takes float32, bfloat16 and float16; other dtypes (float64) run one ``mm`` per
  expert of the block, the same products.
- Each call reads its per-expert token counts to the host once (a device-to-host copy on a GPU).
- The backward keeps the sorted rows and the up projection's output (the stock experts keep the
  activation's output and saved product too: ``dropped_activation_bytes``, the planner's): where many
  tokens meet small experts they outweigh the ring buffers' saving; activation checkpointing drops them.
- On a GPU, torch's grouped GEMM wants 16-byte-aligned strides and addresses: a message lays each block
  of experts out at a multiple of 16 bytes (``_wire.py``), whatever precedes it (a bias, a gradient
  partial); the strides (a row of an expert's matrix) are the model's, which real expert shapes keep
  16-byte aligned.
"""

import inspect
import itertools

import torch
import torch.nn as nn
import torch.nn.functional as F

from torch.autograd.function import once_differentiable

from .._compat import autocast_dtype, grouped_mm
from ._checkpoint import kept_or_run
from ._ring_function import local_shard
from ._sub_block import _Call, _SubBlockBackward
from ._wire import Segment, segment

# The experts implementations Hugging Face dispatches to whose function the ring computes (see the
# docstring); None is what Hugging Face uses when the experts module runs outside a model (the eager loop).
_HF_IMPLEMENTATIONS = ("grouped_mm", "batched_mm", "eager", None)
_HF_MARKERS = ("has_gate", "has_bias", "_is_expert_parallel", "num_experts", "config")
# The dtypes torch._grouped_mm takes; others multiply expert by expert.
_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def is_experts_module(module: nn.Module) -> bool:
    """Whether ``module`` is a Hugging Face experts module (decorated ``use_experts_implementation``)."""
    return all(hasattr(module, marker) for marker in _HF_MARKERS) and any(p.dim() == 3 for p in module.parameters(recurse=False))


class Routing:
    """Where a call's routed rows (sorted by expert) lie: ``rows[s]`` is the first row of block s's
    experts (``rows[W]`` the end of the last), host integers read once per call; and, per block, what
    its grouped GEMMs take (``groups``)."""

    def __init__(self, counts: torch.Tensor, layout):
        self.counts, self.layout = counts, layout
        self.ends = list(itertools.accumulate(counts.tolist(), initial=0))  # ends[e]: expert e's first row
        self.rows = tuple(self.ends[layout.start(shard)] for shard in range(layout.world)) + (self.ends[-1],)
        self._groups: dict[int, Groups] = {}

    def groups(self, shard: int) -> "Groups":
        groups = self._groups.get(shard)
        if groups is None:
            groups = self._groups[shard] = Groups(self, shard)
        return groups


class Groups:
    """One block's experts as its grouped GEMMs take them, its rows counted from its first: ``offsets``
    (each expert's end, int32 on the device), ``tokens`` (each expert's row count, on the device),
    ``bounds`` and ``sizes`` (each expert's rows and their count, host integers) and, made when a bias asks, ``expert_of_rows`` (each
    row's expert within the block)."""

    def __init__(self, routing: Routing, shard: int):
        experts = routing.layout.row_slice(shard)
        first = routing.rows[shard]
        self.count, self.rows = experts.stop - experts.start, routing.rows[shard + 1] - first
        self.offsets = routing.counts[experts].cumsum(0, dtype=torch.int32)
        ends = routing.ends[experts.start : experts.stop + 1]
        self.bounds = [(start - first, end - first) for start, end in itertools.pairwise(ends)]
        self.sizes = [end - start for start, end in self.bounds]
        self.tokens = routing.counts[experts]  # each expert's rows, on the device
        self._expert_of_rows = None

    @property
    def expert_of_rows(self) -> torch.Tensor:
        if self._expert_of_rows is None:
            experts = torch.arange(self.count, device=self.tokens.device)
            self._expert_of_rows = torch.repeat_interleave(experts, self.tokens, output_size=self.rows)
        return self._expert_of_rows


def _grouped(a: torch.Tensor, b: torch.Tensor, groups: Groups) -> torch.Tensor:
    """Rows of ``a`` times their expert's matrix of ``b`` (``[experts, in, out]``): one grouped GEMM, or
    one ``mm`` per expert where torch's grouped GEMM lacks the dtype."""
    if grouped_mm is not None and a.dtype in _GROUPED_MM_DTYPES:
        return grouped_mm(a, b, offs=groups.offsets)
    return torch.cat([a[start:end] @ b[expert] for expert, (start, end) in enumerate(groups.bounds)])


def _write_weight_gradient(view: torch.Tensor, a: torch.Tensor, g: torch.Tensor, groups: Groups, add: bool) -> None:
    """Each expert's ``a_e^T g_e`` written (or added) into its matrix of ``view`` (``[experts, in, out]``,
    a partial's): one ``mm`` per expert with ``out=`` (or ``addmm_``), so that no gradient the size of the
    block exists beside the partial; in a compute dtype other than the partial's (torchtitan's bfloat16
    products, float32 partials), one expert's product at a time, added."""
    # Each expert's operands split in one op each (not sliced one by one: ops are host time at every step).
    for matrix, a_t, g_expert in zip(view.unbind(0), a.mT.split(groups.sizes, 1), g.split(groups.sizes)):
        if matrix.dtype != a.dtype:
            product = a_t @ g_expert
            matrix.add_(product) if add else matrix.copy_(product)
        elif add:
            if g_expert.shape[0]:
                matrix.addmm_(a_t, g_expert)
        else:
            torch.mm(a_t, g_expert, out=matrix)


def _write_bias_gradient(view: torch.Tensor, g: torch.Tensor, groups: Groups, add: bool) -> None:
    """Each expert's sum of its rows of ``g`` written (or added) into its row of ``view`` (``[experts, out]``)."""
    if g.dtype != view.dtype:
        sums = torch.zeros(view.shape, dtype=g.dtype, device=g.device).index_add_(0, groups.expert_of_rows, g)
        view.add_(sums) if add else view.copy_(sums)
        return
    if not add:
        view.zero_()
    view.index_add_(0, groups.expert_of_rows, g)


def expert_product(x: torch.Tensor, w_t: torch.Tensor, groups: Groups, dtype: torch.dtype) -> torch.Tensor:
    """A ring step's product of its rows ``x`` with its block's weights ``w_t`` (``[experts, in, out]``),
    both cast to ``dtype``, as torch's grouped GEMM computes it (autograd runs through it only where a
    step is backpropagated: a LoRA-updated weight's, ``_expert_lora.py``)."""
    return _grouped(x.to(dtype), w_t.to(dtype), groups)


class ExpertStage:
    """One of an experts module's two projections (``ExpertRing.stages``), a ring of its own in backward:
    its parameters, and at each step its ``product`` of the rows routed to the block held. The interface the sub-block ring
    (``_sub_block.py``) drives: ``param_slots``, ``per_shard``, ``param_transposed``, ``transposed``,
    ``segments``, ``run_step``, and its backward itself (``input_gradients``, ``weight_gradients``;
    with a LoRA update on its weights, autograd through each step computed again: ``_expert_lora.py``)."""

    per_shard = shard_parts = ()  # parameters used whole at every step: none but LoRA adapters (_expert_lora.py)
    advice = ""  # a sub-block's refusal names plan entries; no ring_plan entry names an experts module

    def __init__(self, experts: "ExpertRing", names: tuple[str, ...], product, label: str):
        module = experts.module
        self.module, self.name, self.product = module, f"{experts.name}[{label}]", product
        self.param_slots = [(module, name) for name in names]
        # A step's weight operands are [experts, in, out] views, as grouped GEMMs take them: a weight
        # stored [experts, out, in] is viewed transposed.
        self.transposed = tuple(getattr(module, name).dim() == 3 and not experts.stored_transposed for name in names)
        self.param_transposed = (False,) * len(names)
        # Per parameter: the columns of the step's output its product makes (None: all) and the dtype it
        # computes in (None: the operand's), which is all its gradient needs (``weight_gradients``).
        self.terms = [experts.gradient_term(name) for name in names]
        self.ring = None
        self._segments: dict[tuple[torch.dtype, int, int], tuple[Segment, ...]] = {}

    def segments(self, dtype: torch.dtype, ring) -> tuple[Segment, ...]:
        """Each parameter's block of experts on ``ring``, in ``param_slots`` order: one layout (the
        experts' over the ring's owners: ranks, or groups of them) for all."""
        key = (dtype, ring.owners, ring.group_size)
        if key not in self._segments:
            layout = ring.layout(getattr(self.module, self.param_slots[0][1]).shape[0])
            self._segments[key] = tuple(segment(layout, getattr(self.module, name).shape[1:], dtype) for _, name in self.param_slots)
        return self._segments[key]

    def call(self, routing: Routing) -> tuple[_Call, list[torch.Tensor], list[torch.Tensor]]:
        """This ring's part of a call: its ``_Call`` (its one tensor, the routed rows or the activation,
        given to its steps through ``_Call.arguments``; no step's graph is kept, see
        ``input_gradients``), its per-shard parameters as installed (gathered) and its parameters' local
        shards (gradient leaves)."""
        call = _Call(self, [None, routing], None, [0], None)
        per_shard = [module._parameters[name] for module, name in self.per_shard]
        params = [local_shard(getattr(module, name), module, name, self.ring) for module, name in self.param_slots]
        return call, per_shard, params

    def block_output(self, call: _Call, rows: torch.Tensor, per_shard: list[torch.Tensor], shard: int, operands: list[torch.Tensor], groups: "Groups") -> torch.Tensor:
        """The block ``shard``'s product (its parameters ``operands``) on its rows ``rows``, its per-shard
        parameters (LoRA adapters) installed for the step."""
        if not self.per_shard:
            return self.product(rows, operands, groups)
        installed = call.install(per_shard, shard)
        try:
            return self.product(rows, operands, groups)
        finally:
            call.restore(installed)

    def input_gradients(self, call, dy: torch.Tensor, shard: int, operands: list[torch.Tensor], into: torch.Tensor) -> None:
        """Block ``shard``'s term of the input's gradient, added into its rows of ``into`` (the routed rows',
        in their dtype): each weight's product's, ``dy @ w^T`` over the columns it makes, as the grouped
        GEMM's backward computes it (a bias has none)."""
        routing = call.leaves[1]
        first, end = routing.rows[shard], routing.rows[shard + 1]
        if end == first:
            return
        groups, g, rows = routing.groups(shard), dy[first:end], into[first:end]
        for (columns, compute), operand in zip(self.terms, operands):
            if operand.dim() == 3:
                compute = compute or operand.dtype
                term = (g if columns is None else g[:, columns]).to(compute).contiguous()
                rows.add_(_grouped(term, operand.to(compute).mT, groups).to(into.dtype))

    def weight_gradients(
        self, call, rows: torch.Tensor, dy: torch.Tensor, shard: int, params: list[tuple[int, torch.dtype]], into: list[torch.Tensor], add: bool
    ) -> None:
        """Block ``shard``'s parameter gradients from its rows of ``rows`` (the call's input) and of ``dy``
        (its output's gradient) alone: a product's weight gradient is its input times its output's
        gradient, a bias's the sum of its rows, neither reads the weights. Written, or added (``add``),
        into ``into`` (views shaped as the operands: ``[experts, in, out]``, biases ``[experts, out]``), one
        per entry of ``params``: (the parameter's index, its operand's dtype)."""
        routing = call.leaves[1]
        first, end = routing.rows[shard], routing.rows[shard + 1]
        groups = routing.groups(shard)
        x, g = rows[first:end], dy[first:end]
        for (index, dtype), view in zip(params, into):
            columns, compute = self.terms[index]
            term = g if columns is None else g[:, columns]
            if view.dim() == 3:
                compute = compute or dtype
                # contiguous, as the grouped GEMM's backward takes it: the same products, bit for bit
                _write_weight_gradient(view, x.to(compute), term.to(compute).contiguous(), groups, add)
            else:
                _write_bias_gradient(view, term.to(dtype), groups, add)

    def run_step(self, call, arguments, shard: int, operands: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The block ``shard``'s product (its parameters ``operands``) on its rows, in a partial output as
        long as the routed rows (zeros elsewhere: each row is written by one step); returns it twice
        (output, partial)."""
        rows, routing = arguments.args
        first, end = routing.rows[shard], routing.rows[shard + 1]
        output = self.product(rows[first:end], operands, routing.groups(shard))
        partial = F.pad(output, (0, 0, first, rows.shape[0] - end))
        return partial, partial


class ExpertRing:
    """An experts module on its rings (see the module docstring). Subclasses say which parameters each
    projection has (``first``, ``second``: names), whether the weights are stored ``[experts, in, out]``
    (``stored_transposed``), how a call's arguments are checked (``call_arguments``), routed (``routed``)
    and combined (``combine``), and what a step's products and the activation compute (``first_product``,
    ``second_product``, ``activation``)."""

    stored_transposed = False
    adapter_linears = ()  # LoRA adapters the rings use whole (peft's on the experts: _expert_lora.py)

    def __init__(self, module: nn.Module, name: str, experts: int, first: tuple[str, ...], second: tuple[str, ...]):
        self.module, self.name, self.experts = module, name, experts
        self.call_site = module  # the module whose call runs the rings (a LoRA wrapper's: _expert_lora.py)
        self.signature = inspect.signature(type(module).forward)
        where = f"rsdp_shard: experts {name or type(module).__qualname__!r}"
        nested = [n for n, p in module.named_parameters() if "." in n]
        if nested:
            raise ValueError(
                f"{where} holds parameters in submodules ({nested}, a post-expert norm); its experts rotate in "
                "blocks, computed as the stock experts compute them, so it may hold only [experts, ...] "
                "parameters. Shard that module with torch's fully_shard instead."
            )
        not_per_expert = [n for n, p in module.named_parameters() if p.dim() < 2 or p.shape[0] != experts]
        if not_per_expert:
            raise ValueError(
                f"{where}: parameters {not_per_expert} are not [num_experts={experts}, ...]; only per-expert "
                "parameters can rotate in blocks of experts. Shard that module with torch's fully_shard instead."
            )
        self.stages = (ExpertStage(self, first, self.first_product, "up"), ExpertStage(self, second, self.second_product, "down"))
        self.param_slots = [slot for stage in self.stages for slot in stage.param_slots]

    def gradient_term(self, name: str) -> tuple[slice | None, torch.dtype | None]:
        """How a step's product uses parameter ``name``: the columns of its output it makes (None: all) and
        the dtype it computes in (None: the operand's); a subclass whose products differ says so."""
        return None, None

    def bound_arguments(self, args: tuple, kwargs: dict) -> list:
        """A call's arguments in the order of the module's forward, defaults applied."""
        bound = self.signature.bind(self.module, *args, **kwargs)
        bound.apply_defaults()
        return list(bound.arguments.values())[1:]

    def forward(self, args: tuple, kwargs: dict) -> torch.Tensor:
        """The experts' output for a call: routed, one forward ring, combined."""
        rows, counts, restore = self.routed(*self.call_arguments(args, kwargs))
        routing = Routing(counts, self.stages[0].ring.ring.layout(self.experts))
        (up_call, up_per_shard, up_params), (down_call, down_per_shard, down_params) = (stage.call(routing) for stage in self.stages)
        sizes = (len(up_per_shard), len(up_params), len(down_per_shard))
        output = _ExpertsFunction.apply(self, (up_call, down_call, sizes), rows, *up_per_shard, *up_params, *down_per_shard, *down_params)
        return self.combine(output, restore)


class _ExpertsForward:
    """One forward of an experts call: a ring of both projections' blocks, each step the block's rows up,
    through the activation and down, into the call's ``hidden`` (the up projection's output, kept for the
    backward) and ``output``, allocated once per call; rows no expert takes stay zero."""

    def __init__(self, experts: "ExpertRing", calls: tuple, rows: torch.Tensor, tensors: tuple):
        self.experts = experts
        (up_call, down_call, (up_parts, up_count, down_parts)) = calls
        self.up_call, self.down_call = up_call, down_call
        self.up_per_shard, self.up_params = tensors[:up_parts], tensors[up_parts : up_parts + up_count]
        self.down_per_shard, self.down_params = tensors[up_parts + up_count : up_parts + up_count + down_parts], tensors[up_parts + up_count + down_parts :]
        up, down = experts.stages
        self.layer = up.ring
        precision, self.ring = self.layer.precision, self.layer.ring
        # Inputs in the policy's compute dtype (as FSDP2 casts them); the weights in the dtype the
        # products use, which autocast, where it is on, may lower further.
        self.input_dtype = precision.compute_dtype(self.up_params[0].dtype)
        self.dtype = precision.matmul_dtype(self.up_params[0].dtype)
        self.message = self.ring.buffers.message_of(up.segments(self.dtype, self.ring) + down.segments(self.dtype, self.ring))
        self.transposed = up.transposed + down.transposed
        self.up_operands = len(self.up_params)
        self.rows = rows.to(self.input_dtype) if rows.is_floating_point() else rows
        self.routing = up_call.leaves[1]
        self.hidden = self.output = None

    def rotate(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The output and the hidden rows, from one ring."""
        self.layer.driver.forward(self.message, self.during, [*self.up_params, *self.down_params])
        return self.output, self.hidden

    def during(self, step: int, buffer: torch.Tensor) -> None:
        """The block held at ``step`` (in ``buffer``) on its rows: up, the activation, down."""
        shard = self.ring.weight_shards[step]
        routing = self.routing
        first, end = routing.rows[shard], routing.rows[shard + 1]
        if first == end:
            return
        up, down = self.experts.stages
        operands, groups, count = self.message.views(buffer, shard, transposed=self.transposed), routing.groups(shard), self.up_operands
        hidden = up.block_output(self.up_call, self.rows[first:end], self.up_per_shard, shard, operands[:count], groups)
        activation = self.experts.activation(hidden)
        activation = activation.to(self.input_dtype) if activation.is_floating_point() else activation  # as a ring's input
        output = down.block_output(self.down_call, activation, self.down_per_shard, shard, operands[count:], groups)
        if self.output is None:
            total = self.rows.shape[0]
            self.hidden = hidden.new_zeros((total, hidden.shape[1]))
            self.output = output.new_zeros((total, output.shape[1]))
        self.hidden[first:end] = hidden
        self.output[first:end] = output


class _ExpertsFunction(torch.autograd.Function):
    """An experts call's rings: forward one ring (``_ExpertsForward``), backward the down projection's
    ring then the up projection's, each a sub-block ring's backward (``_sub_block._SubBlockBackward``),
    with the activation's backward between them. Inputs: the experts, the two rings' ``_Call`` and
    sizes, the routed rows, then per ring its per-shard parameters and its parameters' local shards."""

    @staticmethod
    def forward(ctx, experts: "ExpertRing", calls: tuple, rows: torch.Tensor, *tensors):
        forward = _ExpertsForward(experts, calls, rows, tensors)
        # Under a ring checkpoint region the recomputation takes the kept output and hidden rows.
        output, hidden = kept_or_run(forward.layer, forward.rotate)
        ctx.experts, ctx.calls = experts, calls
        ctx.dtype, ctx.input_dtype = forward.dtype, forward.input_dtype
        ctx.autocast = autocast_dtype(forward.ring.device.type)  # the activation's backward runs under it too
        ctx.save_for_backward(rows, hidden, *tensors)
        return output

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        experts, (up_call, down_call, (up_parts, up_count, _)) = ctx.experts, ctx.calls
        rows, hidden, *tensors = ctx.saved_tensors
        needs_rows, needs = ctx.needs_input_grad[2], ctx.needs_input_grad[3:]
        split = up_parts + up_count
        up_tensors, down_tensors, up_needs, down_needs = tensors[:split], tensors[split:], needs[:split], needs[split:]
        wants_up = needs_rows or any(up_needs)
        # The activation again, from the kept up-projection output, for its backward between the two rings.
        hidden = hidden.detach().requires_grad_(wants_up)
        autocast = torch.autocast(hidden.device.type, dtype=ctx.autocast, enabled=ctx.autocast is not None)
        with torch.enable_grad(), autocast:
            activation = experts.activation(hidden)
        down = _SubBlockBackward(
            down_call, (activation.detach(), *down_tensors), (wants_up, *down_needs), ctx.dtype, ctx.input_dtype, None, ctx.autocast, grad_output
        )
        grad_activation, *down_parts_grads = down.run()
        del down  # its ring's memory and the activation's, before the up projection's ring
        grad_rows, up_parts_grads = None, [None] * up_parts
        if wants_up:
            if grad_activation is None:
                grad_activation = torch.zeros_like(activation)
            (grad_hidden,) = torch.autograd.grad(activation, hidden, grad_activation)
            del activation, grad_activation, hidden
            up = _SubBlockBackward(up_call, (rows, *up_tensors), (needs_rows, *up_needs), ctx.dtype, ctx.input_dtype, None, ctx.autocast, grad_hidden)
            del grad_hidden  # the up ring holds it, as its output's gradient
            grad_rows, *up_parts_grads = up.run()
        # The parameters' gradients went to their leaves (``_SubBlockBackward._deliver``): None here.
        return (None, None, grad_rows, *up_parts_grads, *[None] * up_count, *down_parts_grads, *[None] * (len(down_tensors) - len(down_parts_grads)))


class RingExperts:
    """Mixed into an experts module (by class swap): its forward runs on its rings."""

    _rsdp_sub_block: ExpertRing

    @torch.compiler.disable
    def forward(self, *args, **kwargs):
        return self._rsdp_sub_block.forward(args, kwargs)


class ExpertsBlock(ExpertRing):
    """A Hugging Face experts module on its rings: computed as Hugging Face's ``grouped_mm``
    implementation computes it (see the module's pitfalls)."""

    def __init__(self, module: nn.Module, name: str):
        self.stored_transposed = module.is_transposed
        super().__init__(module, name, module.num_experts, *self.ring_parameters(module))

    @staticmethod
    def ring_parameters(module: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The parameters of the up projection's ring and of the down projection's (the planner's too)."""
        up = "gate_up_proj" if module.has_gate else "up_proj"
        if module.has_bias:
            return (up, f"{up}_bias"), ("down_proj", "down_proj_bias")
        return (up,), ("down_proj",)

    @staticmethod
    def dropped_activation_bytes(module: nn.Module, args: tuple) -> int:
        """What the stock experts keep from forward to backward and the rings do not (the planner's): the
        activation's output and saved product, two ``[routed rows, inner]`` (SwiGLU's)."""
        inner = module.down_proj.shape[1 if module.is_transposed else 2]
        return 2 * args[1].numel() * inner * module.down_proj.element_size()

    def call_arguments(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        """A call's ``(hidden_states, top_k_index, top_k_weights)``, whatever the experts' forward names
        them (gpt-oss: ``router_indices``, ``routing_weights``); checked before the rings start, so that
        every rank refuses at the same point."""
        implementation = getattr(self.module.config, "_experts_implementation", None)
        if implementation not in _HF_IMPLEMENTATIONS:
            raise ValueError(
                f"rsdp: experts {self.name!r} run with experts implementation {implementation!r}; an expert ring "
                f"computes what {[*_HF_IMPLEMENTATIONS[:-1]]} compute only. Load the model with "
                "experts_implementation='grouped_mm' (or call set_experts_implementation('grouped_mm'))."
            )
        values = self.bound_arguments(args, kwargs)
        if len(values) != 3 or not all(isinstance(value, torch.Tensor) for value in values):
            raise ValueError(
                f"rsdp: experts {self.name!r} must be called with (hidden_states, top_k_index, top_k_weights) "
                f"tensors, as Hugging Face's MoE blocks call them; got {[type(v).__name__ for v in values]}."
            )
        return values

    def routed(self, hidden_states: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> tuple:
        """Each token-expert pair's row, sorted by expert, each expert's count, and what ``combine``
        needs: the order, the pairs' routing weights, the tokens' dtype."""
        top_k = index.shape[-1]
        experts = index.reshape(-1)
        order = torch.argsort(experts, stable=True)
        counts = torch.bincount(experts, minlength=self.experts)
        return hidden_states[order // top_k], counts, (order, weights.reshape(-1)[order], top_k, hidden_states.dtype)

    def _product(self, rows: torch.Tensor, operands: list[torch.Tensor], groups: Groups) -> torch.Tensor:
        """One projection of the block's rows: Hugging Face's grouped linear (input in the weight's dtype,
        each row's expert's bias added)."""
        weight = operands[0]
        output = expert_product(rows, weight, groups, weight.dtype)
        return output + operands[1][groups.expert_of_rows] if len(operands) > 1 else output

    first_product = second_product = _product

    def activation(self, hidden: torch.Tensor) -> torch.Tensor:
        module = self.module
        return module._apply_gate(hidden) if module.has_gate else module.act_fn(hidden)

    def combine(self, output: torch.Tensor, restore: tuple) -> torch.Tensor:
        """Each pair's output weighted by the router, summed per token."""
        order, weights, top_k, dtype = restore
        weighted = output * weights.unsqueeze(-1)
        unsorted = torch.empty_like(order)
        unsorted[order] = torch.arange(order.shape[0], device=order.device)
        return weighted[unsorted].view(-1, top_k, weighted.shape[-1]).sum(dim=1).to(dtype)
