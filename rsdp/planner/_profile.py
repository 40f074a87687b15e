"""Measure what every unit of a model costs under each strategy, on the ranks the model will train on.

One training step of the model with *every* unit under one strategy gives, through hooks at each unit's
forward and backward boundaries, a timeline: the live bytes at each boundary, the peak between
boundaries (``MemoryTracker.mark``) and the time. The timeline is cut into contiguous phases — the root's
work before the first unit, each unit's forward, the root's work between the last unit's forward and
its backward (head, loss), each unit's backward, and the root's work after (optimizer step) — so that
replaying phases measured under different strategies predicts a mixed plan, and reproduces a uniform one
exactly.
"""

import collections
import contextlib
import copy
import dataclasses
import gc
import time
from collections.abc import Callable, Collection
from typing import ClassVar

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .._compat import DTensor
from .._fully_shard import release_ring_buffers
from ..memory import MemoryTracker
from ..policy import Strategy, parallelize


@contextlib.contextmanager
def without_cyclic_gc():
    """Measure deterministically: collect earlier garbage first, and let no collection run inside.

    Autograd graphs and hooks form reference cycles; when the cyclic collector happens to run inside a
    step (which depends on the whole process's allocation history) it frees some of them early. Without
    it the measured peak is reproducible, and an upper bound for a run in which the collector does run.
    """
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@dataclasses.dataclass(frozen=True)
class Phase:
    delta: int  # live bytes at its end minus at its start
    peak: int  # highest live bytes during it, above the level at its start
    seconds: float


@dataclasses.dataclass(frozen=True)
class Carried:
    """Buffers a part's parallelism leaves alive past its own phases, freed at a point that depends on
    the other parts' strategies (the cost model's; a measured phase contains whatever was alive during
    it, so measured costs carry nothing). The search places them (``_search``):

    - ``gather``: FSDP2 keeps a module's all-gather output until the next FSDP module's all-gather (or
      the root's forward ends), and in backward all-gathers a module during the previous FSDP2
      module's backward (prefetch);
    - ``reduce``: FSDP2 (and the FSDP-based ``replicate``) keeps a module's reduce-scatter input until
      the next such module's reduce, or the backward's end;
    - ``ring``, ``ring_forward``: the ring's pair of message buffers in backward and in forward
      (weight shards alone), and ``ring_scratch``, ``ring_forward_scratch`` its scratch (a Linear's
      next contribution, a ring of groups' block): one set per process, each buffer sized apart, so a
      plan's largest pair and largest scratch, in every phase that runs with them (``ringed``: an rsdp
      part's that has a ring, and every part's below an rsdp root, whose forward holds them
      throughout), and in every backward phase after the first that does, to the backward's end: a
      backward that follows its pass's record trims them to what the rest of it needs, but one that
      left it (the first ones, and the one after Linears on one input started sharing a ring) keeps
      the largest it was asked for (``_fully_shard/_schedule.py``).
    """

    BYTES: ClassVar[tuple[str, ...]] = ("gather", "reduce", "ring", "ring_forward", "ring_scratch", "ring_forward_scratch")

    gather: int = 0
    reduce: int = 0
    ring: int = 0
    ringed: bool = False
    ring_forward: int = 0
    ring_scratch: int = 0
    ring_forward_scratch: int = 0


@dataclasses.dataclass(frozen=True)
class UnitCost:
    """One unit under one strategy at one batch size."""

    static_bytes: int  # its parameters and their optimizer state, on one rank
    forward: Phase
    backward: Phase
    optimizer_seconds: float  # its share of the optimizer step
    carried: Carried = Carried()
    optimizer_step_bytes: int = 0  # what the optimizer step allocates for its parameters (the cost model's)
    # What a for-loop optimizer's step allocates for its largest parameter on one rank (the cost model's):
    # a plan's step allocates at least its largest unit's or its root's.
    optimizer_step_floor_bytes: int = 0

    @property
    def seconds(self) -> float:
        return self.forward.seconds + self.backward.seconds + self.optimizer_seconds


@dataclasses.dataclass(frozen=True)
class RootCost:
    """The root's own parameters and work, under one strategy at one batch size."""

    static_bytes: int
    before: Phase  # step start -> first unit's forward
    middle: Phase  # last unit's forward -> its backward: head, loss and their backward
    after: Phase  # first unit's backward done -> step end (measured: the optimizer step included)
    optimizer_seconds: float
    carried: Carried = Carried()
    # The cost model's optimizer step, which it puts after ``after``: the root's share of what it
    # allocates per parameter byte, and what a for-loop optimizer allocates for its largest parameter.
    optimizer_step_bytes: int = 0
    optimizer_step_floor_bytes: int = 0

    @property
    def seconds(self) -> float:
        return self.before.seconds + self.middle.seconds + self.after.seconds + self.optimizer_seconds


def find_units(model: nn.Module) -> list[str]:
    """The modules the root calls, expanding containers and the modules that hold them. A module whose parameters are tied to another
    candidate or to the root stays with the root: FSDP and replicate need a tied parameter in one unit."""
    candidates = []

    def expand(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            # A container, or a module that holds one (Hugging Face's ``model`` around its ``layers``),
            # is expanded into its children: its layers are the units.
            holds_stack = any(isinstance(c, (nn.ModuleList, nn.ModuleDict)) for c in child.children())
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)) or holds_stack:
                expand(f"{path}.", child)
            elif any(True for _ in child.parameters()):
                candidates.append(path)

    expand("", model)
    holders = collections.Counter(id(p) for path in candidates for p in model.get_submodule(path).parameters())
    holders.update(id(p) for p in model.parameters(recurse=False))
    return [
        path
        for path in candidates
        if all(holders[id(p)] == 1 for p in model.get_submodule(path).parameters())
    ]


class _Timeline:
    """Boundary events of one step: (label, live bytes, peak since previous event, time)."""

    def __init__(self, tracker: MemoryTracker):
        self.tracker = tracker
        self.events: dict[str, tuple[int, int, float]] = {}
        self.order: list[str] = []

    def mark(self, label: str) -> None:
        """Mark ``label``; its k-th repetition in the step is ``label#k`` (a chunked loss's head)."""
        if label in self.events:
            repeats = 2
            while f"{label}#{repeats}" in self.events:
                repeats += 1
            label = f"{label}#{repeats}"
        current, peak = self.tracker.mark()
        self.events[label] = (current, peak, time.perf_counter())
        self.order.append(label)

    def relevel(self, levels: list[tuple[int, int]]) -> None:
        """Replace every mark's live bytes and peak since the previous mark (in the marks' order) by
        ``levels``, a count made after the step (the cost model's); its phases then take no time."""
        for label, (current, peak) in zip(self.order, levels, strict=True):
            self.events[label] = (current, peak, 0.0)

    def without(self, units: Collection[str]) -> "_Timeline":
        """This step's timeline as hooks at the other units' boundaries alone record it: ``units``' marks
        left out, each one's peak joining the next kept mark's (marking allocates nothing, so the levels
        are the same step's)."""
        dropped = {f"{kind}:{name}" for name in units for kind in ("forward", "forward-done", "backward", "backward-done")}
        kept, peak = _Timeline(self.tracker), 0
        for label in self.order:
            current, since, seconds = self.events[label]
            peak = max(peak, since)
            if label.partition("#")[0] not in dropped:
                kept.events[label], peak = (current, peak, seconds), 0
                kept.order.append(label)
        return kept

    def phase(self, start: str, end: str) -> Phase:
        first, last = self.order.index(start), self.order.index(end)
        level = self.events[start][0]
        peak = max((self.events[label][1] for label in self.order[first + 1 : last + 1]), default=level)
        return Phase(self.events[end][0] - level, max(peak, level) - level, self.events[end][2] - self.events[start][2])


def _first_tensor(value) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        return next((t for t in map(_first_tensor, value) if t is not None), None)
    return None


class _BackwardBoundary(torch.autograd.Function):
    """Identity that marks the timeline when the gradient of a unit's output arrives: wrapped around
    the output, it runs before any hook a parallelism put on that output (FSDP2's unshard)."""

    @staticmethod
    def forward(ctx, timeline, label, tensor):
        ctx.timeline, ctx.label = timeline, label
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        ctx.timeline.mark(ctx.label)
        return None, None, grad


def _hook_boundaries(model: nn.Module, units: list[str], timeline: _Timeline) -> list:
    """Marks at each unit's boundaries, outside whatever the parallelism does at them: before its
    pre-forward work (prepended hook), after its post-forward work, before its pre-backward work and
    after its post-backward work (a hook on the input as the caller passed it)."""
    handles = []
    for name in units:
        module = model.get_submodule(name)

        def before_forward(module, args, name=name):
            timeline.mark(f"forward:{name}")
            first = _first_tensor(args)
            if first is not None and first.requires_grad:
                first.register_hook(lambda grad: timeline.mark(f"backward-done:{name}"))

        def after_forward(module, args, output, name=name):
            timeline.mark(f"forward-done:{name}")
            if not isinstance(output, torch.Tensor):
                raise ValueError(f"rsdp.plan: unit {name} must return one tensor (got {type(output).__name__})")
            if output.requires_grad:
                return _BackwardBoundary.apply(timeline, f"backward:{name}", output)
            return None  # frozen, and so is everything before it: no backward (a frozen embedding's)

        handles.append(module.register_forward_pre_hook(before_forward, prepend=True))
        handles.append(module.register_forward_hook(after_forward))
    return handles


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def parameter_and_optimizer_bytes(params: list[nn.Parameter], optimizer: torch.optim.Optimizer) -> int:
    total = 0
    for param in params:
        total += _local_bytes(param)
        total += sum(_local_bytes(t) for t in optimizer.state.get(param, {}).values() if isinstance(t, torch.Tensor))
    return total


def counted_peak(step: Callable[[], None], device: torch.device) -> int:
    """Run ``step`` and return its peak bytes, then free the ring buffers: they stay resident after a
    step, and the next counted step counts them when it makes them again."""
    with without_cyclic_gc(), MemoryTracker(device) as tracker:
        step()
    release_ring_buffers()
    return tracker.peak_bytes


def measure_peak(model: nn.Module, batch, loss_fn: Callable, optimizer_fn: Callable = torch.optim.AdamW) -> int:
    """Peak bytes per rank of training an already parallelized ``model``: parameters and optimizer state
    plus the larger of the second step's peak and the third's, the maximum over ranks. To check a plan.

    The first step makes the optimizer state. The second still runs off the first's ring schedule
    (``_fully_shard/_schedule.py``: the Linears on one input share a ring only after the first forward,
    so its rings differ from the record and its ring buffers are sized off track); the third is the
    first steady one. A mixed plan peaks a few percent above or below its later steps in the second,
    and training runs both, so a budget must hold both."""
    optimizer = optimizer_fn(model.parameters())
    release_ring_buffers()

    def step() -> None:
        loss_fn(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # makes the optimizer state
    release_ring_buffers()
    step_peak = max(counted_peak(step, batch.device), counted_peak(step, batch.device))
    peak = torch.tensor(float(parameter_and_optimizer_bytes(list(model.parameters()), optimizer) + step_peak))
    if dist.is_initialized():
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return int(peak)


def profile(
    model: nn.Module,
    strategies: dict[str, Strategy],
    batch,
    loss_fn: Callable,
    optimizer_fn: Callable,
    mesh: DeviceMesh,
    mp_policy,
    device: torch.device,
) -> tuple[dict[str, UnitCost], RootCost, int]:
    """Train a copy of ``model`` parallelized with ``strategies`` (unit name -> strategy, ``""`` the
    root) for three steps. Returns every unit's cost and the root's, from the second step, and the peak
    bytes as ``measure_peak`` counts them (parameters and optimizer state, and the larger of the second
    and the third step's peaks), each the maximum over the ranks so that every rank plans alike. The
    costs are the second step's because a step off its ring schedule asks for each ring buffer when a
    unit needs it, in that unit's phase, while a step on its schedule makes each buffer at its largest
    at the first request, in whichever unit comes first: phases of a uniform run replayed in a mixed
    plan must carry their own buffers."""
    units = [name for name in strategies if name]
    copy_ = parallelize(copy.deepcopy(model), strategies, mesh=mesh, mp_policy=mp_policy)
    optimizer = optimizer_fn(copy_.parameters())

    def step(timeline: _Timeline | None = None) -> None:
        loss_fn(copy_, batch).backward()
        if timeline is not None:
            timeline.mark("backward-done")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # makes the optimizer state
    release_ring_buffers()
    with without_cyclic_gc(), MemoryTracker(device) as tracker:
        timeline = run_marked_step(copy_, units, tracker, step)
    release_ring_buffers()
    steady = counted_peak(step, device)
    phases = StepPhases.of(timeline, units)
    optimizer_seconds = timeline.phase("backward-done", "end").seconds

    unit_params = {name: list(copy_.get_submodule(name).parameters()) for name in units}
    in_units = {id(p) for params in unit_params.values() for p in params}
    root_params = [p for p in copy_.parameters() if id(p) not in in_units]
    total_static = parameter_and_optimizer_bytes(list(copy_.parameters()), optimizer) or 1
    costs = {}
    for name in units:
        static = parameter_and_optimizer_bytes(unit_params[name], optimizer)
        costs[name] = UnitCost(
            static, phases.forward[name], phases.backward[name], optimizer_seconds * static / total_static
        )
    root_static = parameter_and_optimizer_bytes(root_params, optimizer)
    root = RootCost(
        root_static,
        phases.before,
        phases.middle,
        dataclasses.replace(phases.after, seconds=phases.after.seconds - optimizer_seconds),
        optimizer_seconds * root_static / total_static,
    )
    return _agree(costs, root, total_static + max(tracker.peak_bytes, steady))


def run_marked_step(model: nn.Module, units: list[str], tracker, step: Callable[[_Timeline], None]) -> _Timeline:
    """Run ``step(timeline)`` (which marks ``backward-done`` when its backward returns) with marks at
    every unit boundary; ``tracker`` is a started tracker with ``mark()``."""
    timeline = _Timeline(tracker)
    handles = _hook_boundaries(model, units, timeline)
    timeline.mark("start")
    try:
        step(timeline)
        timeline.mark("end")
    finally:
        for handle in handles:
            handle.remove()
    return timeline


@dataclasses.dataclass(frozen=True)
class StepPhases:
    """One step's timeline cut into the phases a plan is replayed from."""

    forward: dict[str, Phase]  # unit -> its forward, up to the next unit's
    backward: dict[str, Phase]  # unit -> its backward, up to the previous unit's
    before: Phase
    middle: Phase
    after: Phase
    # The last unit when a chunked loss calls it once per chunk, each call's backward inside the loss:
    # its forward phase runs from its first call to its last call's backward, and holds every call's
    # backward; its backward phase is empty.
    called_per_chunk: str | None = None

    @classmethod
    def of(cls, timeline: _Timeline, units: list[str]) -> "StepPhases":
        first, last = units[0], units[-1]
        idle = [name for name in units if f"forward:{name}" not in timeline.events]
        if idle:
            raise ValueError(
                f"rsdp.plan: {', '.join(idle[:3])}{f' and {len(idle) - 3} more' if len(idle) > 3 else ''} never ran in the training step (a multimodal model's encoder in a "
                "text-only step?); a plan counts modules that run: plan for a model whose step runs every module."
            )
        # The first unit's input needs no gradient when it is the token ids: its backward ends the pass.
        end_of_backward = f"backward-done:{first}" if f"backward-done:{first}" in timeline.events else "backward-done"
        chunked = _called_per_chunk(timeline, units)
        forward, backward = {}, {}
        # A unit whose output needs no gradient has no backward; the backward before it ends the pass.
        backward_end = end_of_backward
        for index, name in enumerate(units):
            forward_end = f"forward:{units[index + 1]}" if index + 1 < len(units) else f"forward-done:{last}"
            forward[name] = timeline.phase(f"forward:{name}", forward_end)
            if f"backward:{name}" in timeline.events:
                backward[name] = timeline.phase(f"backward:{name}", backward_end)
                backward_end = f"backward:{name}"
            else:
                backward[name] = Phase(0, 0, 0.0)
        if chunked:
            # The head's last backward is the loss's last work on it; the rest of the loss, then the
            # decoder's backward (the unit before the head's), follow.
            head_done = f"backward-done:{last}#{chunked}"
            forward[last] = timeline.phase(f"forward:{last}", head_done)
            backward[last] = Phase(0, 0, 0.0)
            middle = timeline.phase(head_done, f"backward:{units[-2]}" if len(units) > 1 else end_of_backward)
        else:
            middle = timeline.phase(f"forward-done:{last}", f"backward:{last}")
        return cls(
            forward,
            backward,
            timeline.phase("start", f"forward:{first}"),
            middle,
            timeline.phase(end_of_backward, "end"),
            last if chunked else None,
        )


def _called_per_chunk(timeline: _Timeline, units: list[str]) -> int:
    """How often the last unit ran when a chunked loss called it (each call's backward before the next
    call), 0 when every unit ran once. A unit run twice otherwise is not a plan's unit."""
    last = units[-1]
    for name in units:
        if f"forward:{name}#2" not in timeline.events:
            continue
        order = timeline.order
        interleaved = (
            name == last
            and f"backward-done:{name}" in timeline.events
            and order.index(f"backward-done:{name}") < order.index(f"forward:{name}#2")
        )
        if not interleaved:
            raise RuntimeError(
                f"rsdp.plan: unit {name} ran twice in one step; a unit may run once per step (the last one "
                "may run once per chunk of a chunked loss, each call's backward before the next call)"
            )
        calls = 2
        while f"forward:{name}#{calls + 1}" in timeline.events:
            calls += 1
        return calls
    return 0


def _agree(costs: dict[str, UnitCost], root: RootCost, peak: int) -> tuple[dict[str, UnitCost], RootCost, int]:
    flat = [dataclasses.astuple(cost) for cost in (*costs.values(), root)]
    numbers = [peak] + [value for record in flat for value in _flatten(record)]
    tensor = torch.tensor(numbers, dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    values = iter(tensor.tolist())
    peak = int(next(values))
    rebuilt = [_rebuild(type(cost), values) for cost in (*costs.values(), root)]
    return dict(zip(costs, rebuilt[:-1])), rebuilt[-1], peak


def _flatten(record) -> list[float]:
    return [v for item in record for v in (_flatten(item) if isinstance(item, tuple) else [item])]


def _rebuild(cls, values):
    fields = []
    for field in dataclasses.fields(cls):
        if dataclasses.is_dataclass(field.type):
            fields.append(_rebuild(field.type, values))
        else:
            value = next(values)
            fields.append(int(value) if field.type is int else value)
    return cls(*fields)
