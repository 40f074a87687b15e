"""torchtitan's trainer on CPU ranks with gloo, for machines without GPUs.

    python -m rsdp.torchtitan.train --nproc 2 --config llama3_debugmodel_rsdp \\
        --parallelism.dp_strategy rsdp --training.steps 3

Starts ``--nproc`` ranks with torchrun (``--standalone``), applies the CPU shims of ``_cpu`` in each,
and runs ``torchtitan.train``. ``--module`` defaults to ``rsdp.torchtitan``; stock torchtitan configs
(``--module llama3 --config llama3_debugmodel``) run too. Without ``--hf_assets_path`` and
``--dataloader.dataset_path`` it uses a tokenizer and dataset generated in ``./outputs/assets``.
"""

import argparse
import os
import sys

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


def worker(args: list[str]) -> None:
    from . import _cpu

    _cpu.prepare_imports()
    import torchtitan.train
    from torchtitan.config import ConfigManager

    parse_args = ConfigManager.parse_args

    def parse_for_cpu(self, argv=None):
        config = parse_args(self, argv)
        _cpu.adapt_config(config)
        return config

    ConfigManager.parse_args = parse_for_cpu
    sys.argv = [sys.argv[0], *args]
    torchtitan.train.main()


def main(argv: list[str] | None = None) -> None:
    nproc, args = _split(sys.argv[1:] if argv is None else argv)
    if "RANK" in os.environ:
        worker(args)
        return
    from torch.distributed.run import main as torchrun

    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    torchrun(["--standalone", f"--nproc_per_node={nproc}", "-m", "rsdp.torchtitan.train", *_with_defaults(args)])


if __name__ == "__main__":
    main()
