"""torchtitan's trainer on CPU ranks with gloo, for machines without GPUs.

    python -m rsdp.torchtitan.train --nproc 2 --config llama3_debugmodel_rsdp \\
        --parallelism.dp_strategy rsdp --training.steps 3

Imports torchtitan once, with the CPU shims of ``_cpu``, and forks ``--nproc`` ranks that run
``torchtitan.train`` on one machine: a torchrun launch re-imports torch and torchtitan in every rank
(~10 s each on a small machine). When a rank fails, the others are stopped and the launcher exits 1.
Started by torchrun (``RANK`` set), it runs that rank. ``--module`` defaults to ``rsdp.torchtitan``;
stock torchtitan configs (``--module llama3 --config llama3_debugmodel``) run too. Without
``--hf_assets_path`` and ``--dataloader.dataset_path`` it uses a tokenizer and dataset generated in
``./outputs/assets``.

Pitfall: the ranks are forked, and GNU OpenMP's thread pool does not survive a fork (a child that runs
a parallel region after its parent ran one can hang). So the launcher forks before any CPU work of its
own, and each rank sets its thread count before its first op; a process that has run parallel work
(the tests fork the launcher from theirs) must give its ranks one thread each (``OMP_NUM_THREADS=1``).

The launcher hosts the ranks' rendezvous store, as torchrun's agent does, so that no rank's exit takes
it from the others. torchtitan's rank 0 sleeps 2 s after its last step "for other ranks to complete":
a workaround (torchtitan PR 224) for NCCL's heartbeat monitor, which reads the store after rank 0, its
host under a plain launch, has left (pytorch issue 123969). These ranks run gloo, which has no heartbeat
monitor, and the store is the launcher's, so the forked ranks skip that sleep.
"""

import argparse
import gc
import os
import sys
import time
import types

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ASSETS = os.path.join("outputs", "assets")


def _split(argv: list[str]) -> tuple[int, list[str]]:
    """``--nproc`` for the launcher; everything else for torchtitan."""
    parser = argparse.ArgumentParser(prog="python -m rsdp.torchtitan.train", allow_abbrev=False, add_help=False)
    parser.add_argument("--nproc", type=int, default=2, help="CPU ranks to start")
    known, rest = parser.parse_known_args(argv)
    if known.nproc < 1:
        parser.error(f"--nproc must be at least 1, got {known.nproc}")
    return known.nproc, rest


def _with_defaults(args: list[str]) -> list[str]:
    def given(flag: str) -> bool:
        return any(a == flag or a.startswith(flag + "=") for a in args)

    defaults = []
    if not given("--module"):
        defaults += ["--module", "rsdp.torchtitan"]
    if not given("--training.mixed_precision_param"):
        defaults += ["--training.mixed_precision_param", "float32"]  # bf16 matmuls are slow on CPUs
    if not given("--hf_assets_path") or not given("--dataloader.dataset_path"):
        from .assets import write_assets

        write_assets(ASSETS)
    if not given("--hf_assets_path"):
        defaults += ["--hf_assets_path", os.path.join(ASSETS, "tokenizer")]
    if not given("--dataloader.dataset_path"):
        defaults += ["--dataloader.dataset_path", os.path.join(ASSETS, "dataset")]
    return defaults + args


def launch(nproc: int, args: list[str]) -> int:
    """Fork ``nproc`` ranks that run torchtitan's trainer with ``args``; 0 when every rank finished,
    1 when one failed (its error printed, the others stopped)."""
    _prepare()
    store = dist.TCPStore("127.0.0.1", 0, nproc, is_master=True, wait_for_workers=False)  # any free port
    environment = {
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True",
        "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
    }
    # Ranks share the cores: one each would leave cores idle, more would oversubscribe them.
    threads = int(os.environ.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 1) // nproc))
    try:
        mp.start_processes(_rank, args=(args, environment, threads), nprocs=nproc, start_method="fork")
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as failure:
        print(f"rsdp.torchtitan.train: {failure}", file=sys.stderr)
        return 1
    return 0


def _rank(local_rank: int, args: list[str], environment: dict[str, str], threads: int) -> None:
    os.environ.update(environment, RANK=str(local_rank), LOCAL_RANK=str(local_rank))
    torch.set_num_threads(threads)
    # What the rank inherited (torch, torchtitan) lives as long as it: frozen, it is left out of every
    # full collection (--parallelism.dp_measure_memory runs one before each measured step).
    gc.freeze()
    import torchtitan.trainer

    torchtitan.trainer.time = _TimeWithoutShutdownSleep("time")
    _train(args)


class _TimeWithoutShutdownSleep(types.ModuleType):
    """``time`` for torchtitan's trainer in a forked gloo rank: its one sleep is the shutdown wait the
    module's docstring explains, which waits for nothing here."""

    def __getattr__(self, name: str):
        return getattr(time, name)

    @staticmethod
    def sleep(seconds: float) -> None:
        pass


def _prepare() -> None:
    """Import torchtitan's trainer with the CPU shims, and make its config parser adapt configs to CPUs."""
    from . import _cpu

    _cpu.prepare_imports()
    import torchtitan.train  # noqa: F401  (once, here: forked ranks inherit it)
    from torchtitan.config import ConfigManager

    if getattr(ConfigManager.parse_args, "adapts_to_cpu", False):
        return
    parse_args = ConfigManager.parse_args

    def parse_for_cpu(self, argv=None):
        config = parse_args(self, argv)
        _cpu.adapt_config(config)
        return config

    parse_for_cpu.adapts_to_cpu = True
    ConfigManager.parse_args = parse_for_cpu


def _train(args: list[str]) -> None:
    import torchtitan.train

    sys.argv = [sys.argv[0], *args]
    torchtitan.train.main()


def main(argv: list[str] | None = None) -> None:
    nproc, args = _split(sys.argv[1:] if argv is None else argv)
    if "RANK" in os.environ:
        _prepare()
        _train(args)
        return
    sys.exit(launch(nproc, _with_defaults(args)))


if __name__ == "__main__":
    main()
