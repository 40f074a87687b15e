"""Estimates instead of measurements, to plan for a cluster this machine cannot run (8 to 1024 GPUs).

Counting. One single-process training step of the model on the meta device (no memory, no compute),
forward and backward, with the profiler's boundary hooks, gives each part's forward FLOPs, its
parameter bytes, and the phases of everything that is neither a parameter nor a parameter's gradient:
activations, their gradients, the logits, the loss's temporaries, each phase's change and peak as a
CPU run of the same step allocates them (storages counted as ``MemoryTracker`` counts them; parameter
gradients are dropped as they are made, since where they live is the strategy's business). One run
counts all of it (the phases come from a log of the step's allocations, replayed without the ones that
became parameter gradients), and a stack of blocks runs cut to a few of each kind (``_repeated_blocks``).
The same step with some units made the root's (``Planner``'s ``replicated_in_root``) is derived from
that run, not run again (``fold``).

Estimating. A :class:`CostModel` adds what each strategy allocates for the parameters, as FSDP2,
torch's ``replicate`` and rsdp do it (P a part's parameter bytes, L its bytes on one rank, W the world):

- every strategy: L of parameters and L x ``optimizer_state_bytes_per_param_byte`` of optimizer state
  all the time, L of gradients from the part's backward on, and L x ``optimizer_step_bytes_per_param_byte``
  during the optimizer step;
- FSDP: the unsharded parameters (P) while the part computes, the unsharded gradients (P) through its
  backward; its all-gather output and its reduce-scatter input (P each) outlive the part's phase and
  are carried (``_profile.Carried``); a root's unsharded parameters stay for the whole step;
- replicate: an unsharded copy of the parameters (P) from its forward to its backward (the FSDP-based
  ``replicate`` all-gathers over one rank into a buffer of its own), and in backward the gradients
  beside it; FSDP2's post-backward then frees the copy, copies the gradients into the reduce-scatter
  input (carried) and frees them, and reduces into the gradient; a root's copy lives from the step's
  start to the end of the backward, where its post-backward does the same (a unit replicated inside
  the root, ``Planner``'s ``replicated_in_root``, is the root's);
- rsdp: the ring's two messages of a weight shard of the part's largest ring in forward; in backward
  two messages of a weight shard and a gradient partial and the scratch of the next contribution for
  a Linear ring (5 shards), two messages of a partial for an Embedding's (a ring of groups of g: two
  member messages, and in the scratch the group's block of g shards of the weights, in backward of
  the partials too, and behind it g staged shards for a message of several segments or the one the
  model's vectors ride). The message pair and the scratch are buffers of their own, each sized by the
  largest request, so a plan holds its largest pair and its largest scratch; carried for the rest of
  the pass, in backward to its end (a backward that left its pass's record trims nothing: the first
  steps, and the one after the Linears on one input started sharing a ring), through an FSDP or
  replicate root's reduction (FSDP2 queues its root's post-backward as the backward begins, before
  rsdp's end of backward that frees them); a part with no ring,
  norms only, holds none; an rsdp root's forward frees them before the loss. An Embedding ring's
  rows (tokens x row: the selected rows in forward, the masked output gradient in backward) beside
  them; its vectors (norm weights, biases; V bytes) gathered whole and kept
  from forward to backward, with a send and a receive buffer, and reduce-scattered from V of
  gradients and V of contributions, which wait (with their concatenation: 2V) for the one
  reduce-scatter at the end of the backward. An experts module (``experts_of``) rotates blocks of
  whole experts: forward on one ring of both projections (two blocks of all its experts' weights),
  backward on two rings, the down projection's then the up projection's, of which the up one is the
  larger (``up_bytes``): two messages of a block's weights and gradient partials and the owner's
  contribution (carried); on a ring of groups of g, two member messages and the group's block of g
  blocks, of the weights and in backward of the partials alike, and the block's weight gradients during a
  step where its products compute in a dtype other than the partials' (else they are written into the
  partials); of the experts' activations the rings keep the routed rows and the up projection's output
  from forward to backward, where the stock experts also keep the activation's (``dropped_activation_bytes``).

Mixed precision (``CostModel.param_dtype``, ``reduce_dtype``): the step is counted with the parameters
cast to ``param_dtype`` (activations in it, as FSDP2's and rsdp's compute makes them); sharded
parameters, their gradients and the optimizer state are in the model's own dtype, gathered copies,
unsharded gradients and ring weight messages in ``param_dtype``, reduce-scatter inputs and ring
partials in ``reduce_dtype`` (FSDP2 casts while it copies the gradients into the reduce-scatter input).
Activation checkpointing applied to the model is counted as it runs (what regions save, their
recomputation in backward); rsdp units under ``ring_checkpoint_context`` also keep their ring outputs.
The caching allocator (``CostModel.caching_allocator``, a GPU preset's): the count's allocation log
is replayed through a model of PyTorch's CUDA caching allocator (``_allocator``: rounding, segment
sizes, best fit, splitting, expandable segments), and every byte figure is scaled by its reserved peak
over the log's allocated peak (``Counts.reserved_per_allocated``; CPU ranks: allocated bytes).

Time (``_Parallelism.seconds``; the constants come from ``rsdp calibrate`` or a preset, ``_hardware``).
Compute is the counted FLOPs (backward twice forward, plus what activation checkpointing recomputes)
and the work outside the matrix products by kind (``Work``, counted op by op in the same run: flash
attention's executed FLOPs, the bytes norms, elementwise ops and the loss read and write). Where
``attention_flops_per_s`` is set, every matrix product runs at ``gemm_flops_per_s`` and each kind at its
own rate, so the time follows the sequence length as each kind does (attention with its square, the
rest linearly); else the Linears' FLOPs at ``gemm_flops_per_s`` and the rest at ``other_flops_per_s``
where both were measured, else all at ``flops_per_s``. Every transfer costs ``hops x latency + bytes / bandwidth`` with its own op's fitted figures
(``Link``; bytes as nccl-tests' busbw counts them: (W-1)/W of the whole for a ring collective).
Overlap, per strategy, where a device computes (``host_overlaps_compute``; where the host computes, as
on CPU ranks, it runs the transfers and its own work too, so every "longer of" below is a sum):

- FSDP: a unit's all-gather (in backward: its re-gather and its reduce-scatter, back to back)
  overlaps the unit's compute (FSDP2 prefetches the next unit's gather during this one's compute), so a
  phase takes the longer of the two;
- RSDP: per ring (as the engine forms them, ``PartCounts.rings``: the Linears called on one input share
  one, an Embedding has one, an experts module one forward and one per projection backward) and phase, W steps each computing 1/W of the layer's work, its
  Linears' GEMM time (at ``gemm_flops_per_s``) divided by ``partial_gemm_efficiency`` (a 1/W-row GEMM's
  rate relative to a whole one: RSDP's per-shard penalty) beside ``ring_step_host_s`` of host work (the longer of the two); each of the
  ring's W-1 exchanges (one message: a weight shard forward, a shard and a gradient partial backward)
  overlaps one step, so the ring takes one step plus W-1 times the longer of a step and an exchange
  (an expert ring's too: its partials reach their owners in those exchanges, as a Linear's);
  in forward every ring but an Embedding's is prefetched (its first message rode the last exchange of
  the ring before: ``_Parallelism.ring_traffic`` counts the exchanges as ``CommCounter`` does), so it
  makes one exchange fewer, of the same bytes in all.
  A ring of groups of g (``ring_group_size``): W/g steps of g/W of the work (the efficiency at W/g),
  W/g - 1 exchanges of one shard between groups, and at every step the all-gather of the group's block
  of g weight shards (backward: and the reduce-scatter of its g partials) within the group, which
  overlaps the step with the exchange;
- replicate: the gradient's all-reduce (2(W-1) hops, 2(W-1)/W of the bytes) overlaps the backward.

Two levels (``gpus_per_node``, ``inter_node_links``): where the world is more than one machine, every
collective over it and every ring exchange (a step waits for its slowest, which crosses a machine
boundary) pays the link between machines; a ring group's all-gather and reduce-scatter pay the link
within one, or between where a group is several machines. Gathered weights and ring weight messages
move in ``param_dtype``, reductions and partials in ``reduce_dtype``. The optimizer step is memory-bound: its traffic per parameter byte over the device's
memory bandwidth (where known). FSDP2's own work beside the wire (copies into and out of the
collectives' buffers, the pre-division, its hooks) is charged per parameter byte with the compute where
``rsdp calibrate`` measured it (``fsdp_overhead_s_per_byte``, ``replicate_overhead_s_per_byte``; the H100
presets fit FSDP2's to this project's one-GPU step and leave replicate's out); a ring of groups (g > 1) pays FSDP2's figure too, since its all-gathers within the
group copy every weight byte in and out of their buffers as FSDP2's do (an assumption: not measured
for the ring of groups). Not modelled: the first gather of a pass (not overlapped with anything).

The estimate is within 15% of what a run measures, so far from above (``tests/test_planner.py`` runs
plans of several shapes, every strategy and mixed, and compares): where the timing of a buffer depends
on its neighbours, it is counted as if it lived as long as it can. What it does not see: buffers a
communication backend allocates internally, a matrix that an rsdp module uses in an op with no ring
form (gathered whole, with a warning at run time), and that rsdp gathers the vectors of every part at
the start of the pass at once (each part's are counted at its own forward: at that start the pass
holds all of them and their receive buffer, twice their bytes, when nothing else of the pass is
alive yet).
"""

import collections
import contextlib
import contextvars
import copy
import dataclasses
import itertools
import math
import operator
import weakref
from collections.abc import Sequence

import torch
import torch.nn as nn
from torch.utils.flop_counter import flop_registry

from .._compat import TorchDispatchMode, in_backward, saved_tensors_hooks_active, tree_leaves
from .._fully_shard._checkpoint import in_ring_checkpoint_forward
from .._fully_shard._experts import ExpertsBlock, is_experts_module
from .._fully_shard._grouped_experts import GroupedExpertsBlock, is_grouped_experts
from .._fully_shard._llama4_experts import Llama4ExpertsBlock, is_llama4_experts
from ..policy import Strategy
from ._allocator import reserved_peak
from ._profile import Carried, Phase, RootCost, StepPhases, UnitCost, run_marked_step
from ._repeated_blocks import repeated_blocks


@dataclasses.dataclass(frozen=True)
class Link:
    """One kind of transfer: ``hops x latency_s + bytes / bandwidth_bytes_per_s`` (a ring collective
    over W ranks is W-1 hops, an all-reduce 2(W-1), a point-to-point exchange one)."""

    latency_s: float
    bandwidth_bytes_per_s: float

    def seconds(self, nbytes: float, hops: int = 1) -> float:
        return hops * self.latency_s + nbytes / self.bandwidth_bytes_per_s


CACHING_ALLOCATORS = (None, "segments", "expandable_segments")


@dataclasses.dataclass(frozen=True)
class Work:
    """The work of a part's forward outside its matrix products, by kind, each timed at its own rate:
    attention's FLOPs (``attention_flops`` as ``torch.utils.flop_counter`` counts them, every score of
    the square; ``attention_executed_flops`` what a flash kernel runs: half of them when causal), and
    the bytes that memory-bound ops read and write (every input and output of an op that is not a view
    or a matrix product), in norms (inside a module whose type's name ends in ``Norm``), in the loss
    (after the model's forward returned) and in every other elementwise op."""

    attention_flops: float = 0
    attention_executed_flops: float = 0
    norm_bytes: float = 0
    elementwise_bytes: float = 0
    loss_bytes: float = 0

    def __add__(self, other: "Work") -> "Work":
        return Work(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    def __sub__(self, other: "Work") -> "Work":
        return Work(*(a - b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    def backward(self) -> "Work":
        """The backward's work for this forward: a flash backward runs 2.5 times its forward's FLOPs
        (five matrix products of the tile to the forward's two; FlashAttention-2, Dao 2023, section 3.1),
        counted twice the forward's as every counted FLOP is; a memory-bound op's gradient reads the
        output's gradient and what the op saved and writes the input's gradient: twice its forward's bytes."""
        return Work(2 * self.attention_flops, 2.5 * self.attention_executed_flops,
                    2 * self.norm_bytes, 2 * self.elementwise_bytes, 2 * self.loss_bytes)


@dataclasses.dataclass(frozen=True)
class CostModel:
    world_size: int
    flops_per_s: float  # achieved per device: a training step's rate (or whole GEMMs' where no step was measured)
    bandwidth_bytes_per_s: float  # per device: every op's, unless the op has its own Link below
    latency_s: float  # per message (hop): every op's, unless the op has its own Link below
    # The optimizer, per byte of the parameters it trains (``OPTIMIZERS``, ``with_optimizer``; the
    # default is torch's AdamW, whose implementation depends on the device): its state, and its step's
    # temporaries, per byte of all the parameters (a foreach implementation's, made at once) and per byte
    # of the largest (a for-loop implementation's, made one parameter at a time); the larger applies.
    optimizer_state_bytes_per_param_byte: float = 2.0
    optimizer_step_bytes_per_param_byte: float = 1.0
    optimizer_step_bytes_per_largest_param_byte: float = 2.0
    # The mixed-precision policy (``MixedPrecisionPolicy``): the dtype parameters are gathered and computed
    # in, and the one gradients are reduced in (None: the parameters' own; the reduce dtype defaults to
    # the parameter dtype, as FSDP2's does). Sharded parameters, their gradients and the optimizer state
    # stay in the parameters' own dtype.
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    # The optimizer step's time: bytes it moves per parameter byte on one rank, at the device's memory
    # bandwidth (None: not modelled). torch's foreach AdamW (the default on GPUs) reads and writes 20
    # parameter-sized tensors per step: lerp_ of the first moment (3), mul_ and addcmul_ of the second
    # (2 + 3), the decoupled weight decay's mul_ (2), sqrt, div_ and add_ of the denominator (2 each),
    # addcdiv_ into the parameter (4).
    memory_bandwidth_bytes_per_s: float | None = None
    optimizer_traffic_per_param_byte: float = 20.0
    # A fixed factor of reserved per allocated byte (a profile may give one; 1: none): every byte figure
    # is scaled by it and by the caching allocator's (below), so the predicted peak, and what the budget
    # is compared with, is the reserved peak.
    reserved_per_allocated: float = 1.0
    # The caching allocator modelled (``_allocator``): None (CPU ranks: allocated bytes), "segments"
    # (PyTorch's default) or "expandable_segments" (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``,
    # as torchtitan runs). Its factor, from replaying the counted step, scales every byte figure beside
    # ``reserved_per_allocated``.
    caching_allocator: str | None = None
    # Time terms that ``rsdp calibrate`` measures (the defaults leave only the three numbers above).
    partial_gemm_efficiency: float = 1.0  # FLOP/s of 1/world_size-row GEMMs over that of whole ones
    gemm_flops_per_s: float | None = None  # whole GEMMs' rate (None: flops_per_s), for the shards' penalty
    # With ``gemm_flops_per_s``: the rate of the FLOPs outside the Linears' GEMMs (attention; it stands
    # in for the step's elementwise and normalisation work too, which the count gives no FLOPs). Then
    # the Linears' FLOPs run at ``gemm_flops_per_s`` and the rest at this; None: every FLOP at ``flops_per_s``.
    other_flops_per_s: float | None = None
    # The work outside the matrix products by kind (``Work``), each at its own rate where
    # ``attention_flops_per_s`` is set (then every matrix product runs at ``gemm_flops_per_s``, and
    # ``other_flops_per_s`` is not used): flash attention's executed FLOPs, and the bytes that norms,
    # elementwise ops and the loss move. A byte rate left None: that kind is not charged.
    attention_flops_per_s: float | None = None
    norm_bytes_per_s: float | None = None
    elementwise_bytes_per_s: float | None = None
    loss_bytes_per_s: float | None = None
    # FSDP2's own work beside the wire per stored parameter byte of a unit, (forward, backward): its
    # copies into and out of the collectives' buffers, the pre-division, its hooks (``rsdp calibrate``
    # measures them on the fake process group; 0: not modelled). It runs where the compute runs.
    fsdp_overhead_s_per_byte: tuple[float, float] = (0.0, 0.0)
    replicate_overhead_s_per_byte: tuple[float, float] = (0.0, 0.0)
    ring_step_host_s: float = 0.0  # host time per ring step, beside its GEMMs
    host_overlaps_compute: bool = True  # False where the host itself computes (CPU ranks)
    send_recv: Link | None = None
    all_gather: Link | None = None
    reduce_scatter: Link | None = None
    all_reduce: Link | None = None
    # Two levels: devices per machine (None: the world is one machine) and each op's link between machines
    # as (op, Link) pairs (empty: one level, the links above whatever an op spans). An op whose ranks span
    # machines pays the link between them: every collective over the world, and every ring step (a flat
    # ring's, or a ring of groups' exchange between groups), when the world is more than one machine.
    gpus_per_node: int | None = None
    inter_node_links: tuple[tuple[str, Link], ...] = ()
    # rsdp's ring of groups (``ring_group_size``): the group sizes the search may choose (None: every one
    # ``ring_group_sizes`` allows), and the partial GEMMs' efficiency of each, as (g, efficiency) pairs: a
    # step computes g/W of a layer, so it is the efficiency at W/g (``_hardware``; a size not listed runs
    # at ``partial_gemm_efficiency``, W's, an underestimate of its speed).
    allowed_ring_group_sizes: tuple[int, ...] | None = None
    partial_gemm_efficiency_of_groups: tuple[tuple[int, float], ...] = ()

    def with_optimizer(self, name: str) -> "CostModel":
        """This cost model for a run that trains with the optimizer ``name`` (a key of ``OPTIMIZERS``)."""
        if name not in OPTIMIZERS:
            raise ValueError(f"rsdp plan: no optimizer {name!r} is modelled; pick one of {', '.join(OPTIMIZERS)}.")
        return dataclasses.replace(self, **OPTIMIZERS[name])

    def __post_init__(self):
        if self.caching_allocator not in CACHING_ALLOCATORS:
            raise ValueError(
                f"rsdp: caching_allocator {self.caching_allocator!r} is none of {CACHING_ALLOCATORS}; give one of them."
            )
        if self.gpus_per_node is not None and self.gpus_per_node <= 0:
            raise ValueError(f"rsdp plan: gpus per node must be positive, got {self.gpus_per_node}; e.g. --gpus-per-node 8.")
        possible = self._possible_ring_group_sizes()
        for size in self.allowed_ring_group_sizes or ():
            if size not in possible:
                raise ValueError(
                    f"rsdp plan: ring group size {size} is not one of {list(possible)}, the sizes that divide the world "
                    f"of {self.world_size} into groups within one machine"
                    f"{'' if self.gpus_per_node is None else f' of {self.gpus_per_node} or of whole machines'}; pick one of them."
                )

    def _possible_ring_group_sizes(self) -> tuple[int, ...]:
        """Every g that divides the world into groups of consecutive ranks within one machine or of whole
        machines (1 where the machine's size is unknown: a group would cross a boundary nobody stated)."""
        if self.gpus_per_node is None:
            return (1,)
        machine = min(self.gpus_per_node, self.world_size)
        return tuple(
            g for g in range(1, self.world_size + 1)
            if self.world_size % g == 0 and (machine % g == 0 or g % machine == 0)
        )

    def ring_group_sizes(self) -> tuple[int, ...]:
        """The ring group sizes an rsdp part may take: those allowed, else every possible one."""
        return tuple(self.allowed_ring_group_sizes or self._possible_ring_group_sizes())

    def partial_efficiency(self, ring_group_size: int) -> float:
        """The partial GEMMs' efficiency of a ring step of a group of ``ring_group_size`` (g/W of a layer)."""
        if ring_group_size == 1:
            return self.partial_gemm_efficiency
        return dict(self.partial_gemm_efficiency_of_groups).get(ring_group_size, self.partial_gemm_efficiency)

    @property
    def spans_machines(self) -> bool:
        """Whether the world is more than one machine (then its collectives and ring steps cross them)."""
        return self.spans_more_than_a_machine(self.world_size)

    def spans_more_than_a_machine(self, ranks: int) -> bool:
        """Whether ``ranks`` consecutive ranks (a ring group, the world) span more than one machine."""
        return self.gpus_per_node is not None and ranks > self.gpus_per_node

    def compute_seconds(self, flops: float, linear_flops: float, work: Work = Work()) -> float:
        """``flops`` of which ``linear_flops`` are the Linears' GEMMs and ``work`` the rest by kind, at
        the rates that were measured."""
        if self.attention_flops_per_s:
            matmuls = max(flops - work.attention_flops, 0.0)  # the Linears' and any other matrix product
            seconds = matmuls / (self.gemm_flops_per_s or self.flops_per_s)
            seconds += work.attention_executed_flops / self.attention_flops_per_s
            for nbytes, rate in ((work.norm_bytes, self.norm_bytes_per_s), (work.elementwise_bytes, self.elementwise_bytes_per_s),
                                 (work.loss_bytes, self.loss_bytes_per_s)):
                seconds += nbytes / rate if rate else 0.0
            return seconds
        if self.gemm_flops_per_s and self.other_flops_per_s:
            return linear_flops / self.gemm_flops_per_s + (flops - linear_flops) / self.other_flops_per_s
        return flops / self.flops_per_s

    @property
    def peak_is_reserved(self) -> bool:
        """Whether byte figures are what a caching allocator reserves (else allocated bytes)."""
        return self.caching_allocator is not None or self.reserved_per_allocated != 1.0

    def link(self, op: str, across_machines: bool = False) -> Link:
        """The fitted cost of ``op`` (``send_recv``, ``all_gather``, ``reduce_scatter``, ``all_reduce``), between
        machines where ``across_machines`` and this model has a link there, else within one."""
        between = dict(self.inter_node_links).get(op) if across_machines else None
        return between or getattr(self, op) or Link(self.latency_s, self.bandwidth_bytes_per_s)


def _optimizer(state: float, per_param_byte: float, per_largest_param_byte: float, traffic: float) -> dict:
    return dict(
        optimizer_state_bytes_per_param_byte=state,
        optimizer_step_bytes_per_param_byte=per_param_byte,
        optimizer_step_bytes_per_largest_param_byte=per_largest_param_byte,
        optimizer_traffic_per_param_byte=traffic,
    )


# torch's optimizers, per byte of the parameters they train, as torch 2.13 allocates them
# (``tests/test_planner_training.py`` steps each on the CPU and compares): state (AdamW: two moments;
# SGD with its defaults, no momentum: none); the step's temporaries (foreach AdamW: the square root of
# every second moment at once; for-loop AdamW: that root and its quotient, one parameter at a time, of
# which the largest parameter's count; fused AdamW and SGD: none); the bytes the step reads and writes
# (foreach and for-loop AdamW 20 parameter-sized tensors, see ``optimizer_traffic_per_param_byte``; fused
# AdamW reads parameter, gradient and both moments and writes three of them, 7; SGD reads parameter and
# gradient and writes the parameter, 3).
OPTIMIZERS = {
    "adamw": _optimizer(2.0, 1.0, 2.0, 20.0),  # torch's default: foreach on GPUs, for-loop on CPUs
    "adamw-foreach": _optimizer(2.0, 1.0, 0.0, 20.0),
    "adamw-for-loop": _optimizer(2.0, 0.0, 2.0, 20.0),
    "adamw-fused": _optimizer(2.0, 0.0, 0.0, 7.0),
    "sgd": _optimizer(0.0, 0.0, 0.0, 3.0),
}


@dataclasses.dataclass
class PartCounts:
    """What one part of the model holds and does in one step, counted on the meta device."""

    param_bytes: int = 0
    vector_bytes: int = 0  # of 1-D parameters: gathered whole under rsdp
    # Of them, the frozen ones (``requires_grad`` off: no gradient, no optimizer state; a part written by
    # hand trains everything), and the largest parameter that trains (the for-loop optimizer's step).
    frozen_bytes: int = 0
    frozen_vector_bytes: int = 0
    largest_trainable_param_bytes: int = 0
    # The weights of one ring (an Embedding's, or the Linears' called on one input), in the stored dtype:
    # what rsdp's messages are shards of; of them the Linears', whose backward message carries the
    # weights beside the partials and needs a scratch (an Embedding's carries its partial alone).
    largest_layer_bytes: int = 0
    largest_linear_bytes: int = 0
    # The trainable weights of one ring: its backward message's gradient partials (an Embedding's, or the
    # Linears' called on one input; a frozen ring's backward carries its weights alone, or nothing).
    largest_trainable_layer_bytes: int = 0
    largest_trainable_linear_bytes: int = 0
    # An Embedding ring's own temporaries: a buffer of the looked-up rows (forward: the selected rows,
    # in param_dtype; backward: the masked output gradient, in reduce_dtype), counted in elements of
    # its largest call's output times the stored itemsize.
    embedding_rows_bytes: int = 0
    # Of them its largest ring of several Linears (weights, stored dtype): a ring of groups gathers and
    # reduces their shards in a staging area behind the block (``_wire.BlockRegions``).
    largest_shared_linear_bytes: int = 0
    # The model's vectors (every part's, stored dtype): their collectives ride one ring of a pass behind
    # its message (``_fully_shard/_collectives.py``), which may be any part's.
    model_vector_bytes: int = 0
    # The outputs of its rings (Linears, Embeddings) inside a ``ring_checkpoint_context`` region, which
    # saves nothing else: rsdp keeps them from the forward for the recomputation (``_fully_shard/_checkpoint.py``).
    # (Another selective policy saves matmul outputs itself, which the count holds already.)
    checkpointed_ring_output_bytes: int = 0
    # Its Embeddings' rings in a forward (calls) and their weights (stored dtype): an Embedding's forward
    # ring is never prefetched (its first message carries the out-of-range flag, known once called) and
    # its backward moves gradient partials alone (``ring_traffic``).
    embedding_rings: int = 0
    embedding_bytes: int = 0
    # The rings rsdp runs in one forward call of the part, as the engine forms them (the Linears called
    # on one input share one, an Embedding has one, an experts module one of both projections:
    # ``expert_rings_of``, and one more backward: ``expert_rings``; norms and other vectors ride them), and the weights they rotate (stored
    # dtype, once per ring that uses them): what ``ring_traffic`` counts messages and backward bytes by.
    rings: int = 0
    ring_weight_bytes: int = 0
    # Its largest experts module (a MoE layer's ``[experts, ...]`` parameters, ``experts_of``): its
    # parameter bytes in the stored dtype, of them those that train, those of its larger backward ring
    # (the up projection's: ``_fully_shard/_experts.py`` rotates them in blocks of whole experts, one
    # ring of both projections forward, one per projection backward) and of them those that train, and
    # its number of experts. ``expert_rings``: its experts modules on expert rings, each a ring more in
    # a backward than in a forward (``ring_traffic``).
    experts_bytes: int = 0
    trainable_experts_bytes: int = 0
    up_bytes: int = 0
    trainable_up_bytes: int = 0
    up_parameters: int = 0  # how many parameters its up ring rotates (several: staged on a ring of groups)
    experts: int = 0
    expert_rings: int = 0
    # What its expert rings' forwards keep less than the stock experts' (``dropped_activation_bytes``).
    dropped_expert_activation_bytes: int = 0
    layers: int = 0
    forward_flops: int = 0
    recomputed_flops: int = 0  # what activation checkpointing runs again in its backward
    calls: int = 0  # its forwards in a step: 1, or a chunked loss's chunks for its head
    linear_flops: int = 0  # of them, the Linears' GEMMs (what rsdp splits into shards)
    forward_work: Work = Work()  # its forward's attention and memory-bound work (``Work``)
    recomputed_work: Work = Work()  # of that, what activation checkpointing runs again in backward
    itemsize: int = 0  # of its parameters as the model stores them (before a mixed-precision cast)

    def add_layer(self, module: nn.Module, seen: set[int]) -> None:
        """Count ``module``'s own parameters, each parameter once however often it is tied (``seen``
        holds the identities of the original model's parameters, which moving to meta does not keep)."""
        originals = getattr(module, "_rsdp_original_params", {})
        up_ring = up_ring_of(module)
        self.expert_rings += on_expert_rings(module)
        layer_bytes = trainable_bytes = up_bytes = trainable_up_bytes = 0
        for name, param in module.named_parameters(recurse=False):
            identity, itemsize = originals.get(name, (id(param), param.element_size()))
            nbytes = param.numel() * itemsize
            self.itemsize = max(self.itemsize, itemsize)
            layer_bytes += nbytes
            trainable_bytes += nbytes if param.requires_grad else 0
            if name in up_ring:
                up_bytes += nbytes
                trainable_up_bytes += nbytes if param.requires_grad else 0
            if identity not in seen:
                seen.add(identity)
                self.param_bytes += nbytes
                self.vector_bytes += nbytes if param.dim() < 2 else 0
                if param.requires_grad:
                    self.largest_trainable_param_bytes = max(self.largest_trainable_param_bytes, nbytes)
                else:
                    self.frozen_bytes += nbytes
                    self.frozen_vector_bytes += nbytes if param.dim() < 2 else 0
        if layer_bytes:  # a tied weight is stored once but still moves wherever it is used
            self.layers += 1
        experts = experts_of(module)
        if experts and layer_bytes > self.experts_bytes:
            self.experts_bytes, self.trainable_experts_bytes, self.experts = layer_bytes, trainable_bytes, experts
            self.up_bytes, self.trainable_up_bytes, self.up_parameters = up_bytes, trainable_up_bytes, len(up_ring)


def experts_of(module: nn.Module) -> int:
    """The number of experts of ``module`` if it is a MoE layer's experts module (Hugging Face's, marked by
    ``use_experts_implementation``; torchtitan's ``GroupedExperts``): every parameter of its own is
    ``[experts, ...]`` and one is 3-D, a stack of matrices. Else 0."""
    params = list(module.parameters(recurse=False))
    if not any(p.dim() == 3 for p in params) or any(p.dim() < 2 or p.shape[0] != params[0].shape[0] for p in params):
        return 0
    return params[0].shape[0]


_EXPERT_RING_KINDS = ((is_experts_module, ExpertsBlock), (is_grouped_experts, GroupedExpertsBlock), (is_llama4_experts, Llama4ExpertsBlock))


def on_expert_rings(module: nn.Module) -> bool:
    """Whether rsdp rotates ``module`` on expert rings (``_fully_shard/_experts.py``)."""
    return any(recognised(module) for recognised, _ in _EXPERT_RING_KINDS)


def dropped_activation_bytes(module: nn.Module, args: tuple) -> int:
    """What the stock experts ``module`` keep from a call's forward to its backward that rsdp's expert
    rings do not (``_fully_shard/_experts.py``: they keep the routed rows and the up projection's output,
    and compute the activation again in backward); 0 for any other module."""
    for recognised, block in _EXPERT_RING_KINDS:
        if recognised(module):
            return block.dropped_activation_bytes(module, args)
    return 0


def expert_rings_of(module: nn.Module) -> int:
    """The rings rsdp runs in a forward call of ``module`` if it is an experts module (``experts_of``):
    one (on expert rings both projections ride one forward ring, ``_fully_shard/_experts.py``; another
    experts module is one parameterised module's ring). Else 0. The backward runs one more on expert
    rings (``PartCounts.expert_rings``)."""
    return 1 if on_expert_rings(module) or experts_of(module) else 0


def up_ring_of(module: nn.Module) -> tuple[str, ...]:
    """The parameters of ``module``'s larger backward expert ring (the up projection's) if rsdp rotates it
    on expert rings (``_fully_shard/_experts.py``), or all its parameters if it is another experts module
    (``experts_of``), else none."""
    for recognised, block in _EXPERT_RING_KINDS:
        if recognised(module):
            return block.ring_parameters(module)[0]
    return tuple(name for name, _ in module.named_parameters(recurse=False)) if experts_of(module) else ()


@dataclasses.dataclass
class Counts:
    units: dict[str, PartCounts]
    before: PartCounts  # the root's parameters and work before the first unit
    after: PartCounts  # after the last unit: the head and the loss
    activations: StepPhases  # the step's phases, without parameters and their gradients
    # The caching allocator's reserved peak over the allocated peak when it replays the step's log
    # (``_allocator``), without and with expandable segments (1.0: not replayed). Of the step that ran:
    # for a stack of alike blocks, the four counted (their pattern repeats), so it is left out of the
    # comparison of a cut count with a whole one.
    reserved_per_allocated: tuple[float, float] = dataclasses.field(default=(1.0, 1.0), compare=False)


class _MetaStorages(TorchDispatchMode):
    """``MemoryTracker``'s storage count (fresh results of every op, freed when their storage dies),
    for the meta device, whose storages it leaves out elsewhere, and the FLOPs (``torch.utils.flop_counter``'s
    formulas, as ``FlopCounterMode`` counts them) of every op of the step's forward (``counting_flops``,
    outside a backward: a chunked loss runs its chunks' backwards inside it) and of a recomputation
    (``recomputing``, in the backward).

    Allocations, frees and marks are logged in the order the step makes them, and the phases are
    computed from the log afterwards (:meth:`levels`), leaving out the allocations that autograd turned
    into parameter gradients: that is known only when it accumulates them, after the phases that made
    them had passed their peaks. One run, where replaying the step would take two."""

    def __init__(self):
        super().__init__()
        self.log: list[tuple] = []  # (ALLOCATED, number, storage key, bytes) | (FREED, storage key) | (MARKED,)
        self.allocations = 0
        self.allocation_of: dict[int, int] = {}  # live storage identity -> its allocation's number
        self.flops = 0
        self.work = Work()  # by kind (``Work``), counted where the FLOPs are
        self.counting_flops = True
        self.recomputing = False
        self.norm_depth = 0  # inside a norm module (``_StepCounter``'s hooks say so)
        self.in_loss = False  # after the model's forward returned, before the backward

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        counted = self.recomputing or (self.counting_flops and not in_backward())
        if counted:
            self._count(func, args, kwargs, out)
        if all(ret.alias_info is None for ret in func._schema.returns):
            for leaf in tree_leaves(out):
                if isinstance(leaf, torch.Tensor):
                    storage = leaf.untyped_storage()
                    key = id(storage)
                    if key not in self.allocation_of:
                        weakref.finalize(storage, self._freed_storage, key)
                    self.allocation_of[key] = self.allocations
                    self.log.append((_ALLOCATED, self.allocations, key, storage.nbytes()))
                    self.allocations += 1
        return out

    def _count(self, func, args, kwargs, out) -> None:
        """``func``'s FLOPs, and its work by kind (``Work``)."""
        packet = func._overloadpacket
        if packet in flop_registry:
            flops = flop_registry[packet](*args, **kwargs, out_val=out)
            self.flops += flops
            if packet in _ATTENTION:
                executed = flops / 2 if _argument(func, args, kwargs, "is_causal") else flops
                window, keys = _attention_window.get(), args[1].shape[-2]
                if window is not None and window < keys and _argument(func, args, kwargs, "is_causal"):
                    executed = flops * (window * window / 2 + (keys - window) * window) / keys**2
                self.work += Work(attention_flops=flops, attention_executed_flops=executed)
            return
        if func.is_view or packet.__name__.startswith(_NO_TRAFFIC):
            return
        moved = tree_leaves(out) if packet.__name__.startswith(_LOOKUPS) else tree_leaves((args, kwargs, out))
        nbytes = sum(t.numel() * t.element_size() for t in moved if isinstance(t, torch.Tensor))
        nbytes *= 2 if packet.__name__.startswith(_LOOKUPS) else 1
        kind = "loss_bytes" if self.in_loss else "norm_bytes" if self.norm_depth else "elementwise_bytes"
        self.work += Work(**{kind: nbytes})

    def _freed_storage(self, key: int) -> None:
        del self.allocation_of[key]
        self.log.append((_FREED, key))

    def mark(self) -> tuple[int, int]:
        self.log.append((_MARKED,))
        return 0, 0  # known once the step is over: :meth:`levels`

    def levels(self, skipped: set[int]) -> list[tuple[int, int]]:
        """At every mark, the live bytes and the highest level since the previous mark, leaving out the
        allocations numbered in ``skipped``."""
        live: dict[int, int] = {}
        current = peak = 0
        levels = []
        for event in self.log:
            if event[0] == _ALLOCATED:
                _, number, key, nbytes = event
                if number not in skipped:
                    current += nbytes - live.get(key, 0)
                    live[key] = nbytes
                    peak = max(peak, current)
            elif event[0] == _FREED:
                current -= live.pop(event[1], 0)
            else:
                levels.append((current, peak))
                peak = current
        return levels


_ALLOCATED, _FREED, _MARKED = range(3)
# Attention ops: their FLOPs run at their own rate (``Work``).
# A sliding window (each query attends to the last ``window`` keys, itself included) under which the
# causal attention ops run: a flash kernel runs only the tiles inside it (:func:`attention_window`).
_attention_window: contextvars.ContextVar[int | None] = contextvars.ContextVar("attention_window", default=None)


@contextlib.contextmanager
def attention_window(window: int | None):
    """Count the causal attention ops run inside as a sliding window of ``window`` keys (None: the whole
    causal triangle): their executed FLOPs (``Work.attention_executed_flops``) are the window's band,
    the triangle of its first ``window`` queries and ``window`` keys for each later one; their FLOPs as
    ``torch.utils.flop_counter`` counts them (the square) and their memory do not change."""
    token = _attention_window.set(window)
    try:
        yield
    finally:
        _attention_window.reset(token)


_ATTENTION = {packet for packet in flop_registry if "attention" in getattr(packet, "__name__", "")}
# Ops that allocate without reading or writing the memory.
# (``_unsafe_view`` is a view that does not say so.)
_NO_TRAFFIC = ("empty", "new_empty", "detach", "lift_fresh", "_local_scalar_dense", "_unsafe_view")
# Lookups read the rows they return, not their whole table: their output's bytes twice.
_LOOKUPS = ("embedding", "nll_loss_forward", "gather", "index_select")


def _argument(func, args: tuple, kwargs: dict, name: str):
    """The value of ``func``'s argument ``name`` in a call (its default when not passed)."""
    for index, argument in enumerate(func._schema.arguments):
        if argument.name == name:
            return kwargs[name] if name in kwargs else args[index] if index < len(args) else argument.default_value
    return None


def work_of(fn, *inputs: torch.Tensor) -> Work:
    """The work of ``fn(*inputs)`` as the count charges it, counted on the meta device (its memory-bound
    bytes as elementwise ones): what ``rsdp calibrate`` divides by the time the same call takes."""
    storages, inputs = _MetaStorages(), [tensor.to("meta") for tensor in inputs]
    with storages:
        fn(*inputs)
    return storages.work


def count(model: nn.Module, units: list[str], batch: torch.Tensor, loss_fn, param_dtype: torch.dtype | None = None) -> Counts:
    """Counts for every unit, for the root's work before the first unit and after the last, and the
    activation phases of one training step (``loss_fn(model, batch).backward()``) computed in
    ``param_dtype`` (a mixed-precision policy's: the floating parameters are cast to it, so the
    activations are in it as FSDP2's and rsdp's compute makes them; parameter bytes are still counted
    in the model's own dtype). Activation checkpointing applied to ``model`` is counted as it runs:
    what its regions save, and their recomputation in backward. A stack of blocks is counted by a
    few of each kind (``_repeated_blocks``), to the byte what counting all of them gives."""
    return count_folded(model, units, batch, loss_fn, param_dtype)[0]


def count_folded(
    model: nn.Module, units: list[str], batch: torch.Tensor, loss_fn, param_dtype: torch.dtype | None = None,
    folded: Sequence[str] = (),
) -> tuple[Counts, Counts | None]:
    """:func:`count`'s counts, and from the same step those of ``folded`` units made the root's (``None``
    without): what :func:`count` gives with the other units alone (``fold``), the step of a root that
    holds them (``Planner``'s ``replicated_in_root``). Folded units ``fold`` cannot derive exactly are
    counted again with the others alone (``_foldable``)."""
    others = [name for name in units if name not in folded]
    if not others:
        raise ValueError(f"rsdp.plan: every unit ({', '.join(folded)}) is to be the root's; leave at least one unit.")
    if folded and not _foldable(model, units, folded):
        return count(model, units, batch, loss_fn, param_dtype), count(model, others, batch, loss_fn, param_dtype)
    batch = batch.to("meta")
    repeated = repeated_blocks(model, units)
    if repeated is not None and not set(folded) & set(repeated.names):  # a block folded: its stack counted whole
        kept = [name for name in units if name not in repeated.names or name in repeated.kept]
        with repeated.cut():  # copied cut: a 70B model's 80 blocks take seconds to copy
            meta = meta_copy(model, param_dtype)
        try:
            counted = _count_step(meta, kept, batch, loss_fn, repeated.whole_step_events, folded)
        except Exception:  # a forward that needs every block (indexes its stack): counted whole below
            counted = None
        if counted is not None and all(
            _alike(counts, *pair) for counts in counted if counts is not None for pair in repeated.compared
        ):
            whole, without = counted
            every_block = _with_model_vectors(_with_every_block(whole, units, repeated.representative))
            if without is None:
                return every_block, None
            return every_block, _with_model_vectors(_with_every_block(without, others, repeated.representative))
    return _count_step(meta_copy(model, param_dtype), units, batch, loss_fn, folded=folded)


def _foldable(model: nn.Module, units: list[str], folded: Sequence[str]) -> bool:
    """Whether ``fold`` derives the step with the ``folded`` units the root's exactly: each is one module
    with no submodules (so it runs once a call: a torchtitan head), and the root has no Linear of its own
    (one could take a folded Linear's input, and the root would run both on one ring)."""
    modules = dict(model.named_modules())
    if any(next(modules[name].children(), None) is not None for name in folded):
        return False
    in_units = {id(module) for name in units for module in modules[name].modules()}
    return not any(isinstance(module, nn.Linear) and id(module) not in in_units for module in model.modules())


def _with_model_vectors(counts: Counts) -> Counts:
    """``counts`` with every part knowing the model's vectors (``PartCounts.model_vector_bytes``): a
    cut count's (``_with_every_block``) are its whole stack's."""
    parts = (*counts.units.values(), counts.before, counts.after)
    vectors = sum(part.vector_bytes for part in parts)
    for part in parts:
        part.model_vector_bytes = vectors
    return counts


def meta_copy(model: nn.Module, param_dtype: torch.dtype | None = None) -> nn.Module:
    """``model`` on the meta device with its floating parameters in ``param_dtype``, every module
    noting its original parameters' identities and sizes (``PartCounts.add_layer``)."""
    meta = copy.deepcopy(model).to("meta")
    for original, moved in zip(model.modules(), meta.modules()):
        moved._rsdp_original_params = {
            name: (id(p), p.element_size()) for name, p in original.named_parameters(recurse=False)
        }
    if param_dtype is not None:
        for param in meta.parameters():
            if param.is_floating_point():
                param.data = param.data.to(param_dtype)
    return meta


def _alike(counts: Counts, first: str, second: str) -> bool:
    phases = counts.activations
    return counts.units[first] == counts.units[second] and all(
        phase[first] == phase[second] for phase in (phases.forward, phases.backward)
    )


def _with_every_block(counts: Counts, units: list[str], representative) -> Counts:
    """``counts`` of a step that ran some of ``units``, for all of them: each takes its ``representative``'s."""
    phases = counts.activations
    return Counts(
        {name: dataclasses.replace(counts.units[representative(name)]) for name in units},
        counts.before,
        counts.after,
        dataclasses.replace(
            phases,
            forward={name: phases.forward[representative(name)] for name in units},
            backward={name: phases.backward[representative(name)] for name in units},
        ),
        counts.reserved_per_allocated,
    )


def count_step(meta: nn.Module, units: list[str], batch: torch.Tensor, loss_fn, whole_step=None) -> Counts:
    """:func:`count`'s one training step of ``meta`` (on the meta device): each part's forward FLOPs and
    parameters, and the step's phases without the parameters' gradients, which are the strategies' to
    count (whole, sharded, or one shard at a time). ``whole_step`` (a cut stack's
    ``RepeatedBlocks.whole_step_events``) turns the step's allocator events into the whole stack's."""
    return _count_step(meta, units, batch, loss_fn, whole_step)[0]


def _count_step(meta: nn.Module, units: list[str], batch: torch.Tensor, loss_fn, whole_step=None,
                folded: Sequence[str] = ()) -> tuple[Counts, Counts | None]:
    """:func:`count_step`, and the same step's counts with the ``folded`` units the root's (``fold``)."""
    counter = _StepCounter(meta, units, batch, loss_fn)
    handles = counter.hooks()
    try:
        with counter.storages:
            timeline = run_marked_step(meta, units, counter.storages, counter.step)
    finally:
        for handle in handles:
            handle.remove()
    timeline.relevel(counter.storages.levels(counter.gradients))
    counter.per_call()
    events = _allocator_events(counter.storages.log, counter.gradients, timeline.order)
    if whole_step is not None:
        events = whole_step(events)
    reserved = tuple(_allocator_factor(events, expandable) for expandable in (False, True))
    counts = _with_model_vectors(Counts(counter.per_unit, counter.before, counter.after, StepPhases.of(timeline, units), reserved))
    return counts, fold(counts, timeline, folded) if folded else None


def fold(counts: Counts, timeline, folded: Sequence[str]) -> Counts:
    """``counts`` (of the step ``timeline`` marked) with the ``folded`` units the root's, as the step
    counted with the other units alone attributes them: each one's forward runs in the root's part
    before the units if no other unit ran before it, else after them; its phases are the other units'
    and the root's (its marks left out: ``_Timeline.without``). The root counts a module's layers and
    rings at each of its calls, and no recomputation of its modules (``_StepCounter``), so a folded
    unit's are taken per call and its recomputation is dropped. That is what counting the step again
    without them as units gives (``tests/test_planner.py``; every torchtitan model's head, checked while
    this was written) where each of their modules runs once a call and no Linear of the root takes the
    input one of theirs takes (the root would run both on one ring); else the two differ
    in those modules' layers and rings, so ``count_folded`` counts such a step again (``_foldable``)."""
    kept = [name for name in counts.units if name not in folded]
    first = min(timeline.order.index(f"forward:{name}") for name in kept)
    before, after = dataclasses.replace(counts.before), dataclasses.replace(counts.after)
    for name in folded:
        _fold_into(before if timeline.order.index(f"forward:{name}") < first else after, counts.units[name])
    units = {name: dataclasses.replace(counts.units[name]) for name in kept}
    return _with_model_vectors(
        Counts(units, before, after, StepPhases.of(timeline.without(folded), kept), counts.reserved_per_allocated)
    )


# How a unit's counts join the root's part it runs in (``fold``), field by field of ``PartCounts``: summed,
# the larger kept, taken once per call (the root counts a module's layers and rings at every call; a
# unit once, or per call: ``per_call``), the root's own (its calls; the recomputation of its modules, which
# the count does not see; the model's vectors, recounted), and the larger experts module's whole.
_SUMMED = ("param_bytes", "vector_bytes", "frozen_bytes", "frozen_vector_bytes", "checkpointed_ring_output_bytes",
           "embedding_rings", "embedding_bytes", "dropped_expert_activation_bytes", "forward_flops", "linear_flops",
           "forward_work")
_LARGER = ("largest_trainable_param_bytes", "largest_layer_bytes", "largest_linear_bytes", "largest_trainable_layer_bytes",
           "largest_trainable_linear_bytes", "embedding_rows_bytes", "largest_shared_linear_bytes", "itemsize")
_PER_CALL = ("rings", "ring_weight_bytes", "layers", "expert_rings")
_ROOTS_OWN = ("calls", "recomputed_flops", "recomputed_work", "model_vector_bytes")
_EXPERTS = ("experts_bytes", "trainable_experts_bytes", "up_bytes", "trainable_up_bytes", "up_parameters", "experts")


def _fold_into(root: PartCounts, unit: PartCounts) -> None:
    calls = max(unit.calls, 1)
    for name in _SUMMED:
        setattr(root, name, getattr(root, name) + getattr(unit, name))
    for name in _LARGER:
        setattr(root, name, max(getattr(root, name), getattr(unit, name)))
    for name in _PER_CALL:
        setattr(root, name, getattr(root, name) + getattr(unit, name) * calls)
    if unit.experts_bytes > root.experts_bytes:
        for name in _EXPERTS:
            setattr(root, name, getattr(unit, name))


def _allocator_events(log: list[tuple], skipped: set[int], marks: list[str]) -> list[tuple]:
    """The step's allocations (without the parameters' gradients, numbered in ``skipped``) and frees as
    ``_allocator`` replays them, with its marks (``("mark", label)``)."""
    labels = iter(marks)
    return [
        ("mark", next(labels)) if event[0] == _MARKED else ("malloc", event[2], event[3]) if event[0] == _ALLOCATED
        else ("free", event[1])
        for event in log if not (event[0] == _ALLOCATED and event[1] in skipped)
    ]


def _allocator_factor(events: list[tuple], expandable_segments: bool) -> float:
    """The caching allocator's reserved peak over the allocated peak for ``events``."""
    allocated, reserved = reserved_peak([event for event in events if event[0] != "mark"], expandable_segments)
    return reserved / allocated if allocated else 1.0


class _StepCounter:
    """What ``count_step``'s hooks count while the step runs: which part (a unit, or the root before or
    after the units) the ops run in, each part's layers, Linears and ring outputs, and the FLOPs that
    activation checkpointing recomputes in backward."""

    def __init__(self, meta: nn.Module, units: list[str], batch: torch.Tensor, loss_fn):
        self.meta, self.units, self.batch, self.loss_fn = meta, units, batch, loss_fn
        self.per_unit = {name: PartCounts() for name in units}
        self.before, self.after = PartCounts(), PartCounts()
        self.seen: set[int] = set()
        for name in units:
            for module in meta.get_submodule(name).modules():
                self.per_unit[name].add_layer(module, self.seen)
        self.unit_of = {id(m): self.per_unit[name] for name in units for m in meta.get_submodule(name).modules()}
        self.storages = _MetaStorages()
        self.section, self.flops_at_entry, self.work_at_entry, self.forward = self.before, 0, Work(), True
        # rsdp rotates the Linears called on one input as one message (``_fully_shard/_fusion.py``). An
        # input is known by a serial number, dropped when it dies: a checkpointed region frees its
        # intermediates at once, and a new tensor may then get a freed one's id.
        # (part, input) -> bytes of the weights, and of those that train
        self.shared_input: dict[tuple[int, int], tuple[int, int]] = collections.defaultdict(lambda: (0, 0))
        self.serial_of: dict[int, int] = {}  # live input's id -> its serial number
        self.serials = itertools.count()
        # Activation checkpointing's recomputation in backward: a unit's module runs its forward again.
        # Counted from the outermost such forward to its end (ops a selective policy saved are not run
        # again: the checkpoint's mode answers them before this one sees them).
        self.recompute_depth, self.recomputed_section, self.recompute_flops_at_entry = 0, None, 0
        self.recompute_work_at_entry = Work()
        self.gradients: set[int] = set()  # the allocations of the parameters' gradients

    def hooks(self) -> list:
        handles = []
        for name in self.units:
            module = self.meta.get_submodule(name)
            handles.append(module.register_forward_pre_hook(lambda m, args, name=name: self.enter_unit(name)))
            handles.append(module.register_forward_hook(lambda m, args, out: self.switch_to(self.after)))
        for module in self.meta.modules():
            handles.append(module.register_forward_pre_hook(self.recompute_begins))
            handles.append(module.register_forward_hook(self.recompute_ends))
            if type(module).__name__.endswith("Norm"):  # its ops' bytes are norms' (``Work``)
                handles.append(module.register_forward_pre_hook(lambda m, args: self.enter_norm(1)))
                handles.append(module.register_forward_hook(lambda m, args, out: self.enter_norm(-1)))
            if id(module) not in self.unit_of and any(True for _ in module.parameters(recurse=False)):
                handles.append(module.register_forward_pre_hook(self.note_root_layer))
            if isinstance(module, nn.Linear):
                handles.append(module.register_forward_pre_hook(self.note_linear))
            if isinstance(module, nn.Embedding):
                handles.append(module.register_forward_pre_hook(self.note_embedding))
            if expert_rings_of(module):
                handles.append(module.register_forward_pre_hook(self.note_experts))
            if isinstance(module, (nn.Linear, nn.Embedding)):
                handles.append(module.register_forward_hook(self.note_ring_output))
        # What runs after the model's forward returned is the loss's (``Work``).
        handles.append(self.meta.register_forward_hook(lambda m, args, out: setattr(self.storages, "in_loss", True)))
        handles += [param.register_post_accumulate_grad_hook(self.drop_gradient) for param in self.meta.parameters() if param.requires_grad]
        return handles

    def step(self, timeline) -> None:
        loss = self.loss_fn(self.meta, self.batch)
        self.switch_to(self.after)
        self.storages.in_loss = False  # a recomputation in backward is no loss's
        self.forward = self.storages.counting_flops = False
        loss.backward()
        del loss  # freed before the mark, as a step that never names it frees it
        timeline.mark("backward-done")

    def switch_to(self, section: PartCounts) -> None:
        self.section.forward_flops += self.storages.flops - self.flops_at_entry
        self.section.forward_work += self.storages.work - self.work_at_entry
        self.section, self.flops_at_entry, self.work_at_entry = section, self.storages.flops, self.storages.work

    def enter_norm(self, depth: int) -> None:
        self.storages.norm_depth += depth

    def enter_unit(self, name: str) -> None:
        if self.forward:  # not a recomputation
            self.per_unit[name].calls += 1
        self.switch_to(self.per_unit[name])

    def note_linear(self, module: nn.Linear, args) -> None:
        if not self.forward:  # a checkpointed region recomputing in backward
            return
        part, tensor = self.section, args[0]
        if id(tensor) not in self.serial_of:
            self.serial_of[id(tensor)] = next(self.serials)
            weakref.finalize(tensor, self.serial_of.pop, id(tensor), None)
        key = (id(part), self.serial_of[id(tensor)])
        shared = key in self.shared_input  # the first Linear called on this input starts a ring
        if not shared:
            part.rings += 1
        part.ring_weight_bytes += _weight_bytes(module)
        weights, trainable = self.shared_input[key]  # a bias is a vector: gathered whole, not rotated
        weights += _weight_bytes(module)
        trainable += _weight_bytes(module) if module.weight.requires_grad else 0
        self.shared_input[key] = (weights, trainable)
        part.largest_layer_bytes = max(part.largest_layer_bytes, weights)
        part.largest_linear_bytes = max(part.largest_linear_bytes, weights)
        part.largest_trainable_layer_bytes = max(part.largest_trainable_layer_bytes, trainable)
        part.largest_trainable_linear_bytes = max(part.largest_trainable_linear_bytes, trainable)
        if shared:
            part.largest_shared_linear_bytes = max(part.largest_shared_linear_bytes, weights)
        part.linear_flops += 2 * tensor.numel() * module.out_features

    def note_embedding(self, module: nn.Embedding, args) -> None:
        if self.forward:
            section = self.section
            section.embedding_rings += 1
            section.embedding_bytes += _weight_bytes(module)
            section.rings += 1
            section.ring_weight_bytes += _weight_bytes(module)
            section.largest_layer_bytes = max(section.largest_layer_bytes, _weight_bytes(module))
            rows = args[0].numel() * module.weight.shape[1] * _weight_bytes(module) // module.weight.numel()
            section.embedding_rows_bytes = max(section.embedding_rows_bytes, rows)
            if module.weight.requires_grad:
                section.largest_trainable_layer_bytes = max(section.largest_trainable_layer_bytes, _weight_bytes(module))

    def note_experts(self, module: nn.Module, args) -> None:
        if not self.forward:
            return
        self.section.rings += expert_rings_of(module)
        self.section.ring_weight_bytes += sum(p.numel() * itemsize for p, itemsize in _stored(module))
        # Under activation checkpointing (saved-tensor hooks) the stock experts keep nothing either.
        if not saved_tensors_hooks_active():
            self.section.dropped_expert_activation_bytes += dropped_activation_bytes(module, args)

    def per_call(self) -> None:
        """Rings and their weights per forward call of each part (counted over all of a step's calls),
        as ``layers`` are."""
        for part in (*self.per_unit.values(), self.before, self.after):
            calls = max(part.calls, 1)
            part.rings, part.ring_weight_bytes = part.rings // calls, part.ring_weight_bytes // calls

    def note_ring_output(self, module: nn.Module, args, output) -> None:
        if self.forward and isinstance(output, torch.Tensor) and in_ring_checkpoint_forward():
            self.section.checkpointed_ring_output_bytes += output.untyped_storage().nbytes()

    def note_root_layer(self, module: nn.Module, args) -> None:
        if self.forward:
            self.section.add_layer(module, self.seen)

    def recompute_begins(self, module: nn.Module, args) -> None:
        if self.forward or (self.recompute_depth == 0 and id(module) not in self.unit_of):
            return
        if self.recompute_depth == 0:
            self.recomputed_section, self.recompute_flops_at_entry = self.unit_of[id(module)], self.storages.flops
            self.recompute_work_at_entry = self.storages.work
            self.storages.recomputing = True
        self.recompute_depth += 1

    def recompute_ends(self, module: nn.Module, args, output) -> None:
        if self.forward or self.recompute_depth == 0:
            return
        self.recompute_depth -= 1
        if self.recompute_depth == 0:
            self.recomputed_section.recomputed_flops += self.storages.flops - self.recompute_flops_at_entry
            self.recomputed_section.recomputed_work += self.storages.work - self.recompute_work_at_entry
            self.storages.recomputing = False

    def drop_gradient(self, param: nn.Parameter) -> None:
        self.gradients.add(self.storages.allocation_of[id(param.grad.untyped_storage())])
        param.grad = None


def _stored(module: nn.Module) -> list[tuple[nn.Parameter, int]]:
    """``module``'s own parameters with their stored itemsize (the meta copy may be cast)."""
    originals = getattr(module, "_rsdp_original_params", {})
    return [(p, originals.get(name, (None, p.element_size()))[1]) for name, p in module.named_parameters(recurse=False)]


def _weight_bytes(module: nn.Module) -> int:
    """A Linear's or Embedding's weight in its stored dtype (the meta copy may be cast)."""
    _, itemsize = getattr(module, "_rsdp_original_params", {}).get("weight", (None, module.weight.element_size()))
    return module.weight.numel() * itemsize


@dataclasses.dataclass(frozen=True)
class RingTraffic:
    """One part's rsdp rings in one pass, on one rank, as ``rsdp.memory.CommCounter`` counts them: its
    exchanges between groups (between ranks where g = 1: ``between_groups``) and the bytes it sends in
    them, and its collectives within its group (the blocks' all-gathers, in backward the partials'
    reduce-scatters: ``within_groups``) and the bytes it sends in those. Prefetch across rings makes
    ``exchanges`` fractional where every other ring is prefetched (a part of an odd number of rings)."""

    exchanges: float = 0.0
    exchange_bytes: float = 0.0
    collectives: int = 0
    collective_bytes: float = 0.0


class _Parallelism:
    """What one part's parameters cost on one rank under one strategy (rsdp: in rings of groups of
    ``ring_group_size``)."""

    def __init__(self, counts: PartCounts, strategy: Strategy, cost: CostModel, ring_group_size: int = 1):
        self.counts, self.strategy, self.cost = counts, strategy, cost
        # A part with no ring of its own (vectors only) has no group to form: the flat ring's figures, so
        # that the search's tie between its group sizes keeps 1.
        self.ring_group_size = ring_group_size if counts.largest_layer_bytes else 1
        world = cost.world_size
        whole = strategy is Strategy.REPLICATE or world == 1

        def on_one_rank(nbytes: int) -> int:
            return nbytes if whole else math.ceil(nbytes / world)

        # Every parameter is stored (sharded or whole); the trainable ones alone have gradients, optimizer
        # state and a share of the optimizer step.
        self.params = counts.param_bytes
        trainable = counts.param_bytes - counts.frozen_bytes
        self.local = on_one_rank(self.params)
        self.local_gradients = on_one_rank(trainable)
        self.static = int(self.local + self.local_gradients * cost.optimizer_state_bytes_per_param_byte)
        # The optimizer step's temporaries per byte of the parameters on this rank (foreach; the for-loop
        # implementation's, of the largest parameter, are ``estimate_root``'s floor).
        self.largest_local = on_one_rank(counts.largest_trainable_param_bytes)
        self.optimizer_step = int(self.local_gradients * cost.optimizer_step_bytes_per_param_byte)
        # The for-loop implementation's, of one parameter at a time: its largest on one rank.
        self.optimizer_step_floor = int(self.largest_local * cost.optimizer_step_bytes_per_largest_param_byte)
        # Bytes per stored parameter byte of the gathered copies (param_dtype) and of the gradients
        # that are reduced (reduce_dtype).
        stored = counts.itemsize or 1
        self.compute_ratio = cost.param_dtype.itemsize / stored if cost.param_dtype else 1.0
        self.reduce_ratio = cost.reduce_dtype.itemsize / stored if cost.reduce_dtype else self.compute_ratio
        self.compute = int(self.params * self.compute_ratio)  # a gathered copy
        self.compute_gradients = int(trainable * self.compute_ratio)  # its gradient
        self.reduced = int(trainable * self.reduce_ratio)  # the gradient as it is reduced
        # The ring's buffers (``_fully_shard/_buffers.py``), one set per process: a pair of message
        # buffers (``ring``, ``ring_forward``), each as large as the largest message of a pass, and a
        # scratch (``ring_scratch``, ``ring_forward_scratch``) as large as its largest request; the two
        # are sized apart, so a plan holds the largest pair and the largest scratch of its rings. Flat
        # ring: in forward two messages of a weight shard of its largest ring; in backward two messages
        # of a weight shard and a gradient partial for a Linear ring (partials of its trainable weights
        # alone) and a scratch of the next contribution, two of a partial for an Embedding's (its
        # gradient needs no weights, and its sparse contribution is added into the arrived partial). A
        # ring of groups of g holds two member messages (this rank's shards, as a ring of ranks' messages)
        # and in the scratch the block of g shards its group assembles from them, of the weights in
        # forward and in backward of the weights and the partials alike (the block's contributions,
        # reduce-scattered into the piece that travels on), and behind the block the staging area of the
        # collectives within the group, g member messages of the weights or of the partials, for a
        # message of several segments (Linears on one input, an up ring of several parameters, an
        # Embedding's rows and flag) and for the one the model's vectors ride (``_ring._WithinGroup``),
        # taken to be an Embedding's where the part has one (the backward's last ring, the forward's
        # first). The vectors' shard rides behind a message.
        def shard(nbytes: int) -> int:
            return math.ceil(nbytes / world)

        group = self.ring_group_size
        rsdp = strategy is Strategy.RSDP
        # An expert ring: a block is ceil(experts / W) whole experts (torch.chunk rows), its weights in
        # param_dtype and its gradient partials in reduce_dtype (``_fully_shard/_sub_block.py``).
        # Forward, one ring of both projections: two blocks of all the experts' weights, staged on a ring
        # of groups (several parameters). Backward, the up projection's ring, the larger: two messages of
        # [partials | weights], and as the ring ends the owner's reduced shards copied out of them, which become the
        # rank's gradient shard (counted with the part's gradients); a ring of groups holds the group's
        # block of g blocks beside them, and stages an up ring of several parameters. A step writes its
        # weight gradients into the partial expert by expert (``_experts.ExpertStage.weight_gradients``),
        # where it computes in their dtype with no copy, else through one expert's product (param_dtype).
        block = math.ceil(counts.experts / world) / counts.experts if counts.experts else 0.0
        expert_weights = counts.up_bytes * block * self.compute_ratio
        expert_partials = counts.trainable_up_bytes * block * self.reduce_ratio
        written_into_partials = self.compute_ratio == self.reduce_ratio
        one_expert = counts.trainable_up_bytes / counts.experts if counts.experts else 0.0
        self.expert_step = int(one_expert * self.compute_ratio) if rsdp and not written_into_partials else 0
        all_expert_weights = counts.experts_bytes * block * self.compute_ratio
        rider = shard(counts.model_vector_bytes) * self.compute_ratio
        table = counts.embedding_bytes / counts.embedding_rings if counts.embedding_rings else 0
        weights = max(shard(counts.largest_layer_bytes) * self.compute_ratio, all_expert_weights) + rider
        linear_weights = shard(counts.largest_linear_bytes) * self.compute_ratio
        linear_partials = shard(counts.largest_trainable_linear_bytes) * self.reduce_ratio
        layer_partials = shard(counts.largest_trainable_layer_bytes) * self.reduce_ratio
        if group == 1:
            forward_scratch = 0.0
            scratch = max(linear_partials, expert_partials)
        else:
            staged_forward = max(
                shard(counts.largest_shared_linear_bytes) * self.compute_ratio,
                shard(table) * self.compute_ratio,
                all_expert_weights,
            )
            forward_scratch = group * (weights + staged_forward)
            shared = shard(counts.largest_shared_linear_bytes) * max(self.compute_ratio, self.reduce_ratio)
            staged = max(shared, min(shard(table) * self.reduce_ratio, layer_partials), max(expert_weights, expert_partials) if counts.up_parameters > 1 else 0.0)
            scratch = group * (max(linear_weights + linear_partials, layer_partials, expert_weights + expert_partials) + staged + rider)
        rings = rsdp and bool(counts.largest_layer_bytes or counts.experts)  # a part of vectors alone has none
        self.ring_forward = int(2 * weights) if rings else 0
        self.ring_forward_scratch = int(forward_scratch) if rings else 0
        self.ring = int(2 * (max(linear_weights + linear_partials, layer_partials, expert_weights + expert_partials) + rider)) if rings else 0
        self.ring_scratch = int(scratch) if rings else 0
        # An Embedding ring's rows (``_fully_shard/_embedding.py``): the forward's selected rows, the
        # backward's masked output gradient.
        self.embedding_rows = (int(counts.embedding_rows_bytes * self.compute_ratio), int(counts.embedding_rows_bytes * self.reduce_ratio))
        self.vectors = int(counts.vector_bytes * self.compute_ratio)  # gathered whole under rsdp
        self.vector_gradients = int((counts.vector_bytes - counts.frozen_vector_bytes) * self.compute_ratio)

    def ring_buffers(self, ringed: bool) -> Carried:
        """The ring's buffers this part asks for, carried into every phase that holds them (``ringed``:
        its own, or every part's below an rsdp root)."""
        return Carried(ring=self.ring, ringed=ringed, ring_forward=self.ring_forward, ring_scratch=self.ring_scratch,
                       ring_forward_scratch=self.ring_forward_scratch)

    def ring_traffic(self, backward: bool) -> RingTraffic:
        """What this part's rings send on one rank in a forward (or ``backward``) pass under rsdp, as
        ``rsdp.memory.CommCounter`` counts it (nothing under another strategy), ring by ring as the
        engine forms them (``PartCounts.rings``). A ring of groups of g makes W/g steps; between them
        W/g - 1 exchanges, of one shard of its weights in forward (the part's vectors and matrices with
        no ring of their own ride them: all its parameters) and in backward of its ring weights (the
        vectors stay from the forward) with a gradient partial of every trainable parameter beside
        them (an Embedding's backward: the partial alone). Forward,
        every ring but an Embedding's is prefetched: its first message rides the last exchange of the
        ring before (``_fully_shard/_prefetch.py``), so it makes one exchange fewer; a ring left with
        none (W/g = 2) carries nothing, so there every other ring is prefetched. The pass's first ring
        is not prefetched: this counts it as if it were, unless it is an Embedding's (a language
        model's first ring), so a pass that starts with another ring makes one exchange more. Within
        the group (g > 1), per step: the all-gather of the block's g - 1 other shards, in backward
        (but not an Embedding's, which needs no weights) and, where the weights train, the
        reduce-scatter of its partials. An experts module's forward is one ring, its backward two (the
        down projection's, then the up projection's), which together send its weights and partials once."""
        if self.strategy is not Strategy.RSDP or self.cost.world_size == 1 or self.counts.param_bytes == 0:
            return RingTraffic()
        counts, world, group = self.counts, self.cost.world_size, self.ring_group_size
        calls = max(counts.calls, 1)
        rings = (counts.rings + (counts.expert_rings if backward else 0)) * calls
        if not rings:  # vectors only: gathered whole, no ring of its own
            return RingTraffic()
        steps, embedding_rings = world // group, counts.embedding_rings * calls
        own = steps - 1  # exchanges per ring: each step's block but the first arrives from the group before
        # The bytes each exchange's worth of shards moves, summed over the part's rings.
        if backward:
            weights = (counts.ring_weight_bytes - counts.embedding_bytes) * self.compute_ratio * calls / world
            moved = weights + self.reduced * calls / world
        else:
            weights = moved = self.compute * calls / world
        exchanges = float(rings * own)
        if not backward:
            prefetched = rings - embedding_rings
            exchanges -= prefetched if own >= 2 else prefetched / 2 if own == 1 else 0
        collectives, collective_bytes = 0, 0.0
        if group > 1:
            gathers = (rings - (embedding_rings if backward else 0)) * steps
            scatters = rings * steps if backward and self.reduced else 0
            collectives = gathers + scatters
            collective_bytes = steps * (group - 1) * (weights + (self.reduced * calls / world if backward else 0))
        return RingTraffic(exchanges, own * moved, collectives, collective_bytes)

    @property
    def optimizer_seconds(self) -> float:
        """The optimizer step over this part's parameters on one rank: memory-bound, its traffic over the
        device's memory bandwidth (not modelled where that is unknown)."""
        bandwidth = self.cost.memory_bandwidth_bytes_per_s
        return self.local_gradients * self.cost.optimizer_traffic_per_param_byte / bandwidth if bandwidth else 0.0

    @property
    def backward_flops(self) -> int:
        """Twice the forward's (the gradients of the inputs and of the weights) and what activation
        checkpointing recomputes."""
        return 2 * self.counts.forward_flops + self.counts.recomputed_flops

    def seconds(self, flops: float, backward: bool) -> float:
        """This part's phase: compute of ``flops`` overlapped with moving its weights (and in
        ``backward`` its gradients), as the module docstring states."""
        cost, world, counts = self.cost, self.cost.world_size, self.counts
        # The Linears' share of the phase's FLOPs (activation checkpointing recomputes in proportion).
        linear = counts.linear_flops * flops / counts.forward_flops if counts.forward_flops else 0.0
        work = counts.forward_work.backward() + counts.recomputed_work if backward else counts.forward_work
        compute = cost.compute_seconds(flops, linear, work)
        if world == 1 or counts.param_bytes == 0:
            return compute
        share = (world - 1) / world
        # Where a device computes, the host's work and the transfers run beside it; where the host
        # computes (CPU ranks), it also runs the transfers (gloo copies and reduces on the same cores).
        overlap = max if cost.host_overlaps_compute else operator.add
        across = cost.spans_machines
        if self.strategy is Strategy.RSDP:
            per_call = max(counts.rings, 1)  # a part with no ring (vectors only): one step's worth of time
            rings = per_call * max(counts.calls, 1)  # a chunked loss's head rotates its weights once per chunk
            group = self.ring_group_size
            steps = world // group
            # The shards' penalty is on the Linears' GEMM time alone (at the whole GEMMs' rate): attention
            # and elementwise work are not split. A step computes g/W of the layer.
            # A measured efficiency above 1 (timing noise on a loaded host) is no speed-up: no negative penalty.
            efficiency = min(cost.partial_efficiency(group), 1.0)
            if group > 1:  # its group's all-gathers copy every weight byte in and out of their buffers, as FSDP2's do
                compute += self.params * cost.fsdp_overhead_s_per_byte[backward]
            penalty = linear / (cost.gemm_flops_per_s or cost.flops_per_s) * (1 / efficiency - 1)
            gemms = (compute + penalty) / rings / steps
            host = cost.ring_step_host_s
            step = overlap(gemms, host)
            # Between groups (between ranks where g = 1): the ring's exchanges (``ring_traffic``), each of
            # one message of its bytes on average (a carrying ring's last one holds the next ring's first
            # message too), across machines when the world spans them (a step lasts as long as its
            # slowest exchange); each overlaps one step, and a step with none (a prefetched ring's first,
            # every ring's last) overlaps only its group's collectives.
            traffic = self.ring_traffic(backward)
            exchanges = traffic.exchanges / rings
            exchange = cost.link("send_recv", across).seconds(traffic.exchange_bytes / traffic.exchanges) if traffic.exchanges else 0.0
            # Within the group (g > 1), at every step: the all-gather of its block of g weight shards, and
            # in backward the reduce-scatter of the block's g partials (across machines where a group is
            # several), each overlapping a step's compute (the first step's too: g = W is FSDP's pattern,
            # one all-gather beside the layer's compute).
            gathering, in_group = 0.0, cost.spans_more_than_a_machine(group)
            if group > 1:
                gathering = cost.link("all_gather", in_group).seconds((group - 1) * self.compute / per_call / world, group - 1)
                if backward:
                    gathering += cost.link("reduce_scatter", in_group).seconds((group - 1) * self.reduced / per_call / world, group - 1)
            return rings * ((steps - exchanges) * overlap(step, gathering) + exchanges * overlap(step, exchange + gathering))
        if self.strategy is Strategy.FSDP:
            compute += self.params * cost.fsdp_overhead_s_per_byte[backward]
            transfer = cost.link("all_gather", across).seconds(share * self.compute, world - 1)
            if backward:  # the re-gather (the unit was resharded after its forward), then the reduce
                transfer += cost.link("reduce_scatter", across).seconds(share * self.reduced, world - 1)
            return overlap(compute, transfer)
        compute += self.params * cost.replicate_overhead_s_per_byte[backward]
        if not backward:  # replication communicates in backward only
            return compute
        return overlap(compute, cost.link("all_reduce", across).seconds(2 * share * self.reduced, 2 * (world - 1)))

    def unit(self, forward: Phase, backward: Phase, below_ring_root: bool, called_per_chunk: bool = False) -> UnitCost:
        """The unit's cost, from the activations of its ``forward`` and ``backward``, below a root that
        holds the ring's buffers through its forward (an rsdp root) or not; ``called_per_chunk``: a
        chunked loss's head (``StepPhases.called_per_chunk``), whose forward phase holds its backwards."""
        counts, vectors = self.counts, self.vectors
        compute, reduced = self.compute, self.reduced
        # Of the trainable parameters alone: the gradient on one rank, the unsharded gradient, the
        # vectors' gradients (frozen parameters have none, and nothing of theirs is reduced).
        gradients, compute_gradients, vector_gradients = self.local_gradients, self.compute_gradients, self.vector_gradients
        if self.strategy is Strategy.FSDP:
            # Unsharded parameters and the all-gather output they were copied from while computing (the
            # output outlives the forward: carried); in backward the unsharded parameters and gradients
            # (param_dtype), and at the reduce the reduce-scatter input (reduce_dtype: the copy into it
            # casts; it outlives the phase: carried) and the reduced shard.
            forward_bytes, backward_bytes = (0, 2 * compute), (gradients, compute + compute_gradients + gradients)
            carried = Carried(gather=compute, reduce=reduced, ringed=below_ring_root)
        elif self.strategy is Strategy.REPLICATE:
            # The copy lives from forward to backward. In backward autograd makes the gradients beside it
            # (the phase's compute peak); FSDP2's post-backward then frees the copy, copies the gradients
            # into the reduce-scatter input and frees them, and reduces into the gradient (a replicated
            # reduce-scatter is a copy): at most the larger of the input and the input and gradient less
            # the freed gradients, once the phase's activations are gone.
            forward_bytes = (compute, compute)
            backward_bytes = (gradients - compute, compute_gradients)
            reducing = backward.delta + max(reduced, 2 * reduced - compute_gradients)
            carried = Carried(reduce=reduced, ringed=below_ring_root)
        else:
            # Vectors: gathered with a send and a receive buffer, kept; their gradients and the
            # contributions, which wait for the backward's one reduce-scatter at its end (counted twice:
            # its input is the concatenation of all of them). The ring buffers are carried; a part with
            # no ring of its own (vectors only) holds them only below an rsdp root's forward.
            # Ring outputs inside a selective checkpointing region are kept from the forward to the
            # recomputation, which takes them instead of running the ring again.
            # An expert ring's step may hold one expert's weight gradient. The experts run last in a block's
            # forward, so first in its backward: before any gradient of the part.
            # The expert rings keep less of the experts' activations than the stock experts, whose count
            # this is (``dropped_activation_bytes``): the forward leaves that less, the backward frees it less.
            kept = counts.checkpointed_ring_output_bytes - counts.dropped_expert_activation_bytes
            expert_step = self.expert_step
            rows_forward, rows_backward = self.embedding_rows
            forward_bytes = (vectors + kept, 3 * vectors + kept + counts.dropped_expert_activation_bytes + rows_forward)
            backward_bytes = (gradients + vector_gradients - kept, max(gradients + 2 * vector_gradients, expert_step) + rows_backward)
            carried = self.ring_buffers(ringed=below_ring_root or self.ring > 0)
        backward_peak = backward.peak + backward_bytes[1]
        if self.strategy is Strategy.REPLICATE:
            backward_peak = max(backward_peak, reducing)
        forward_phase = Phase(forward.delta + forward_bytes[0], forward.peak + forward_bytes[1], self.seconds(counts.forward_flops, backward=False))
        backward_phase = Phase(backward.delta + backward_bytes[0], backward_peak, self.seconds(self.backward_flops, backward=True))
        if called_per_chunk:
            forward_phase, backward_phase, carried = self._chunked(forward, forward_bytes, backward_bytes, forward_phase.seconds, backward_phase.seconds, carried)
        return UnitCost(self.static, forward_phase, backward_phase, self.optimizer_seconds, carried, self.optimizer_step,
                        self.optimizer_step_floor)

    def _chunked(
        self, activations: Phase, forward_bytes: tuple, backward_bytes: tuple, forward_seconds: float, backward_seconds: float,
        carried: Carried,
    ) -> tuple[Phase, Phase, Carried]:
        """A chunked loss's head: its backwards run inside its forward phase, whose ``activations`` hold
        theirs, so what its strategy adds to a backward (``backward_bytes``) is added there, above what it
        adds to the forward, and its backward phase only takes the time. Nothing is carried out of it:
        torchtitan keeps an FSDP head unsharded across the chunks and reshards it after the last, each
        chunk's backward ends (with its reduction, or the ring's buffers freed) before the next chunk.
        The ring's buffers are the forward's during a call (which the search adds to every ringed
        forward phase) and the backward's during its backward: the difference is counted here."""
        ring = max(self.ring + self.ring_scratch - self.ring_forward - self.ring_forward_scratch, 0)
        added = max(forward_bytes[1], forward_bytes[0] + backward_bytes[1] + ring)
        phase = Phase(activations.delta + forward_bytes[0] + backward_bytes[0], activations.peak + added, forward_seconds)
        # The loss runs after the root's forward: only the head's own ring holds buffers in it.
        kept = Carried(ringed=self.strategy is Strategy.RSDP, ring_forward=carried.ring_forward, ring_forward_scratch=carried.ring_forward_scratch)
        return phase, Phase(0, 0, backward_seconds), kept


def estimate_units(counts: Counts, strategy: Strategy, root_strategy: Strategy, cost: CostModel,
                   ring_group_size: int = 1) -> dict[str, UnitCost]:
    """Every unit's cost under ``strategy`` (rsdp: in rings of groups of ``ring_group_size``), below a root
    under ``root_strategy``; units with experts run their expert rings in the same groups."""
    phases, below_ring_root = counts.activations, root_strategy is Strategy.RSDP
    return {
        name: _reserved(
            _Parallelism(part, strategy, cost, ring_group_size).unit(
                phases.forward[name], phases.backward[name], below_ring_root, name == phases.called_per_chunk
            ),
            cost, counts,
        )
        for name, part in counts.units.items()
    }


def _reserved(estimate, cost: CostModel, counts: Counts):
    """``estimate`` (a ``UnitCost`` or ``RootCost`` of allocated bytes) in bytes the caching allocator
    reserves for them: every byte figure times ``cost.reserved_per_allocated`` and the factor of the
    allocator's replay of the counted step (``Counts.reserved_per_allocated``, with or without
    expandable segments). A plan's peak is a maximum of sums of these figures, so it scales alike."""
    factor = cost.reserved_per_allocated
    if cost.caching_allocator is not None:
        factor *= counts.reserved_per_allocated[cost.caching_allocator == "expandable_segments"]
    if factor == 1.0:
        return estimate

    def scaled(value):
        if isinstance(value, Phase):
            return dataclasses.replace(value, delta=round(value.delta * factor), peak=round(value.peak * factor))
        if isinstance(value, Carried):
            return dataclasses.replace(value, **{f: round(getattr(value, f) * factor) for f in Carried.BYTES})
        return value

    changes = {field.name: scaled(getattr(estimate, field.name)) for field in dataclasses.fields(estimate)}
    changes.update({
        field.name: round(getattr(estimate, field.name) * factor)
        for field in dataclasses.fields(estimate) if field.name.endswith("bytes")
    })
    return dataclasses.replace(estimate, **changes)


def estimate_root(counts: Counts, strategy: Strategy, cost: CostModel, ring_group_size: int = 1) -> RootCost:
    """The root's cost under ``strategy`` (rsdp: in rings of groups of ``ring_group_size``): its parameters
    are those of the work before the first unit (embedding) and after the last (head); the head's
    gradients appear in the middle phase."""
    embedding, head = (_Parallelism(part, strategy, cost, ring_group_size) for part in (counts.before, counts.after))
    pair = (counts.before, counts.after)
    whole = PartCounts(
        **{name: sum(getattr(part, name) for part in pair)
           for name in ("param_bytes", "vector_bytes", "frozen_bytes", "frozen_vector_bytes", "rings", "ring_weight_bytes")},
        **{
            name: max(getattr(part, name) for part in pair)
            for name in ("largest_trainable_param_bytes", "largest_layer_bytes", "largest_linear_bytes",
                         "largest_trainable_layer_bytes", "largest_trainable_linear_bytes",
                         "embedding_rows_bytes", "largest_shared_linear_bytes", "model_vector_bytes", "itemsize")
        },
    )
    root = _Parallelism(whole, strategy, cost, ring_group_size)
    vectors, vector_gradients = root.vectors, root.vector_gradients
    gradients, head_gradients = root.local_gradients, head.local_gradients  # on one rank, trainable parameters'
    params, reduced = root.compute, root.reduced  # the gathered copy, in param_dtype; the reduced gradient
    before, middle, after = counts.activations.before, counts.activations.middle, counts.activations.after
    if strategy is Strategy.RSDP:
        # Vectors as in units, the head's gradient shards from its backward on; the ring's buffers carried.
        rows_forward, rows_backward = embedding.embedding_rows
        before_bytes = (vectors, 3 * vectors + rows_forward)
        middle_bytes = (head_gradients, head_gradients + 2 * vector_gradients)
        after_bytes = (gradients - head_gradients - vectors, gradients + 2 * vector_gradients + rows_backward)
        carried = root.ring_buffers(ringed=True)
    else:
        # FSDP2 does not reshard its root after forward and replicate keeps its copy: the parameters are
        # whole from the first forward to the end of the backward, the head's gradient from the head's
        # backward; all gradients are reduced at the end, in FSDP2's root post-backward (FSDP: the
        # parameters, beside the gradients the reduce-scatter input and the reduced shard). Replicate's
        # post-backward frees the copy first, then copies the gradients (the head's, and those its own
        # backward made: the embedding's) into the reduce-scatter input, frees them, and reduces into
        # an output of its own, which becomes the gradient.
        gathering = params if strategy is Strategy.FSDP else 0  # the all-gather output, beside the copy-out
        before_bytes = (params, params + gathering)
        middle_bytes = (head.compute_gradients, head.compute_gradients)
        if strategy is Strategy.FSDP:
            reducing = params + gradients
        else:
            reducing = embedding.compute_gradients + max(0, reduced - params, 2 * reduced - params - root.compute_gradients)
        after_bytes = (gradients - params - head.compute_gradients, reducing)
        carried = Carried(gather=gathering)
    # The for-loop optimizer's temporaries of the root's largest trainable parameter on one rank (a
    # unit's are its own ``UnitCost``'s, under the unit's strategy; the foreach one's are the parts').
    return _reserved(RootCost(
        root.static,
        Phase(before.delta + before_bytes[0], before.peak + before_bytes[1], embedding.seconds(counts.before.forward_flops, backward=False)),
        Phase(
            middle.delta + middle_bytes[0],
            middle.peak + middle_bytes[1],
            head.seconds(counts.after.forward_flops, backward=False) + head.seconds(2 * counts.after.forward_flops, backward=True),
        ),
        Phase(after.delta + after_bytes[0], after.peak + after_bytes[1], embedding.seconds(2 * counts.before.forward_flops, backward=True)),
        root.optimizer_seconds,
        carried,
        root.optimizer_step,
        root.optimizer_step_floor,
    ), cost, counts)
