"""Run the dp, fsdp, tp and rtp benchmarks on one config and world size, and compare them.

Each strategy runs its own script (``<name>_benchmark.py --json ...``) in a process of its own: on CPU a
child forked from this one, which has imported torch once (a new interpreter would import it again,
~5 s on 2 cores, more than a small config's run); on CUDA a new interpreter (a process that has asked
CUDA for its devices, as the flags' parsing does, cannot be forked for CUDA work). The strategies
alternate over ``--repeats`` rounds (timings on a shared machine drift, so strategies are compared
within a round) and each strategy's step time is its median round. This prints a markdown table with
every figure also as a ratio to fsdp's, the per-round ratios of step time and of host CPU time (all
ranks' user and system time per step: where ranks share cores the step time follows it) and
``/proc/loadavg``, and draws a chart.

    python benchmarks/rtp/compare.py                  # default: 4 CPU ranks (one per GPU on CUDA), 3 rounds (~3 min, 2 cores)
    python benchmarks/rtp/compare.py --preset small   # the batch-1 regime rsdp is for
    python benchmarks/rtp/compare.py --preset moe     # a Mixtral MoE at batch 1: experts rotate in blocks
    python benchmarks/rtp/compare.py --batch_size 1 --vocab_size 32768 --chart img/wide_vocab.png
"""

import json
import multiprocessing
import runpy
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


import common  # noqa: E402

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
STRATEGIES = ("dp", "fsdp", "tp", "rtp")
BASELINE = "fsdp"
# Small enough that all four strategies finish in a few minutes on 2 CPU cores with 4 ranks.
DEFAULT_CONFIG = {
    "vocab_size": 8192,
    "ninp": 512,
    "nhid": 2048,
    "nhead": 8,
    "num_decoder_layers": 2,
    "seq_len": 64,
    "batch_size": 2,
    "max_batch": 10,
    "warmup": 2,
}
# The regime of fine-tuning at small per-GPU batches (docs/benchmarks.md, "Small per-GPU batches").
PRESETS = {
    "default": {},
    "small": {"vocab_size": 2004, "ninp": 128, "nhid": 256, "nhead": 4, "seq_len": 16, "batch_size": 1, "max_batch": 20, "warmup": 3},
    # A mixture-of-experts LM (moe_lm.py: Mixtral) at batch 1 whose weights are mostly experts (16 of 128 x 256
    # a layer, 6 MiB of its 6.3 MiB in fp32); tp's plan is the dense model's, so it is left out.
    "moe": {
        "vocab_size": 1024, "ninp": 128, "nhid": 256, "nhead": 4, "experts": 16, "seq_len": 16, "batch_size": 1,
        "max_batch": 10, "warmup": 3, "strategies": ["dp", "fsdp", "rtp"],
    },
}
# (label, results key, format, True when more is better); each becomes a table column and a chart panel
METRICS = (
    ("step time", "step_time_s", lambda s: f"{s * 1e3:.1f} ms", False),
    ("host CPU per step", "cpu_per_step_s", lambda s: f"{s * 1e3:.1f} ms", False),
    ("throughput", "tokens_per_s", lambda t: f"{t:.0f} tokens/s", True),
    ("peak memory", "peak_memory_bytes", common.format_bytes, False),
    ("sent per step", "bytes_sent_per_step", common.format_bytes, False),
    ("exchanges per step", "exchanges_per_step", str, False),
)


def run_strategy(name: str, args, workdir: Path) -> dict:
    out = workdir / f"{name}.json"
    argv = [str(HERE / f"{name}_benchmark.py"), "--use_synthetic_data", *common.forwarded_flags(args), f"--json={out}"]
    print("$", sys.executable, " ".join(argv), flush=True)
    if args.device == "cuda":
        exitcode = subprocess.run([sys.executable, *argv]).returncode
    else:
        child = multiprocessing.get_context("fork").Process(target=_run_script, args=(argv,))
        child.start()
        child.join()
        exitcode = child.exitcode
    if exitcode != 0:
        sys.exit(f"compare: {name}_benchmark.py failed; see its output above")
    return json.loads(out.read_text())


def _run_script(argv: list[str]) -> None:
    """``python *argv`` in a forked child (the scripts share this one's folder, so ``sys.path`` is theirs)."""
    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")


def ratio(value: float, baseline: float) -> str:
    # One rank sends nothing, so its byte and exchange ratios have no baseline.
    return f"{value / baseline:.2f}" if baseline else "–"


def markdown_table(results: dict[str, dict]) -> str:
    baseline = results.get(BASELINE)
    header = ["strategy"]
    for label, *_ in METRICS:
        header += [label] + ([f"× {BASELINE}"] if baseline else [])
    header.append("final loss")
    rows = [header, ["---"] * len(header)]
    for name, result in results.items():
        row = [name]
        for _, key, fmt, _ in METRICS:
            row.append(fmt(result[key]))
            if baseline:
                row.append(ratio(result[key], baseline[key]))
        row.append(f"{result['final_loss']:.4f}")
        rows.append(row)
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


def draw_chart(results: dict[str, dict], title: str, path: Path) -> None:
    import matplotlib  # only here: a machine without it still runs the comparison with --no-chart

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    # Step times are not comparable when global batches differ (tp's is one rank's); throughput is.
    panels = [metric for metric in METRICS if metric[1] not in ("step_time_s", "cpu_per_step_s", "exchanges_per_step")]
    figure, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), constrained_layout=True)
    names = list(results)
    colors = ["tab:red" if name == "rtp" else "tab:gray" if name == BASELINE else "tab:blue" for name in names]
    for axis, (label, key, _, more_is_better) in zip(axes, panels):
        values = [results[name][key] for name in names]
        scale, unit = (2**20, "MiB") if "bytes" in key else (1, "tokens/s")
        bars = axis.bar(names, [v / scale for v in values], color=colors)
        if BASELINE in results:
            baseline = results[BASELINE][key]
            axis.bar_label(bars, labels=[ratio(v, baseline) + "×" for v in values], padding=2)
        axis.set_title(f"{label} ({'higher' if more_is_better else 'lower'} is better)")
        axis.set_ylabel(unit)
        axis.margins(y=0.15)
    figure.suptitle(title, fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def main() -> None:
    parser = common.build_parser(__doc__.split("\n\n")[0])
    parser.set_defaults(**DEFAULT_CONFIG, use_synthetic_data=True)
    parser.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    parser.add_argument("--preset", choices=tuple(PRESETS), default="default", help="model shape; flags given override it")
    parser.add_argument("--repeats", type=int, default=3, help="rounds, the strategies alternating within each")
    parser.add_argument("--chart", type=Path, default=REPO / "img" / "compare.png", help="where to draw the chart")
    parser.add_argument("--no-chart", action="store_true", help="draw no chart (matplotlib not needed)")
    preset = parser.parse_known_args()[0].preset
    parser.set_defaults(**PRESETS[preset])
    args = common.parse_args(parser)  # --json: all strategies' results, keyed by strategy
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")

    loads = [loadavg()]
    rounds: dict[str, list[dict]] = {name: [] for name in args.strategies}
    with tempfile.TemporaryDirectory(prefix="rtp-compare-") as workdir:
        for _ in range(args.repeats):
            for name in args.strategies:
                rounds[name].append(run_strategy(name, args, Path(workdir)))
            loads.append(loadavg())
    # Each strategy's median round by step time; everything else is deterministic or nearly so.
    results = {
        name: dict(sorted(runs, key=lambda r: r["step_time_s"])[len(runs) // 2], step_time_rounds_s=[r["step_time_s"] for r in runs])
        for name, runs in rounds.items()
    }

    shape = ", ".join(f"{name} {getattr(args, name)}" for name in common.MODEL_FLAGS)
    title = f"{args.nproc} ranks, {args.device}, {args.dtype}: {shape}"
    print(f"\n### {title}\n\n{markdown_table(results)}\n")
    if BASELINE in rounds:
        for label, key in (("step time", "step_time_s"), ("host CPU", "cpu_per_step_s")):
            for name in args.strategies:
                ratios = [r[key] / b[key] for r, b in zip(rounds[name], rounds[BASELINE])]
                print(f"{label} × {BASELINE} per round, {name}: " + ", ".join(f"{x:.2f}" for x in ratios)
                      + f" (median {statistics.median(ratios):.2f})")
    print(f"/proc/loadavg before and after each round: {' | '.join(loads)}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    if not args.no_chart:
        draw_chart(results, title, args.chart)
        print(f"chart: {args.chart}")


if __name__ == "__main__":
    main()
