"""rsdp in torchtitan: choose rsdp, FSDP or replication per module from a torchtitan config.

    torchrun --nproc_per_node 8 -m torchtitan.train --module rsdp.torchtitan --config llama3_8b_rsdp
    python -m rsdp.torchtitan.train --nproc 2 --config llama3_debugmodel_rsdp   # CPU ranks, gloo

torchtitan finds ``config_registry`` in this package; see docs/torchtitan.md. Nothing here imports
torchtitan, so the CPU launcher can prepare that import first.
"""

from importlib.metadata import PackageNotFoundError, version

SUPPORTED_TORCHTITAN = "0.3."

try:
    _installed = version("torchtitan")
except PackageNotFoundError:
    raise ImportError("rsdp.torchtitan needs torchtitan 0.3: pip install 'rsdp[torchtitan]'") from None
if not _installed.startswith(SUPPORTED_TORCHTITAN):
    raise ImportError(
        f"rsdp.torchtitan is written against torchtitan {SUPPORTED_TORCHTITAN}x (its config and parallelize "
        f"interfaces change between releases); found {_installed}. pip install 'torchtitan>=0.3,<0.4'."
    )
