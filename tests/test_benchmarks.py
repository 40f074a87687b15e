"""The benchmark scripts of benchmarks/rtp, run end to end as a user would, on a tiny config (2 CPU ranks): each
as ``python script ...`` forked from a process that imported torch and rsdp once (``forked_scripts``)."""

import json
import math
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks" / "rtp"
TINY = [
    "--nproc=2",
    "--device=cpu",
    "--vocab_size=64",
    "--ninp=16",
    "--nhid=32",
    "--nhead=2",
    "--num_decoder_layers=1",
    "--seq_len=8",
    "--batch_size=2",
    "--max_batch=2",
    "--warmup=1",
]
TIMEOUT_S = 180


def run(scripts, script: str, *flags: str) -> subprocess.CompletedProcess:
    """``python script *flags`` (forked, with torch and rsdp imported: see ``forked_scripts``)."""
    return scripts.run([BENCHMARKS / script, *flags], timeout_s=TIMEOUT_S)


def assert_succeeded(done: subprocess.CompletedProcess) -> None:
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"


def assert_sane(result: dict, strategy: str) -> None:
    """One strategy's JSON result: positive speeds, memory and traffic, phases within the step."""
    assert result["strategy"] == strategy and result["world_size"] == 2
    assert result["data_parallel_size"] == (1 if strategy == "tp" else 2)
    assert result["tokens_per_s"] > 0 and result["sequences_per_s"] > 0
    assert math.isfinite(result["final_loss"])
    assert len(result["peak_memory_bytes_per_rank"]) == 2
    assert all(peak > 0 for peak in result["peak_memory_bytes_per_rank"])
    assert all(sent > 0 for sent in result["bytes_sent_per_step_per_rank"])
    assert result["cpu_per_step_s"] >= result["system_cpu_per_step_s"] >= 0 and result["cpu_per_step_s"] > 0
    phases = result["phase_times_s"]
    assert list(phases) == ["forward", "backward", "optimizer"] and all(seconds > 0 for seconds in phases.values())
    assert sum(phases.values()) <= result["step_time_s"], (phases, result["step_time_s"])  # the same rank's steps


# fsdp and rtp run through compare.py below, which runs their scripts.
@pytest.mark.parametrize("strategy", ["dp", "tp"])
def test_benchmark_reports_sane_figures(scripts, strategy, tmp_path):
    out = tmp_path / "results.json"
    done = run(scripts, f"{strategy}_benchmark.py", "--use_synthetic_data", *TINY, f"--json={out}")
    assert_succeeded(done)
    assert "batch 2/2" in done.stdout and "tokens/s" in done.stdout
    assert "phases         forward " in done.stdout
    assert_sane(json.loads(out.read_text()), strategy)


def test_compare_tabulates_charts_and_rtp_trains_like_fsdp(scripts, tmp_path):
    chart, out = tmp_path / "compare.png", tmp_path / "compare.json"
    done = run(scripts, "compare.py", *TINY, "--strategies", "fsdp", "rtp", "--repeats=2", f"--chart={chart}", f"--json={out}")
    assert_succeeded(done)
    assert "step time × fsdp per round, rtp: " in done.stdout and "/proc/loadavg" in done.stdout
    assert "host CPU × fsdp per round, rtp: " in done.stdout
    table_rows = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    assert [row.split("|")[1].strip() for row in table_rows] == ["strategy", "---", "fsdp", "rtp"]
    assert chart.stat().st_size > 0
    assert "batch 2/2" in done.stdout and "tokens/s" in done.stdout and "phases         forward " in done.stdout
    results = json.loads(out.read_text())
    for strategy in ("fsdp", "rtp"):
        assert_sane(results[strategy], strategy)
    # Same initial model, same per-rank batches, gradients averaged: the same training run.
    assert results["rtp"]["final_loss"] == pytest.approx(results["fsdp"]["final_loss"], rel=1e-5)
    assert len(results["rtp"]["step_time_rounds_s"]) == 2
    # One decoder layer and the root at W=2: the layer's attention and FFN rings (ring plan) and the
    # root's embedding and head rings, 1 exchange per pass each. In forward the attention's and the
    # head's first messages ride the embedding's and the FFN's exchanges; in backward the last hop of
    # the FFN's and the attention's partials rides the next ring's first exchange. The layer's norms
    # ride the embedding's rings (no all-gather, no reduce-scatter).
    assert results["rtp"]["exchanges_per_step"] == 2 + 4, results["rtp"]["exchanges_per_step"]


@pytest.mark.parametrize(
    "flag, message",
    [("--nproc=4", "--nhead 2 is not divisible by the 4 ranks"), ("--experts=4", "--experts 4: this script's plan is the dense model's")],
)
def test_tp_rejects_what_its_plan_cannot_split(monkeypatch, capsys, flag, message):
    """In process: the check runs before any rank starts (a subprocess would only add imports). Heads
    that do not divide over the ranks, and the MoE model (tp's plan is the dense model's FFN)."""
    script = BENCHMARKS / "tp_benchmark.py"
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setattr(sys, "argv", [str(script), "--use_synthetic_data", *TINY, flag])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(script), run_name="__main__")
    assert exit_.value.code != 0
    assert message in capsys.readouterr().err


def test_collective_latency_tabulates_every_op(scripts):
    done = scripts.run([BENCHMARKS.parent / "collective_latency.py", "--nproc=2", "--ops=3", "--repeats=2"], timeout_s=TIMEOUT_S)
    assert_succeeded(done)
    rows = {line.split("|")[1].strip(): line for line in done.stdout.splitlines() if line.startswith("| ") and "---" not in line}
    ops = {"ring exchange", "ring exchange, works dropped at once", "all-gather", "reduce-scatter", "all-reduce"}
    assert set(rows) == {"op"} | ops, done.stdout
    for name in ops:
        median, rounds, system = rows[name].split("|")[2:5]
        assert float(median) > 0 and len(rounds.split(",")) == 2 and float(system) >= 0, rows[name]


def test_scale_runs_every_strategy_on_cpu_and_reports_positive_figures(scripts, tmp_path):
    """benchmarks/scale.py is the GPU benchmark's code: here on CPU, at toy shapes, on the fake process group."""
    out = tmp_path / "scale.json"
    done = scripts.run([BENCHMARKS.parent / "scale.py", "--preset=tiny", "--device=cpu", "--world", "2", "--seq", "16",
                        "--steps=1", "--gemm-reps=1", f"--json={out}"], timeout_s=TIMEOUT_S)
    assert_succeeded(done)
    assert "PREDICTION (not measured)" in done.stdout and "split GEMMs" in done.stdout
    result = json.loads(out.read_text())
    assert result["args"]["config"]["n_layers"] == 2 and result["args"]["batch"] == 1
    run = result["runs"]["2"]
    assert "error" not in run
    strategies = {"fsdp", "rsdp", "rsdp+plan"}
    timing, memory, prediction = run["timing"]["16"], run["memory"], run["prediction"]["16"]
    assert set(timing) == set(memory) == set(prediction) == strategies
    for strategy in strategies:
        phases = timing[strategy]["phase_median_s"]
        assert list(phases) == ["forward", "backward", "optimizer"] and all(t > 0 for t in phases.values())
        assert len(timing[strategy]["step_rounds_s"]) == 3 and timing[strategy]["host_issue_median_s"] > 0
        messages = memory[strategy]["16"]["messages"]
        assert messages["forward"]["bytes"] > 0 and messages["backward"]["bytes"] > 0, (strategy, messages)
        wire = prediction[strategy]["wire_s"]
        assert wire["forward"] > 0 and wire["backward"] > 0
        assert prediction[strategy]["no_overlap_s"] == pytest.approx(timing[strategy]["step_median_s"] + sum(wire.values()))
        assert timing[strategy]["step_median_s"] <= prediction[strategy]["overlap_s"] <= prediction[strategy]["no_overlap_s"]
    # FSDP gathers and reduce-scatters; rsdp's weights travel by send/recv.
    assert "c10d::send" not in memory["fsdp"]["16"]["messages"]["forward"]["calls"]
    assert memory["rsdp"]["16"]["messages"]["forward"]["calls"]["c10d::send"] > 0
    # The ring plan rotates each attention and MLP as one message: fewer sends than one ring per Linear.
    plan_sends = memory["rsdp+plan"]["16"]["messages"]["forward"]["calls"]["c10d::send"]
    assert 0 < plan_sends < memory["rsdp"]["16"]["messages"]["forward"]["calls"]["c10d::send"]
    linears = {row["linear"] for row in result["gemm"]}
    assert linears == {"wq", "wk/wv", "wo", "wo (plan: cols)", "w1/w3", "w2", "w2 (plan: cols)", "lm_head"}
    assert all(row["full_tflops"] > 0 and row["split_tflops"] > 0 and row["world"] == 2 for row in result["gemm"])
    assert len(result["gemm"]) == len(linears) * 3


def test_scale_model_is_torchtitans_llama3():
    """benchmarks/llama3.py is torchtitan 0.3's Llama 3 with q/k/v beside wo instead of inside
    ``qkv_linear``: the same parameters, and RoPE rotating as torchtitan's ``ComplexRoPE`` does."""
    from rsdp.torchtitan import _cpu

    _cpu.prepare_imports()  # torchtitan's model package imports triton kernels
    import torch
    from torchtitan.models.common.rope import ComplexRoPE
    from torchtitan.models.llama3 import llama3_configs

    sys.path.insert(0, str(BENCHMARKS.parent))
    from llama3 import Llama3, Llama3Config, apply_rope, rope_tables

    config = Llama3Config(dim=128, n_heads=4, n_kv_heads=2)
    rope = ComplexRoPE.Config(dim=config.head_dim, max_seq_len=32, theta=config.rope_theta).build()
    q, k = torch.randn(2, 16, 4, config.head_dim), torch.randn(2, 16, 2, config.head_dim)
    cos, sin = rope_tables(config, 16, "cpu")
    for ours, theirs in zip((apply_rope(q, cos, sin), apply_rope(k, cos, sin)), rope(q, k)):
        torch.testing.assert_close(ours, theirs)

    titan = llama3_configs["8B"](attn_backend="varlen")
    titan.layers = titan.layers[:2]
    with torch.device("meta"):
        theirs = {name.replace("qkv_linear.", ""): p.shape for name, p in titan.build().state_dict().items()}
        ours = {name: p.shape for name, p in Llama3(Llama3Config(n_layers=2)).state_dict().items()}
    assert ours == theirs


def test_host_overhead_counts_each_strategys_host_work(scripts, tmp_path):
    """benchmarks/host_overhead.py on a tiny config: a time for every strategy and reference, and counts
    that say what each issues (a ring sends, FSDP2 runs collectives, a sharded step does more than the
    model itself; a ring of groups runs collectives within its groups, and with its ring communication
    made free, none, and the same ops)."""
    out = tmp_path / "host.json"
    done = scripts.run([BENCHMARKS.parent / "host_overhead.py", "--world=4", "--blocks=1", "--dim=16", "--heads=4",
                        "--hidden=8", "--tokens=4", "--steps=1", "--repeats=3", "--ring-group-size=2",
                        "--free-ring-communication", f"--json={out}"], timeout_s=TIMEOUT_S)
    assert_succeeded(done)
    result = json.loads(out.read_text())
    strategies = ["fsdp", "rsdp", "rsdp+plan", "rsdp g=2", "rsdp+plan g=2", "rsdp g=2, free ring comm", "unsharded", "unsharded, split"]
    assert list(result["median_s"]) == strategies and all(result["median_s"][s] > 0 for s in strategies)
    counts = result["counts"]
    assert counts["fsdp"]["sends_per_block"] == 0 and counts["fsdp"]["collectives_per_block"] > 0
    for strategy in ("rsdp", "rsdp+plan", "rsdp g=2"):
        assert counts[strategy]["sends_per_block"] > 0, counts[strategy]
    for strategy in ("fsdp", "rsdp", "rsdp+plan"):
        for count in ("ops_per_block", "python_calls_per_block", "builtin_calls_per_block"):
            assert counts[strategy][count] > counts["unsharded"][count] > 0, (strategy, count, counts)
    grouped, free = counts["rsdp g=2"], counts["rsdp g=2, free ring comm"]
    assert grouped["within_groups_per_block"] > 0 and free["within_groups_per_block"] == free["sends_per_block"] == 0, counts
    assert free["ops_per_block"] == grouped["ops_per_block"], counts

