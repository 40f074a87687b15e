"""``rsdp plan``: the plan for a model, a cluster and a memory budget.

    rsdp plan --model torchtitan:llama3:8B --world-size 8 --seq-len 8192 --local-batch-size 2 \\
        --activation-checkpoint selective --mixed-precision bf16 --budget 80GiB --hardware h100-sxm-nvlink
    rsdp plan --model hf:path/to/config.json --world-size 64 --budget 40GiB --json plan.json
    torchrun --nproc-per-node 2 -m rsdp calibrate --model benchmark --out profile.json   # then --hardware profile.json
    torchrun --nproc_per_node 4 -m rsdp plan --measure --budget 64MiB --ninp 512 --nhid 2048 ...

``--model`` is ``torchtitan:<family>:<flavor>``, ``hf:<config.json>`` or ``benchmark`` (the RTP benchmarks'
transformer LM, sized by ``--vocab_size --ninp --nhid --nhead --num_decoder_layers``; needs a source
checkout). Without ``--measure`` the plan comes from the cost model on the meta device (any cluster,
no processes); with it (benchmark model only), every strategy is profiled on the ranks torchrun started.
``--json`` writes each uniform strategy's and the plan's predicted peak bytes per device, step seconds and
tokens/s per device, and the plan's strategy per module.

A torchtitan model's replicated ``lm_head`` is planned inside a replicate root, as ``rsdp.torchtitan``
applies it (``replicated_in_root``): the plan's table says "replicate, in the root", and replicate
everywhere is counted so. Pitfall: planned otherwise, the CLI's plan would not be the one
``dp_strategy=auto`` chooses, nor its peak the one that run holds. Likewise a torchtitan model whose head
is tied to its embedding keeps both in the root, which ``rsdp.torchtitan`` makes FSDP or replicate
(``root_strategies``): its plans' roots are those, and rsdp everywhere is counted with an FSDP root.
"""

import argparse
import json
import os
import re
import sys
import time

import torch
import torch.distributed as dist

from . import CostModel, plan
from . import _calibrate, _hardware, _models, _training
from ._cost_model import OPTIMIZERS
from ._plan import NoPlanFits, choices_of, count_steps, plan_from_counts, predict_policy
from ._profile import find_units
from ..policy import Strategy

UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def parse_bytes(text: str) -> int:
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 512MiB, 8GiB, 1000000)")
    return int(float(match.group(1)) * UNITS[match.group(2).lower()])


def _model_arguments() -> argparse.ArgumentParser:
    """The model and the shape it runs at: what ``plan`` and ``calibrate`` both take."""
    shared = argparse.ArgumentParser(add_help=False)
    shared.add_argument("--seq-len", "--seq_len", dest="seq_len", type=int, default=None,
                        help="tokens per sample (default 2048; the benchmark model's 128)")
    shared.add_argument("--mixed-precision", choices=("bf16", "fp32"), default="fp32",
                        help="bf16: parameters gathered and computed in bf16, gradients reduced in fp32 (torchtitan's default)")
    model = shared.add_argument_group("benchmark model (--model benchmark)")
    for name, default in (("vocab_size", 10240), ("ninp", 2048), ("nhid", 2048), ("nhead", 32), ("num_decoder_layers", 5)):
        model.add_argument(f"--{name}", type=int, default=default)
    return shared


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="rsdp", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    shared = _model_arguments()
    p = commands.add_parser("plan", parents=[shared], help="print the plan for a model, a cluster and a memory budget")
    p.add_argument("--model", default="benchmark", help="torchtitan:<family>:<flavor>, hf:<config.json> or benchmark")
    p.add_argument("--budget", type=parse_bytes, required=True, help="bytes per device, e.g. 80GiB")
    p.add_argument("--world-size", type=int, default=8, help="data-parallel devices (cost model)")
    p.add_argument("--local-batch-size", type=int, nargs="+", default=None, dest="batch_sizes",
                   help="per-device batch sizes to consider (default 1)")
    p.add_argument("--batch-sizes", type=int, nargs="+", dest="batch_sizes", help=argparse.SUPPRESS)
    p.add_argument("--activation-checkpoint", choices=_models.AC_MODES, default="none",
                   help="torchtitan 0.3's activation checkpointing of every block")
    p.add_argument("--loss-chunks", type=int, default=1,
                   help="torchtitan's chunked loss in this many sequence chunks (torchtitan 0.3's llama3 configs: 8); "
                        "1: cross-entropy over the whole logits")
    trains = p.add_argument_group("what the run trains (cost model)")
    trains.add_argument("--training-dtype", choices=tuple(_training.TRAINING_DTYPES), default="fp32",
                        help="the dtype the run keeps parameters, gradients and optimizer state in, whatever a config's "
                             "torch_dtype says: fp32 (mixed precision keeps fp32 parameters), bf16 (pure-bf16 training)")
    trains.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="adamw",
                        help="its state and its step's temporaries (adamw: torch's default, foreach on GPUs and for-loop "
                             "on CPUs: both counted; sgd: torch's defaults, no momentum)")
    trains.add_argument("--lora-rank", type=int, default=0, help="train peft LoRA adapters of this rank, the rest frozen")
    trains.add_argument("--lora-targets", nargs="+", default=None, metavar="NAME",
                        help="the Linears LoRA adapts, by the last segment of their names (default: every Linear of the blocks)")
    trains.add_argument("--frozen", nargs="+", default=[], metavar="PATTERN",
                        help="parameters that do not train (no gradient, no optimizer state), by name glob: "
                             "'model.embed_tokens.*', '**.mlp.**'")
    p.add_argument("--hardware", default=None, help=f"a preset ({_hardware.preset_names()}) or a profile JSON")
    p.add_argument("--flops", type=float, default=None, help="achieved FLOP/s per device (overrides --hardware)")
    p.add_argument("--bandwidth", type=float, default=None, help="bytes/s per device (overrides --hardware)")
    p.add_argument("--latency", type=float, default=None, help="seconds per message (overrides --hardware)")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="devices per machine: ops whose ranks span machines pay the link between them, and rsdp's ring "
                        "groups stay within one (default: the hardware's, 8 for the two-level presets; a profile without "
                        "one: one machine, flat rings only)")
    p.add_argument("--ring-group-sizes", type=int, nargs="+", default=None, metavar="G",
                   help="the rsdp ring group sizes the search may choose (default: every divisor of the world within one "
                        "machine; 1: flat rings only)")
    p.add_argument("--json", default=None, help="write predictions per strategy and for the plan to this file")
    p.add_argument("--measure", action="store_true", help="profile on the ranks torchrun started (benchmark model)")
    c = commands.add_parser("calibrate", parents=[shared], help="measure this machine's time constants into a profile")
    c.add_argument("--model", default=None,
                   help="take the Linear shapes from this model (as plan's --model; default: a 1024-wide block); "
                        "with benchmark, also time one unsharded training step")
    c.add_argument("--world-size", type=int, default=None,
                   help="without torchrun: ranks to simulate on the fake process group (host time only)")
    c.add_argument("--local-batch-size", type=int, default=1)
    c.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    c.add_argument("--hardware", default="h100-sxm-nvlink",
                   help="without torchrun: the preset whose links the profile keeps (none can be measured)")
    c.add_argument("--out", default="profile.json", help="the profile to write (rank 0)")
    c.add_argument("--gpus-per-node", type=int, default=None,
                   help="under torchrun: take every N consecutive ranks as one machine (default: the machines the ranks "
                        "run on, by host name); on one host this simulates machines, whose links are then this host's")
    args = parser.parse_args(argv)
    if args.command == "calibrate" and "RANK" not in os.environ and not args.world_size:
        parser.error("rsdp calibrate: start it with torchrun (measures the process group), or give --world-size W "
                     "to measure host and GEMM times for W ranks in this one process")
    if args.command == "calibrate" and "RANK" not in os.environ and args.gpus_per_node:
        parser.error("rsdp calibrate: --gpus-per-node splits the ranks torchrun starts into machines; on the fake process "
                     "group no link is measured (the --hardware preset's are kept): drop it, or start it with torchrun")
    if args.command == "plan":
        args.batch_sizes = args.batch_sizes or [1]
    if args.seq_len is None:
        args.seq_len = 128 if args.model in ("benchmark", None) else 2048
    _check_arguments(args)
    return args


def _check_arguments(args: argparse.Namespace) -> None:
    """Exit with one line naming the first bad value and its fix: a count that must be positive, a time
    constant that must be positive (a latency may be 0)."""
    positive = {"--seq-len": args.seq_len, "--local-batch-size": args.batch_sizes if args.command == "plan" else args.local_batch_size}
    if args.command == "plan" or args.world_size is not None:
        positive["--world-size"] = args.world_size
    if args.command == "plan":
        positive.update({"--flops": args.flops, "--bandwidth": args.bandwidth, "--loss-chunks": args.loss_chunks,
                         "--ring-group-sizes": args.ring_group_sizes})
    if args.command == "plan" or args.gpus_per_node is not None:
        positive["--gpus-per-node"] = args.gpus_per_node
    if args.model in ("benchmark", None):
        positive.update({f"--{name}": getattr(args, name) for name in ("vocab_size", "ninp", "nhid", "nhead", "num_decoder_layers")})
    for flag, value in positive.items():
        values = value if isinstance(value, list) else [value]
        if any(v is not None and v <= 0 for v in values):
            sys.exit(f"rsdp {args.command}: {flag} must be positive, got {' '.join(map(str, values))}; "
                     f"{_FIXES.get(flag, 'pass a positive number')}.")
    if args.command == "plan" and args.latency is not None and args.latency < 0:
        sys.exit(f"rsdp plan: --latency must be 0 or more seconds per message, got {args.latency}; e.g. --latency 5e-6.")
    if args.command == "plan" and args.lora_rank < 0:
        sys.exit(f"rsdp plan: --lora-rank must be 0 (no LoRA) or more, got {args.lora_rank}; e.g. --lora-rank 16.")
    if args.model in ("benchmark", None) and args.ninp % args.nhead:
        sys.exit(f"rsdp {args.command}: the benchmark model's --ninp {args.ninp} must divide into --nhead {args.nhead} "
                 "attention heads; pick an --nhead that divides --ninp.")


_FIXES = {
    "--seq-len": "pass the tokens per sample, e.g. --seq-len 2048, or leave it out (2048; the benchmark model's 128)",
    "--local-batch-size": "pass per-device batch sizes of 1 or more, e.g. --local-batch-size 1 2 4",
    "--world-size": "pass the number of data-parallel devices, e.g. --world-size 8",
    "--loss-chunks": "pass 1 for cross-entropy over the whole logits, or the number of sequence chunks, e.g. --loss-chunks 8",
    "--flops": "pass the achieved FLOP/s per device, e.g. --flops 4e14, or leave it out (--hardware's)",
    "--bandwidth": "pass bytes/s per device, e.g. --bandwidth 4.5e11, or leave it out (--hardware's)",
    "--gpus-per-node": "pass the devices of one machine, e.g. --gpus-per-node 8, or leave it out (--hardware's)",
    "--ring-group-sizes": "pass divisors of the world within one machine, e.g. --ring-group-sizes 1 8, or leave it out",
}


def _cost_model(args: argparse.Namespace) -> CostModel:
    hardware = _hardware.load(args.hardware) if args.hardware else _hardware.PRESETS["h100-sxm-nvlink"]
    bf16 = args.mixed_precision == "bf16"
    return hardware.cost_model(
        args.world_size, param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32 if bf16 else None,
        flops_per_s=args.flops, bandwidth_bytes_per_s=args.bandwidth, latency_s=args.latency,
        gpus_per_node=args.gpus_per_node,
        allowed_ring_group_sizes=tuple(sorted(set(args.ring_group_sizes))) if args.ring_group_sizes else None,
    ).with_optimizer(args.optimizer)


def replicated_in_root(model_spec: str, units: list[str]) -> tuple[str, ...]:
    """The units a plan for ``--model model_spec`` replicates inside the root (``rsdp.plan``'s
    ``replicated_in_root``): a torchtitan model's ``lm_head``, as ``rsdp.torchtitan`` applies a replicated
    head under ``dp_strategy`` ``auto`` and ``replicate`` (torchtitan's chunked loss cannot call a replicate
    module; ``data_parallel_rules``). A tied head is no unit (it stays in the root with its embedding).
    Hugging Face models and the benchmark model call their head in their forward: a replicated head is a
    module of its own there."""
    return ("lm_head",) if model_spec.startswith("torchtitan:") and "lm_head" in units else ()


def root_strategies(model_spec: str, model: torch.nn.Module) -> tuple[Strategy, ...]:
    """The strategies the root of ``--model model_spec`` may take (``rsdp.plan``'s ``root_strategies``):
    FSDP or replicate for a torchtitan model that ties its head to its embedding, as ``rsdp.torchtitan``
    applies it (both stay in the root, which torchtitan's chunked loss calls after the forward, where
    only FSDP's and replicate's root parameters stay usable: ``data_parallel_rules`` makes an rsdp root
    FSDP); any strategy otherwise."""
    tied = model_spec.startswith("torchtitan:") and getattr(model, "enable_weight_tying", False)
    return (Strategy.FSDP, Strategy.REPLICATE) if tied else tuple(Strategy)


def _prediction(peak: float, seconds: float, batch_size: int, seq_len: int) -> dict:
    return {"peak_bytes": int(peak), "step_s": seconds, "tokens_per_s_per_device": batch_size * seq_len / seconds}


def main(argv: list[str] | None = None) -> None:
    args = _arguments(argv)
    if args.command == "calibrate":
        return _calibrated(args)
    if args.measure:
        return _measured(args)
    try:
        cost_model = _cost_model(args)
        benchmark_shape = dict(vocab_size=args.vocab_size, ninp=args.ninp, nhid=args.nhid, nhead=args.nhead,
                               num_decoder_layers=args.num_decoder_layers, seq_len=args.seq_len)
        model, loss_fn, vocab = _models.build(args.model, benchmark_shape, args.loss_chunks)
        model = _training.as_trained(model, training_dtype=args.training_dtype, lora_rank=args.lora_rank,
                                     lora_targets=args.lora_targets, frozen=args.frozen)
        _models.apply_activation_checkpointing(model, args.activation_checkpoint)
        started = time.perf_counter()
        units = find_units(model)
        in_root = replicated_in_root(args.model, units)
        roots = root_strategies(args.model, model)
        sample = torch.zeros(1, args.seq_len + 1, dtype=torch.long, device="meta")
        counted, folded = count_steps(model, units, sample, args.batch_sizes, loss_fn, cost_model.param_dtype,
                                      in_root if Strategy.REPLICATE in roots else ())
    except ValueError as error:
        sys.exit(str(error))
    except Exception as error:  # a model whose step cannot run on the meta device: one line, not a traceback
        reason = (str(error).strip().splitlines() or [""])[0][:300]
        sys.exit(f"rsdp plan: {args.model}'s training step cannot be counted on the meta device ({type(error).__name__}: "
                 f"{reason}); rsdp plan counts decoder language models that run there.")
    try:
        chosen = plan_from_counts(counted, units, memory_budget=args.budget, cost_model=cost_model,
                                  replicated_in_root=in_root, folded=folded, root_strategies=roots)
        no_plan = None
    except NoPlanFits as error:
        chosen, no_plan = None, error
    uniform = {}
    for choice in choices_of(tuple(Strategy), cost_model.ring_group_sizes()):
        # Replicate everywhere puts the units of in_root in the root too: its step is the folded one.
        step, step_units = (
            (folded, [name for name in units if name not in in_root]) if in_root and choice.strategy is Strategy.REPLICATE
            else (counted, units)
        )
        # A root that cannot take the strategy takes FSDP, as dp_strategy=rsdp makes the root of a tied head.
        policy = {"": choice.strategy if choice.strategy in roots else Strategy.FSDP, **dict.fromkeys(step_units, choice.strategy)}
        best = None  # the batch size of most tokens/s per device that fits, else the smallest
        for size, counts in step.items():
            peak, seconds = predict_policy(counts, step_units, policy, cost_model, dict.fromkeys(policy, choice.ring_group_size))
            entry = {"local_batch_size": size, **_prediction(peak, seconds, size, args.seq_len)}
            key = (peak <= args.budget, entry["tokens_per_s_per_device"] if peak <= args.budget else -peak)
            if best is None or key > best[0]:
                best = (key, entry)
        uniform[str(choice)] = best[1]
    elapsed = time.perf_counter() - started
    report = {
        "model": args.model, "world_size": args.world_size, "seq_len": args.seq_len,
        "activation_checkpoint": args.activation_checkpoint, "mixed_precision": args.mixed_precision,
        "training_dtype": args.training_dtype, "optimizer": args.optimizer, "lora_rank": args.lora_rank,
        "lora_targets": args.lora_targets, "frozen": args.frozen,
        "loss_chunks": args.loss_chunks,
        "budget_bytes": args.budget, "cost_model": {k: str(v) for k, v in vars(cost_model).items()},
        "peak_bytes_are": "reserved" if cost_model.peak_is_reserved else "allocated",
        "gpus_per_node": cost_model.gpus_per_node,
        # each strategy everywhere (rsdp in flat rings), and rsdp everywhere in rings of groups of g ("rsdp g=G")
        "strategies": {name: entry for name, entry in uniform.items() if name in Strategy._value2member_map_},
        "ring_groups": {name: entry for name, entry in uniform.items() if name not in Strategy._value2member_map_},
        "plan": None if chosen is None else {
            "local_batch_size": chosen.batch_size,
            **_prediction(chosen.predicted_peak_bytes, chosen.predicted_step_seconds, chosen.batch_size, args.seq_len),
            "modules": {name or "(root)": s.value for name, s in chosen.strategies.items()},
            "ring_group_sizes": {name or "(root)": g for name, g in chosen.ring_group_sizes.items()},
            "in_root": [row.module for row in chosen.rows if row.in_root],  # replicated inside the root
        },
        "smallest_fitting_budget_bytes": no_plan.needed_bytes if no_plan else None,
        "planning_seconds": elapsed,
    }
    GiB = 2**30
    trained = f"LoRA rank {args.lora_rank}" if args.lora_rank else "every parameter"
    trained += f", {' '.join(args.frozen)} frozen" if args.frozen else ""
    machines = "" if not cost_model.spans_machines else f" on machines of {cost_model.gpus_per_node}"
    heading = f"{args.world_size} devices{machines} (cost model), {args.model}, seq {args.seq_len}, " \
              f"activation checkpointing {args.activation_checkpoint}, {args.mixed_precision}, " \
              f"{args.training_dtype} parameters, {args.optimizer}, training {trained}"
    print(f"plan for {heading}:\n{chosen}\n" if chosen else f"no plan for {heading}\n")
    print("| everywhere | batch | peak per device | step | tokens/s per device |\n| --- | --- | --- | --- | --- |")
    for name, entry in uniform.items():
        print(f"| {name} | {entry['local_batch_size']} | {entry['peak_bytes'] / GiB:.2f} GiB | {entry['step_s'] * 1e3:.1f} ms | "
              f"{entry['tokens_per_s_per_device']:.0f} |")
    print(f"\nplanned in {elapsed:.1f} s")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)
    if no_plan:
        sys.exit(str(no_plan))


def _calibrated(args: argparse.Namespace) -> None:
    try:
        hardware, report = _calibrate.calibrate(args)
    except ValueError as error:
        sys.exit(str(error))
    if int(os.environ.get("RANK", 0)) != 0:
        return
    _calibrate.write(hardware, report, args.out)
    print(f"wrote {args.out}: {hardware.source}")
    print(f"flops_per_s {hardware.flops_per_s:.4g} (whole GEMMs {report['gemm_flops_per_s']:.4g}, the rest "
          f"{hardware.other_flops_per_s or 0:.4g}); partial GEMM efficiency "
          + ", ".join(f"W={w}: {e:.3f}" for w, e in hardware.partial_gemm_efficiency.items())
          + f"; host per ring step {hardware.ring_step_host_s * 1e6:.1f} us")
    levels = [("", hardware.links)]
    if hardware.inter_node_links:
        levels = [("within a machine, ", hardware.links), (f"between machines of {hardware.gpus_per_node}, ", hardware.inter_node_links)]
    for level, links in levels:
        for op, link in links.items():
            print(f"{level}{op}: latency {link.latency_s * 1e6:.1f} us per hop, bandwidth {link.bandwidth_bytes_per_s / 1e9:.3f} GB/s")


def _measured(args: argparse.Namespace) -> None:
    if "RANK" not in os.environ:
        sys.exit("rsdp plan --measure: start it with torchrun, e.g. torchrun --nproc_per_node 4 -m rsdp plan --measure ...")
    if args.model != "benchmark":
        sys.exit("rsdp plan --measure profiles the benchmark model only; drop --model or --measure.")
    if (args.training_dtype, args.optimizer, args.lora_rank, args.frozen) != ("fp32", "adamw", 0, []):
        sys.exit("rsdp plan --measure trains the benchmark model whole, in fp32, with AdamW; --training-dtype, --optimizer, "
                 "--lora-rank and --frozen describe the cost model's run: drop them or --measure.")
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    try:
        lm, loss_fn = _models._benchmark_model(args.vocab_size, args.ninp, args.nhid, args.nhead, args.num_decoder_layers, args.seq_len)
        sample = torch.randint(args.vocab_size, (1, args.seq_len + 1))
        chosen = plan(lm, memory_budget=args.budget, sample_input=sample, batch_sizes=args.batch_sizes, loss_fn=loss_fn)
    except ValueError as error:
        sys.exit(str(error))
    finally:
        dist.destroy_process_group()
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"plan for the ranks of this run (measured):\n{chosen}")


if __name__ == "__main__":
    main()
