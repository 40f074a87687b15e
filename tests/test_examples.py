"""The examples run end to end, as a user starts them: the LoRA one starts its own ranks (fork on CPU), the
Trainer one is started on ranks as torchrun starts them; both forked from a process that imported their
libraries once (``forked_scripts``)."""

from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_lora_fine_tuning_example_matches_fsdp2_and_reloads_its_adapters(tmp_path, scripts):
    """The script itself raises if rsdp's losses drift from FSDP2's or reloaded adapters differ. It starts
    its own ranks (``python finetune_llama_lora.py --nproc 2``), forked here (``forked_scripts``)."""
    pytest.importorskip("peft")
    result = scripts.run([EXAMPLES / "finetune_llama_lora.py", "--nproc", "2", "--steps", "3", "--out", tmp_path], timeout_s=300)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 3
    for row in rows:
        fsdp_loss, rsdp_loss = (float(cell) for cell in row.strip("| ").split(" | ")[1:])
        assert abs(fsdp_loss - rsdp_loss) < 1e-4, row
    assert (tmp_path / "lora_adapters_rsdp.pt").exists()
    assert "reloaded" in result.stdout


def test_hf_trainer_example_matches_fsdp2_and_reloads_its_model(tmp_path, scripts):
    """Launched as its docstring says (torchrun: ranks given torchrun's environment, forked here,
    ``forked_scripts``), with SFTTrainer's defaults (its fused loss, gradient checkpointing; the
    Trainer's path is tests/test_hf_trainer.py's); the script raises if rsdp's losses or weights drift
    from FSDP2's, or if the saved model, reloaded in one process, computes other logits."""
    pytest.importorskip("trl")
    result = scripts.run_ranks(2, [EXAMPLES / "finetune_hf_trainer.py", "--trainer", "sft", "--strategy", "fsdp", "rsdp",
                                   "--max-steps", "2", "--out", tmp_path], timeout_s=300)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 2, result.stdout
    assert "rsdp against fsdp: losses within" in result.stdout
    assert (tmp_path / "rsdp" / "final" / "model.safetensors").exists()
