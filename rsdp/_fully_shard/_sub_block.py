"""A whole attention or MLP sub-block as one ring, from a plan in tensor parallelism's vocabulary; the
same ring's backward runs each of a MoE layer's backward expert rings in blocks of whole experts
(``_experts.py``: a projection of experts supplies its step through the interface ``SubBlock`` marks).

Megatron and RTP pair the Linears of a sub-block: q/k/v (or gate/up) split by output rows, "colwise",
and o (or down) split by input columns, "rowwise". Shard s of the pair — the rows of q/k/v of some
heads and the columns of o that read those heads — computes a *partial output* of the sub-block on the
rank's own batch, and the W partial outputs sum to the full output (the "partials accumulate into the
full result" of RSDP). So the sub-block's shards travel as one message and the block costs one ring per
pass instead of one per Linear: a Llama block needs 2.

``rsdp_shard(block, ring_plan={...})`` takes the plan as torchtitan's ``ColwiseParallel`` /
``RowwiseParallel`` per submodule name, or Hugging Face's ``"colwise"`` / ``"rowwise"`` strings
(``base_model_tp_plan``, as a model ships it: every string Hugging Face uses has a meaning here, listed
at ``_COLWISE``); names may be given from any ancestor (``layers.*.self_attn.q_proj`` matches
``self_attn.q_proj`` of a block). Each rowwise Linear is paired with the colwise Linears that are its
siblings; their parent module is the sub-block. Parameters inside it that the plan names
``"replicated_with_grad_allreduce"`` (Qwen3's and Gemma3's per-head ``q_norm``/``k_norm``) are used whole at
every step, as on every tensor-parallel rank, and their gradient is summed over the steps: they go to
the ring function as inputs, and each step installs its own leaf of them. The rowwise weight is stored as a ``Shard(1)`` DTensor
(its columns), the colwise ones as ``Shard(0)``; the rowwise bias is gathered and added once.

A planned Linear may be peft's LoRA Linear (``lora.Linear``): its base layer is the Linear that
rotates, and its adapters (``lora_A``/``lora_B``, small) are gathered whole and go to the ring function
like the per-head norms, but each step installs only the part its shard needs (``_lora_base``): a
colwise shard, rows ``r0:r1`` of the output, takes rows ``r0:r1`` of ``lora_B`` (``lora_A`` whole); a
rowwise shard, input columns ``c0:c1``, takes columns ``c0:c1`` of ``lora_A`` (``lora_B`` whole), so its
``B A x`` is a partial output summed over the steps like the base's. peft's own forward runs around the
base's product, so scaling, the active adapters and ``disable_adapter()`` are peft's; the partial output
is the LoRA Linear's (``SubBlock.row_output``). Each adapter's gradient is the sum over the steps of
gradients that are zero outside its shard's rows or columns.

- **Forward**: W steps; at step k the sub-block's own forward runs on the shards held (installed as
  plain tensors in its Linears) while the next shards travel, and its output is added to the total.
- **Backward**: the weights rotate again. At each step the rank backpropagates through the sub-block
  for the shards held, adding the input gradient to its own and the weight gradient to the partial of
  that shard. A shard's gradient needs that shard's weights (it flows back through the rowwise weight),
  so a partial starts one rank below its owner and collects W-1 ranks' contributions in W-1 exchanges
  (the first carries the weights only, so on W >= 4 ranks it rides the last exchange of the backward
  ring before, once the order of rings is known: ``_prefetch.py``), ending one hop from the owner.
  That last hop, the partial alone, is deferred (``_ring.DeferredHop``): it rides an early exchange of
  the next ring (the previous sub-block's, the Embedding's), or goes alone at the end of the backward.
  The owner adds its own contribution, computed from its local shard at step 0, when its partial
  arrives, and hands the gradient to the parameters itself (the function has returned by then). So a
  backward costs W-1 exchanges of its own (W-2 prefetched), the ZeRO-3 bytes. A ring of experts
  computes its weight gradients without weights (``SubBlock.weight_gradients``), so its partials travel
  as a Linear's instead, owner's neighbour to owner in the W-1 exchanges, with no last hop; and its
  inputs' gradients itself (``SubBlock.input_gradients``), so it keeps no step's graph.
- **On a ring of groups** (``ring_group_size`` g > 1, ``_ring.py``) a step's shard is a group's block (g
  ranks' heads and hidden units, ``Ring.layout``; LoRA parts and KV cache heads alike), and the partials
  follow the weights: the group all-gathers each block as it arrives, each rank backpropagates through
  it, and one reduce-scatter sums the group's contributions with the piece that came into the piece
  that travels on (``Ring.circulate``'s ``own``); step 0's contributions to the rank's own group's
  block are summed into its own, and the deferred hop goes to the rank at its place in the previous
  group.
- **What the forward keeps** (``_ShardGraphs``): each step's autograd graph, as a stock sub-block keeps
  its activations, so the backward runs no forward again. Where the partial output is the rowwise
  Linear's own (no LoRA adapter), autocast is off and the weights compute in full precision (a bf16
  policy's input gradients, summed in place in bf16, would round further than autograd's), the graph
  covers only what lies between the Linears (``_ExplicitStep``): the backward computes the Linears' gradients by their formulas, each
  weight's straight into its partial (no gradient of autograd's copied), the input's summed over the
  products and steps, from the weights the backward ring holds (cached views in the orientation each
  product reads). Otherwise the graphs save the weights, which lie in a ring buffer the next ring
  overwrites: each step's weights are leaf tensors of their own over that buffer, which the Linears'
  products hand to ``mm`` as they are, and the backward points them at the buffer that holds that
  shard then (so does an explicit step for a colwise Linear whose input is not one of the call's
  tensors: autograd backpropagates its input gradient). Under activation checkpointing (or any other
  ``saved_tensors_hooks``) the forward keeps only the inputs and the backward recomputes each step
  through autograd, as it does when a graph was already used (a second backward through a retained
  graph).

Pitfalls:
- The sub-block must return its rowwise Linear's output (or a tuple of it and Nones, as Hugging Face's
  attention does), called once per forward (an explicit step adds its product into the output as it
  runs: ``_Total``); every step runs the same code on fewer heads, so its forward must not hard-code
  the head count (read it from the shapes, as tensor parallelism already requires: ``view(..., -1, hd)``).
- Features of the colwise outputs and the rowwise input must divide by the shard group size W, and the
  heads (and kv heads) too, as with tensor parallelism; nothing random may run inside (dropout).
- The sub-block may hold no parameters besides its plan's Linears (with their LoRA adapters) and its
  per-shard vectors, and no other Linears. What a shard cannot compute alone is refused: DoRA and peft's
  other LoRA variants (their forward reads the whole base weight), a rowwise adapter's bias (added once
  per step), adapters merged into the base weight, LoRA dropout (as all dropout). The adapters are
  gathered with the module's norms, so they must share their dtype (``_api._check_one_dtype``). A norm
  over all heads (OLMo2's full-width ``q_norm``) cannot act on a shard of heads: Hugging Face's plans gather such a projection's output instead (``colwise_gather_output``), which
  leaves its Linears out of any sub-block. Every refusal names the plan entries to drop.
- Its arguments are tensors, plain values (functions, flex attention's BlockMask), and at most one
  key/value cache: Hugging Face's attention updates its cache inside, so each shard's run gets a view
  of that shard's heads and the cache is updated once per call (``_sub_block_cache.py``); any other
  object is refused, as W runs would see it.
- A kept graph needs its step's partial output only for its shape, so once added to the total its
  memory is freed: a forward hook on the rowwise Linear that keeps its output keeps a tensor without
  data.
- During a step a planned Linear computes ``linear`` as ATen does (``mm``, or ``addmm`` with a bias, of
  the flattened input and the transposed weight), so its results are the stock Linear's; the shard's
  weights exist only inside those calls, which is what lets a kept graph have them re-pointed.
"""

import fnmatch
import functools
import math

import torch
import torch.nn as nn
from torch.autograd.function import once_differentiable

from .._compat import (
    ColwiseParallel,
    RowwiseParallel,
    autocast_dtype,
    gradients_of,
    saved_tensors_hooks_active,
    tree_flatten,
    tree_unflatten,
)
from ._checkpoint import kept_or_run
from ._ring_function import RingLayer, autocast_like, finished_gradients, local_shard, sharded
from ._param import owners_layout
from ._wire import Message, Segment, segment
from ._ring import Phase, Ring
from ._sub_block_cache import SubBlockCache, shard_cache_arguments

# Hugging Face's plan strings (``transformers.distributed.tensor_parallel``), as a ring plan reads them.
# A colwise Linear and its rowwise sibling form a sub-block.
_COLWISE = ("colwise", "local_colwise")
_ROWWISE = ("rowwise", "local_rowwise")
# A parameter replicated on every tensor-parallel rank whose gradient there is partial: a norm between a
# colwise and a rowwise Linear that acts on each rank's own heads (Qwen3's per-head ``q_norm``). Inside a
# sub-block it is used whole at every ring step, and its gradient is the sum over the steps.
_PER_SHARD = ("replicated_with_grad_allreduce",)
# Every other string leaves its module to rsdp's own sharding, which is exact for each: a Linear whose
# input or output is whole ("colwise_gather_output", "colwise_rep", "rowwise_split_input",
# "rowwise_rep") rotates alone, an Embedding ("embedding_rowwise") on its own ring, experts
# ("moe_tp_experts"; the "packed_colwise" and "rowwise" beside it name their parameters, no module) on an
# expert ring (``_experts.py``), and what only reshapes or reduces activations
# under tensor parallelism ("sequence_parallel", "all_reduce", "local_params", "replicate",
# "mla_kv_a_proj", "moe_identity_expert") has nothing to do here. Inside a sub-block, those modules'
# parameters make it refused (below), naming the entries to drop.


def _style(style) -> str | None:
    """"colwise", "rowwise", "per_shard", or None (left to rsdp's own sharding) for a plan's value."""
    if isinstance(style, str):
        return "colwise" if style in _COLWISE else "rowwise" if style in _ROWWISE else "per_shard" if style in _PER_SHARD else None
    if ColwiseParallel is not None and isinstance(style, ColwiseParallel):
        return "colwise"
    if RowwiseParallel is not None and isinstance(style, RowwiseParallel):
        return "rowwise"
    return None


def _matches(name: str, key: str) -> bool:
    """``key`` (a plan key, possibly from an ancestor: ``layers.*.attn.q``) names submodule ``name``."""
    parts, key_parts = name.split("."), key.split(".")
    if not name or len(key_parts) < len(parts):
        return False
    return all(fnmatch.fnmatchcase(part, pattern) for part, pattern in zip(parts, key_parts[-len(parts) :]))


class SubBlock:
    """One planned sub-block: its module, colwise Linears, rowwise Linear, and its ring."""

    def __init__(
        self, module: nn.Module, name: str, columns: list[nn.Linear], row: nn.Linear, per_shard: list[tuple[nn.Module, str, object]],
        adapter_linears: list[nn.Linear], advice: str, row_output: nn.Module,
    ):
        self.module, self.name, self.columns, self.row = module, name, columns, row
        # The module whose output is the partial output: the rowwise Linear, or peft's LoRA Linear around
        # it (base plus adapter), with its own forward.
        self.row_output = row_output
        self.row_output_forward = None if row_output is row else functools.partial(type(row_output).forward, row_output)
        self.advice = advice  # which ring_plan entries to drop, for a refusal at its first call
        # (module, parameter name) of each parameter used whole at every step (a per-head norm's weight, a
        # LoRA adapter's): handed to the ring function as an input, so that its gradient, summed over the
        # steps, reaches it.
        self.per_shard = [(owner, name) for owner, name, _ in per_shard]
        # Per per-shard parameter: how a step takes the part the shard held needs (a LoRA adapter's rows or
        # columns, ``_lora_base``), or None: all of it.
        self.shard_parts = [part for _, _, part in per_shard]
        # The LoRA adapters' Linears (``lora_A``/``lora_B``): their weights are gathered whole, not rotated.
        self.adapter_linears = adapter_linears
        self.forward = type(module).forward  # the original forward, run once per shard
        self.ring: RingLayer | None = None
        # (Linear, attribute) of each parameter the ring function takes, in its order; a column
        # without a bias still has its slot (None there).
        self.param_slots = [(column, name) for column in columns for name in ("weight", "bias")] + [(row, "weight")]
        # Read at every ring step; a Linear's ``bias`` goes through nn.Module.__getattr__.
        self.column_has_bias = [column.bias is not None for column in columns]
        # Per segment of a message: whether its step operand is the view transposed (a colwise weight).
        self.transposed = tuple(t for has_bias in self.column_has_bias for t in ((True, False) if has_bias else (True,))) + (False,)
        # Per parameter slot: whether a message carries it transposed (the rowwise weight, as its columns).
        self.param_transposed = (False,) * (len(self.param_slots) - 1) + (True,)
        # Per segment: whether its view as its Linear holds it (``[out, in]``: what an input gradient's
        # product reads) is the view transposed (the rowwise weight's).
        self.as_held = tuple(False for has_bias in self.column_has_bias for _ in range(1 + has_bias)) + (True,)
        # Per Linear, columns then row: where its weight and its bias (or None) are among a step's operands.
        self.operand_at, at = [], 0
        for has_bias in self.column_has_bias:
            self.operand_at.append((at, at + 1 if has_bias else None))
            at += 1 + has_bias
        self.operand_at.append((at, None))
        # Whether a kept step's Linears are backpropagated by ``_ExplicitStep``'s formulas rather than by
        # autograd: where the partial output is the rowwise Linear's own (no LoRA adapter around it).
        self.explicit_linears = not adapter_linears and row_output is row
        self._segments: dict[tuple[torch.dtype, int, int], tuple[Segment, ...]] = {}

    keeps_graphs = True  # each forward step's graph is kept for the backward (``_ShardGraphs``)

    # The interface the ring below drives, which an experts block (``_experts.py``) also provides.
    # ``weight_gradients(call, rows, dy, shard, params, into, add)``: a block whose parameter gradients
    # need no weights computes them itself (an experts block's: ``_experts.ExpertStage``), so its partials
    # travel as a Linear's (``_SubBlockBackward.synchronised``); None: autograd computes them through the
    # step, which needs the shard's weights (a sub-block's flow back through its rowwise weight).
    weight_gradients = None
    # ``input_gradients(call, dy, shard, operands, into)``: a block that computes its inputs' gradients
    # itself from the weights held (an experts block's), added into ``into``; None: autograd, through the
    # step's kept graph or its recomputation.
    input_gradients = None

    def call_arguments(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return args, kwargs

    def run_step(
        self, call: "_Call", arguments: "_Arguments", shard: int, operands: list[torch.Tensor], record: "_ExplicitStep | None" = None
    ) -> tuple:
        """The sub-block's forward for ``shard`` with its parameters ``operands`` installed (as plain
        tensors in its Linears); returns (its output, the rowwise Linear's output or None). With
        ``record``, its Linears' products are kept there for their explicit backward."""
        if call.cache is not None:
            call.cache.shard = shard
        linears = self.columns + [self.row]
        # Each Linear's forward becomes its product with the shard's parameters, as an instance
        # attribute, which ``nn.Module.__call__`` finds before the class's (hooks still run around it).
        # Set through __dict__: nn.Module.__setattr__ checks parameters, buffers and submodules first,
        # which would cost a small sub-block step much of its host time; and not through the ring
        # Linear's own forward, whose compiler-disable wrapper adds Python calls to each.
        produced = []
        for index, (linear, (weight_t, bias)) in enumerate(zip(linears, _shard_params(self, operands))):
            outputs = produced if linear is self.row_output else None
            if record is None:
                product = functools.partial(_shard_product, weight_t, bias, arguments, outputs)
            else:
                product = functools.partial(_explicit_product, record, self.operand_at[index], weight_t, bias, arguments, outputs)
            linear.__dict__["forward"] = product
        if self.row_output_forward is not None:  # a LoRA rowwise Linear: its output, adapters included
            self.row_output.__dict__["forward"] = functools.partial(_kept_output, self.row_output_forward, produced)
        try:
            output = self.forward(self.module, *arguments.args, **arguments.kwargs)
        finally:
            for linear in linears:
                del linear.__dict__["forward"]
            self.row_output.__dict__.pop("forward", None)
        return output, produced[-1] if produced else None

    def finish(self, total: torch.Tensor) -> torch.Tensor:
        """The summed partial outputs plus the rowwise bias, gathered, added once."""
        return total if self.row.bias is None else total + autocast_like(self.row.bias, total)

    def segments(self, dtype: torch.dtype, ring: Ring) -> tuple[Segment, ...]:
        """The sub-block's weight segments in a message of ``ring`` (laid out over its owners: ranks, or
        groups, whose block is their ranks' shards): each colwise weight (and bias), then the rowwise
        weight, transposed (its columns as rows: ``[in shard, out]``)."""
        key = (dtype, ring.owners, ring.group_size)
        if key not in self._segments:
            segments = []
            for column, has_bias in zip(self.columns, self.column_has_bias):
                layout = ring.layout(column.out_features)
                segments.append(segment(layout, torch.Size([column.in_features]), dtype))
                if has_bias:
                    segments.append(segment(layout, torch.Size(), dtype))
            segments.append(segment(ring.layout(self.row.in_features), torch.Size([self.row.out_features]), dtype))
            self._segments[key] = tuple(segments)
        return self._segments[key]


def plan_sub_blocks(root: nn.Module, ring_plan: dict, world: int, group: int = 1) -> list[SubBlock]:
    """The sub-blocks ``ring_plan`` describes inside ``root`` for a ring of ``world`` ranks in groups of
    ``group``; raises, naming the plan entries to drop, if one cannot rotate as a whole."""
    styles = {}  # submodule name -> (kind, module, the plan key that named it)
    for name, module in root.named_modules():
        for key, style in ring_plan.items():
            kind = _style(style)
            if kind is not None and _matches(name, key):
                styles[name] = (kind, module, key)
                break
    rows_by_parent: dict[str, list[str]] = {}
    for name, (kind, _, _) in styles.items():
        if kind == "rowwise":
            rows_by_parent.setdefault(name.rpartition(".")[0], []).append(name)
    return [_sub_block(root, parent_name, rows, styles, world, group) for parent_name, rows in rows_by_parent.items()]


def _sub_block(root: nn.Module, parent_name: str, rows: list[str], styles: dict, world: int, group: int) -> SubBlock:
    """The sub-block ``parent_name`` with its rowwise Linears ``rows``, checked whole."""
    parent = root.get_submodule(parent_name)
    prefix = f"{parent_name}." if parent_name else ""
    inside = {name: value for name, value in styles.items() if name.startswith(prefix) and name != parent_name}
    column_names = [name for name, (kind, _, _) in inside.items() if kind == "colwise" and name.rpartition(".")[0] == parent_name]
    columns = [inside[name][1] for name in column_names]
    per_shard_modules = [module for kind, module, _ in inside.values() if kind == "per_shard"]
    drop = sorted({key for kind, _, key in inside.values() if kind is not None})
    where = f"ring_plan: sub-block {parent_name or type(root).__qualname__!r}"
    advice = f" Drop these ring_plan entries: {drop} (its Linears then rotate one ring each)."
    if len(rows) > 1:
        raise ValueError(f"{where} has {len(rows)} rowwise Linears ({rows}); a sub-block sums one Linear's partial outputs.{advice}")
    row = styles[rows[0]][1]
    if not columns:
        raise ValueError(f"{where} has a rowwise Linear {rows[0]!r} but no colwise sibling to pair it with.{advice}")
    adapters = []  # (module, parameter name, its part per shard) of every LoRA adapter on a planned Linear
    layout = functools.partial(owners_layout, world // group, group)  # the ring's (``Ring.layout``): a step's rows
    row_output, row = row, _lora_base(row, "rowwise", rows[0], layout, adapters, where, advice)
    columns = [_lora_base(column, "colwise", name, layout, adapters, where, advice) for column, name in zip(columns, column_names)]
    linears = [row, *columns]
    if any(type(linear) is not nn.Linear for linear in linears):
        found = [f"{type(m).__module__}.{type(m).__qualname__}" for m in linears]
        raise ValueError(
            f"{where}: planned modules must be plain nn.Linear or peft's LoRA Linear around one (found {found}).{advice}"
        )
    uneven = [n for n in [row.in_features] + [c.out_features for c in columns] if n % world]
    if uneven:
        raise ValueError(
            f"{where}: the colwise out_features and the rowwise in_features must divide by the {world} "
            f"ranks of the shard group, as with tensor parallelism; found {uneven}.{advice}"
        )
    planned = {id(p) for linear in linears for p in linear.parameters()}
    per_shard = [(module, name, None) for module in per_shard_modules for name, p in module.named_parameters(recurse=False) if id(p) not in planned]
    per_shard_ids = {id(getattr(module, name)) for module, name, _ in per_shard}
    adapter_ids = {id(getattr(module, name)) for module, name, _ in adapters}
    adapter_linears = [module for module, _, _ in adapters]
    others = [n for n, p in parent.named_parameters() if id(p) not in planned | per_shard_ids | adapter_ids]
    other_linears = [n for n, m in parent.named_modules() if isinstance(m, nn.Linear) and m not in linears and m not in adapter_linears]
    if others or other_linears:
        raise ValueError(
            f"{where} holds parameters or Linears besides its plan's ({others or other_linears}); its forward "
            "runs once per shard, so any other may only be a per-head norm named 'replicated_with_grad_allreduce'."
            f"{advice}"
        )
    matrices = [f"{prefix}{n}" for n, p in parent.named_parameters() if id(p) in per_shard_ids and p.dim() > 1]
    if matrices:
        raise ValueError(f"{where}: its 'replicated_with_grad_allreduce' parameters must be vectors (a norm's weight); found {matrices}.{advice}")
    # A vector as wide as a colwise output is a norm over all its heads (OLMo2's q_norm), which a shard of
    # heads cannot compute alone; a per-head one is a head wide. One shard is all heads.
    widths = {column.out_features for column in columns}
    full_width = [f"{prefix}{n}" for n, p in parent.named_parameters() if id(p) in per_shard_ids and p.dim() == 1 and world > 1 and p.numel() in widths]
    if full_width:
        raise ValueError(
            f"{where}: {full_width} span a colwise Linear's whole output (a norm over all heads), which a shard "
            "of heads cannot compute alone; gather those Linears' output instead ('colwise_gather_output', as "
            f"OLMo2's plan does).{advice}"
        )
    if any(isinstance(m, nn.Dropout) and m.p > 0 for m in parent.modules()):
        raise ValueError(f"{where} has dropout; a ring sub-block runs once per shard and must be deterministic.{advice}")
    return SubBlock(parent, parent_name, columns, row, per_shard + adapters, adapter_linears, advice, row_output)


def _lora_base(module: nn.Module, kind: str, name: str, layout, adapters: list, where: str, advice: str) -> nn.Module:
    """A planned module as the Linear that rotates: itself, or, for peft's LoRA Linear, its base layer,
    whose adapters are then added to ``adapters`` as per-shard parameters: used whole at every step but
    for the part the shard held needs. A colwise shard (rows ``r0:r1`` of the output) takes rows ``r0:r1``
    of ``lora_B`` (and of its bias), ``lora_A`` whole; a rowwise one (input columns ``c0:c1``) takes
    columns ``c0:c1`` of ``lora_A``, ``lora_B`` whole, so its ``B A x`` is a partial output summed over the
    steps like the base's. ``layout(rows)`` splits rows over the ring's owners (ranks, or groups on a ring
    of groups, whose step computes with a block of shards). Anything a shard cannot compute alone is
    refused, naming the fix."""
    base = getattr(module, "base_layer", None)
    if not (isinstance(base, nn.Linear) and isinstance(getattr(module, "lora_A", None), nn.ModuleDict)):
        return module
    variants = sorted({type(v).__name__ for v in getattr(module, "lora_variant", {}).values()})
    if variants or any(getattr(module, "use_dora", {}).values()):
        raise ValueError(
            f"{where}: {name!r} carries a LoRA variant ({variants or ['DoRA']}), whose forward reads the whole base "
            f"weight (DoRA's weight norm), which no ring step holds; use plain LoRA (LoraConfig(use_dora=False)).{advice}"
        )
    if module.merged:
        raise ValueError(f"{where}: {name!r} has merged adapters {module.merged_adapters}; unmerge them (unmerge_adapter()) before rsdp_shard.{advice}")
    if kind == "rowwise" and any(module.lora_bias.values()):
        raise ValueError(
            f"{where}: {name!r} is rowwise and its LoRA adapter has a bias (LoraConfig(lora_bias=True)), which a "
            f"partial output would add once per ring step; train without lora_bias.{advice}"
        )
    adapter_linears = [*module.lora_A.values(), *module.lora_B.values()]
    if any(type(linear) is not nn.Linear for linear in adapter_linears):
        found = sorted({type(linear).__qualname__ for linear in adapter_linears})
        raise ValueError(f"{where}: {name!r} has LoRA adapters that are not plain nn.Linear ({found}).{advice}")
    if kind == "colwise":
        sliced, part = list(module.lora_B.values()), functools.partial(_rows_of, layout(base.out_features))
    else:
        sliced, part = list(module.lora_A.values()), functools.partial(_columns_of, layout(base.in_features))
    adapters.extend(
        (linear, param_name, part if linear in sliced else None)
        for linear in adapter_linears
        for param_name, value in linear._parameters.items()
        if value is not None
    )
    return base


def _rows_of(layout, value: torch.Tensor, shard: int) -> torch.Tensor:
    """A colwise adapter's part for ``shard``: the rows of the output the shard computes."""
    return value[layout.row_slice(shard)]


def _columns_of(layout, value: torch.Tensor, shard: int) -> torch.Tensor:
    """A rowwise adapter's part for ``shard``: the columns of the input the shard reads."""
    return value[:, layout.row_slice(shard)]


class RingSubBlock:
    """Mixed into a planned sub-block module (by class swap): its forward runs as one ring."""

    _rsdp_sub_block: SubBlock

    @torch.compiler.disable
    def forward(self, *args, **kwargs):
        block = self._rsdp_sub_block
        leaves, spec = _flatten_arguments(*block.call_arguments(args, kwargs))
        params = [local_shard(getattr(linear, name), linear, name, block.ring) for linear, name in block.param_slots]
        cache = None
        if spec is not None:  # objects besides tensors: a cache is handed over per shard, others refused
            differentiable = torch.is_grad_enabled() and any(
                t.requires_grad for t in (*leaves, *params) if isinstance(t, torch.Tensor)
            )
            leaves, cache = shard_cache_arguments(block.name, leaves, block.ring.ring.owners, differentiable, block.advice)
        tensor_at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        call = _Call(block, leaves, spec, tensor_at, cache)
        # Decided here: inside the autograd Function's forward, grad mode is off.
        call.keeps_graphs = block.keeps_graphs and torch.is_grad_enabled() and not saved_tensors_hooks_active()
        per_shard = [module._parameters[name] for module, name in block.per_shard]  # as installed: gathered
        total = _RingSubBlockFunction.apply(call, *(leaves[i] for i in tensor_at), *per_shard, *params)
        return call.rebuild(block.finish(total))


class _Call:
    """One call of a sub-block: how to rebuild its arguments, and the shape of its output."""

    def __init__(self, block: SubBlock, leaves: list, spec, tensor_at: list[int], cache: SubBlockCache | None):
        self.block, self.leaves, self.spec, self.tensor_at = block, leaves, spec, tensor_at
        # The ring function's tensors: the call's, then the parameters the sub-block uses whole at each step.
        self.tensor_count = len(tensor_at) + len(block.per_shard)
        self.cache = cache  # the KV cache the call was given, handed to each shard's run as a view
        self.output_spec, self.output_position = None, None
        self.keeps_graphs = False

    def arguments(self, tensors: list[torch.Tensor]) -> "_Arguments":
        """The call's arguments with ``tensors`` for its tensors (then its per-shard parameters): made
        once for a ring's steps, which all take the same."""
        leaves = list(self.leaves)
        for index, tensor in zip(self.tensor_at, tensors):
            leaves[index] = tensor
        args, kwargs = (tuple(leaves), {}) if self.spec is None else tree_unflatten(leaves, self.spec)
        count = len(self.tensor_at)
        return _Arguments(args, kwargs, tensors[:count], tensors[count:])

    def cast(self, tensors, dtype: torch.dtype) -> list[torch.Tensor]:
        """The call's floating tensors in ``dtype`` (the inputs' compute dtype); its per-shard parameters
        stay as installed, as the stock sub-block reads them."""
        count = len(self.tensor_at)
        return [t.to(dtype) if i < count and t.is_floating_point() else t for i, t in enumerate(tensors)]

    def run(self, arguments: "_Arguments", shard: int, operands: list[torch.Tensor], record: "_ExplicitStep | None" = None) -> torch.Tensor:
        """The block's forward on ``arguments`` (as ``arguments()`` makes them) with shard ``shard``'s
        parameters ``operands`` installed; returns its partial output (a sub-block's rowwise Linear's).
        With ``record`` (a ``SubBlock`` with ``explicit_linears``), its products are kept there."""
        block = self.block
        installed = self.install(arguments.per_shard, shard) if block.per_shard else None
        try:
            if record is None:
                output, produced = block.run_step(self, arguments, shard, operands)
            else:
                output, produced = block.run_step(self, arguments, shard, operands, record)
        finally:
            if installed is not None:
                self.restore(installed)
        if output is produced and produced is not None:  # the usual output: the partial itself
            self.output_spec, self.output_position = None, 0
            return produced
        # A lone tensor needs no pytree.
        out_leaves, self.output_spec = ([output], None) if isinstance(output, torch.Tensor) else tree_flatten(output)
        positions = [i for i, leaf in enumerate(out_leaves) if leaf is produced]
        if len(positions) != 1 or any(leaf is not None for leaf in out_leaves if leaf is not produced):
            raise ValueError(
                f"rsdp ring_plan: sub-block {block.name!r} must return its rowwise Linear's output (or a tuple "
                "of it and Nones, as Hugging Face's sdpa attention does; eager attention returns its weights); its "
                f"partial outputs are summed.{block.advice}"
            )
        self.output_position = positions[0]
        return produced

    def install(self, per_shard: list[torch.Tensor], shard: int) -> list[torch.Tensor]:
        """The per-shard parameters as a step of ``shard`` takes them (``per_shard``: this ring's leaves of
        them, kept graphs' too, in the block's order; each its shard's part, ``shard_parts``), in place of
        the installed ones, which are returned for ``restore`` after the step."""
        block = self.block
        installed = [module._parameters[name] for module, name in block.per_shard]
        for (module, name), part, value in zip(block.per_shard, block.shard_parts, per_shard):
            module._parameters[name] = value if part is None else part(value, shard)
        return installed

    def restore(self, installed: list[torch.Tensor]) -> None:
        for (module, name), value in zip(self.block.per_shard, installed):
            module._parameters[name] = value

    def rebuild(self, total: torch.Tensor):
        """The sub-block's output structure with ``total`` where its rowwise output was (Nones elsewhere)."""
        if self.output_spec is None:
            return total
        out_leaves = [None] * self.output_spec.num_leaves
        out_leaves[self.output_position] = total
        return tree_unflatten(out_leaves, self.output_spec)


def _flatten_arguments(args: tuple, kwargs: dict) -> tuple[list, object]:
    """A call's arguments as (leaves, pytree spec); with tensors only and no keywords, the usual call of
    a sub-block, (the tensors, None), without torch's pytree, which costs host time at every call."""
    if not kwargs and all(isinstance(arg, torch.Tensor) for arg in args):
        return list(args), None
    return tree_flatten((args, kwargs))


class _Arguments:
    """A call's ``(args, kwargs)`` for the steps of one ring, and its tensors flattened as the planned
    Linears take them (``[tokens, features]``): once for every step and Linear that reads one (q, k and
    v read the block's input at each of the W steps), not once per product."""

    def __init__(self, args: tuple, kwargs: dict, tensors: list[torch.Tensor], per_shard: list[torch.Tensor]):
        self.args, self.kwargs, self.per_shard = args, kwargs, per_shard
        # id -> (tensor, its version when flattened, the flat view or None): the tensors are held, so
        # their ids stay theirs; a tensor changed in place since is flattened again.
        self._flat = {id(t): (t, -1, None) for t in tensors}
        self._tensors = tensors
        # id -> (index among the call's tensors, its version at the call); index -> (index, its flat view
        # outside autograd, its leading dimensions): made on first use (``call_tensor``: kept steps, never
        # of inference tensors).
        self._index: dict[int, tuple[int, int]] | None = None
        self._plain: dict[int, tuple[int, torch.Tensor, tuple]] = {}

    def flat(self, input: torch.Tensor) -> torch.Tensor:
        entry = self._flat.get(id(input))
        if entry is None or input.is_inference():  # an activation inside the block; no version counter
            return _flattened(input)
        _, version, flat = entry
        if version != input._version:
            flat = _flattened(input)
            self._flat[id(input)] = (input, input._version, flat)
        return flat

    def call_tensor(self, input: torch.Tensor) -> tuple[int, torch.Tensor, tuple] | None:
        """For one of the call's tensors, unchanged since the call: its index, its flat view detached (a
        product of it records no autograd node) and its leading dimensions (a product's output shape but
        the last), made once for every step and Linear; else None."""
        if self._index is None:
            self._index = {id(t): (i, t._version) for i, t in enumerate(self._tensors)}
        index, version = self._index.get(id(input), (None, None))
        if index is None or input._version != version:
            return None
        found = self._plain.get(index)
        if found is None:
            found = self._plain[index] = (index, self.flat(input).detach(), tuple(input.shape[:-1]))
        return found


def _flattened(input: torch.Tensor) -> torch.Tensor:
    """``input`` as ``[tokens, features]``: ``-1`` for the tokens (the product of the leading dimensions
    costs host time at every product), but where there are no features, which ``-1`` cannot infer."""
    features = input.shape[-1]
    return input.reshape(-1, features) if features else input.reshape(math.prod(input.shape[:-1]), 0)


def _shard_product(
    weight_t: torch.Tensor, bias: torch.Tensor | None, arguments: _Arguments, outputs: list | None, input: torch.Tensor
) -> torch.Tensor:
    """A planned Linear's forward during a ring step: ``linear(input, weight, bias)`` with one shard's
    parameters, computed as ATen's ``linear`` computes it (``mm``, or ``addmm`` with a bias, of the
    flattened input and the transposed weight), but with the transposed weight given: ``weight_t`` is
    then the very tensor autograd saves (see ``_ShardGraphs``). The rowwise Linear's output is also
    kept in ``outputs``: it is the partial output."""
    flat = arguments.flat(input)
    output = torch.mm(flat, weight_t) if bias is None else torch.addmm(bias, flat, weight_t)
    output = output.view(*input.shape[:-1], weight_t.shape[1])
    if outputs is not None:
        outputs.append(output)
    return output


class _ExplicitStep:
    """What a kept step holds for the explicit backward of its Linears (``SubBlock.explicit_linears``).

    Autograd's graph of the step covers only what lies between the Linears (attention, activations,
    per-head norms): from the colwise outputs, which are its leaves, to the rowwise input, its output,
    both as the sub-block sees them (not their flat ``[tokens, features]`` views, which would add a
    node at each end that every step's forward and backward run).
    The backward computes the Linears' gradients by their formulas: each weight's straight into its
    partial (``mm``/``addmm_`` with the partial as output, no gradient copied), the input's summed over
    the products and steps into one tensor, from the weights the backward ring holds in the orientation
    each product needs (cached views, no transpose per step). Nothing of the forward's ring buffer is
    saved, so nothing is re-pointed, but for a colwise Linear whose input is not one of the call's
    tensors (a norm inside the sub-block before it): its input gradient goes through autograd, whose node
    saves the weight as a leaf of its own, re-pointed like ``_ShardGraphs``' (``_weight_leaves``).
    """

    __slots__ = ("needs", "columns", "row_input", "row_flat", "total")

    def __init__(self, needs: list[bool], total: "_Total"):
        self.needs = needs  # per operand of the step: whether its gradient is wanted
        self.total = total  # the call's sum of partial outputs, which the rowwise product adds to
        # Per colwise product: (where its weight and bias are among the operands, the call tensor's index
        # or None, its output as returned (a leaf of the graph, where one of the call's tensors is its
        # input), its flat input, the weight leaf autograd saved or None).
        self.columns: list[tuple] = []
        self.row_input: torch.Tensor | None = None  # the rowwise Linear's input: the graph's output
        self.row_flat: torch.Tensor | None = None  # it flat and detached: the product's left factor


class _Total:
    """The sum of a call's partial outputs, which each explicit step's rowwise product adds to in place
    (one ``addmm_``; the first writes it: ``mm`` with it as output). Its own memory, not a view, as the
    ring function's output must be; the sub-block's forward gets it as its rowwise Linear's output."""

    __slots__ = ("sum", "flat")

    def __init__(self):
        self.sum: torch.Tensor | None = None
        self.flat: torch.Tensor | None = None  # ``sum`` as the products write it: [tokens, features]

    def add_product(self, flat: torch.Tensor, weight_t: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
        """Add ``flat @ weight_t`` (``flat``: ``input`` flattened) to the sum, shaped as ``input``'s product."""
        if self.sum is None:
            self.sum = torch.empty(*input.shape[:-1], weight_t.shape[1], dtype=flat.dtype, device=flat.device)
            self.flat = self.sum.view(flat.shape[0], weight_t.shape[1])
            torch.mm(flat, weight_t, out=self.flat)
        else:
            self.flat.addmm_(flat, weight_t)
        return self.sum

    def release(self) -> None:
        self.sum = self.flat = None


def _explicit_product(
    record: _ExplicitStep, at: tuple[int, int | None], weight_t: torch.Tensor, bias: torch.Tensor | None,
    arguments: _Arguments, outputs: list | None, input: torch.Tensor,
) -> torch.Tensor:
    """A planned Linear's forward during a kept step with an explicit backward (``_ExplicitStep``): the
    product as ``_shard_product`` computes it, kept in ``record`` (``at``: where its weight and bias are
    among the step's operands). The rowwise output (the partial) is computed outside autograd; a
    colwise product of one of the call's tensors reads its detached flat view, and its output becomes a
    leaf of the step's graph where a gradient is wanted of it."""
    if outputs is not None:  # the rowwise Linear (its bias is added once, to the total)
        if record.row_input is not None:  # each product is added to the total: a second would be too
            raise ValueError(
                "rsdp ring_plan: a planned sub-block calls its rowwise Linear more than once in one forward; its "
                "output must be that Linear's one output, the partial summed over the ring. Drop the sub-block's "
                "entries from ring_plan (its Linears then rotate one ring each)."
            )
        record.row_input = input
        # Flattened detached (cheaper than under no_grad): no node of the graph.
        flat = record.row_flat = _flattened(input.detach())
        output = record.total.add_product(flat, weight_t, input)
        outputs.append(output)
        return output
    weight_at, bias_at = at
    wanted = record.needs[weight_at] or (bias_at is not None and record.needs[bias_at])
    found = arguments.call_tensor(input)
    if found is None:  # its input gradient goes through autograd, which saves the weight
        tensor_index, flat, weight_t = None, arguments.flat(input), weight_t.data
        leading, leaf = input.shape[:-1], weight_t
    else:
        (tensor_index, flat, leading), leaf = found, None
        wanted = wanted or input.requires_grad
    output = torch.mm(flat, weight_t) if bias is None else torch.addmm(bias, flat, weight_t)
    # Shapes go to ``view`` as ints: a tuple (a torch.Size more so) costs more host time than the view
    # itself, in torch's argument parsing.
    output = output.view(*leading, weight_t.shape[1])
    if wanted and not output.requires_grad:  # the view made a leaf: its gradient comes as it is shaped
        output.requires_grad_()
    record.columns.append((at, tensor_index, output, flat, leaf))
    return output


def _kept_output(forward, outputs: list, *args, **kwargs) -> torch.Tensor:
    """A LoRA-wrapped rowwise Linear's forward during a ring step, its output (the partial) kept in ``outputs``."""
    output = forward(*args, **kwargs)
    outputs.append(output)
    return output


def _packed(block, params) -> list[torch.Tensor]:
    """The block's parameters (local shards) as a message lays them out: present ones, the rowwise
    weight transposed (``param_transposed``)."""
    return [p.t() if transposed else p for p, transposed in zip(params, block.param_transposed) if p is not None]


def _weight_leaves(operands: list[torch.Tensor], needs: list[bool]) -> list[torch.Tensor]:
    """Gradient leaves of one shard's parameters (``operands``: views of a ring buffer, as the step's
    products use them), requiring grad where ``needs`` says: each a tensor of its own over the ring
    buffer's memory, not a view of it. A view shares the buffer's version counter, which every later
    message written into the buffer bumps, and autograd checks the version of what it saved; ``.data``
    makes such a tensor (a new version counter) with no op dispatched."""
    return [operand.data.requires_grad_(need) for operand, need in zip(operands, needs)]


def _shard_params(block: SubBlock, operands: list[torch.Tensor]) -> list[tuple]:
    """(transposed weight, bias) per Linear, columns then row, from one step's operands (views, or
    ``_weight_leaves``)."""
    operands = iter(operands)
    params = [(next(operands), next(operands) if has_bias else None) for has_bias in block.column_has_bias]
    params.append((next(operands), None))
    return params


class _ShardGraphs:
    """The autograd graph of each forward step of one sub-block call, kept for its backward.

    A step's graph starts from leaves: the call's inputs (shared by every step) and the shard's
    parameters (``_weight_leaves``), which alias the forward's ring buffer. Those leaves are the only
    way a step reaches ring-buffer memory, and the products hand them to ``mm``/``addmm`` as they are,
    so where autograd saves a weight it saves the leaf itself. When the step is backpropagated, each
    leaf is pointed (``.data``) at the same segment of the buffer that holds that shard in the backward
    ring, whatever the forward's buffer holds by then; its version counter is its own and stays. No
    saved-tensor hook runs: the sub-block's activations are saved as autograd saves them.
    """

    def __init__(self, call: _Call, inputs: list[torch.Tensor], needs_params: list[bool], explicit: bool):
        """``explicit``: the steps' Linears are backpropagated by their formulas (``_ExplicitStep``)."""
        self.call, self.inputs, self.needs_params, self.explicit = call, inputs, needs_params, explicit
        self.total = _Total() if explicit else None  # the explicit steps' partial outputs, summed
        self.arguments = call.arguments(inputs)
        self._graphs: dict[int, tuple | _ExplicitStep] = {}  # shard -> (partial output, leaves), or its record

    def forward(self, shard: int, operands: list[torch.Tensor]) -> torch.Tensor:
        """Run the sub-block on shard ``shard``'s weight ``operands`` (views of a ring buffer, colwise
        weights transposed: ``SubBlock.transposed``), keeping its graph; returns its partial output,
        whose memory the caller frees once it has added it (``release_output``), unless ``explicit``
        (then no graph holds it)."""
        with torch.enable_grad():
            if self.explicit:
                record = self._graphs[shard] = _ExplicitStep(self.needs_params, self.total)
                return self.call.run(self.arguments, shard, operands, record)
            leaves = _weight_leaves(operands, self.needs_params)
            partial = self.call.run(self.arguments, shard, leaves)
        self._graphs[shard] = (partial, leaves)
        return partial

    def take(self, shard: int) -> _ExplicitStep | None:
        """The record of an explicit step of ``shard``; None once taken (a second backward recomputes)."""
        return self._graphs.pop(shard, None)

    def release_output(self, shard: int) -> None:
        """Free a step's partial output: its graph reads only its shape. Its producer (the rowwise
        Linear's ``mm``) saves no output, and a node that saved it consumed it, so comes after it and
        does not run in its backward."""
        self._graphs[shard][0].untyped_storage().resize_(0)

    def backward(self, shard: int, operands: list[torch.Tensor], dy: torch.Tensor, needs_inputs: list[bool], grad_slots: list[int]):
        """Gradients of the needed inputs, then of the weights ``grad_slots``, from the kept graph of
        ``shard`` with its weights read from ``operands``; None when there is none (then recompute)."""
        kept = self._graphs.pop(shard, None)
        if kept is None:
            return None
        partial, leaves = kept
        for leaf, operand in zip(leaves, operands):
            leaf.data = operand
        wanted = [x for x, need in zip(self.inputs, needs_inputs) if need] + [leaves[slot] for slot in grad_slots]
        return gradients_of(partial, wanted, dy.to(partial.dtype))


def _write_product(into: torch.Tensor, a: torch.Tensor, b: torch.Tensor, add: bool) -> None:
    """``a @ b`` written or added (``add``) into ``into``: with no result of its own where the dtypes
    agree (a partial in another reduce dtype takes the product cast, as it takes autograd's)."""
    if into.dtype != a.dtype:
        product = torch.mm(a, b)
        into.add_(product) if add else into.copy_(product)
    elif add:
        into.addmm_(a, b)
    else:
        torch.mm(a, b, out=into)


def _write_sum(into: torch.Tensor, g: torch.Tensor, add: bool) -> None:
    """A bias's gradient, ``g`` summed over its rows, written or added (``add``) into ``into``."""
    if add or into.dtype != g.dtype:
        total = g.sum(0)
        into.add_(total) if add else into.copy_(total)
    else:
        torch.sum(g, 0, out=into)


class _SubBlockForward:
    """One forward of a sub-block call (``_RingSubBlockFunction``): its message (the sub-block's weight
    segments) and, at each ring step, the sub-block run on the shard held (``during``), its partial
    output added to the total; with ``graphs``, each step's graph kept for the backward."""

    def __init__(self, call: _Call, tensors_and_params: tuple, needs: tuple[bool, ...]):
        self.call = call
        self.layer = call.block.ring
        precision, ring = self.layer.precision, self.layer.ring
        self.ring = ring
        tensors = tensors_and_params[: call.tensor_count]
        self.params = params = tensors_and_params[call.tensor_count :]
        present = [p for p in params if p is not None]
        # Inputs in the policy's compute dtype (as FSDP2 casts them); the weights in the dtype the
        # sub-block's matmuls use, which autocast, where it is on, may lower further.
        self.input_dtype = precision.compute_dtype(present[0].dtype)
        self.dtype = precision.matmul_dtype(present[0].dtype)
        self.message = self.ring.buffers.message_of(call.block.segments(self.dtype, ring))
        self.cast = call.cast(tensors, self.input_dtype)
        self.row_layout = self.message.segments[-1].layout  # the cached message's: its bounds are computed once
        self.graphs = None
        if call.keeps_graphs and any(needs):
            inputs = [t.detach().requires_grad_(need and t.is_floating_point()) for t, need in zip(self.cast, needs)]
            # Under autocast a product's dtypes are autocast's: autograd's formulas follow them. Under a
            # low-precision policy the explicit steps' input gradients, summed over products and steps
            # in place in the compute dtype, round further from the exact ones than autograd's path
            # (test_prefetch's bf16 case: a bias gradient 3x FSDP2's error), so they run in full precision only.
            explicit = call.block.explicit_linears and autocast_dtype(ring.device.type) is None and self.dtype.itemsize >= 4
            needs_params = [need for need, p in zip(needs[len(tensors) :], params) if p is not None]
            self.graphs = _ShardGraphs(call, inputs, needs_params, explicit)

    def rotate(self) -> tuple:
        """The sum of the partial outputs, from one ring, and the output's structure."""
        call, layer, params = self.call, self.layer, self.params
        self.total = None
        self.arguments = call.arguments(self.cast) if self.graphs is None else None
        layer.driver.forward(self.message, self.during, _packed(call.block, params))
        if self.graphs is not None and self.graphs.explicit:
            # The total becomes the function's output, whose node holds the graphs: not back to it.
            self.graphs.total.release()
        if call.cache is not None:  # every shard has run: the cache takes their keys and values once
            call.cache.commit()
        return self.total, call.output_spec, call.output_position

    def during(self, step: int, buffer: torch.Tensor) -> None:
        """The sub-block on the shard held at ``step`` (in ``buffer``), its partial output added."""
        shard = self.ring.weight_shards[step]
        if self.row_layout.rows_of(shard) == 0:
            return
        block, graphs = self.call.block, self.graphs
        operands = self.message.views(buffer, shard, transposed=block.transposed)
        if graphs is None:
            partial = self.call.run(self.arguments, shard, operands)
        else:
            partial = graphs.forward(shard, operands)
        if graphs is not None and graphs.explicit:  # the step added its product to the total itself
            self.total = partial
            return
        self.total = partial.clone() if self.total is None else self.total.add_(partial)
        if graphs is not None:
            graphs.release_output(shard)


class _RingSubBlockFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call: _Call, *tensors_and_params):
        forward = _SubBlockForward(call, tensors_and_params, ctx.needs_input_grad[1:])
        # A recomputation that takes the kept output learns the output's structure from the forward.
        total, call.output_spec, call.output_position = kept_or_run(call.block.ring, forward.rotate)
        ctx.call, ctx.dtype, ctx.input_dtype, ctx.graphs = call, forward.dtype, forward.input_dtype, forward.graphs
        ctx.autocast = autocast_dtype(forward.ring.device.type)  # the recomputations in backward run under it too
        ctx.save_for_backward(*tensors_and_params)
        return total

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_total):
        saved = ctx.saved_tensors
        backward = _SubBlockBackward(ctx.call, saved, ctx.needs_input_grad[1:], ctx.dtype, ctx.input_dtype, ctx.graphs, ctx.autocast, grad_total)
        return (None, *backward.run(), *[None] * len(backward.params))


class _SubBlockBackward:
    """One backward of a sub-block call (``_RingSubBlockFunction``): the weights rotate again, and at
    each step the rank backpropagates through the sub-block for the shard held (``step``).

    Synchronised (``synchronised``), the weight gradients' partials travel with the weights, each
    starting one rank below its owner and ending one hop short of it: that hop is deferred
    (``_ring.DeferredHop``), and the owner adds its own contribution when the partial comes home. A block
    that computes its parameter gradients without weights (``SubBlock.weight_gradients``: experts) has its
    partials travel as a Linear's instead (``_weights_free``): from the owner's neighbour to the owner in
    the ring's own W-1 exchanges, with no last hop. Unsynchronised (``unsynchronised``: no gradient wanted, or ``set_requires_gradient_sync(False)``),
    only the weights travel, and each rank adds its contributions to every shard into local
    accumulators."""

    def __init__(
        self, call: _Call, saved: tuple, needs: tuple[bool, ...], dtype: torch.dtype, input_dtype: torch.dtype,
        graphs: "_ShardGraphs | None", autocast: torch.dtype | None, grad_total: torch.Tensor,
    ):
        """``saved``: the ring function's tensors (the call's, its per-shard parameters, then its
        parameters' local shards) and ``needs`` whether each wants a gradient; ``dtype`` the weights'
        (the matmuls') and ``input_dtype`` the inputs' compute dtype; ``graphs`` the forward's kept graphs;
        ``autocast`` the forward's autocast dtype, under which recomputations run."""
        self.call = call
        self.block = block = self.call.block
        self.layer = block.ring
        self.gradients, self.ring = self.layer.gradients, self.layer.ring
        self.graphs, self.input_dtype, self.autocast = graphs, input_dtype, autocast
        n = self.call.tensor_count
        self.tensors, self.params = saved[:n], saved[n:]
        self.needs_inputs = needs[:n]
        self.needs_params = [need and p is not None for need, p in zip(needs[n:], self.params)]
        self.present = [i for i, p in enumerate(self.params) if p is not None]
        self.weight_segments = block.segments(dtype, self.ring)
        self.reduce_dtype = self.layer.precision.reduce_dtype(self.params[self.present[0]].dtype)
        self.grad_index = [slot for slot, i in enumerate(self.present) if self.needs_params[i]]
        self.grad_segments = [
            segment(self.weight_segments[slot].layout, self.weight_segments[slot].trailing, self.reduce_dtype)
            for slot in self.grad_index
        ]
        # The partials' views in the orientation of the gradients autograd gives: those of colwise weights
        # transposed, as their operands are.
        self.grads_transposed = tuple(block.transposed[slot] for slot in self.grad_index)
        self.row_layout = self.weight_segments[-1].layout
        self.keys = [(id(block), slot) for slot in self.grad_index]
        # A block that computes its parameter gradients itself: which (parameter, operand dtype) each
        # partial is, and the input its gradients read (cast once per backward, not per step).
        self.computes_weight_gradients = block.weight_gradients is not None
        if self.computes_weight_gradients:
            self.weight_params = [(self.present[slot], self.weight_segments[slot].dtype) for slot in self.grad_index]
            self.rows = self.call.cast(self.tensors, self.input_dtype)[0]
        self.graph_grad_slots = [] if self.computes_weight_gradients else self.grad_index
        self.grad_inputs = [None] * n
        self.dy = grad_total if grad_total.dtype == dtype else grad_total.to(dtype)
        # Kept steps backpropagated by the Linears' formulas (``_explicit``): each operand's position
        # among the partials (None: no gradient wanted); the graphs' inputs whose gradients are wanted,
        # and their indices; per call tensor, its input gradient from the colwise products, flat, and
        # its flat view transposed (a weight gradient's left factor).
        self.explicit = graphs is not None and graphs.explicit
        if self.explicit:
            self.partial_at = [None] * len(self.present)
            for position, slot in enumerate(self.grad_index):
                self.partial_at[slot] = position
            self.wanted = [index for index, need in enumerate(self.needs_inputs) if need]
            self.wanted_inputs = [graphs.inputs[index] for index in self.wanted]
            self.grad_flat: list[torch.Tensor | None] = [None] * n
            self.flat_t: dict[int, torch.Tensor] = {}
            self.dy_flat = self.dy.reshape(-1, self.dy.shape[-1])
        # As laid out in a message: the colwise weights (and biases), then the rowwise weight transposed.
        self.weights = _packed(block, self.params)

    def run(self) -> list[torch.Tensor | None]:
        """The backward's ring (synchronised where gradients are wanted and synced); returns the
        gradients of the call's tensors and per-shard parameters (``input_gradients``)."""
        if self.grad_index and self.gradients.requires_sync:
            self.synchronised()
        else:
            self.unsynchronised()
        return self.input_gradients()

    def input_gradients(self) -> list[torch.Tensor | None]:
        if self.explicit:  # the colwise products' share, summed apart
            for index, flat in enumerate(self.grad_flat):
                if flat is not None:
                    g = flat.view(*self.tensors[index].shape)
                    self.grad_inputs[index] = g if self.grad_inputs[index] is None else self.grad_inputs[index].add_(g)
        return [g if g is None or g.dtype == t.dtype else g.to(t.dtype) for g, t in zip(self.grad_inputs, self.tensors)]

    def held_views(self, message: Message, buffer: torch.Tensor, shard: int, first: int = 0) -> list[torch.Tensor] | None:
        """Shard ``shard``'s weights in ``buffer`` as their Linears hold them (``SubBlock.as_held``), what
        an explicit step's input gradients read; None where no step is explicit."""
        return message.views(buffer, shard, first, self.block.as_held) if self.explicit else None

    def step(
        self, shard: int, operands: list[torch.Tensor], into: list[torch.Tensor] | None, add: bool,
        held: list[torch.Tensor] | None = None,
    ) -> None:
        """Backpropagate through the sub-block for ``shard`` (its kept graph, a recomputation, or the
        block's own: experts) with its weight ``operands``: input gradients into this rank's, weight
        gradients written or added (``add``) into ``into``, views shaped as the operands are (a colwise
        weight's transposed: ``grads_transposed``), so that no gradient is transposed first. ``held``:
        the same weights as ``held_views`` gives them."""
        if self.row_layout.rows_of(shard) == 0:
            if into is not None and not add:
                for view in into:
                    view.zero_()
            return
        if self.explicit:
            record = self.graphs.take(shard)
            if record is not None:
                self._explicit(record, operands, held, into or [], add)
                return
        got = self._backpropagated(shard, operands)
        if self.computes_weight_gradients:
            if into:
                self._weight_gradients(shard, into, add)
            return
        for view, g in zip(into or [], got):
            if g is None:
                if not add:
                    view.zero_()
            elif add:
                view.add_(g)
            else:
                view.copy_(g)

    def _backpropagated(self, shard: int, operands: list[torch.Tensor]):
        """Backpropagate through the step of ``shard`` (its kept graph, or a recomputation) with its weight
        ``operands``: the inputs' gradients added into this rank's; returns an iterator over the weight
        gradients autograd computed (``graph_grad_slots``)."""
        if not any(self.needs_inputs) and not self.graph_grad_slots:
            return iter(())
        if self.block.input_gradients is not None:  # the block's own (its inputs: the call's one tensor)
            if self.grad_inputs[0] is None:
                self.grad_inputs[0] = torch.zeros_like(self.tensors[0], dtype=self.input_dtype)
            self.block.input_gradients(self.call, self.dy, shard, operands, self.grad_inputs[0])
            return iter(())
        got = None if self.graphs is None else self.graphs.backward(shard, operands, self.dy, self.needs_inputs, self.graph_grad_slots)
        if got is None:
            got = self._recomputed(shard, operands)
        got = iter(got)
        for index, need in enumerate(self.needs_inputs):
            if need:
                g = next(got)
                if g is not None:
                    self.grad_inputs[index] = g if self.grad_inputs[index] is None else self.grad_inputs[index].add_(g)
        return got

    def _explicit(self, record: _ExplicitStep, operands: list[torch.Tensor], held: list[torch.Tensor], into: list[torch.Tensor], add: bool) -> None:
        """Backpropagate a kept step by its Linears' formulas (``_ExplicitStep``): the rowwise weight's
        gradient and its input's from ``dy``, autograd through what lies between the Linears, then each
        colwise product's weight (and bias) gradient and input gradient from its output's."""
        at = self.partial_at
        row, dy = self.block.operand_at[-1][0], self.dy_flat
        h = record.row_input
        if at[row] is not None:
            _write_product(into[at[row]], record.row_flat.t(), dy, add)
        columns = [column for column in record.columns if column[2].requires_grad]
        inputs = self.wanted_inputs
        if not (h.requires_grad and (columns or inputs)):
            return
        for (weight_at, _), _, _, _, leaf in columns:
            if leaf is not None:  # saved by autograd (``_ShardGraphs.backward``)
                leaf.data = operands[weight_at]
        dh = torch.mm(dy, held[row])
        if dh.dtype != h.dtype:
            dh = dh.to(h.dtype)
        got = gradients_of(h, inputs + [column[2] for column in columns], dh if h.dim() == 2 else dh.view(*h.shape))
        grad_inputs = self.grad_inputs
        for index, g in zip(self.wanted, got):
            if g is not None:
                grad_inputs[index] = g if grad_inputs[index] is None else grad_inputs[index].add_(g)
        for ((weight_at, bias_at), tensor_index, _, flat, _), g in zip(columns, got[len(inputs) :]):
            if g is not None and g.dim() != 2:
                g = _flattened(g)
            for slot in (weight_at, bias_at):
                if slot is None or at[slot] is None:
                    continue
                if g is None:
                    if not add:
                        into[at[slot]].zero_()
                elif slot == bias_at:
                    _write_sum(into[at[slot]], g, add)
                else:
                    _write_product(into[at[slot]], self._flat_t(tensor_index, flat), g, add)
            if g is not None and tensor_index is not None and self.needs_inputs[tensor_index]:
                total = self.grad_flat[tensor_index]
                if total is None:
                    self.grad_flat[tensor_index] = torch.mm(g, held[weight_at])
                else:
                    total.addmm_(g, held[weight_at])

    def _flat_t(self, tensor_index: int | None, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` transposed; once per backward for one of the call's tensors, read at every step."""
        if tensor_index is None:
            return flat.t()
        flat_t = self.flat_t.get(tensor_index)
        if flat_t is None:
            flat_t = self.flat_t[tensor_index] = flat.t()
        return flat_t

    def _weight_gradients(self, shard: int, into: list[torch.Tensor], add: bool) -> None:
        """The block's own parameter gradients for ``shard`` (no weights needed), into ``into``."""
        self.block.weight_gradients(self.call, self.rows, self.dy, shard, self.weight_params, into, add)

    def _recomputed(self, shard: int, operands: list[torch.Tensor]) -> tuple:
        """The gradients of ``step``, from the sub-block's forward for ``shard`` run again."""
        leaves = _weight_leaves(operands, [self.needs_params[i] and not self.computes_weight_gradients for i in self.present])
        inputs = [t.detach().requires_grad_(need) for t, need in zip(self.call.cast(self.tensors, self.input_dtype), self.needs_inputs)]
        autocast = torch.autocast(self.ring.device.type, dtype=self.autocast, enabled=self.autocast is not None)
        with torch.enable_grad(), autocast:
            partial = self.call.run(self.call.arguments(inputs), shard, leaves)
            wanted = [x for x, need in zip(inputs, self.needs_inputs) if need] + [leaves[slot] for slot in self.graph_grad_slots]
            return gradients_of(partial, wanted, self.dy.to(partial.dtype))

    def _pack(self, into: Message, first: int, buffer: torch.Tensor) -> None:
        """This rank's weights into ``buffer`` as ``into``'s segments ``first:`` (one rank's layout:
        ``members``, on a ring of groups)."""
        into.members.pack(buffer, self.ring.rank, self.weights, first)

    def _deliver(self, reduced: list[torch.Tensor]) -> None:
        """This rank's reduced gradient shards, to its parameters (``_grad.py``): not returned, since
        they arrive after the Function has returned (the ring's last hop is deferred)."""
        for slot, grad in zip(self.grad_index, reduced):
            index = self.present[slot]
            linear, name = self.block.param_slots[index]
            grad = grad.t().contiguous() if self.block.param_transposed[index] else grad
            dtype = self.params[index].dtype
            self.gradients.receive(sharded(getattr(linear, name), linear, name), grad if grad.dtype == dtype else grad.to(dtype))

    def synchronised(self) -> None:
        """The weights and the partials round the ring, ``[partials | weights]``: a message's first
        exchange sends the weights alone (nothing is added to a partial yet), so the ring before may
        have done it, and a deferred hop travelling behind it follows them directly."""
        self.grads = self.ring.buffers.message_of(tuple(self.grad_segments))
        if self.computes_weight_gradients:
            self._weights_free()
            return
        self.message = message = self.ring.buffers.message_of(self.grads.segments + self.weight_segments)
        self.first_weight = len(self.grad_segments)
        # What travels is this rank's own shards and partial pieces (``members``; the message itself on a
        # ring of ranks), and the rank's gradients are its own shards of them.
        self.own_grads = self.grads.members
        self.weights_start = message.members.offsets[self.first_weight]
        alone = self.ring.size == 1  # no exchange: the message is packed and used where it is
        pair = message.nbytes if alone else None
        with self.layer.driver.run(Phase.BACKWARD, message, self.weights, self.first_weight, pair=pair) as run:
            # The owner's own contribution, then its reduced gradients: memory of its own, not a ring
            # buffer, so that it needs no copy to outlive this ring (the deferred hop) nor to become the
            # gradients. On a ring of groups the group's contributions to its own block, summed by the ring.
            self.mine = torch.zeros(self.own_grads.nbytes, dtype=torch.uint8, device=self.ring.device)
            self.unsynced = [self.gradients.take_unsynced(key) for key in self.keys]
            self.has_unsynced = any(total is not None for total in self.unsynced)
            pack = functools.partial(self._pack, message, self.first_weight)
            if alone:
                buffer = run.buffers[0]
                pack(buffer)
                self._own_contribution(0, buffer)
                self._deliver(self._finished(self.mine))
                return
            # On a ring of groups the weights are gathered within the group and the partials follow them,
            # the group's contributions to its own block summed into ``mine`` (a ring of ranks ignores both).
            final = run.turn(pack if run.prefetched is None else run.prefetched, self._own_contribution, self._partials_arrived,
                             region=self._region, gathered=range(self.first_weight, len(message.segments)), own=self.mine)
            if self.ring.owners == 1:  # one group: its reduce-scatter summed every contribution
                self._deliver(self._finished(self.mine))
                return
            # W-1 hops (W/g - 1 between groups) took every partial past every owner but its own, one
            # hop down. That hop rides the next ring's first exchange, or goes alone at the end of the
            # backward.
            run.defer_last_hop(final[: self.own_grads.nbytes].clone(), functools.partial(self._home, self.mine))

    def _weights_free(self) -> None:
        """The synchronised backward of a block whose parameter gradients need no weights (experts): the
        partials travel as a Linear's (``_ring_function.ring_backward``), in ``[weights | partials]``
        messages, the partial of ``ring.partial_shards[k]`` held at step k beside the weights of
        ``ring.weight_shards[k]``, and reach their owners in the ring's own exchanges, the owner's own
        contribution added last: no last hop, deferred or sent. A rank adds its contribution into a
        partial as it arrives (no scratch beside the ring buffers: what the backward's peak would hold),
        and its reduced shards are copied out as the ring ends. The first message carries partials, so
        the ring before cannot send it ahead. On a ring of groups each step's contributions are written
        into the block (``fill``) and the group sums them into the travelling partials (``Ring.circulate``)."""
        ring, weights = self.ring, len(self.weight_segments)
        message = ring.buffers.message_of(self.weight_segments + self.grads.segments)
        with self.layer.driver.run(Phase.BACKWARD, message) as run:
            self.unsynced = [self.gradients.take_unsynced(key) for key in self.keys]
            self.has_unsynced = any(total is not None for total in self.unsynced)
            pack = functools.partial(self._pack, message, 0)

            def during(step: int, block: torch.Tensor) -> None:
                shard = ring.weight_shards[step]
                if self.row_layout.rows_of(shard):
                    self._backpropagated(shard, message.views(block, shard, 0, self.block.transposed))

            if ring.group_size > 1:
                def fill(shard: int, block: torch.Tensor) -> None:
                    self._contribute(message, shard, block, add=False)

                final = run.turn(pack, during, gathered=range(weights), fill=fill)
            else:
                def start(buffer: torch.Tensor) -> None:
                    pack(buffer)
                    self._contribute(message, ring.partial_shards[0], buffer, add=False)

                def arrived(step: int, buffer: torch.Tensor) -> None:
                    self._contribute(message, ring.partial_shards[step], buffer, add=True)

                final = run.turn(start, during, arrived)
            self._deliver(finished_gradients(self.layer, message.members, weights, final))

    def _contribute(self, message: Message, shard: int, buffer: torch.Tensor, add: bool) -> None:
        """This rank's contribution to the partials of ``shard`` in ``buffer`` (``message``'s segments
        after its weights), written or added."""
        weights = len(self.weight_segments)
        self._weight_gradients(shard, message.views(buffer, shard, weights, self.grads_transposed), add)
        if self.has_unsynced:
            self._add_unsynced(shard, message.views(buffer, shard, weights))

    def _add_unsynced(self, shard: int, views: list[torch.Tensor]) -> None:
        """Add what backwards without sync kept for ``shard`` (``views``: its partials as laid out)."""
        for view, total in zip(views, self.unsynced):
            if total is not None:
                view.add_(self.gradients.unsynced_shard(total, shard, view.shape))

    def _own_contribution(self, hop: int, buffer: torch.Tensor) -> None:
        """The owner's own contribution, from its local shard (on a ring of groups, its group's block,
        whose partials the ring sums into ``mine``): while the first message (its weights) travels, to
        be added when its partial comes home."""
        if hop == 0:
            owner, message = self.ring.owner, self.message
            # The grads' segments lead the message, laid out as in it.
            into = self.mine if self.ring.group_size == 1 else buffer
            own = self.grads.views(into, owner, transposed=self.grads_transposed)
            operands = message.views(buffer, owner, self.first_weight, self.block.transposed)
            self.step(owner, operands, own, add=False, held=self.held_views(message, buffer, owner, self.first_weight))
            if self.has_unsynced:
                self._add_unsynced(owner, self.grads.views(into, owner))

    def _partials_arrived(self, hop: int, buffer: torch.Tensor) -> None:
        """The message of ``hop`` came (on a ring of groups, its block, gathered): this rank's
        contribution to its partials, added to them (written, for the ring to sum them with the piece
        that came, on a ring of groups; hop 1 starts them on a ring of ranks)."""
        shard, message = self.ring.weight_shards[hop], self.message
        into = message.views(buffer, shard, transposed=self.grads_transposed)[: self.first_weight]
        operands = message.views(buffer, shard, self.first_weight, self.block.transposed)
        held = self.held_views(message, buffer, shard, self.first_weight)
        self.step(shard, operands, into, add=hop > 1 and self.ring.group_size == 1, held=held)
        if self.has_unsynced:
            self._add_unsynced(shard, message.views(buffer, shard)[: self.first_weight])

    def _region(self, hop: int) -> slice:
        return slice(self.weights_start, None) if hop == 0 else slice(None)  # nothing added to a partial yet

    def _home(self, own: torch.Tensor, partials: torch.Tensor) -> None:
        """The partials came home (the deferred hop): added to the owner's own contribution, delivered."""
        # One add for every segment: all are in reduce_dtype, so none has a gap before it (padding rows
        # are added too, and never read). Into ``own``, not the ring buffer: it becomes the gradients.
        own.view(self.reduce_dtype).add_(partials[: self.own_grads.nbytes].view(self.reduce_dtype))
        self._deliver(self._finished(own))

    def _finished(self, own: torch.Tensor) -> list[torch.Tensor]:
        """This rank's reduced gradient shards, views of ``own`` (the whole message's memory, which they
        keep), divided in place (``RingGradients.divisor``): no copy of a layer's gradient shard is made."""
        divisor = self.gradients.divisor
        if divisor != 1:
            own.view(self.reduce_dtype).div_(divisor)
        return self.own_grads.views(own, self.ring.rank)

    def unsynchronised(self) -> None:
        """No partials travel: the weights rotate for the input gradient, and with sync off each rank's
        contributions to every shard are kept locally until the next synchronised backward."""
        ring = self.ring
        weights_only = self.ring.buffers.message_of(self.weight_segments)
        totals = [self.gradients.unsynced_total(key, segment) for key, segment in zip(self.keys, self.grad_segments)]

        def during(hop: int, buffer: torch.Tensor) -> None:
            shard = ring.weight_shards[hop]
            views = weights_only.views(buffer, shard)
            into = [self.gradients.unsynced_shard(total, shard, views[slot].shape) for total, slot in zip(totals, self.grad_index)]
            into = [view.mT if transposed else view for view, transposed in zip(into, self.grads_transposed)]
            operands = weights_only.views(buffer, shard, transposed=self.block.transposed)
            self.step(shard, operands, into, add=True, held=self.held_views(weights_only, buffer, shard))

        with self.layer.driver.run(Phase.BACKWARD, weights_only) as run:
            run.turn(functools.partial(self._pack, weights_only, 0), during)
