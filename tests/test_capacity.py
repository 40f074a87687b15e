"""benchmarks/capacity.py: the family is Hugging Face's Llama, the search finds the largest rung that
fits (and tries the next), and a 2-rank run on a tiny budget reports peaks within it, next rungs beyond
it, rsdp at least as large as FSDP2, and the planner's plans within the budget they were made for."""

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import capacity  # noqa: E402
import common  # noqa: E402  (benchmarks/rtp, put on the path by capacity)

MiB = 2**20
# Small enough for a few seconds per strategy on 2 ranks; the vocabulary still dominates small rungs.
TINY = ["--nproc=2", "--budget=40MiB", "--vocab=4096", "--no-plot"]
STRATEGIES = ["fsdp", "rsdp", "auto", "rsdp_lora"]
TIMEOUT_S = 240


def test_family_has_hugging_face_llamas_parameters():
    transformers = pytest.importorskip("transformers")
    for index in (0, 1, 9):
        shape = capacity.rung(index, vocab=32000)
        config = transformers.LlamaConfig(
            vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.ffn,
            num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.heads,
            tie_word_embeddings=False,
        )
        with torch.device("meta"):
            reference = transformers.LlamaForCausalLM(config)
        ours = capacity.build_on_meta(shape, lora_rank=None)
        assert shape.parameters == sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in reference.parameters())
        bigger = capacity.rung(index + 1, vocab=32000)
        assert all(getattr(bigger, f) >= getattr(shape, f) for f in ("layers", "hidden", "heads", "ffn"))


def test_moe_family_has_hugging_face_mixtrals_parameters_and_grows_its_experts():
    pytest.importorskip("transformers")
    for index in (0, 1, 5):
        shape = capacity.rung(index, vocab=1024, family="moe")
        model = capacity.build_on_meta(shape, lora_rank=None)
        assert shape.parameters == sum(p.numel() for p in model.parameters())
        assert [m.num_experts for m in model.modules() if hasattr(m, "gate_up_proj")] == [shape.experts] * shape.layers
        bigger = capacity.rung(index + 1, vocab=1024, family="moe")
        assert bigger.experts > shape.experts and (bigger.layers, bigger.hidden, bigger.ffn) == (shape.layers, shape.hidden, shape.ffn)


def test_moe_family_refuses_the_llama_familys_strategies(capsys):
    with pytest.raises(SystemExit):
        capacity.parse_args(["--family=moe", "--strategies", "fsdp", "auto"])
    assert "--family moe runs ddp fsdp rsdp; auto are the Llama family's (drop them)" in capsys.readouterr().err
    args = capacity.parse_args(["--family=moe"])
    assert args.strategies == ["ddp", "fsdp", "rsdp"] and args.vocab == 1024


@pytest.mark.parametrize("peaks_known", [True, False], ids=["interpolating", "bisecting"])
def test_largest_fitting_finds_the_last_fitting_rung_from_any_hint_and_tries_the_next(peaks_known):
    sizes = [10, 12, 15, 20, 26, 33, 41, 50, 61, 75]
    peaks = [round(40 + 3 * size + 0.05 * size**2) for size in sizes]  # not quite linear in parameters
    for budget in range(peaks[0] - 1, peaks[-1] + 2):
        last_fitting = sum(peak <= budget for peak in peaks) - 1
        for hint in range(len(sizes)):
            tried = []

            def try_rung(index):
                assert index not in tried, "a rung was probed twice"
                tried.append(index)
                return peaks[index] <= budget, peaks[index] if peaks_known else None

            assert capacity.largest_fitting(try_rung, sizes, budget, hint) == last_fitting
            assert last_fitting + 1 == len(sizes) or last_fitting + 1 in tried
            assert len(tried) <= len(sizes).bit_length() + 3, (budget, hint, tried)


def test_bad_flags_name_the_fix(capsys):
    for argv, message in (
        (["--budget=0"], "--budget must be positive, got 0 bytes; pass e.g. --budget 512MiB"),
        (["--budget=12XB"], "not a size: '12XB' (examples: 512MiB, 8GiB, 1000000)"),
        (["--nproc=0"], "--nproc must be at least 1"),
    ):
        with pytest.raises(SystemExit):
            capacity.parse_args(argv)
        assert message in capsys.readouterr().err


def _probe_on_rank(strategy: str, index: int) -> capacity.Probe:
    args = capacity.parse_args(TINY)
    world = dist.get_world_size()
    worker = common.Worker(args, dist.get_rank(), world, torch.device("cpu"), init_device_mesh("cpu", (world,)))
    return capacity.probe(strategy, index, worker)


def test_two_rank_search_fits_the_budget_and_is_maximal(tmp_path, ranks, scripts):
    out = tmp_path / "capacity.json"
    done = scripts.run([BENCHMARKS / "capacity.py", *TINY, "--strategies", *STRATEGIES, f"--json={out}"], timeout_s=TIMEOUT_S)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    assert "| strategy | max params |" in done.stdout and "/proc/loadavg" in done.stdout
    report = json.loads(out.read_text())
    budget = report["budget_bytes"]
    assert budget == 40 * MiB and report["nproc"] == 2 and report["device"] == "cpu" and len(report["loadavg"]) == 2
    assert list(report["results"]) == STRATEGIES
    for name, result in report["results"].items():
        assert isinstance(result["max_params"], int) and result["max_params"] > 0, name
        assert set(result["shape"]) == {"layers", "hidden", "heads", "ffn", "vocab", "experts"} and result["shape"]["experts"] == 0
        assert isinstance(result["peak_bytes"], int) and 0 < result["peak_bytes"] <= budget, name
        assert isinstance(result["step_seconds"], float) and result["step_seconds"] > 0
        assert result["next_peak_bytes"] > budget, name
        assert result["next_params"] > result["max_params"]
    results = report["results"]
    assert results["rsdp"]["max_params"] >= results["fsdp"]["max_params"]
    assert results["rsdp_lora"]["trainable_params"] < results["rsdp_lora"]["max_params"] / 10
    # The planner's plans held the budget when they trained, and its prediction bounded the measurement.
    assert results["auto"]["exceeded"] == [] and results["auto"]["plan"]
    assert results["auto"]["peak_bytes"] <= results["auto"]["predicted_peak_bytes"] <= budget

    # Maximality, measured again outside the search: the next rung does not fit, for every strategy,
    # and the rung found fits (re-run for the two whose next rung differs: a lower bound, and a run).
    for name, result in results.items():
        if name in ("rsdp", "rsdp_lora"):
            found = ranks.run(2, _probe_on_rank, name, result["ladder_index"])[0]
            assert found.fits and found.peak_bytes <= budget, (name, found)
            assert found.peak_bytes == result["peak_bytes"], (name, found)  # memory is deterministic on CPU
        after = ranks.run(2, _probe_on_rank, name, result["ladder_index"] + 1)[0]
        assert not after.fits, (name, after)
        assert (name == "auto" and after.peak_bytes is None) or after.peak_bytes > budget, (name, after)  # None: no plan
