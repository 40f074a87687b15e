"""``rsdp calibrate`` on 2 gloo ranks (torchrun) writes a profile that ``rsdp plan --hardware`` loads."""

import json
import os
import subprocess
import sys
from pathlib import Path

from rsdp.planner import _hardware
from rsdp.planner.cli import main

REPO = Path(__file__).resolve().parent.parent


def test_calibrate_on_two_gloo_ranks_writes_a_profile_the_planner_loads(tmp_path, capsys):
    profile = tmp_path / "profile.json"
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "rsdp", "calibrate",
         "--seq-len", "8", "--out", str(profile)],
        capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    values = json.loads(profile.read_text())
    hardware = _hardware.load(str(profile))
    assert hardware.flops_per_s > 0 and hardware.ring_step_host_s > 0 and not hardware.host_overlaps_compute
    assert set(hardware.links) == set(_hardware.LINK_OPS) and set(hardware.partial_gemm_efficiency) == {2, 4, 8}
    assert all(getattr(hardware, rate) > 0 for rate in _hardware.WORK_RATES)  # attention, norms, elementwise, loss
    assert values["measured"]["world_size"] == 2 and "2 gloo ranks" in hardware.source

    main(["plan", "--budget", "1GiB", "--world-size", "2", "--vocab_size", "256", "--ninp", "32", "--nhid", "64",
          "--nhead", "2", "--num_decoder_layers", "1", "--seq-len", "8", "--hardware", str(profile)])
    assert "plan for 2 devices (cost model)" in capsys.readouterr().out
