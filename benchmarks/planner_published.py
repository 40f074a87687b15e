"""The planner against published FSDP runs (benchmarks/published_fsdp_runs.md): each row's predicted
tokens/s per GPU and reserved memory beside the published ones.

Each row is counted on the meta device as the run trained (its model, sequence length, micro-batch,
activation checkpointing, bf16 mixed precision with fp32 reduction) and predicted with FSDP everywhere
on the row's hardware preset. A row that accumulates gradients over several micro-batches steps the
optimizer once per ``grad_accum`` of them: its share of the step time is divided accordingly.
Configs whose position table is sized by the run (MPT's learned positions) are written to a temporary
directory with ``n_positions`` set to the row's sequence length.

One number is fitted, to the MPT-7B rows alone (``fitted``): the rate of the attention kernel llm-foundry's
runs used (``attn_impl: triton``, the default of its ``submit_benchmarks.py``: a Triton FlashAttention of
2022, whose H100 rate is not published), by least squares on the log of predicted over published
tokens/s. Every other row is held out; the torchtitan rows use the preset's FlashAttention-2 rate.

    python benchmarks/planner_published.py            # every row: about 1 min on 2 shared cores
    python benchmarks/planner_published.py --fit      # and the fit again (about 1 min more)
    python benchmarks/planner_published.py --consistency  # what each pair of MPT rows implies (instant)
"""

import argparse
import dataclasses
import functools
import json
import math
import sys
import tempfile
from pathlib import Path

import torch

from rsdp import Strategy
from rsdp.planner import _hardware, _models
from rsdp.planner._cost_model import count, estimate_root, estimate_units
from rsdp.planner._plan import predict_uniform
from rsdp.planner._profile import find_units

# What ``fit_triton_attention`` returns (``--fit`` prints it): the rows and tests use it.
TRITON_ATTENTION_FLOPS_PER_S = 168e12
CONFIGS = Path(__file__).resolve().parents[1] / "tests" / "data" / "configs"
GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Row:
    source: str  # where it is published (benchmarks/published_fsdp_runs.md names the file and commit)
    model: str  # rsdp plan --model, or mpt:<size> (tests/data/configs/mpt-<size>-shaped, positions per row)
    hardware: str  # a preset
    world_size: int
    seq_len: int
    micro_batch: int
    grad_accum: int
    checkpoint: str  # none, selective, full
    tokens_per_s: float  # per GPU, published
    memory_gib: float | None = None  # reserved peak, published (None: not published)
    num_params: int | None = None  # as published (llm-foundry's NumParams)

    @property
    def triton_attention(self) -> bool:
        """llm-foundry's runs used its Triton attention kernel, whose rate is fitted (module docstring)."""
        return self.model.startswith("mpt:")

    @property
    def fitted(self) -> bool:
        return self.model == "mpt:7b"


ROWS = [
    # torchtitan, Llama 3.1 8B, H100 96 GB HBM2e at 500 W (benchmarks/llama3_h100_202412_torchtitan.md).
    Row("torchtitan Dec 2024, Table 1", "torchtitan:llama3:8B", "h100-hbm2e-500w-nvlink", 8, 8192, 2, 1, "selective", 5762, 82.4),
    Row("torchtitan Dec 2024, Table 3", "torchtitan:llama3:8B", "h100-hbm2e-500w-infiniband", 128, 8192, 2, 1, "selective", 5605, 67.0),
    # llm-foundry, MPT, H100 80GB SXM, 8 GPUs on NVLink (scripts/train/benchmarking/README.md).
    *(Row("llm-foundry H100 BF16", f"mpt:{size}", "h100-sxm-nvlink", 8, seq, mb, ga, ac, tps, num_params=params)
      for size, seq, mb, ga, ac, tps, params in [
          ("7b", 1024, 64, 2, "full", 10203, 6654664704), ("7b", 2048, 6, 1, "none", 10643, 6658859008),
          ("7b", 4096, 16, 2, "full", 8611, 6667247616), ("7b", 8192, 8, 2, "full", 6935, 6684024832),
          ("7b", 32768, 2, 2, "full", 3318, 6784688128),
          ("13b", 1024, 40, 3, "full", 5502, 12848711680), ("13b", 2048, 2, 1, "none", 4792, 12853954560),
          ("13b", 4096, 10, 3, "full", 4717, 12864440320), ("13b", 16384, 3, 3, "full", 2985, 12927354880),
          ("13b", 32768, 1, 3, "full", 1976, 13011240960),
          ("30b", 1024, 6, 21, "full", 2084, 29967874048), ("30b", 2048, 3, 21, "full", 2002, 29975214080),
          ("30b", 4096, 1, 21, "full", 1802, 29989894144), ("30b", 8192, 1, 21, "full", 1384, 30019254272),
      ]),
]


def _model_spec(row: Row, scratch: Path) -> str:
    if not row.model.startswith("mpt:"):
        return row.model
    values = json.loads((CONFIGS / f"mpt-{row.model[4:]}-shaped" / "config.json").read_text())
    values["n_positions"] = row.seq_len  # MPT's learned position table is the run's max_seq_len
    path = scratch / f"{row.model[4:]}-{row.seq_len}.json"
    path.write_text(json.dumps(values))
    return f"hf:{path}"


@functools.cache
def _counted(row: Row, scratch: Path):
    model, loss_fn, _ = _models.build(_model_spec(row, scratch), {})
    _models.apply_activation_checkpointing(model, row.checkpoint)
    units = find_units(model)
    batch = torch.zeros(row.micro_batch, row.seq_len + 1, dtype=torch.long, device="meta")
    return count(model, units, batch, loss_fn, torch.bfloat16), units


def predict(row: Row, scratch: Path, triton_attention_flops_per_s: float) -> dict:
    """The row's predicted reserved peak and tokens/s per GPU (FSDP everywhere)."""
    counts, units = _counted(row, scratch)
    hardware = _hardware.load(row.hardware)
    if row.triton_attention:
        hardware = dataclasses.replace(hardware, attention_flops_per_s=triton_attention_flops_per_s)
    cost = hardware.cost_model(row.world_size, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    peak, seconds = predict_uniform(counts, units, Strategy.FSDP, cost)
    costs = [*estimate_units(counts, Strategy.FSDP, Strategy.FSDP, cost).values(), estimate_root(counts, Strategy.FSDP, cost)]
    optimizer = sum(c.optimizer_seconds for c in costs)
    per_micro_batch = seconds - optimizer * (1 - 1 / row.grad_accum)  # one optimizer step per grad_accum
    return {"peak_gib": peak / GiB, "tokens_per_s": row.micro_batch * row.seq_len / per_micro_batch}


def implied_attention_cost(first: Row, second: Row) -> float:
    """How many times a GEMM FLOP's time an attention FLOP must take for two published rows of one model
    (same checkpointing) to hold together under any time model that charges each kind of work at its own
    fixed rate: per token, time = c * (matmul FLOPs + k * attention FLOPs), solved for k from the two rows'
    tokens/s. FLOPs as the source counts them (its README, "MFU": 6 per parameter per token, and
    ``n_layers * 2 * 2 * d_model * seq_len`` a token's attention, three times for training); the model's
    shape is read from its config in tests/data/configs."""
    values = json.loads((CONFIGS / f"mpt-{first.model[4:]}-shaped" / "config.json").read_text())

    def flops(row: Row) -> tuple[float, float]:
        return 6 * row.num_params, 3 * 4 * values["n_layer"] * values["n_embd"] * row.seq_len

    (matmul_1, attention_1), (matmul_2, attention_2) = flops(first), flops(second)
    slowdown = first.tokens_per_s / second.tokens_per_s  # the second row's time per token over the first's
    return (slowdown * matmul_1 - matmul_2) / (attention_2 - slowdown * attention_1)


def consistency_pairs() -> list[tuple[Row, Row, float]]:
    """Each llm-foundry model's consecutive checkpointed rows, with ``implied_attention_cost`` of the pair."""
    checkpointed = [row for row in ROWS if row.num_params and row.checkpoint == "full"]
    return [(first, second, implied_attention_cost(first, second))
            for first, second in zip(checkpointed, checkpointed[1:]) if first.model == second.model]


def fit_triton_attention(scratch: Path) -> float:
    """The Triton attention rate that minimises the squared log error of the fitted rows' tokens/s
    (golden-section search between 30 and 600 TFLOP/s, in log space)."""
    fitted = [row for row in ROWS if row.fitted]

    def error(log_rate: float) -> float:
        return sum(math.log(predict(row, scratch, math.exp(log_rate))["tokens_per_s"] / row.tokens_per_s) ** 2 for row in fitted)

    low, high = math.log(30e12), math.log(600e12)
    golden = (math.sqrt(5) - 1) / 2
    while high - low > 1e-3:
        a, b = high - golden * (high - low), low + golden * (high - low)
        low, high = (low, b) if error(a) < error(b) else (a, high)
    return math.exp((low + high) / 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="rows whose source or model contains this")
    parser.add_argument("--fit", action="store_true", help="fit the Triton attention rate again and print it")
    parser.add_argument("--consistency", action="store_true",
                        help="only the attention cost each pair of llm-foundry's rows implies (implied_attention_cost)")
    args = parser.parse_args()
    if args.consistency:
        print("| model | seq | next seq | attention FLOP's time / GEMM FLOP's |\n| --- | ---: | ---: | ---: |")
        for first, second, cost in consistency_pairs():
            print(f"| {first.model} | {first.seq_len} | {second.seq_len} | {cost:.2f} |")
        return
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        if args.fit:
            print(f"llm-foundry's Triton attention on H100, fitted to the MPT-7B rows: "
                  f"{fit_triton_attention(scratch) / 1e12:.1f} TFLOP/s (used: {TRITON_ATTENTION_FLOPS_PER_S / 1e12:.0f})\n")
        print("| source | model | GPUs | seq | micro-batch x accum | AC | published TPS/GPU | predicted | ratio | "
              "published GiB | predicted GiB | ratio | role |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for row in ROWS:
            if args.only not in f"{row.source} {row.model}":
                continue
            got = predict(row, scratch, TRITON_ATTENTION_FLOPS_PER_S)
            memory = (f"{row.memory_gib} | {got['peak_gib']:.1f} | **{got['peak_gib'] / row.memory_gib:.2f}**"
                      if row.memory_gib else f"— | {got['peak_gib']:.1f} | —")
            print(f"| {row.source} | {row.model} | {row.world_size} | {row.seq_len} | {row.micro_batch} x {row.grad_accum} | "
                  f"{row.checkpoint} | {row.tokens_per_s:,.0f} | {got['tokens_per_s']:,.0f} | "
                  f"**{got['tokens_per_s'] / row.tokens_per_s:.2f}** | {memory} | "
                  f"{'fitted' if row.fitted else 'held out'} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
