"""Named hardware for the cost model (``rsdp plan --hardware``), each number with its source, and
profiles written as JSON (``{"flops_per_s": ..., "bandwidth_bytes_per_s": ..., "latency_s": ...}``).

Pitfalls: a preset's FLOP/s is the datasheet's dense BF16 peak, which training does not reach (torchtitan
reports 33-39% of it for Llama 3.1 8B on H100s), so its step times are lower bounds; its bandwidth is
the per-direction link rate per GPU, which NCCL's collectives approach for large messages only. The
per-message latency has no datasheet: it is an order of magnitude for NCCL's small messages, stated
as such.
"""

import dataclasses
import json
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Hardware:
    flops_per_s: float
    bandwidth_bytes_per_s: float
    latency_s: float
    source: str = ""


_CHIPS = {  # dense BF16 peak FLOP/s and its source
    "h100-sxm": (989e12, "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM: BF16 Tensor Core 989 TFLOP/s dense, 1,979 with sparsity)"),
    "a100-sxm": (312e12, "NVIDIA A100 Tensor Core GPU datasheet (A100 SXM: BF16 Tensor Core 312 TFLOP/s dense)"),
}
_LINKS = {  # bytes/s per GPU each way and its source
    ("h100-sxm", "nvlink"): (450e9, "NVLink 4: 900 GB/s per GPU, both directions together (450 GB/s each way)"),
    ("h100-sxm", "infiniband"): (50e9, "one 400 Gb/s NDR InfiniBand link (ConnectX-7) per GPU = 50 GB/s"),
    ("a100-sxm", "nvlink"): (300e9, "NVLink 3: 600 GB/s per GPU, both directions together (300 GB/s each way)"),
    ("a100-sxm", "infiniband"): (25e9, "one 200 Gb/s HDR InfiniBand link (ConnectX-6) per GPU = 25 GB/s"),
}
_LATENCY_S = 5e-6
_LATENCY = "latency 5 us: assumed (NCCL small-message order of magnitude), not from a datasheet"

PRESETS = {
    f"{chip}-{link}": Hardware(_CHIPS[chip][0], rate, _LATENCY_S, f"{_CHIPS[chip][1]}; {link_source}; {_LATENCY}")
    for (chip, link), (rate, link_source) in _LINKS.items()
}


def load(name_or_path: str) -> Hardware:
    """A preset by name, or a profile from a JSON file."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(
            f"rsdp plan: --hardware {name_or_path!r} is neither a preset ({', '.join(PRESETS)}) nor a profile file."
        )
    values = json.loads(path.read_text())
    try:
        return Hardware(
            float(values["flops_per_s"]), float(values["bandwidth_bytes_per_s"]), float(values["latency_s"]),
            str(values.get("source", path)),
        )
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(
            f"rsdp plan: profile {path} needs numbers flops_per_s, bandwidth_bytes_per_s and latency_s ({error!r})."
        ) from None
