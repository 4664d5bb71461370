"""``python -m parallax.plan calibrate`` on the CPU: tiny sizes, and on two gloo ranks the
collectives too; the profile it writes is one ``--machine`` reads and the planner plans with."""

import io

from rich.console import Console

from parallax.plan.calibrate import main
from parallax.plan.cli import plan
from parallax.plan.machine import load
from parallax.testing import run_ranks


def _calibrate(path: str) -> None:
    assert main(["--out", path, "--precision", "fp32"]) == 0


def test_calibrate_writes_a_profile_the_planner_reads(tmp_path):
    path = tmp_path / "cpu.json"
    _calibrate(str(path))
    machine = load(path)
    assert machine.measured and machine.gemm_tflops > 0 and machine.host_adam_s > 0
    assert machine.host_one_pass_s > 0  # (on the CPU: its plain torch ops, as the CPU runs it)
    assert machine.hbm_gbs > 0 and machine.host_gbs > 0 and machine.gemm_half_tokens >= 1
    assert "no GPU" in machine.notes and "links left at the defaults" in machine.notes
    out = io.StringIO()
    result, line = plan(
        ["--machine", str(path), "--gpu-memory", "1", "--gpus", "1"], Console(file=out)
    )
    assert result.ranked and "measured" in out.getvalue() and line.startswith("torchrun")


def test_calibrate_measures_the_collectives_on_two_ranks(tmp_path):
    path = tmp_path / "two.json"
    run_ranks(_calibrate, 2, str(path))
    machine = load(path)
    assert machine.gpus_per_node == 2 and machine.intra.busbw_gbs > 0
    assert "all-reduce within a node over 2 ranks" in machine.notes
