"""The examples run end to end, as a user starts them (their own ranks, fork on CPU)."""

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_lora_fine_tuning_example_matches_fsdp2_and_reloads_its_adapters(tmp_path):
    """The script itself raises if rsdp's losses drift from FSDP2's or reloaded adapters differ."""
    pytest.importorskip("peft")
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "finetune_llama_lora.py"), "--nproc", "2", "--steps", "3", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 3
    for row in rows:
        fsdp_loss, rsdp_loss = (float(cell) for cell in row.strip("| ").split(" | ")[1:])
        assert abs(fsdp_loss - rsdp_loss) < 1e-4, row
    assert (tmp_path / "lora_adapters_rsdp.pt").exists()
    assert "reloaded" in result.stdout
