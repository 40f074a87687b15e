"""torchtitan integration: its llama3 debug model, started with the CPU launcher on 2 gloo ranks, trains
the same under every strategy as under torchtitan's own FSDP, and resumes across strategies.

Every run starts from one seed checkpoint (torchtitan's way to give differently sharded runs the same
initial weights) and reads a tokenizer and dataset generated here. Each run is the CPU launcher's
process tree, forked from this process (a few seconds), and the runs are few and shared.
"""

import itertools
import multiprocessing
import os
import re
import signal
import sys

import pytest

from rsdp.torchtitan import _cpu
from rsdp.torchtitan import train as launcher
from rsdp.torchtitan.assets import write_assets

_cpu.prepare_imports()  # this module imports torchtitan below, without triton or a GPU

import torchtitan.train  # noqa: E402,F401  (once: every launch forks from this process)
from torchtitan.distributed import ParallelDims  # noqa: E402
from torchtitan.models.llama3 import model_registry as llama3_model  # noqa: E402
from torchtitan.models.qwen3 import model_registry as qwen3_model  # noqa: E402

from rsdp import Strategy  # noqa: E402
from rsdp.torchtitan.config import ParallelismConfig, head_under_chunked_loss  # noqa: E402
from rsdp.torchtitan.parallelize import _check_supported, data_parallel_rules  # noqa: E402

STEPS = 3
# Losses and gradient norms are printed with 5 significant digits; fp32 runs that differ only in
# sharding agree to about 1e-6. The gradient norm is what catches a wrong reduction (mean instead of
# torchtitan's sum): AdamW's steps, and so the losses, barely change when every gradient halves.
RTOL = 2e-4
LAUNCH_TIMEOUT_S = 600
_launches = itertools.count()
# The plans auto chooses (each with the root replicate, lm_head in it, and the norm FSDP): at 61 MiB the
# embedding and every block rsdp; at 75 MiB the embedding and the first block replicate, the other blocks
# rsdp; at 61 MiB in rings of groups of 2 the embedding and the first four blocks rsdp g=2, the last two
# blocks and lm_head FSDP.
AUTO_BUDGETS_MIB = (61, 75)
AUTO_GROUPS_BUDGET_MIB = 61
BF16_RTOL = 5e-4  # bf16 compute; the measured gap is under 1e-4
BF16_SEQ_LEN = 16  # bf16 matmuls are several times slower than fp32 ones on CPU; what is compared does not need 64
STEP_LOG = re.compile(r"step:\s*(\d+)\s+loss:\s*([0-9.]+)\s+grad_norm:\s*([0-9.]+)")
MEMORY_LOG = re.compile(r"rsdp: step (\d+) memory per rank: .* = ([0-9.]+) MiB")
PLANNED_PEAK_LOG = re.compile(r"predicted peak ([0-9.]+) MiB of a")
# How far the plan's predicted peak may lie above the most a step measures (last runs: 0.4% to 2.4%).
PREDICTION_MARGIN = 0.05


def train(workdir, name: str, *flags: str, **launch) -> dict[int, tuple[float, float]]:
    """Run the CPU launcher in ``workdir`` with dump folder ``name``; (loss, grad norm) per step."""
    return logged_losses(launch_training(workdir, name, *flags, **launch))


def logged_losses(output: str) -> dict[int, tuple[float, float]]:
    """(loss, grad norm) per step, as a run printed them."""
    logged: dict[int, tuple[float, float]] = {}
    for step, loss, grad_norm in STEP_LOG.findall(output):
        # every rank logs the global values; they must agree
        values = (float(loss), float(grad_norm))
        assert logged.setdefault(int(step), values) == values, output[-3000:]
    return logged


def launch_training(workdir, name: str, *flags: str, nproc: int = 2, steps: int = STEPS, seq_len: int = 64,
                    module: str = "rsdp.torchtitan", config: str = "llama3_debugmodel_rsdp") -> str:
    """Run the CPU launcher in ``workdir`` with dump folder ``name``; what it printed."""
    argv = [
        f"--nproc={nproc}", "--module", module, "--config", config,
        "--hf_assets_path", "assets/tokenizer", "--dataloader.dataset_path", "assets/dataset",
        "--dump_folder", name, f"--training.steps={steps}", f"--training.seq_len={seq_len}",
        "--training.local_batch_size=2", "--metrics.disable_color_printing", *flags,
    ]
    exitcode, output = run_launcher(workdir, argv)
    if exitcode != 0:
        pytest.fail(f"python -m rsdp.torchtitan.train {' '.join(argv)} exited {exitcode}:\n{output[-6000:]}")
    return output


def run_launcher(workdir, argv: list[str]) -> tuple[int, str]:
    """``python -m rsdp.torchtitan.train *argv`` in ``workdir``: its exit status and what it printed.
    It runs in a child forked from this process, which has imported torchtitan, so the child and the
    ranks it forks skip the ~10 s import that a new process pays."""
    log = workdir / f"launch-{next(_launches)}.log"
    process = multiprocessing.get_context("fork").Process(target=_launch, args=(workdir, log, argv))
    process.start()
    process.join(LAUNCH_TIMEOUT_S)
    if process.is_alive():
        os.killpg(process.pid, signal.SIGKILL)  # the launcher and its ranks
        process.join()
    return process.exitcode, log.read_text()


def _launch(workdir, log, argv: list[str]) -> None:
    """``python -m rsdp.torchtitan.train *argv`` in ``workdir``, printing to ``log`` (a forked child)."""
    os.setpgrp()  # one group with the ranks, to kill them all on a timeout
    os.chdir(workdir)
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1")
    with open(log, "w") as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
    # pytest's capture replaced these; torchtitan's logger prints to sys.stdout
    sys.stdout, sys.stderr = open(1, "w", buffering=1, closefd=False), open(2, "w", buffering=1, closefd=False)
    launcher.main(argv)


def from_seed(workdir, saving: bool = False) -> list[str]:
    """Start from the seed checkpoint; without ``saving``, write no checkpoint (a save at the last step
    otherwise, ~1 s a launch, that no test reads)."""
    flags = ["--checkpoint.enable", f"--checkpoint.initial_load_path={workdir / 'seed' / 'checkpoint' / 'step-0'}"]
    return flags if saving else [*flags, "--checkpoint.load_only"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("torchtitan")
    write_assets(folder / "assets")
    train(folder, "seed", "--checkpoint.enable", "--checkpoint.create_seed_checkpoint", "--debug.seed=0", nproc=1)
    return folder


@pytest.fixture(scope="module")
def torchtitan_fsdp(workdir) -> dict[int, tuple[float, float]]:
    """Stock torchtitan: its llama3 config and its own parallelize_llama / apply_fsdp_to_decoder."""
    losses = train(workdir, "stock", *from_seed(workdir), module="llama3", config="llama3_debugmodel")
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


def assert_losses_match(logged: dict[int, tuple], expected: dict[int, tuple]) -> None:
    assert logged and logged.keys() <= expected.keys(), (logged, expected)
    for step, values in logged.items():
        assert values == pytest.approx(expected[step], rel=RTOL), f"step {step} (loss, grad norm): {logged} vs {expected}"


@pytest.mark.parametrize(
    "flags",
    [
        ["--parallelism.dp_strategy=fsdp"],
        ["--parallelism.dp_strategy=replicate"],
        # layers.2.feed_forward: a name inside a block, as before activation checkpointing wrapped it
        ["--parallelism.dp_overrides=layers.0=replicate,layers.1=fsdp,layers.2.feed_forward=fsdp,lm_head=fsdp"],
        # rsdp on a ring of groups: on 2 ranks one group, each ring one all-gather (tests/test_ring_groups.py
        # has the rings of several groups)
        ["--parallelism.dp_ring_group_size=2"],
    ],
    ids=["fsdp", "replicate", "mixed", "ring-groups"],
)
def test_strategy_trains_like_torchtitan_fsdp(workdir, torchtitan_fsdp, flags):
    """rsdp's run is the checkpoint test's, auto's the budget test's (each launch is ~5-10 s)."""
    losses = train(workdir, "run-" + "-".join(f.split(".")[-1] for f in flags), *from_seed(workdir), *flags)
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert_losses_match(losses, torchtitan_fsdp)


@pytest.mark.parametrize("budget_mib,group", [(budget, 1) for budget in AUTO_BUDGETS_MIB] + [(AUTO_GROUPS_BUDGET_MIB, 2)])
def test_auto_plans_hold_their_budget_and_train_like_torchtitan_fsdp(workdir, torchtitan_fsdp, budget_mib, group):
    """dp_strategy=auto plans with the cost model, whose predicted peak bounds what a step measures, within
    PREDICTION_MARGIN, and the budget bounds the prediction: every step of the plan holds at most the
    predicted peak (parameters, optimizer state and the step's peak, the most of any rank, as
    --parallelism.dp_measure_memory logs it). With --parallelism.dp_ring_group_size 2 it plans its rsdp
    modules in rings of groups of 2 (on 2 ranks one group: each ring one all-gather), as they run. The
    plan trains as torchtitan's FSDP does."""
    flags = ["--parallelism.dp_strategy=auto", f"--parallelism.dp_memory_budget={budget_mib}MiB", "--parallelism.dp_measure_memory",
             f"--parallelism.dp_ring_group_size={group}"]
    output = launch_training(workdir, f"auto-{budget_mib}-g{group}", *from_seed(workdir), *flags)
    losses = logged_losses(output)
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert_losses_match(losses, torchtitan_fsdp)
    logged = MEMORY_LOG.findall(output)
    measured = {int(step): float(total) for step, total in logged}
    assert sorted(measured) == list(range(1, STEPS + 1)), output[-3000:]
    assert len(logged) == STEPS and output.count("rsdp: dp_strategy=auto planned") == 1, "logged once, not per rank"
    assert "torchtitan's chunked loss in 8 chunks" in output, "the config's loss is what the plan counts"

    planned_groups = set(re.findall(r"\| rsdp g=(\d+) \|", output))
    assert planned_groups == (set() if group == 1 else {str(group)}), output[-3000:]

    (predicted,) = map(float, PLANNED_PEAK_LOG.findall(output))
    print(f"budget {budget_mib} MiB, ring group size {group}: predicted {predicted} MiB, measured per step {measured}")
    assert max(measured.values()) <= predicted <= budget_mib, (predicted, measured, output[-3000:])
    assert predicted <= (1 + PREDICTION_MARGIN) * max(measured.values()), (predicted, measured, output[-3000:])


def test_rsdp_trains_like_torchtitan_fsdp_and_resumes_under_replicate(workdir, torchtitan_fsdp):
    """rsdp trains every step as torchtitan's FSDP does; torchtitan's checkpoint manager saves its
    Shard(0) parameters and optimizer state at step 2, and the replicate run in the same folder loads
    them as Replicate and trains step 3 alike."""
    saved = train(workdir, "resume", *from_seed(workdir, saving=True), "--parallelism.dp_strategy=rsdp", "--checkpoint.interval=2")
    assert sorted(saved) == list(range(1, STEPS + 1))
    assert_losses_match(saved, torchtitan_fsdp)
    resumed = train(workdir, "resume", "--checkpoint.enable", "--checkpoint.load_only", "--checkpoint.load_step=2",
                    "--parallelism.dp_strategy=replicate")
    assert sorted(resumed) == [STEPS]
    assert_losses_match(resumed, torchtitan_fsdp)


def test_bf16_rsdp_matches_fsdp_with_the_same_policy(workdir):
    """torchtitan's default mixed precision (bf16 parameters, fp32 reduction) under rsdp and FSDP2."""
    bf16 = [*from_seed(workdir), "--training.mixed_precision_param=bfloat16"]
    fsdp = train(workdir, "bf16-fsdp", *bf16, "--parallelism.dp_strategy=fsdp", seq_len=BF16_SEQ_LEN)
    rsdp = train(workdir, "bf16-rsdp", *bf16, "--parallelism.dp_strategy=rsdp", seq_len=BF16_SEQ_LEN)
    assert sorted(rsdp) == sorted(fsdp) == list(range(1, STEPS + 1))
    for step in fsdp:
        assert rsdp[step] == pytest.approx(fsdp[step], rel=BF16_RTOL), f"step {step}: {rsdp} vs {fsdp}"


def test_tensor_parallel_with_fsdp_matches_torchtitan(workdir):
    """TP 2 (data-parallel degree 1 on 2 ranks) through this package's config trains like stock
    torchtitan with TP 2: with fsdp everywhere the family's own parallelize function runs."""
    tp = [*from_seed(workdir), "--parallelism.tensor_parallel_degree=2"]
    stock = train(workdir, "tp-stock", *tp, module="llama3", config="llama3_debugmodel")
    ours = train(workdir, "tp-fsdp", *tp, "--parallelism.dp_strategy=fsdp")
    assert sorted(stock) == list(range(1, STEPS + 1))
    assert_losses_match(ours, stock)


def test_a_failing_rank_fails_the_launch_with_its_error(workdir):
    exitcode, output = run_launcher(workdir, ["--nproc=2", "--config", "llama3_debugmodel_rsdp", "--training.steps=many"])
    assert exitcode == 1, output[-3000:]
    assert re.search(r"rsdp\.torchtitan\.train: process [01] terminated with exit code 2", output), output[-3000:]
    assert "--training.steps" in output, output[-3000:]


# Configuration errors, without processes.


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(dp_overrides="layers.0"), "not module=strategy"),
        (dict(dp_overrides="layers.0=zero3"), "not module=strategy"),
        (dict(dp_strategy="auto"), "dp_memory_budget"),
        (dict(dp_strategy="auto", dp_memory_budget="lots"), "not a size"),
        (dict(dp_strategy="rsdp", dp_memory_budget="60GiB"), "would do nothing with dp_strategy=rsdp: only dp_strategy=auto"),
        (dict(dp_hardware="h100-pcie"), "parallelism.dp_hardware: .* neither a preset"),
        (dict(dp_ring_group_size=0), "dp_ring_group_size=0 must be a positive integer"),
    ],
)
def test_bad_parallelism_flags_are_named(fields, message):
    with pytest.raises(ValueError, match=message):
        ParallelismConfig(spmd_backend="partial_dtensor", **fields)


def test_auto_plans_for_a_named_hardware_or_the_devices_preset(monkeypatch):
    """auto's cost model comes from dp_hardware (a preset or a calibrated profile), by default the
    preset matching the device (CPU ranks: this project's calibrated CPU host; an H100's NVLink preset
    within a host of 8, InfiniBand beyond; a GPU no preset matches is refused); the old number flags
    override its numbers."""
    import torch

    from rsdp.planner import _hardware

    default = ParallelismConfig(spmd_backend="partial_dtensor")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default.hardware_name(2) == "cpu-gloo" and default.hardware(2) == _hardware.PRESETS["cpu-gloo"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "NVIDIA H100 80GB HBM3")
    assert (default.hardware_name(8), default.hardware_name(16)) == ("h100-sxm-nvlink", "h100-sxm-infiniband")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "NVIDIA H200")
    with pytest.raises(ValueError, match="parallelism.dp_hardware: rsdp: no hardware preset matches 'NVIDIA H200'"):
        default.hardware(8)
    named = ParallelismConfig(spmd_backend="partial_dtensor", dp_hardware="h100-sxm-infiniband", dp_flops_per_s=1e14)
    assert named.hardware(128) == _hardware.PRESETS["h100-sxm-infiniband"]
    overridden = named.hardware(128).cost_model(128, flops_per_s=named.dp_flops_per_s)
    assert overridden.flops_per_s == 1e14 and overridden.compute_seconds(1e14, linear_flops=5e13) == 1.0


def meta_model(registry, flavor="debugmodel"):
    import torch

    with torch.device("meta"):
        return registry(flavor, attn_backend="varlen").model.build()


def rules(model, **fields):
    return data_parallel_rules(model, None, None, ParallelismConfig(spmd_backend="partial_dtensor", **fields))


def test_rules_shard_embeddings_blocks_and_head_and_put_overrides_first():
    model = meta_model(llama3_model)
    assert rules(model, dp_overrides="layers.0=replicate,root=fsdp") == {
        "layers.0": Strategy.REPLICATE, "": Strategy.FSDP, "tok_embeddings": Strategy.RSDP,
        "layers.*": Strategy.RSDP, "lm_head": Strategy.RSDP,
    }


def test_replicated_or_tied_head_joins_the_root():
    assert rules(meta_model(llama3_model), dp_strategy="replicate") == {
        "": Strategy.REPLICATE, "tok_embeddings": Strategy.REPLICATE, "layers.*": Strategy.REPLICATE,
    }
    assert rules(meta_model(llama3_model), dp_overrides="lm_head=replicate") == {
        "": Strategy.REPLICATE, "tok_embeddings": Strategy.RSDP, "layers.*": Strategy.RSDP,
    }
    tied = meta_model(qwen3_model)
    assert rules(tied) == {"": Strategy.FSDP, "layers.*": Strategy.RSDP}
    with pytest.raises(ValueError, match="root cannot be rsdp"):
        rules(tied, dp_overrides="root=rsdp")


def torchtitan_embedding_case():
    """torchtitan's Embedding (its forward reads ``weight.to_local()``) under rsdp, each rank on its
    own rows, against ``nn.Embedding`` on the whole batch: output, and the gradient averaged over
    ranks as FSDP2's is; and what the step sent."""
    import torch
    import torch.distributed as dist
    from torchtitan.models.common.embedding import Embedding

    from rsdp import rsdp_shard
    from rsdp.memory import CommCounter

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    sharded = Embedding(Embedding.Config(num_embeddings=13, embedding_dim=6)).double()
    reference = torch.nn.Embedding(13, 6).double()
    reference.weight.data.copy_(sharded.weight.data)
    rsdp_shard(sharded)
    tokens = torch.randint(0, 13, (2 * world + 1, 5))
    mine = tokens.tensor_split(world)[rank]
    with CommCounter() as sent:
        out = sharded(mine)
        (out * out).sum().backward()
    expected = reference(tokens)
    (expected * expected).sum().div(world).backward()
    torch.testing.assert_close(out, expected.tensor_split(world)[rank])
    torch.testing.assert_close(sharded.weight.grad.full_tensor(), reference.weight.grad)
    return dict(sent.calls)


def test_torchtitans_embedding_rotates_and_is_exact(ranks):
    for calls in ranks.run(2, torchtitan_embedding_case):
        assert calls == {"c10d::send": 2}, calls  # one exchange forward, one backward: nothing gathered


def test_chunked_loss_makes_an_rsdp_head_fsdp_unless_an_override_names_it():
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss

    chunked, whole = ChunkedLossWrapper.Config(), CrossEntropyLoss.Config()

    def overrides(loss, **fields):
        return head_under_chunked_loss(ParallelismConfig(spmd_backend="partial_dtensor", **fields), loss)

    assert overrides(chunked) == "lm_head=fsdp"
    assert overrides(chunked, dp_overrides="layers.0=replicate") == "layers.0=replicate,lm_head=fsdp"
    assert overrides(chunked, dp_overrides="lm_head=rsdp") == "lm_head=rsdp"
    assert overrides(chunked, dp_strategy="replicate") == ""
    assert overrides(whole) == ""
    rules_ = data_parallel_rules(meta_model(llama3_model), None, None, ParallelismConfig(
        spmd_backend="partial_dtensor", dp_overrides=overrides(chunked)))
    assert rules_["lm_head"] is Strategy.FSDP and rules_["layers.*"] is Strategy.RSDP


def test_unsupported_combinations_are_named():
    model = meta_model(llama3_model)
    with pytest.raises(ValueError, match="spmd_backend partial_dtensor"):
        _check_supported(model, _dims(), ParallelismConfig())
    for degrees, what in ((dict(tp=2), "tensor parallelism"), (dict(cp=2), "context parallelism"), (dict(pp=2), "pipeline")):
        with pytest.raises(ValueError, match=what):
            _check_supported(model, _dims(**degrees), ParallelismConfig(spmd_backend="partial_dtensor"))
        _check_supported(model, _dims(**degrees), ParallelismConfig(spmd_backend="partial_dtensor", dp_strategy="fsdp"))
    with pytest.raises(ValueError, match="untied models only"):
        _check_supported(meta_model(qwen3_model), _dims(), ParallelismConfig(
            spmd_backend="partial_dtensor", dp_strategy="auto", dp_memory_budget="1GiB"))


def _dims(tp=1, cp=1, pp=1):
    return ParallelDims(dp_replicate=1, dp_shard=2, cp=cp, tp=tp, pp=pp, ep=1, world_size=2 * tp * cp * pp)
