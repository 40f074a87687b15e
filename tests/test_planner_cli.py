"""``rsdp plan`` on bad input and on tiny Hugging Face MoE configs: one line naming the problem and its
fix, a non-zero exit, no traceback; a budget too small still writes the JSON; the MoE configs plan under
every activation checkpointing mode; a torchtitan model's plan is the one ``dp_strategy=auto`` chooses.
(Every torchtitan family and flavor: ``test_planner_moe``.)
"""

import importlib.util
import json
import re

import pytest
import torch

# torchtitan is imported in the rank only (its CPU shims go in before it: rsdp.torchtitan._cpu).
needs_torchtitan = pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason="torchtitan is not installed")
BENCHMARK = ["--vocab_size", "2048", "--ninp", "128", "--nhid", "256", "--nhead", "4", "--num_decoder_layers", "2", "--seq-len", "32"]


def one_line_exit(argv: list[str]) -> str:
    """``rsdp plan argv``'s exit message, which must be one line (an exit, not an exception) and short
    but for the paths it names (a test's folder is as long as the machine's temporary folder makes it)."""
    from rsdp.planner.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--budget", "1GiB", *argv])
    message = exit_.value.code
    assert isinstance(message, str) and "\n" not in message and len(re.sub(r"/\S+", "PATH", message)) < 400, message
    return message


@pytest.mark.parametrize("argv, names", [
    (["--world-size", "0"], "--world-size must be positive, got 0; pass the number of data-parallel devices"),
    (["--world-size", "-8"], "--world-size must be positive, got -8"),
    (["--seq-len", "0"], "--seq-len must be positive, got 0; pass the tokens per sample"),
    (["--seq-len", "-5"], "--seq-len must be positive, got -5"),
    (["--local-batch-size", "0"], "--local-batch-size must be positive, got 0; pass per-device batch sizes of 1 or more"),
    (["--local-batch-size", "1", "-2"], "--local-batch-size must be positive, got 1 -2"),
    (["--flops", "0"], "--flops must be positive, got 0.0"),
    (["--latency", "-1"], "--latency must be 0 or more seconds per message, got -1.0"),
    (["--nhead", "5"], "--ninp 128 must divide into --nhead 5 attention heads"),
    (["--loss-chunks", "0"], "--loss-chunks must be positive, got 0; pass 1 for cross-entropy over the whole logits"),
    (["--lora-rank", "-4"], "--lora-rank must be 0 (no LoRA) or more, got -4"),
    (["--gpus-per-node", "0"], "--gpus-per-node must be positive, got 0; pass the devices of one machine"),
    (["--ring-group-sizes", "0"], "--ring-group-sizes must be positive, got 0; pass divisors of the world"),
    (["--world-size", "24", "--hardware", "h100-sxm-nvlink-infiniband", "--ring-group-sizes", "12"],
     "ring group size 12 is not one of [1, 2, 4, 8, 24], the sizes that divide the world of 24 into groups within one machine of 8"),
])
def test_bad_arguments_name_the_value_and_the_fix(argv, names):
    assert names in one_line_exit([*BENCHMARK, *argv])


def test_calibrate_checks_its_world_size(capsys):
    from rsdp.planner.cli import main

    with pytest.raises(SystemExit, match="rsdp calibrate: --world-size must be positive, got -2"):
        main(["calibrate", "--world-size", "-2"])
    with pytest.raises(SystemExit):  # machines are the ranks torchrun starts: none on the fake process group
        main(["calibrate", "--world-size", "2", "--gpus-per-node", "1"])
    assert "--gpus-per-node splits the ranks torchrun starts into machines" in capsys.readouterr().err


def bad_files_case(directory: str) -> list[str]:
    files = {
        "bad.json": "{bad", "badcfg.json": '{"model_type": "llama",', "nomt.json": '{"hidden_size": 8}',
        "unknown.json": '{"model_type": "nosuch"}', "zero.json": '{"flops_per_s": 0, "bandwidth_bytes_per_s": 1, "latency_s": 0}',
    }
    for name, text in files.items():
        with open(f"{directory}/{name}", "w") as out:
            out.write(text)
    return [
        one_line_exit([*BENCHMARK, "--hardware", f"{directory}/bad.json"]),
        one_line_exit([*BENCHMARK, "--hardware", f"{directory}/zero.json"]),
        one_line_exit(["--model", f"hf:{directory}/badcfg.json"]),
        one_line_exit(["--model", f"hf:{directory}/nomt.json"]),
        one_line_exit(["--model", f"hf:{directory}/unknown.json"]),
    ]


def test_bad_files_are_named(ranks, tmp_path):
    pytest.importorskip("transformers")
    hardware, zero, malformed, no_type, unknown = ranks.run(1, bad_files_case, str(tmp_path))[0]
    assert f"--hardware {tmp_path}/bad.json is not valid JSON (Expecting property name" in hardware
    assert f"profile {tmp_path}/zero.json needs numbers" in zero and "must be positive" in zero
    assert f"{tmp_path}/badcfg.json is not valid JSON" in malformed
    assert f"{tmp_path}/nomt.json has no model_type" in no_type and '"model_type": "llama"' in no_type
    assert "knows no model_type 'nosuch'" in unknown


def no_plan_case(path: str) -> tuple[str, dict, str]:
    import contextlib
    import io

    from rsdp.planner.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        main(["plan", "--budget", "1KiB", *BENCHMARK, "--local-batch-size", "1", "2", "--json", path])
    with open(path) as report:
        return exit_.value.code, json.load(report), out.getvalue()


def test_no_plan_under_the_budget_still_writes_every_strategys_predictions(ranks, tmp_path):
    message, report, printed = ranks.run(1, no_plan_case, str(tmp_path / "plan.json"))[0]
    assert report["plan"] is None and set(report["strategies"]) == {"replicate", "fsdp", "rsdp"}
    for entry in report["strategies"].values():
        assert entry["peak_bytes"] > report["budget_bytes"] and entry["step_s"] > 0
    needed = report["smallest_fitting_budget_bytes"]
    assert needed <= min(entry["peak_bytes"] for entry in report["strategies"].values())
    assert "\n" not in message and f"the smallest budget that fits is {needed / 2**20:.2f} MiB ({needed} bytes" in message
    assert "layers" not in message and "modules" in message, message  # a summary, not every module
    assert "no plan for 8 devices" in printed and "| rsdp |" in printed


def test_counted_grouped_mm_is_the_grouped_gemm_and_counts_its_flops():
    """The experts' grouped GEMM as the planner counts it: on CPU, exact against a per-expert fp64
    reference (output and both gradients); on meta, the allocations of torch's kernel on CPU (output,
    then the weight's and the input's gradients) and 2 x rows x k x n FLOPs (each row by its own expert)."""
    from torch.utils.flop_counter import FlopCounterMode

    from rsdp.planner._models import grouped_mm

    torch.manual_seed(0)
    a = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, 5, 4, dtype=torch.float64, requires_grad=True)
    offs = torch.tensor([2, 2, 7], dtype=torch.int32)  # expert 1 gets no rows
    grad = torch.randn(7, 4, dtype=torch.float64)
    grouped_mm(a, b, offs).backward(grad)
    a_ref, b_ref = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    rows = [(0, 2), (2, 2), (2, 7)]
    torch.cat([a_ref[s:e] @ b_ref[g] for g, (s, e) in enumerate(rows)]).backward(grad)
    assert torch.equal(a.grad, a_ref.grad) and torch.equal(b.grad, b_ref.grad)
    assert allocations("meta", grouped_mm) == allocations("cpu", lambda a, b, offs: torch._grouped_mm(a, b, offs=offs))
    with FlopCounterMode(display=False) as flops:
        grouped_mm(torch.empty(128, 16, device="meta"), torch.empty(8, 16, 32, device="meta"), torch.empty(8, dtype=torch.int32, device="meta"))
    assert flops.get_total_flops() == 2 * 128 * 16 * 32


def allocations(device: str, grouped) -> list[int]:
    """The bytes of each fresh tensor of a bf16 grouped GEMM's forward and backward, in order."""
    from rsdp.planner._cost_model import _ALLOCATED, _MetaStorages

    a = torch.randn(12, 8, device=device, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(3, 8, 16, device=device, dtype=torch.bfloat16, requires_grad=True)
    offs, grad = torch.tensor([4, 8, 12], dtype=torch.int32, device=device), torch.randn(12, 16, device=device, dtype=torch.bfloat16)
    storages = _MetaStorages()
    with storages:
        grouped(a, b, offs).backward(grad)
    return [event[3] for event in storages.log if event[0] == _ALLOCATED]


def walk_case(specs: list[str]) -> dict[tuple[str, str], str]:
    """``rsdp plan`` for each model under each activation checkpointing mode: "planned", or its one-line
    exit (an exception would fail the case)."""
    import contextlib
    import io

    from rsdp.planner.cli import main

    results = {}
    for spec in specs:
        for mode in ("none", "selective", "full"):
            argv = ["plan", "--model", spec, "--budget", "80GiB", "--seq-len", "64", "--activation-checkpoint", mode,
                    "--mixed-precision", "bf16"]
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    main(argv)
                results[spec, mode] = "planned"
            except SystemExit as exit_:
                results[spec, mode] = exit_.code
    return results


def hf_moe_configs(directory) -> list[str]:
    transformers = pytest.importorskip("transformers")
    shared = dict(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    configs = {
        "mixtral": transformers.MixtralConfig(**shared, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2),
        "qwen3_moe": transformers.Qwen3MoeConfig(**shared, intermediate_size=64, moe_intermediate_size=16, num_experts=4,
                                                 num_experts_per_tok=2, head_dim=8),
        "gpt_oss": transformers.GptOssConfig(**shared, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, head_dim=8),
        "deepseek_v3": transformers.DeepseekV3Config(
            **{**shared, "num_key_value_heads": 4}, intermediate_size=64, moe_intermediate_size=16, first_k_dense_replace=1,
            n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, kv_lora_rank=8,
            q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8),
    }
    for name, config in configs.items():
        (directory / name).mkdir()
        config.to_json_file(directory / name / "config.json")
    return [f"hf:{directory / name}" for name in configs]


def test_hugging_face_moe_configs_plan_under_every_checkpointing_mode(ranks, tmp_path):
    """Mixtral's and Qwen3-MoE's routers normalise topk's values in place, which selective checkpointing
    had cached; DeepSeek-V3's attention has narrower values than queries."""
    results = ranks.run(1, walk_case, hf_moe_configs(tmp_path))[0]
    assert set(results.values()) == {"planned"}, results


def moe_flops_case() -> tuple[float, float]:
    """The experts' FLOPs are counted as they run: each routed token once per expert it is routed to."""
    from rsdp.planner._cost_model import count
    from rsdp.planner._models import build
    from rsdp.planner._profile import find_units

    model, loss, _ = build("torchtitan:qwen3:debugmodel_moe", {})
    units = find_units(model)
    counts = count(model, units, torch.zeros(1, 65, dtype=torch.long, device="meta"), loss)
    block = model.get_submodule(units[1])
    experts = block.moe.routed_experts.inner_experts
    routed = 64 * block.moe.router.top_k
    expected = 3 * 2 * routed * experts.w1_EFD.shape[1] * experts.w1_EFD.shape[2]  # w1, w3 and w2
    return counts.units[units[1]].forward_flops, expected


@needs_torchtitan
def test_moe_experts_flops_are_counted_per_routed_token(ranks):
    counted, experts = ranks.run(1, moe_flops_case)[0]
    assert experts < counted < 2 * experts, (counted, experts)


# At sequence 256 the debug model's replicated head, counted as a unit of its own, holds less than in
# the root: there the CLI chose an FSDP head at 80 MiB, and predicted 1.1 MiB less for replicate everywhere.
HARDWARE = "h100-sxm-nvlink"


def torchtitan_auto_case(budgets: list[str], directory: str) -> dict[str, list[tuple]]:
    """Per budget, (the CLI's, ``dp_strategy=auto``'s) figures for one run of torchtitan's llama3 debug
    model on 8 H100s: ``rsdp plan``'s plan against ``rsdp.torchtitan``'s own planning
    (``_plan``), and the CLI's replicate-everywhere row against ``rsdp.plan``'s count of replicate with
    the head in the root."""
    import contextlib
    import io

    from rsdp.planner import _models

    _models._prepare_torchtitan_imports()
    from torchtitan.config import TrainingConfig
    from torchtitan.models.llama3 import model_registry

    from rsdp import Strategy, plan
    from rsdp.planner.cli import main
    from rsdp.torchtitan import parallelize
    from rsdp.torchtitan.config import ParallelismConfig

    world, seq_len, batch = 8, 256, 2
    training = TrainingConfig(local_batch_size=batch, seq_len=seq_len)
    with torch.device("meta"):
        model = model_registry("debugmodel").model.build()
    parallelize._dp_world = lambda parallel_dims: world  # the rank runs this case alone: no mesh to ask
    figures = {}
    for budget in budgets:
        path = f"{directory}/plan.json"
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            main(["plan", "--model", "torchtitan:llama3:debugmodel", "--world-size", str(world), "--seq-len", str(seq_len),
                  "--local-batch-size", str(batch), "--mixed-precision", "bf16", "--hardware", HARDWARE,
                  "--ring-group-sizes", "1", "--budget", budget, "--json", path])
        with open(path) as report:
            cli = json.load(report)
        parallelism = ParallelismConfig(spmd_backend="partial_dtensor", dp_strategy="auto", dp_memory_budget=budget,
                                        dp_hardware=HARDWARE)
        auto = parallelize._plan(model, None, training, parallelism, None, "")
        figures[budget] = [
            (cli["plan"]["modules"], {name or "(root)": s.value for name, s in auto.strategies.items()}),
            (cli["plan"]["in_root"], [row.module for row in auto.rows if row.in_root]),
            (cli["plan"]["peak_bytes"], auto.predicted_peak_bytes),
            (cli["plan"]["step_s"], auto.predicted_step_seconds),
            ("| lm_head | replicate, in the root |" in printed.getvalue(), any(row.in_root for row in auto.rows)),
        ]
    cost_model = parallelize._cost_model(parallelism.hardware(world), world, 1, training, parallelism)
    replicated = plan(_models.flash_attention_for_counting(model), memory_budget=2**40, cost_model=cost_model,
                      sample_input=torch.zeros(batch, seq_len + 1, dtype=torch.long, device="meta"),
                      loss_fn=_models.next_token_loss, strategies=[Strategy.REPLICATE], replicated_in_root=["lm_head"])
    figures["replicate everywhere"] = [
        (cli["strategies"]["replicate"]["peak_bytes"], replicated.predicted_peak_bytes),
        (cli["strategies"]["replicate"]["step_s"], replicated.predicted_step_seconds),
    ]
    return figures


@needs_torchtitan
def test_torchtitan_plans_are_those_dp_strategy_auto_chooses(ranks, tmp_path):
    """For a torchtitan model the CLI plans a replicated head inside a replicate root, as
    ``rsdp.torchtitan`` applies it: at a roomy budget (the head replicated in the root) and a tight one
    (an FSDP head) its plan, peak and step are ``dp_strategy=auto``'s for the same run, and its
    replicate-everywhere row is counted with the head in the root."""
    figures = ranks.run(1, torchtitan_auto_case, ["80MiB", "70MiB"], str(tmp_path))[0]
    for label, pairs in figures.items():
        cli, auto = zip(*pairs)
        assert cli == auto, label
    assert figures["80MiB"][1][1] == ["lm_head"] and figures["70MiB"][1][1] == [], "the budgets did not choose the head's place"


@needs_torchtitan
def test_a_tied_torchtitan_models_plan_is_the_one_rsdp_torchtitan_applies(tmp_path):
    """A torchtitan model whose head is tied to its embedding (qwen3 0.6B) keeps both in the root, which
    ``rsdp.torchtitan`` makes FSDP or replicate. The CLI's plan, given to ``data_parallel_rules`` as
    ``dp_strategy`` (its root's) and ``dp_overrides`` (every module's), is applied as planned: each
    module and the root take the CLI's strategy (here the CLI chose an rsdp root before, which the
    rules make FSDP). Its rsdp-everywhere row is what ``dp_strategy=rsdp`` applies, an FSDP root."""
    import contextlib
    import io

    from rsdp.planner import _models
    from rsdp.planner.cli import main
    from rsdp.policy import name_matches

    _models._prepare_torchtitan_imports()
    from torchtitan.models.qwen3 import model_registry

    from rsdp.torchtitan.config import ParallelismConfig
    from rsdp.torchtitan.parallelize import data_parallel_rules

    path = tmp_path / "plan.json"
    with contextlib.redirect_stdout(io.StringIO()):
        main(["plan", "--model", "torchtitan:qwen3:0.6B", "--world-size", "8", "--seq-len", "256", "--local-batch-size", "2",
              "--mixed-precision", "bf16", "--hardware", HARDWARE, "--ring-group-sizes", "1", "--budget", "80GiB", "--json", str(path)])
    planned = json.loads(path.read_text())["plan"]["modules"]
    with torch.device("meta"):
        model = model_registry("0.6B").model.build()

    def applied(names, **fields) -> dict[str, str]:
        """Each of ``names``' strategy under the rules (the first that names it), the root's as "(root)"."""
        rules = data_parallel_rules(model, None, None, ParallelismConfig(spmd_backend="partial_dtensor", **fields))
        return {"(root)": rules[""].value, **{name: next(s for rule, s in rules.items() if rule and name_matches(rule, name)).value
                                               for name in names}}

    modules = [name for name in planned if name != "(root)"]
    overrides = ",".join(f"{name}={planned[name]}" for name in modules)
    assert applied(modules, dp_strategy=planned["(root)"], dp_overrides=overrides) == planned
    assert applied(["layers.0"], dp_strategy="rsdp") == {"(root)": "fsdp", "layers.0": "rsdp"}
