"""One rank's share of a W-rank training step at Llama 3 8B's shapes, measured on one device, with the
wire time of a W-GPU job added as a prediction.

torch's fake process group stands in for the W-1 other ranks: every collective and point-to-point op
returns at once without moving data, so a step on one device is exactly one rank's compute and host
work, with no wire time. The model is ``benchmarks/llama3.py`` (torchtitan's Llama 3) at 8B's shapes
with a few decoder layers, the embedding and the vocabulary head, bf16 compute with fp32 gradient
reduction (``MixedPrecisionPolicy``), sharded like rsdp.torchtitan shards it (the embedding, each
layer and the head a unit, then the root) with FSDP2, rsdp, or rsdp with torchtitan's tensor-parallel
plan as its ring plan. Per strategy it gives the step time by phase (CUDA events on a GPU), the host's
time to issue the step, the peak allocated and reserved memory (each strategy measured alone), and the
messages and bytes one rank sends, by phase.

The prediction adds, to each measured phase, the time its messages take on the wire under a linear
model per op (latency plus bytes over bandwidth), with published NCCL figures for 8 H100 SXM GPUs on
NVLink by default (docs/benchmarks.md names them): with no overlap (measured step plus wire time) and
with perfect overlap (only the wire time that outlasts each phase's compute added). Two estimates, not a
measurement: a real run also loses SMs and memory bandwidth to NCCL's kernels.

A second table times the split GEMMs a ring runs: for each Linear of the model and each W, W GEMMs
each on 1/W of the weight's rows (its output features; torchtitan's plan splits ``wo`` and ``w2`` by
input columns, also listed) against one GEMM on the whole weight, for the forward ``y = x W^T`` and
both backward GEMMs ``dX = dY W`` and ``dW = dY^T X``.

Pitfalls:
- The fake process group leaves every received buffer as it was allocated: all-gathered weights and
  rotated shards are uninitialised memory, so values (losses, gradients) are meaningless and may be
  NaN. Timing is still honest: no kernel here takes a data-dependent path, and nothing reads a value
  back to the host.
- All strategies of one W live in one process and share the caching allocator, so memory is measured
  for each strategy built alone, before the timed rounds.
- ``--preset tiny --device cpu`` runs the same code at toy shapes: the CI smoke test.

    python benchmarks/scale.py --json scale.json                      # on a GPU: 8B shapes, W = 2, 4, 8
    python benchmarks/scale.py --preset tiny --device cpu --json out.json
"""

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama3 import RING_PLAN, Llama3, Llama3Config  # noqa: E402

from rsdp import release_ring_buffers, rsdp_shard  # noqa: E402
from rsdp._compat import MixedPrecisionPolicy, fake_store, fully_shard  # noqa: E402
from rsdp.memory import CommCounter  # noqa: E402

STRATEGIES = ("fsdp", "rsdp", "rsdp+plan")
PHASES = ("forward", "backward", "optimizer")
PRESETS = {
    # Llama 3 8B's layers; two of them fit one 80 GB GPU at sequence 8192 with all three strategies
    # alive at W=2 (each ~12 GB of sharded fp32 states, Adam's included, plus the step's activations).
    "8b": dict(config=Llama3Config(n_layers=2), seq=[2048, 8192], world=[2, 4, 8], batch=1),
    "tiny": dict(
        config=Llama3Config(dim=128, n_layers=2, n_heads=16, n_kv_heads=8, ffn_hidden=256, vocab_size=512),
        seq=[32], world=[2, 4], batch=1,
    ),
}
# Published NCCL figures for 8 H100 SXM GPUs on NVLink 4 (NVSwitch); docs/benchmarks.md cites them.
COLLECTIVE_BUS_BANDWIDTH = 360e9  # all-gather / reduce-scatter busbw, large messages (nccl-tests #326)
COLLECTIVE_LATENCY_S = 10e-6  # small-message time of an 8-GPU ring collective: an assumption (see docs)
P2P_BANDWIDTH = 360e9  # a ring of send/recv moves what a ring all-gather moves per step
P2P_LATENCY_S = 3e-6  # sendrecv_perf between two H100 on NVLink (nccl #1487)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


class Clock:
    """Marks in a step: CUDA events (the device's timeline) on a GPU, host time everywhere."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.events, self.host = [], []

    def mark(self) -> None:
        self.host.append(time.perf_counter())
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events.append(event)

    def intervals(self) -> list[float]:
        """Seconds between consecutive marks (on the device when there is one)."""
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.events, self.events[1:])]
        return [b - a for a, b in zip(self.host, self.host[1:])]


def build(strategy: str, config: Llama3Config, world: int, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    with device:
        model = Llama3(config)
    mesh = init_device_mesh(device.type, (world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)
    # rsdp.torchtitan's units: the embedding, each layer, the head, then the root.
    for unit in (model.tok_embeddings, *model.layers.values(), model.lm_head):
        if strategy == "fsdp":
            fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
        else:
            plan = RING_PLAN if strategy == "rsdp+plan" and unit in model.layers.values() else None
            rsdp_shard(unit, mesh=mesh, mp_policy=policy, ring_plan=plan)
    if strategy == "fsdp":
        fully_shard(model, mesh=mesh, mp_policy=policy)
    else:
        rsdp_shard(model, mesh=mesh, mp_policy=policy)
    # torchtitan's AdamW implementation is the fused one (CPUs have it too, so the smoke test runs it).
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)


def step(model: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor, clock: Clock | None = None,
         counters: dict | None = None) -> None:
    """One training step; ``clock`` marked at its start and after each phase; ``counters`` (phase ->
    CommCounter) count the messages of forward and backward."""
    mark = clock.mark if clock else (lambda: None)
    mark()
    with counters["forward"] if counters else contextlib.nullcontext():
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    mark()
    with counters["backward"] if counters else contextlib.nullcontext():
        loss.backward()
    mark()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    mark()


def tokens_for(config: Llama3Config, batch: int, seq: int, device: torch.device) -> torch.Tensor:
    return torch.randint(config.vocab_size, (batch, seq + 1), device=device)


def free_cached(device: torch.device) -> None:
    """Drop what earlier models left: the ring's buffers (the process's, not a model's) and cached blocks."""
    gc.collect()
    release_ring_buffers()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def memory_now(device: torch.device) -> int:
    return torch.cuda.memory_allocated() if device.type == "cuda" else 0


def measure_alone(strategy: str, args, world: int, device: torch.device, result: dict) -> None:
    """Build ``strategy`` alone; per sequence length, into ``result``: a warm-up step, a step whose
    peak memory is read, and a step whose messages are counted. Resident memory is what stays allocated
    between steps (sharded parameters, Adam's states, persistent buffers)."""
    free_cached(device)
    before = memory_now(device)
    model, optimizer = build(strategy, args.config, world, device)
    for seq in args.seq:
        tokens = tokens_for(args.config, args.batch, seq, device)
        step(model, optimizer, tokens)
        figures = {}
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            figures["resident_bytes"] = torch.cuda.memory_allocated() - before
            step(model, optimizer, tokens)
            torch.cuda.synchronize()
            figures["peak_allocated_bytes"] = torch.cuda.max_memory_allocated() - before
            figures["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
        counters = {phase: CommCounter() for phase in ("forward", "backward")}
        try:
            step(model, optimizer, tokens, counters=counters)
            figures["messages"] = {
                phase: {"calls": dict(counter.calls), "bytes_by_op": dict(counter.by_op), "bytes": counter.bytes_sent}
                for phase, counter in counters.items()
            }
        except Exception as error:  # a counting failure must not cost the timings
            figures["messages_error"] = f"{type(error).__name__}: {error}"
            log(f"  message count failed for {strategy}: {figures['messages_error']}")
        result[seq] = figures


def time_rounds(args, world: int, device: torch.device, result: dict) -> None:
    """All strategies built side by side; per sequence length, into ``result``: a warm-up step each,
    then ``--rounds`` rounds of ``--steps`` steps, the strategies alternating within each round."""
    free_cached(device)
    built = {strategy: build(strategy, args.config, world, device) for strategy in args.strategies}
    for seq in args.seq:
        tokens = tokens_for(args.config, args.batch, seq, device)
        for model, optimizer in built.values():
            step(model, optimizer, tokens)
        rounds = {strategy: {"phases_s": [], "host_s": []} for strategy in built}
        for _ in range(args.rounds):
            for strategy, (model, optimizer) in built.items():
                for _ in range(args.steps):
                    clock = Clock(device)
                    step(model, optimizer, tokens, clock)
                    issued = clock.host[-1] - clock.host[0]
                    rounds[strategy]["phases_s"].append(clock.intervals())
                    rounds[strategy]["host_s"].append(issued)
        result[seq] = {
            strategy: {
                "phase_median_s": {phase: statistics.median(p[i] for p in r["phases_s"]) for i, phase in enumerate(PHASES)},
                "step_median_s": statistics.median(sum(p) for p in r["phases_s"]),
                "step_rounds_s": [sum(p) for p in r["phases_s"]],
                "host_issue_median_s": statistics.median(r["host_s"]),
            }
            for strategy, r in rounds.items()
        }
        log(f"  W={world} seq={seq}: " + ", ".join(f"{s} {v['step_median_s'] * 1e3:.1f} ms" for s, v in result[seq].items()))


def wire_seconds(calls: dict, bytes_by_op: dict, args) -> float:
    """Predicted wire time of one phase's messages: per op, latency plus bytes over bandwidth."""
    total = 0.0
    for op, count in calls.items():
        if op == "c10d::send":
            total += count * args.p2p_latency + bytes_by_op.get(op, 0) / args.p2p_bandwidth
        else:
            total += count * args.collective_latency + bytes_by_op.get(op, 0) / args.collective_bandwidth
    return total


def predict(timing: dict, memory: dict, args) -> dict | None:
    """No overlap: the measured step plus every phase's wire time. Perfect overlap: the measured step
    plus, per phase, only the wire time that outlasts the phase's compute."""
    messages = memory.get("messages")
    if messages is None:
        return None
    wire = {phase: wire_seconds(messages[phase]["calls"], messages[phase]["bytes_by_op"], args) for phase in messages}
    measured = timing["phase_median_s"]
    return {
        "wire_s": wire,
        "no_overlap_s": timing["step_median_s"] + sum(wire.values()),
        "overlap_s": timing["step_median_s"] + sum(max(0.0, wire[phase] - measured[phase]) for phase in wire),
    }


def time_gemm(run, device: torch.device, reps: int) -> float:
    run()
    clock = Clock(device)
    clock.mark()
    for _ in range(reps):
        run()
    clock.mark()
    return clock.intervals()[0] / reps


def gemm_table(args, device: torch.device) -> list[dict]:
    """Per Linear, W and GEMM: one GEMM on the whole weight against W on 1/W of it (distinct slices,
    so none is served from cache), achieved FLOP/s and their ratio."""
    c = args.config
    shapes = [  # name, out_features, in_features, split ("rows": output features; "cols": input features)
        ("wq", c.n_heads * c.head_dim, c.dim, "rows"), ("wk/wv", c.n_kv_heads * c.head_dim, c.dim, "rows"),
        ("wo", c.dim, c.n_heads * c.head_dim, "rows"), ("wo (plan: cols)", c.dim, c.n_heads * c.head_dim, "cols"),
        ("w1/w3", c.ffn_hidden, c.dim, "rows"), ("w2", c.dim, c.ffn_hidden, "rows"),
        ("w2 (plan: cols)", c.dim, c.ffn_hidden, "cols"), ("lm_head", c.vocab_size, c.dim, "rows"),
    ]
    dtype = torch.bfloat16
    rows = []
    for seq in args.seq:
        m = args.batch * seq
        for name, n, k, split in shapes:
            x, w, dy = (torch.randn(*shape, device=device, dtype=dtype) for shape in ((m, k), (n, k), (m, n)))
            gemms = {
                "forward x W^T": lambda x, w, dy: x @ w.t(),
                "dX = dY W": lambda x, w, dy: dy @ w,
                "dW = dY^T X": lambda x, w, dy: dy.t() @ x,
            }
            full_time = {g: time_gemm(lambda: f(x, w, dy), device, args.gemm_reps) for g, f in gemms.items()}
            for world in args.world:
                if split == "rows":
                    parts = [(x, w_s.contiguous(), dy_s.contiguous()) for w_s, dy_s in zip(w.chunk(world, 0), dy.chunk(world, 1))]
                else:
                    parts = [(x_s.contiguous(), w_s.contiguous(), dy) for x_s, w_s in zip(x.chunk(world, 1), w.chunk(world, 1))]
                for g, f in gemms.items():
                    split_time = time_gemm(lambda: [f(*part) for part in parts], device, args.gemm_reps)
                    flop = 2 * m * n * k
                    rows.append({
                        "seq": seq, "linear": name, "gemm": g, "world": world, "m": m, "n": n, "k": k,
                        "full_s": full_time[g], "split_s": split_time,
                        "full_tflops": flop / full_time[g] / 1e12, "split_tflops": flop / split_time / 1e12,
                        "ratio": full_time[g] / split_time,
                    })
                del parts
            del x, w, dy
    return rows


def mib(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def print_tables(results: dict, args) -> None:
    c = args.config
    print(
        f"\n### one rank's share of a W-rank step (fake process group: compute + host, no wire), Llama 3 shapes: "
        f"dim {c.dim}, {c.n_heads} heads / {c.n_kv_heads} kv, FFN {c.ffn_hidden}, vocab {c.vocab_size}, "
        f"{c.n_layers} layers + embedding + head; local batch {args.batch}; bf16 compute, fp32 reduce; "
        f"{args.rounds} rounds x {args.steps} steps, medians\n",
        flush=True,
    )
    print("| seq | W | strategy | step ms | × fsdp | forward | backward | optimizer | host issue ms | resident MiB | peak alloc MiB | peak reserved MiB | sends fwd/bwd | collectives fwd/bwd | MiB sent |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for world, per_world in results["runs"].items():
        for seq in args.seq:
            timing = per_world.get("timing", {}).get(seq, {})
            for strategy in args.strategies:
                t = timing.get(strategy)
                m = per_world.get("memory", {}).get(strategy, {}).get(seq, {})
                if t is None:
                    continue
                ratio = t["step_median_s"] / timing["fsdp"]["step_median_s"] if "fsdp" in timing else float("nan")
                phases = " | ".join(f"{t['phase_median_s'][p] * 1e3:.1f}" for p in PHASES)
                msgs = m.get("messages")
                if msgs:
                    sends = "/".join(str(msgs[p]["calls"].get("c10d::send", 0)) for p in ("forward", "backward"))
                    coll = "/".join(str(sum(n for op, n in msgs[p]["calls"].items() if op != "c10d::send")) for p in ("forward", "backward"))
                    sent = mib(sum(msgs[p]["bytes"] for p in msgs))
                else:
                    sends = coll = sent = "-"
                memory = " | ".join(mib(m[key]) if key in m else "-" for key in ("resident_bytes", "peak_allocated_bytes", "peak_reserved_bytes"))
                print(f"| {seq} | {world} | {strategy} | {t['step_median_s'] * 1e3:.1f} | {ratio:.2f} | {phases} | "
                      f"{t['host_issue_median_s'] * 1e3:.1f} | {memory} | {sends} | {coll} | {sent} |")
    print(
        f"\n### PREDICTION (not measured): a W-GPU step = the measured one-rank step + wire time per message, "
        f"collectives {args.collective_latency * 1e6:.0f} µs + bytes / {args.collective_bandwidth / 1e9:.0f} GB/s busbw, "
        f"send/recv {args.p2p_latency * 1e6:.0f} µs + bytes / {args.p2p_bandwidth / 1e9:.0f} GB/s "
        "(8x H100 SXM NVLink figures, docs/benchmarks.md)\n"
    )
    print("| seq | W | strategy | measured ms | wire fwd/bwd ms | predicted, no overlap ms | predicted, perfect overlap ms |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for world, per_world in results["runs"].items():
        for seq in args.seq:
            for strategy in args.strategies:
                p = per_world.get("prediction", {}).get(seq, {}).get(strategy)
                t = per_world.get("timing", {}).get(seq, {}).get(strategy)
                if p is None or t is None:
                    continue
                print(f"| {seq} | {world} | {strategy} | {t['step_median_s'] * 1e3:.1f} | "
                      f"{p['wire_s']['forward'] * 1e3:.2f}/{p['wire_s']['backward'] * 1e3:.2f} | "
                      f"{p['no_overlap_s'] * 1e3:.1f} | {p['overlap_s'] * 1e3:.1f} |")
    if results.get("gemm"):
        print("\n### split GEMMs: W GEMMs on 1/W of the weight against one on all of it (bf16; ratio = full time / split time)\n")
        print("| seq | linear | M x N x K | GEMM | full TFLOP/s | " + " | ".join(f"W={w} TFLOP/s (ratio)" for w in args.world) + " |")
        print("| --- | --- | --- | --- | --- | " + " | ".join("---" for _ in args.world) + " |")
        keyed = {}
        for row in results["gemm"]:
            keyed.setdefault((row["seq"], row["linear"], row["gemm"]), {})[row["world"]] = row
        for (seq, linear, gemm), by_world in keyed.items():
            first = next(iter(by_world.values()))
            cells = " | ".join(f"{by_world[w]['split_tflops']:.3g} ({by_world[w]['ratio']:.2f})" for w in args.world)
            print(f"| {seq} | {linear} | {first['m']}x{first['n']}x{first['k']} | {gemm} | {first['full_tflops']:.3g} | {cells} |")


def save(results: dict, args) -> None:
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=2, default=str)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="8b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, help="decoder layers (the preset's by default)")
    parser.add_argument("--seq", type=int, nargs="+", help="sequence lengths (the preset's by default)")
    parser.add_argument("--world", type=int, nargs="+", help="ranks simulated (the preset's by default)")
    parser.add_argument("--batch", type=int, help="local batch (the preset's by default)")
    parser.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per strategy per round")
    parser.add_argument("--gemm-reps", type=int, default=5)
    parser.add_argument("--no-gemm", action="store_true", help="skip the split-GEMM table")
    parser.add_argument("--collective-bandwidth", type=float, default=COLLECTIVE_BUS_BANDWIDTH, help="bytes/s (busbw)")
    parser.add_argument("--collective-latency", type=float, default=COLLECTIVE_LATENCY_S, help="seconds per collective")
    parser.add_argument("--p2p-bandwidth", type=float, default=P2P_BANDWIDTH, help="bytes/s per send")
    parser.add_argument("--p2p-latency", type=float, default=P2P_LATENCY_S, help="seconds per send")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    preset = PRESETS[args.preset]
    args.seq, args.world = args.seq or preset["seq"], args.world or preset["world"]
    args.batch = args.batch or preset["batch"]
    args.config = dataclasses.replace(preset["config"], n_layers=args.layers or preset["config"].n_layers)
    if args.rounds < 3:
        parser.error("--rounds must be at least 3 (timings alternate over rounds)")
    bad = [w for w in args.world if args.config.n_kv_heads % w or args.config.ffn_hidden % w]
    if bad and "rsdp+plan" in args.strategies:
        parser.error(f"--world {bad}: the ring plan needs the kv heads ({args.config.n_kv_heads}) and FFN hidden "
                     f"({args.config.ffn_hidden}) to divide by W, as tensor parallelism does")
    if fake_store() is None:
        parser.error("this torch has no fake process group (torch.testing._internal.distributed.fake_pg)")
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))

    results = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "nccl": str(torch.cuda.nccl.version()) if device.type == "cuda" else None,
        "loadavg": [open("/proc/loadavg").read().split()[:3]],
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "args": {k: (dataclasses.asdict(v) if k == "config" else v) for k, v in vars(args).items()},
        "runs": {},
    }
    log(f"device {results['device']}, torch {results['torch']}, config {args.config}, local batch {args.batch}")
    for world in args.world:
        per_world = results["runs"][world] = {}
        dist.init_process_group("fake", store=fake_store(), rank=0, world_size=world)
        try:
            per_world["memory"], per_world["timing"] = {}, {}
            for strategy in args.strategies:
                log(f"W={world} {strategy}: memory and messages, built alone")
                memory = per_world["memory"].setdefault(strategy, {})
                try:
                    measure_alone(strategy, args, world, device, memory)
                except Exception as error:  # the other strategies and the timed rounds still run
                    memory["error"] = f"{type(error).__name__}: {error}"
                    log(f"W={world} {strategy}: memory failed: {memory['error']}")
            log(f"W={world}: timed rounds")
            time_rounds(args, world, device, per_world["timing"])
        except Exception as error:  # one W failing must not cost the others, nor what it measured
            per_world["error"] = f"{type(error).__name__}: {error}"
            log(f"W={world} failed: {per_world['error']}")
        finally:
            dist.destroy_process_group()
        per_world["prediction"] = {
            seq: {
                s: predict(per_world["timing"][seq][s], per_world["memory"][s][seq], args)
                for s in args.strategies
                if s in per_world["timing"].get(seq, {}) and seq in per_world["memory"].get(s, {})
            }
            for seq in args.seq
        }
        save(results, args)  # what is done so far survives a run cut short
    if not args.no_gemm:
        log("split GEMMs")
        try:
            results["gemm"] = gemm_table(args, device)
        except Exception as error:
            results["gemm_error"] = f"{type(error).__name__}: {error}"
            log(f"split GEMMs failed: {results['gemm_error']}")
    results["loadavg"].append(open("/proc/loadavg").read().split()[:3])
    save(results, args)
    print_tables(results, args)
    failed = [w for w, r in results["runs"].items() if "error" in r or any("error" in m for m in r["memory"].values())]
    failed += ["gemm"] if "gemm_error" in results else []
    if failed:
        sys.exit(f"failed: {failed}")


if __name__ == "__main__":
    main()
