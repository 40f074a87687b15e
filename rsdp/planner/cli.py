"""``rsdp plan``: print the plan for a benchmark model config and a memory budget.

    rsdp plan --budget 8GiB --world-size 1024 --vocab_size 128256 --ninp 4096 --nhid 14336 \\
        --nhead 32 --num_decoder_layers 32 --seq_len 4096 --batch-sizes 1 2 4
    torchrun --nproc_per_node 4 -m rsdp plan --measure --budget 64MiB --ninp 512 --nhid 2048 ...

The model is the RTP benchmarks' transformer LM (``benchmarks/rtp/transformer_lm.py``, so this needs a
source checkout). Without ``--measure`` the plan comes from the cost model (``--world-size``,
``--flops``, ``--bandwidth``, ``--latency``: any cluster, computed on this machine, no processes);
with it, every strategy is profiled on the ranks torchrun started.
"""

import argparse
import os
import re
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import CostModel, plan

UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def parse_bytes(text: str) -> int:
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 512MiB, 8GiB, 1000000)")
    return int(float(match.group(1)) * UNITS[match.group(2).lower()])


def _benchmark_model_class():
    models = Path(__file__).resolve().parents[2] / "benchmarks" / "rtp"
    if not (models / "transformer_lm.py").exists():
        sys.exit(f"rsdp plan: the benchmark model is not at {models}; run it from a source checkout of rsdp.")
    sys.path.insert(0, str(models))
    from transformer_lm import TransformerLM

    return TransformerLM


def sequence_first_loss(model, tokens: torch.Tensor) -> torch.Tensor:
    """The planner resizes dim 0 of a batch; the benchmark model reads ``[seq, batch]``."""
    sequence_first = tokens.t()
    logits = model(sequence_first[:-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), sequence_first[1:].flatten())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="rsdp", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("plan", help="print the plan for a benchmark model config and a memory budget")
    p.add_argument("--budget", type=parse_bytes, required=True, help="bytes per rank, e.g. 80GiB")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1], help="per-rank batch sizes to consider")
    model = p.add_argument_group("model (the RTP benchmarks' transformer LM)")
    for name, default in (("vocab_size", 10240), ("ninp", 2048), ("nhid", 2048), ("nhead", 32), ("num_decoder_layers", 5), ("seq_len", 128)):
        model.add_argument(f"--{name}", type=int, default=default)
    cluster = p.add_argument_group("cost model (without --measure)")
    cluster.add_argument("--world-size", type=int, default=8)
    cluster.add_argument("--flops", type=float, default=400e12, help="achieved FLOP/s per device")
    cluster.add_argument("--bandwidth", type=float, default=100e9, help="bytes/s per device")
    cluster.add_argument("--latency", type=float, default=10e-6, help="seconds per message")
    p.add_argument("--measure", action="store_true", help="profile on the ranks torchrun started instead")
    args = parser.parse_args(argv)

    measured = args.measure
    if measured:
        if "RANK" not in os.environ:
            sys.exit("rsdp plan --measure: start it with torchrun, e.g. torchrun --nproc_per_node 4 -m rsdp plan --measure ...")
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    TransformerLM = _benchmark_model_class()
    torch.manual_seed(0)
    lm = TransformerLM(args.vocab_size, args.ninp, args.nhead, args.nhid, args.num_decoder_layers, max_len=args.seq_len)
    sample = torch.randint(args.vocab_size, (1, args.seq_len + 1))
    cost_model = None if measured else CostModel(args.world_size, args.flops, args.bandwidth, args.latency)
    try:
        chosen = plan(
            lm, memory_budget=args.budget, sample_input=sample, batch_sizes=args.batch_sizes,
            loss_fn=sequence_first_loss, cost_model=cost_model,
        )
    except ValueError as error:
        sys.exit(str(error))
    finally:
        if measured:
            dist.destroy_process_group()
    if int(os.environ.get("RANK", 0)) == 0:
        where = f"{args.world_size} devices (cost model)" if cost_model else "the ranks of this run (measured)"
        print(f"plan for {where}:\n{chosen}")


if __name__ == "__main__":
    main()
