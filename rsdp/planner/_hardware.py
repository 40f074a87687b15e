"""Hardware for the cost model (``rsdp plan --hardware``): named presets, each number with its source,
and profiles that ``rsdp calibrate`` measures and writes as JSON.

A profile's fields (only the first three are required: a profile of just those still loads, and
then every op costs ``latency_s`` per hop plus bytes over ``bandwidth_bytes_per_s``):

- ``flops_per_s``: the rate at which this device runs the FLOPs the cost model counts. Calibrated with a
  model, it is a whole training step's (GEMMs, attention, norms, elementwise ops); without one, the
  rate of whole GEMMs at default shapes, which a step does not reach (an upper bound of speed);
- ``fsdp_overhead_s_per_byte``, ``replicate_overhead_s_per_byte``: FSDP2's own work beside the wire per
  stored parameter byte, ``[forward, backward]`` (its copies into and out of the collectives' buffers,
  into memory just allocated; the pre-division; its hooks), measured by ``rsdp calibrate`` on the fake
  process group on CPU ranks; the H100 presets' FSDP figure is fitted to this project's one-GPU step
  (below), replicate's left out;
- ``other_flops_per_s``: with ``gemm_flops_per_s``, the rate of the FLOPs outside the Linears' GEMMs:
  a measured step's time less its Linears' FLOPs at the whole-GEMM rate, over its other FLOPs. Where
  set, the cost model charges the Linears at the GEMM rate and the rest at this one;
- ``attention_flops_per_s``, ``norm_bytes_per_s``, ``elementwise_bytes_per_s``, ``loss_bytes_per_s``
  (``WORK_RATES``): where the first is set, the work outside the matrix products by kind
  (``_cost_model.Work``), each at its own rate, replaces ``other_flops_per_s``: flash attention's
  executed FLOPs (causal: half the square), and the bytes norms, elementwise ops and the loss move.
  ``rsdp calibrate`` times one kernel of each kind on the device (``work_rates``); the H100 presets
  take them from published kernel measurements;
- ``bandwidth_bytes_per_s``, ``latency_s``: the default link, per device, bytes as nccl-tests' busbw
  counts them, latency per hop;
- ``links``: per op (``send_recv``, ``all_gather``, ``reduce_scatter``, ``all_reduce``) its own
  ``{"latency_s", "bandwidth_bytes_per_s"}``, fitted over message sizes;
- ``partial_gemm_efficiency``: ``{W: FLOP/s of 1/W-row GEMMs over whole ones}``, the three GEMMs of a
  Linear's step at the model's shapes (RSDP's per-shard penalty), and ``gemm_flops_per_s``, the whole
  GEMMs' rate, at which the penalty is charged on the Linears' FLOPs alone;
- ``gpus_per_node``, ``inter_node_links``: two levels. Devices per machine (absent: the whole world is
  one machine), and per op the link between machines (``{"latency_s", "bandwidth_bytes_per_s"}``), which
  a collective or a ring step whose ranks span machines pays (``_cost_model.CostModel.link``); the
  fields above are then the links within a machine. A profile without them is one level: every op at
  its own link whatever it spans, as before (and only ring groups of 1: ``CostModel.ring_group_sizes``);
- ``ring_step_host_s``, ``host_overlaps_compute``: host time per ring step, and whether a device
  computes while the host issues (False on CPU ranks, where the host computes);
- ``caching_allocator``, ``reserved_per_allocated``: the caching allocator the prediction models
  (``_allocator``: ``"segments"``, PyTorch's default, or ``"expandable_segments"``; absent on CPU
  ranks, which have none: the prediction is then allocated bytes) and a fixed factor beside it (1.0
  unless a profile gives one). The GPU presets model expandable segments, as torchtitan runs.

Presets: ``<chip>-nvlink`` (every op at NVLink's figures, whatever the world), ``<chip>-infiniband``
(every op at one NIC's), and ``<chip>-nvlink-infiniband``, two levels: NVLink within a host of
``GPUS_PER_HOST``, InfiniBand between hosts (a point-to-point exchange at one NIC's rate; a collective
over hosts at the NICs' sum, capped at NVLink's), each figure from NCCL maintainers' public statements
(``_INTER_NODE``). The single-level presets keep planning as before (flat rings alone).

Pitfalls: a preset's datasheet peak is not what training reaches, so the H100 preset's achieved rate
comes from this project's own measured step (docs/benchmarks.md, GPU section), at Llama 3 8B's shapes
and sequence 8192: other shapes run at other rates. The ``h100-hbm2e-500w-*`` presets (torchtitan's
published runs' GPUs) are the SXM ones scaled, not measured: compute-bound rates by an assumed peak
(the middle of the range torchtitan states), memory-bound ones by the published memory bandwidth. Between the world sizes a profile measured, the
partial efficiency is interpolated in log W; beyond the largest, it falls as 1/W (the partial GEMMs
are then assumed to take as long as the largest measured world's: small GEMMs are bound by their
launch, not their FLOPs), which is a guess, stated as one.
"""

import dataclasses
import json
import math
from pathlib import Path

import torch

from ._cost_model import CostModel, Link

LINK_OPS = ("send_recv", "all_gather", "reduce_scatter", "all_reduce")
# The rates of the work outside the matrix products (``_cost_model.Work``), as CostModel names them.
WORK_RATES = ("attention_flops_per_s", "norm_bytes_per_s", "elementwise_bytes_per_s", "loss_bytes_per_s")


@dataclasses.dataclass(frozen=True)
class Hardware:
    flops_per_s: float
    bandwidth_bytes_per_s: float
    latency_s: float
    source: str = ""
    partial_gemm_efficiency: dict[int, float] = dataclasses.field(default_factory=dict)
    ring_step_host_s: float = 0.0
    host_overlaps_compute: bool = True
    links: dict[str, Link] = dataclasses.field(default_factory=dict)
    gemm_flops_per_s: float | None = None
    reserved_per_allocated: float = 1.0  # a fixed reserved per allocated factor (CostModel's)
    caching_allocator: str | None = None  # the caching allocator modelled (CostModel's; None: allocated bytes)
    memory_bandwidth_bytes_per_s: float | None = None  # the device memory's: the optimizer step's time
    other_flops_per_s: float | None = None  # the FLOPs outside the Linears' GEMMs (CostModel's)
    # FSDP2's own work per stored parameter byte beside the wire, forward and backward (CostModel's).
    fsdp_overhead_s_per_byte: tuple[float, float] = (0.0, 0.0)
    replicate_overhead_s_per_byte: tuple[float, float] = (0.0, 0.0)
    # The work outside the matrix products by kind, each at its own rate (CostModel's; ``WORK_RATES``).
    attention_flops_per_s: float | None = None
    norm_bytes_per_s: float | None = None
    elementwise_bytes_per_s: float | None = None
    loss_bytes_per_s: float | None = None
    # Two levels: devices per machine (None: one machine, whatever the world) and each op's link between
    # machines (empty: one level; the links above are then every op's, whatever its ranks span).
    gpus_per_node: int | None = None
    inter_node_links: dict[str, Link] = dataclasses.field(default_factory=dict)

    def efficiency_at(self, world_size: int) -> float:
        """The partial GEMMs' efficiency at ``world_size`` (1.0 when nothing was measured)."""
        if not self.partial_gemm_efficiency:
            return 1.0
        measured = sorted({1: 1.0, **self.partial_gemm_efficiency}.items())
        if world_size in dict(measured):
            return dict(measured)[world_size]
        largest, at_largest = measured[-1]
        if world_size > largest:
            return at_largest * largest / world_size
        below = max(w for w, _ in measured if w < world_size)
        above = min(w for w, _ in measured if w > world_size)
        fraction = math.log(world_size / below) / math.log(above / below)
        efficiency = dict(measured)
        return efficiency[below] + fraction * (efficiency[above] - efficiency[below])

    def cost_model(self, world_size: int, param_dtype: torch.dtype | None = None,
                   reduce_dtype: torch.dtype | None = None, **overrides) -> CostModel:
        """The cost model of ``world_size`` such devices (``overrides``: CostModel fields; ``gpus_per_node``
        replaces this hardware's machine size, ``allowed_ring_group_sizes`` limits the groups the search tries)."""
        gpus_per_node = overrides.pop("gpus_per_node", None) or self.gpus_per_node
        fields = dict(
            flops_per_s=self.flops_per_s, bandwidth_bytes_per_s=self.bandwidth_bytes_per_s, latency_s=self.latency_s,
            param_dtype=param_dtype, reduce_dtype=reduce_dtype,
            partial_gemm_efficiency=self.efficiency_at(world_size), ring_step_host_s=self.ring_step_host_s,
            host_overlaps_compute=self.host_overlaps_compute, gemm_flops_per_s=self.gemm_flops_per_s,
            reserved_per_allocated=self.reserved_per_allocated, caching_allocator=self.caching_allocator,
            memory_bandwidth_bytes_per_s=self.memory_bandwidth_bytes_per_s, other_flops_per_s=self.other_flops_per_s,
            fsdp_overhead_s_per_byte=self.fsdp_overhead_s_per_byte,
            replicate_overhead_s_per_byte=self.replicate_overhead_s_per_byte, **self.links,
            **{rate: getattr(self, rate) for rate in WORK_RATES},
            gpus_per_node=gpus_per_node, inter_node_links=tuple(sorted(self.inter_node_links.items())),
        )
        # A ring step of a group of g computes g/W of a layer: the partial GEMMs' efficiency at W/g.
        fields["partial_gemm_efficiency_of_groups"] = tuple(
            (g, self.efficiency_at(world_size // g)) for g in _divisors(world_size) if g > 1
        )
        fields.update({name: value for name, value in overrides.items() if value is not None})
        if overrides.get("flops_per_s") is not None:  # one given rate for every FLOP replaces the measured split
            fields["other_flops_per_s"] = None
            fields.update(dict.fromkeys(WORK_RATES))
        if {"bandwidth_bytes_per_s", "latency_s"} & {k for k, v in overrides.items() if v is not None}:
            for op in LINK_OPS:  # an overridden default link replaces the fitted ones, within and between machines
                fields.pop(op, None)
            fields["inter_node_links"] = ()
        return CostModel(world_size, **fields)

    def to_json(self) -> dict:
        return {
            "flops_per_s": self.flops_per_s, "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
            "latency_s": self.latency_s, "source": self.source,
            "partial_gemm_efficiency": {str(w): e for w, e in self.partial_gemm_efficiency.items()},
            "ring_step_host_s": self.ring_step_host_s, "host_overlaps_compute": self.host_overlaps_compute,
            "links": {op: dataclasses.asdict(link) for op, link in self.links.items()},
            "gemm_flops_per_s": self.gemm_flops_per_s, "reserved_per_allocated": self.reserved_per_allocated,
            "caching_allocator": self.caching_allocator,
            "memory_bandwidth_bytes_per_s": self.memory_bandwidth_bytes_per_s, "other_flops_per_s": self.other_flops_per_s,
            "fsdp_overhead_s_per_byte": list(self.fsdp_overhead_s_per_byte),
            "replicate_overhead_s_per_byte": list(self.replicate_overhead_s_per_byte),
            **{rate: getattr(self, rate) for rate in WORK_RATES},
            **({} if self.gpus_per_node is None else {"gpus_per_node": self.gpus_per_node}),
            **({} if not self.inter_node_links else {
                "inter_node_links": {op: dataclasses.asdict(link) for op, link in self.inter_node_links.items()}
            }),
        }


def _divisors(number: int) -> list[int]:
    return [d for d in range(1, number + 1) if number % d == 0]


_CHIPS = {  # dense BF16 peak FLOP/s, memory bandwidth, and their source
    "h100-sxm": (989e12, 3.35e12, "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM: BF16 Tensor Core 989 TFLOP/s dense, "
                 "1,979 with sparsity; GPU memory bandwidth 3.35 TB/s)"),
    "a100-sxm": (312e12, 2.039e12, "NVIDIA A100 Tensor Core GPU datasheet (A100 SXM: BF16 Tensor Core 312 TFLOP/s dense; "
                 "A100 80GB SXM memory bandwidth 2,039 GB/s)"),
}
# What a training step achieves, and the partial GEMMs' efficiency, where measured: the step's FLOPs as the
# cost model counts them (of them the Linears'), its forward + backward seconds, and whole GEMMs' rate.
_ACHIEVED = {
    "h100-sxm": dict(
        step_flops=53.86e12,
        step_seconds=120.4e-3,
        gemm_flops_per_s=743e12,
        partial_gemm_efficiency={2: 0.96, 4: 0.90, 8: 0.80},
        ring_step_host_s=140e-6,
        fsdp_overhead_s_per_byte=(1.70e-12, 1.08e-12),
        source=(
            "achieved: this project's H100 SXM 80GB run (docs/benchmarks.md, GPU section; torch 2.11, bf16, "
            "FlashAttention): one rank's FSDP2 step of 2 Llama 3 8B layers + head at sequence 8192, "
            "53.9 TFLOP as the cost model counts them (47.3 of them the Linears') in 120.4 ms (W=8; 120.5 and "
            "120.9 at W=4 and 2) = 447 TFLOP/s = 45.2% of peak; whole GEMMs alone: 743 TFLOP/s; "
            "FSDP2's own work on the device per stored parameter byte, 1.70 / 1.08 ps forward / backward: FITTED to "
            "that run at W=8 (forward 18.2 and 44.2 ms, backward 22.9 and 76.2 ms at sequence 2048 and 8192), "
            "what the step takes beyond this cost model's compute for it (forward 10.3 and 9.9 ms, backward 6.9 and "
            "6.0: the same at both lengths, so per step, not per token), over its 5.95 GB of stored parameters; "
            "partial GEMMs: that run's split-GEMM table at 8192 tokens, "
            "FLOP-weighted over 32 layers and the head (0.96, 0.90, 0.80 at W = 2, 4, 8); host per ring step: "
            "rsdp's host issue time over FSDP2's at W=8, seq 2048 (46.5 - 28.3 ms) over its 132 exchanges"
        ),
    ),
}
# The work outside the matrix products on an H100 SXM, each rate from a published measurement of that
# kind of kernel, none fitted to a training run.
_H100_WORK = (
    dict(attention_flops_per_s=333e12, norm_bytes_per_s=2.8e12, elementwise_bytes_per_s=2.8e12, loss_bytes_per_s=2.8e12),
    "attention 333 TFLOP/s: FlashAttention-2's causal forward at head dim 128, sequence 8k on an H100 80GB SXM5 "
    "(FlashAttention-3 paper, Shah et al. 2024, arXiv 2407.08608, forward-speed figure: 298 at 2k, 335 at 16k), its "
    "causal FLOPs counted as half the square's, the backward (2.5x the forward's FLOPs) assumed at the same rate; "
    "norms, elementwise ops and the loss 2.8 TB/s each: coalesced HBM3 reads measured at 84% of the 3.35 TB/s "
    "datasheet figure under Nsight Compute (mikamirai.com/blog/gpu-memory-bandwidth); `rsdp calibrate` measures each",
)
_LINKS = {  # bytes/s per GPU each way and its source
    ("h100-sxm", "nvlink"): (450e9, "NVLink 4: 900 GB/s per GPU, both directions together (450 GB/s each way)"),
    ("h100-sxm", "infiniband"): (50e9, "one 400 Gb/s NDR InfiniBand link (ConnectX-7) per GPU = 50 GB/s"),
    ("a100-sxm", "nvlink"): (300e9, "NVLink 3: 600 GB/s per GPU, both directions together (300 GB/s each way)"),
    ("a100-sxm", "infiniband"): (25e9, "one 200 Gb/s HDR InfiniBand link (ConnectX-6) per GPU = 25 GB/s"),
}
# Published NCCL figures on NVLink H100s (the collectives' busbw, send/recv latency).
_NCCL_H100_NVLINK = (
    {
        "send_recv": Link(3e-6, 360e9),
        "all_gather": Link(10e-6 / 7, 360e9),
        "reduce_scatter": Link(10e-6 / 7, 360e9),
        "all_reduce": Link(10e-6 / 7, 360e9),
    },
    "NCCL on 8 H100 NVLink: all_gather_perf saturates at ~360 GB/s busbw (NVIDIA/nccl-tests#326, NCCL maintainer), "
    "used for every op; send/recv latency ~3 us between two NVLink H100s (NVIDIA/nccl#1487); collective latency "
    "10 us for 8 ranks' 7 hops: an assumption, not published",
)
# The GPU presets model PyTorch's caching allocator with expandable segments, as torchtitan runs it.
_ALLOCATOR = (
    "expandable_segments",
    "reserved memory: PyTorch's caching allocator with expandable segments replayed over the counted step "
    "(_allocator; torchtitan's launcher sets PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True); nothing fitted",
)
_LATENCY_S = 5e-6
_LATENCY = "latency 5 us: assumed (NCCL small-message order of magnitude), not from a datasheet"


def _preset(chip: str, link: str, rate: float, link_source: str) -> Hardware:
    peak, memory_bandwidth, peak_source = _CHIPS[chip]
    achieved = _ACHIEVED.get(chip)
    links, links_source = _NCCL_H100_NVLINK if (chip, link) == ("h100-sxm", "nvlink") else ({}, _LATENCY)
    allocator, reserved_source = _ALLOCATOR
    if achieved is None:
        return Hardware(peak, rate, _LATENCY_S, f"{peak_source} (no achieved rate measured: step times are lower bounds); "
                        f"{link_source}; {links_source}; {reserved_source}", links=links, caching_allocator=allocator,
                        memory_bandwidth_bytes_per_s=memory_bandwidth)
    work_rates, work_source = _H100_WORK
    return Hardware(
        achieved["step_flops"] / achieved["step_seconds"], rate, _LATENCY_S,
        f"{peak_source}; {achieved['source']}; {work_source}; {link_source}; {links_source}; {reserved_source}",
        partial_gemm_efficiency=achieved["partial_gemm_efficiency"], ring_step_host_s=achieved["ring_step_host_s"],
        links=links, gemm_flops_per_s=achieved["gemm_flops_per_s"], caching_allocator=allocator,
        memory_bandwidth_bytes_per_s=memory_bandwidth, fsdp_overhead_s_per_byte=achieved["fsdp_overhead_s_per_byte"],
        **work_rates,
    )


# This project's CPU host, calibrated: what CPU ranks plan with when no profile is given (its own
# calibration replaces it: ``rsdp calibrate``). No caching allocator: allocated bytes.
_CPU_GLOO = Hardware(
    1.352e10, 1.502e9, 501.2e-6,
    "this project's `rsdp calibrate` on its 2-core CPU host, 2 gloo ranks, fp32, load average 7-10 (docs/planner.md, "
    "Calibrated time model (a)): a benchmark LM step's rate, whole GEMMs' rate, partial GEMMs at W = 2, 4, 8 (above 1 "
    "is noise: charged as 1), host per ring step, each op's fitted link",
    partial_gemm_efficiency={2: 0.828, 4: 1.022, 8: 1.020}, ring_step_host_s=622.6e-6, host_overlaps_compute=False,
    links={
        "send_recv": Link(501.2e-6, 1.502e9), "all_gather": Link(41.2e-6, 0.298e9),
        "reduce_scatter": Link(75.7e-6, 0.047e9), "all_reduce": Link(1184.9e-6, 2.115e9),
    },
    gemm_flops_per_s=1.619e10,
)

PRESETS = {f"{chip}-{link}": _preset(chip, link, rate, source) for (chip, link), (rate, source) in _LINKS.items()}

# torchtitan's published runs' GPUs (its benchmarks/llama3_h100_202412_torchtitan.md): H100 SXM boards with
# 96 GB of HBM2e at 2.4 TB/s, run at a 500 W power limit, whose dense BF16 peak torchtitan puts "between SXM
# and NVL" (989 and 835 TFLOP/s: the H100 SXM and H100 NVL datasheets). Each rate of the SXM preset is scaled
# by what bounds it: the matrix products and attention by the peak (the middle of that range, 912 TFLOP/s, over
# 989), the memory-bound work, the optimizer step and FSDP2's copies by the memory bandwidth (2.4 over 3.35
# TB/s). Links as the SXM presets' (8 per host on NVLink, 400 Gb/s RDMA per GPU, as torchtitan states).
_HBM2E_500W = dict(compute=912e12 / 989e12, memory=2.4e12 / 3.35e12)
_HBM2E_500W_SOURCE = (
    "H100 SXM with 96 GB HBM2e (2.4 TB/s) at a 500 W power limit, as torchtitan's published runs "
    "(benchmarks/llama3_h100_202412_torchtitan.md: peak 'between SXM and NVL'): the h100-sxm preset's matrix and "
    "attention rates x 912/989 (the middle of 835, H100 NVL datasheet, and 989), its memory-bound rates, optimizer "
    "bandwidth and FSDP2 copy cost x 2.4/3.35 (memory bandwidth)"
)


def _scaled(base: Hardware, compute: float, memory: float, source: str) -> Hardware:
    """``base`` on a device whose compute-bound rates are ``compute`` times its and memory-bound ones ``memory``
    times."""
    return dataclasses.replace(
        base,
        flops_per_s=base.flops_per_s * compute, gemm_flops_per_s=base.gemm_flops_per_s * compute,
        attention_flops_per_s=base.attention_flops_per_s * compute,
        norm_bytes_per_s=base.norm_bytes_per_s * memory, elementwise_bytes_per_s=base.elementwise_bytes_per_s * memory,
        loss_bytes_per_s=base.loss_bytes_per_s * memory,
        memory_bandwidth_bytes_per_s=base.memory_bandwidth_bytes_per_s * memory,
        fsdp_overhead_s_per_byte=tuple(seconds / memory for seconds in base.fsdp_overhead_s_per_byte),
        source=f"{source}; from: {base.source}",
    )


PRESETS.update({
    f"h100-hbm2e-500w-{link}": _scaled(PRESETS[f"h100-sxm-{link}"], **_HBM2E_500W, source=_HBM2E_500W_SOURCE)
    for link in ("nvlink", "infiniband")
})
PRESETS["cpu-gloo"] = _CPU_GLOO
GPUS_PER_HOST = 8  # the presets' hosts: NVLink within one, InfiniBand between them

# Two levels: NVLink within a host of GPUS_PER_HOST (NVSwitch), InfiniBand between hosts, one NIC per GPU
# (8 per host, rail-optimised). A point-to-point exchange between hosts runs on one NIC; a ring collective
# over every host uses each of a host's NICs for one of its rings, so its busbw is the NICs' sum, up to
# what NVLink carries within the host.
_INTER_NODE_LATENCY = (10e-6, "latency 10 us per hop between hosts: a 2-rank all_reduce_perf between two hosts over "
                       "HDR InfiniBand takes 19-20 us at small sizes, 2 hops (NVIDIA/nccl-tests#150)")
_INTER_NODE = {  # chip: (one NIC's bytes/s, the collectives' busbw between hosts, source)
    "h100-sxm": (47e9, 360e9, "InfiniBand NDR, 8 x 400 Gb/s ConnectX-7 per host: 46-48 GB/s per NIC (NVIDIA/nccl-tests#290, "
                 "NCCL maintainer), 47 for send/recv, which one NIC carries ('Alltoall cannot aggregate the bandwidth of "
                 "multiple NICs', NVIDIA/nccl-tests#267); collectives over hosts: the 8 NICs' peak is 400 GB/s busbw, above "
                 "380 only with tuned NCCL settings (NVIDIA/nccl-tests#309, NVIDIA), so 360 GB/s, the NVLink figure"),
    "a100-sxm": (24e9, 192e9, "InfiniBand HDR, 8 x 200 Gb/s per host: a DGX-A100 measures 192 GB/s all_reduce busbw "
                 "(NVIDIA/nccl#812, NCCL maintainer), 192 / 8 = 24 GB/s per NIC for send/recv"),
}


def _two_levels(chip: str, within: Hardware) -> Hardware:
    """``within`` (a chip's NVLink preset) on hosts of ``GPUS_PER_HOST`` joined by InfiniBand."""
    nic, collectives, source = _INTER_NODE[chip]
    latency, latency_source = _INTER_NODE_LATENCY
    inter = {"send_recv": Link(latency, nic), **{op: Link(latency, collectives) for op in LINK_OPS if op != "send_recv"}}
    return dataclasses.replace(
        within, gpus_per_node=GPUS_PER_HOST, inter_node_links=inter,
        source=f"{within.source}; between hosts of {GPUS_PER_HOST}: {source}; {latency_source}",
    )


PRESETS.update({
    f"{chip}-nvlink-infiniband": _two_levels(chip.replace("hbm2e-500w", "sxm"), PRESETS[f"{chip}-nvlink"])
    for chip in ("h100-sxm", "h100-hbm2e-500w", "a100-sxm")
})


_LINK_NAMES = ("nvlink-infiniband", "nvlink", "infiniband")


def preset_names() -> str:
    """The presets in a few words: each chip with each link, and the others by name."""
    chips, others = {}, []
    for name in PRESETS:
        link = next((link for link in _LINK_NAMES if name.endswith(f"-{link}")), None)
        if link is None:
            others.append(name)
        else:
            chips.setdefault(name[: -len(link) - 1], []).append(link)
    by_links = {}  # chips with the same links, named once
    for chip, links in chips.items():
        by_links.setdefault(tuple(links), []).append(chip)
    return "; ".join([*(f"{{{','.join(names)}}}-{{{','.join(links)}}}" for links, names in by_links.items()), *others])


def preset_for_this_device(world_size: int) -> str:
    """The name of the preset matching this process's device: an H100's or A100's, on NVLink up to one
    host of ``GPUS_PER_HOST`` and InfiniBand beyond; on CPU ranks this project's calibrated CPU host."""
    if not torch.cuda.is_available():
        return "cpu-gloo"
    name = torch.cuda.get_device_name()
    link = "nvlink" if world_size <= GPUS_PER_HOST else "infiniband"
    for chip, marker in (("h100-sxm", "H100"), ("a100-sxm", "A100")):
        if marker in name:
            return f"{chip}-{link}"
    raise ValueError(
        f"rsdp: no hardware preset matches {name!r} ({preset_names()}); name one, or a profile that "
        "`torchrun -m rsdp calibrate --out profile.json` measured on these GPUs."
    )


def from_json(values: dict, source: str) -> Hardware:
    return Hardware(
        float(values["flops_per_s"]), float(values["bandwidth_bytes_per_s"]), float(values["latency_s"]),
        str(values.get("source", source)),
        partial_gemm_efficiency={int(w): float(e) for w, e in values.get("partial_gemm_efficiency", {}).items()},
        ring_step_host_s=float(values.get("ring_step_host_s", 0.0)),
        host_overlaps_compute=bool(values.get("host_overlaps_compute", True)),
        links=_links(values.get("links", {})),
        gemm_flops_per_s=float(values["gemm_flops_per_s"]) if values.get("gemm_flops_per_s") else None,
        reserved_per_allocated=float(values.get("reserved_per_allocated", 1.0)),
        caching_allocator=values.get("caching_allocator"),
        memory_bandwidth_bytes_per_s=float(values["memory_bandwidth_bytes_per_s"]) if values.get("memory_bandwidth_bytes_per_s") else None,
        other_flops_per_s=float(values["other_flops_per_s"]) if values.get("other_flops_per_s") else None,
        fsdp_overhead_s_per_byte=_pair(values.get("fsdp_overhead_s_per_byte")),
        replicate_overhead_s_per_byte=_pair(values.get("replicate_overhead_s_per_byte")),
        **{rate: float(values[rate]) if values.get(rate) else None for rate in WORK_RATES},
        gpus_per_node=int(values["gpus_per_node"]) if values.get("gpus_per_node") else None,
        inter_node_links=_links(values.get("inter_node_links", {})),
    )


def _links(values: dict) -> dict[str, Link]:
    return {op: Link(float(link["latency_s"]), float(link["bandwidth_bytes_per_s"])) for op, link in values.items()}


def _pair(value) -> tuple[float, float]:
    """A (forward, backward) pair from a profile; absent: not measured (no time charged)."""
    if value is None:
        return (0.0, 0.0)
    forward, backward = value
    return (float(forward), float(backward))


def load(name_or_path: str) -> Hardware:
    """A preset by name, or a profile from a JSON file."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(
            f"rsdp plan: --hardware {name_or_path!r} is neither a preset ({preset_names()}) nor a profile file."
        )
    try:
        values = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(
            f"rsdp plan: --hardware {path} is not valid JSON ({error}); give a profile that `rsdp calibrate` wrote, "
            f"or a preset ({preset_names()})."
        ) from None
    try:
        for field in ("links", "inter_node_links"):
            unknown = set(values.get(field, {})) - set(LINK_OPS)
            if unknown:
                raise ValueError(f"unknown ops in {field}: {sorted(unknown)} (known: {', '.join(LINK_OPS)})")
        hardware = from_json(values, str(path))
        if min(hardware.flops_per_s, hardware.bandwidth_bytes_per_s) <= 0 or hardware.latency_s < 0:
            raise ValueError("flops_per_s and bandwidth_bytes_per_s must be positive, latency_s 0 or more")
        if hardware.gpus_per_node is not None and hardware.gpus_per_node <= 0:
            raise ValueError("gpus_per_node must be positive")
        return hardware
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise ValueError(
            f"rsdp plan: profile {path} needs numbers flops_per_s, bandwidth_bytes_per_s and latency_s, and optionally "
            f"partial_gemm_efficiency, ring_step_host_s, host_overlaps_compute, links, gpus_per_node and "
            f"inter_node_links as `rsdp calibrate` writes them ({error!r})."
        ) from None
