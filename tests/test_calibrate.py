"""``rsdp calibrate`` on 2 gloo ranks (as ``torchrun --nproc-per-node 2 -m rsdp calibrate`` starts them,
from the preloaded fork server: ``forked_scripts``) writes a profile that ``rsdp plan --hardware`` loads."""

import json

from rsdp.planner import _hardware
from rsdp.planner.cli import main


def test_calibrate_on_two_gloo_ranks_writes_a_profile_the_planner_loads(tmp_path, capsys, scripts):
    profile = tmp_path / "profile.json"
    done = scripts.run_ranks(2, ["-m", "rsdp", "calibrate", "--seq-len", "8", "--out", profile], cwd=tmp_path, timeout_s=300)
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
