"""The torchtitan config with a data-parallel strategy per module, and its trainer.

``ParallelismConfig`` adds these flags to torchtitan's (``--parallelism.<name>`` on the command line):

- ``dp_strategy``: ``rsdp``, ``fsdp``, ``replicate``, or ``auto`` (the planner picks per module);
- ``dp_overrides``: per-module exceptions, ``"layers.0=replicate,lm_head=fsdp"`` (module names as in
  ``named_modules()``, globs as in :func:`rsdp.parallelize`; the root is ``root``);
- ``dp_memory_budget``: bytes per rank for ``auto``, e.g. ``"60GiB"``;
- ``dp_hardware``: the hardware ``auto``'s cost model plans for, a preset or a profile ``rsdp calibrate``
  wrote (the model is still on the meta device when the plan is made, so it is estimated, not
  measured); by default the preset matching the device; ``dp_flops_per_s`` / ``dp_bandwidth_bytes_per_s``
  / ``dp_latency_s`` override its numbers;
- ``dp_measure_memory``: log what each step holds per rank, to check a plan against its budget;
- ``dp_ring_group_size``: rsdp modules' ring of groups (``rsdp_shard``'s ``ring_group_size``; ``auto``
  plans its rsdp modules in groups of this size).

``RSDPTrainer`` is torchtitan's Trainer with that config, and the measurement.
"""

import os
from dataclasses import dataclass, field, fields
from typing import Literal

import torch
import torch.distributed as dist
from torchtitan.components.loss import ChunkedLossWrapper
from torchtitan.config import ParallelismConfig as TorchTitanParallelismConfig
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from .._fully_shard import release_ring_buffers
from ..memory import MemoryTracker
from ..planner import _hardware
from ..planner._hardware import Hardware
from ..planner._profile import parameter_and_optimizer_bytes, without_cyclic_gc
from ..planner.cli import parse_bytes
from ..policy import Strategy, name_matches

MiB = 2**20

ROOT = "root"


@dataclass(kw_only=True, slots=True)
class ParallelismConfig(TorchTitanParallelismConfig):
    dp_strategy: Literal["rsdp", "fsdp", "replicate", "auto"] = "rsdp"
    """Data parallelism for every module: rsdp, fsdp, replicate, or auto (planned per module to fit
    dp_memory_budget)."""

    dp_overrides: str = ""
    """Per-module strategies that win over dp_strategy, comma-separated: "layers.0=replicate,lm_head=fsdp"."""

    dp_memory_budget: str = ""
    """Bytes per rank for dp_strategy=auto: parameters, gradients, optimizer state and activations ("60GiB")."""

    dp_hardware: str = ""
    """auto's cost model: a hardware preset (h100-sxm-nvlink, h100-sxm-infiniband, h100-hbm2e-500w-nvlink,
    h100-hbm2e-500w-infiniband, a100-sxm-nvlink, a100-sxm-infiniband, cpu-gloo) or a profile JSON from
    `rsdp calibrate`; empty: the preset matching the device (an H100's or A100's, NVLink up to 8 ranks,
    InfiniBand beyond; cpu-gloo on CPU ranks)."""

    dp_flops_per_s: float | None = None
    """auto's cost model: achieved FLOP/s per device, overriding dp_hardware's."""

    dp_bandwidth_bytes_per_s: float | None = None
    """auto's cost model: bytes/s per device, overriding dp_hardware's (and its per-op links)."""

    dp_latency_s: float | None = None
    """auto's cost model: seconds per message, overriding dp_hardware's (and its per-op links)."""

    dp_measure_memory: bool = False
    """Log each step's memory per rank (the most of any rank): parameters and optimizer state plus the
    step's peak above its start, by rsdp's MemoryTracker (on CPU it counts every allocation, which slows
    the step)."""

    dp_ring_group_size: int = 1
    """rsdp modules pass their shards between groups of this many consecutive ranks of the data-parallel
    shard dimension, all-gathered within a group (rsdp_shard's ring_group_size; it divides that
    dimension's size); 1: a ring of ranks. auto plans its rsdp modules in groups of this size."""

    dp_loss_chunks: int = field(default=1, init=False)
    """Not a flag: the run's loss, set by RSDPTrainer (torchtitan's chunked loss's num_chunks, else 1),
    which auto counts as it runs."""

    dp_optimizer: str = field(default="adamw", init=False)
    """Not a flag: the run's optimizer as the planner models it (``rsdp.planner._cost_model.OPTIMIZERS``),
    set by RSDPTrainer from the optimizer config, which auto counts (its state and its step's temporaries;
    frozen parameters, such as a LoRA converter's base, are counted as the model has them)."""

    def __post_init__(self):
        TorchTitanParallelismConfig.__post_init__(self)
        self.overrides()  # fail at parse time, not after the model is built
        if self.dp_ring_group_size < 1:
            raise ValueError(
                f"parallelism.dp_ring_group_size={self.dp_ring_group_size} must be a positive integer dividing the "
                "data-parallel shard dimension's size; 1 is a ring of ranks."
            )
        if self.dp_strategy == "auto" and not self.dp_memory_budget:
            raise ValueError(
                "parallelism.dp_strategy=auto plans against a memory budget: pass "
                "--parallelism.dp_memory_budget, e.g. 60GiB."
            )
        if self.dp_hardware:
            self.hardware(world_size=1)
        if self.dp_memory_budget:
            self.memory_budget_bytes()
            if self.dp_strategy != "auto" and not self.dp_measure_memory:
                raise ValueError(
                    f"parallelism.dp_memory_budget={self.dp_memory_budget} would do nothing with "
                    f"dp_strategy={self.dp_strategy}: only dp_strategy=auto plans to a budget. Pass "
                    "--parallelism.dp_strategy auto to fit it, or --parallelism.dp_measure_memory to log each "
                    "step's memory beside it, or drop it."
                )

    def overrides(self) -> dict[str, Strategy]:
        """``dp_overrides`` as module name -> strategy (the root as ``""``), in the order given."""
        rules: dict[str, Strategy] = {}
        for item in filter(None, (part.strip() for part in self.dp_overrides.split(","))):
            name, sep, strategy = (text.strip() for text in item.partition("="))
            if not sep or not name or strategy not in [s.value for s in Strategy]:
                raise ValueError(
                    f"parallelism.dp_overrides: {item!r} is not module=strategy with a strategy in "
                    f"{[s.value for s in Strategy]}; example: layers.0=replicate,lm_head=fsdp"
                )
            rules["" if name == ROOT else name] = Strategy(strategy)
        return rules

    def hardware_name(self, world_size: int) -> str:
        """``dp_hardware``, or the preset matching this device for ``world_size`` ranks."""
        try:
            return self.dp_hardware or _hardware.preset_for_this_device(world_size)
        except ValueError as error:
            raise ValueError(f"parallelism.dp_hardware: {error}") from None

    def hardware(self, world_size: int) -> Hardware:
        """The preset or profile :meth:`hardware_name` names."""
        try:
            return _hardware.load(self.hardware_name(world_size))
        except ValueError as error:
            raise ValueError(f"parallelism.dp_hardware: {error}") from None

    def memory_budget_bytes(self) -> int:
        try:
            return parse_bytes(self.dp_memory_budget)
        except Exception as error:  # argparse's error type carries the message we want
            raise ValueError(f"parallelism.dp_memory_budget: {error}") from None


def log_once(message: str) -> None:
    """Log a line every rank would log alike from rank 0 only (torchtitan's logger prints on every rank)."""
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    if rank == 0:
        logger.info(message)


class RSDPTrainer(Trainer):
    """torchtitan's Trainer, configured with :class:`ParallelismConfig` (see :func:`head_under_chunked_loss`)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)

    def __init__(self, config: "RSDPTrainer.Config"):
        # Here, not in the config's __post_init__: the command line's flags are applied after that.
        config.parallelism.dp_overrides = head_under_chunked_loss(config.parallelism, config.loss)
        if isinstance(config.loss, ChunkedLossWrapper.Config):
            config.parallelism.dp_loss_chunks = config.loss.num_chunks
        config.parallelism.dp_optimizer = planned_optimizer(config.optimizer)
        super().__init__(config)

    def train_step(self, data_iterator):
        if not self.config.parallelism.dp_measure_memory:
            return super().train_step(data_iterator)
        # What the step starts with, counted before it: the first step creates the optimizer state
        # inside, where the tracker sees it. The ring buffers (freed after each pass) are counted by it.
        held = sum(
            parameter_and_optimizer_bytes([p for group in optimizer.param_groups for p in group["params"]], optimizer)
            for optimizer in self.optimizers
        )
        release_ring_buffers()
        with without_cyclic_gc(), MemoryTracker(self.device) as tracker:
            super().train_step(data_iterator)
        measured = torch.tensor([held, tracker.peak_bytes, held + tracker.peak_bytes], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(measured, op=dist.ReduceOp.MAX)
        held, peak, total = (value / MiB for value in measured.tolist())
        budget = self.config.parallelism.dp_memory_budget
        log_once(
            f"rsdp: step {self.step} memory per rank: {held:.2f} MiB parameters and optimizer state + {peak:.2f} "
            f"MiB step peak = {total:.2f} MiB" + (f" of a {budget} budget" if budget else "")
        )


def planned_optimizer(optimizer) -> str:
    """The planner's model (``OPTIMIZERS``) of torchtitan's optimizer config: Adam and AdamW (the same
    state) by its ``implementation``. Another optimizer, or bf16 states, is counted as torch's default
    AdamW (its for-loop and foreach temporaries, the larger), with a line in the log that says so."""
    names = {group.optimizer_name for group in optimizer.param_groups}
    implementation = {"fused": "adamw-fused", "foreach": "adamw-foreach", "for-loop": "adamw-for-loop"}.get(optimizer.implementation)
    if names <= {"Adam", "AdamW"} and implementation:
        return implementation
    log_once(
        f"rsdp: dp_strategy=auto counts {sorted(names)} ({optimizer.implementation}) as torch's default AdamW: two fp32 "
        "moments a parameter and the larger of its foreach and for-loop temporaries"
    )
    return "adamw"


def head_under_chunked_loss(parallelism: ParallelismConfig, loss) -> str:
    """``dp_overrides`` with ``lm_head=fsdp`` added when torchtitan's chunked loss would run an rsdp head.

    The chunked loss calls ``lm_head`` once per sequence chunk (8 by default), and an rsdp head rotates
    its whole table on each call: 8x its forward and backward traffic, where FSDP gathers it once and
    keeps it for the chunks. So under ``dp_strategy=rsdp`` the head is FSDP unless an override names
    it (``lm_head=rsdp`` keeps the ring: it never holds the whole head, at that traffic).
    """
    chunked = isinstance(loss, ChunkedLossWrapper.Config)
    if not chunked or parallelism.dp_strategy != Strategy.RSDP.value:
        return parallelism.dp_overrides
    if any(name_matches(name, "lm_head") for name in parallelism.overrides()):
        return parallelism.dp_overrides
    log_once(
        "rsdp: lm_head=fsdp: the chunked loss calls lm_head once per chunk and an rsdp head would rotate "
        "its table each time; --parallelism.dp_overrides lm_head=rsdp keeps the ring"
    )
    return ",".join(filter(None, (parallelism.dp_overrides, "lm_head=fsdp")))


def from_torchtitan(config: Trainer.Config, **parallelism) -> "RSDPTrainer.Config":
    """The same config with this package's parallelism fields (``parallelism`` sets them)."""
    base = config.parallelism
    values = {f.name: getattr(base, f.name) for f in fields(base) if f.init} | parallelism
    rebuilt = {f.name: getattr(config, f.name) for f in fields(config) if f.init and f.name != "parallelism"}
    return RSDPTrainer.Config(**rebuilt, parallelism=ParallelismConfig(**values))
