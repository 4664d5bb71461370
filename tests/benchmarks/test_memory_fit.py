"""The memory-fit benchmark's smoke form: a tiny row planned, run in a watched child process
and reported (host peak, samples/s), and nothing written."""

import math

from benchmarks.tools.common import RESULTS_JSONL, RESULTS_MD
from benchmarks.zero.memory_fit import main


def _sizes() -> list[int]:
    return [f.stat().st_size if f.exists() else 0 for f in (RESULTS_MD, RESULTS_JSONL)]


def test_smoke_row_runs_in_a_watched_child_and_writes_nothing(tmp_path):
    before = _sizes()
    (rec,) = main(["--smoke", "--rows", "tiny-lora", "--steps", "1", "--warmup", "0",
                   "--out", str(tmp_path)])  # fmt: skip
    assert rec["status"] == "ok", rec
    assert rec["host_gib"] > 0.05 and math.isfinite(rec["step_s"]) and rec["samples_per_s"] > 0
    assert rec["step_times"] == [rec["step_s"]]  # each timed step, recorded
    assert rec["predicted_gib"] > 0 and rec["layout"].startswith("tp1 pp1 dp1")
    assert _sizes() == before


def test_a_row_over_the_host_limit_is_ended_and_reported(tmp_path):
    (rec,) = main(["--smoke", "--rows", "tiny-lora", "--host-limit", "0.01",
                   "--out", str(tmp_path), "--no-write"])  # fmt: skip
    assert rec["status"].startswith("host RSS over 0.01 GiB"), rec


def test_the_ratio_is_against_this_invocations_uncapped_row_where_it_ran():
    from benchmarks.zero.memory_fit import UNCAPPED, references, table_row

    capped = {"name": "llava-24", "limit": 24.0, "batch": 32, "samples_per_s": 2.0, "status": "ok"}
    alone = references([capped])
    assert alone["llava"] == UNCAPPED["llava"]  # nothing uncapped ran: RESULTS.md's best
    uncapped = {"name": "llava", "limit": None, "batch": 32, "samples_per_s": 4.0, "status": "ok"}
    refs = references([capped, uncapped])
    assert refs["llava"][0] == 4.0 and refs["openvla"] == UNCAPPED["openvla"]
    assert table_row(capped, refs)[-2] == 0.5 and table_row(uncapped, refs)[-2] == 1.0
    # on another card RESULTS.md's H200 figures are no reference: no ratio without a row of its own
    other = references([capped], "1x NVIDIA H100 80GB HBM3")
    assert other == {} and math.isnan(table_row(capped, other)[-2])
    assert references([capped, uncapped], "1x NVIDIA H100 80GB HBM3")["llava"][0] == 4.0


def test_a_row_stopped_mid_run_keeps_the_steps_it_finished(tmp_path):
    """The child says its plan and each step as they come; a watcher that ends it at
    --row-timeout reads back what the finished record would have said of those steps."""
    import json
    import subprocess
    import sys
    from types import SimpleNamespace

    from benchmarks.zero.memory_fit import SMOKE, finished_steps

    cmd = [sys.executable, "-m", "benchmarks.zero.memory_fit", "--child", "tiny-lora", "--smoke",
           "--steps", "2", "--warmup", "1", "--out", str(tmp_path)]  # fmt: skip
    lines = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.splitlines()
    (done,) = [json.loads(x[len("RESULT ") :]) for x in lines if x.startswith("RESULT ")]
    row = next(r for r in SMOKE if r.name == "tiny-lora")
    args = SimpleNamespace(warmup=1)
    got = finished_steps([x for x in lines if not x.startswith("RESULT ")], row, args)
    assert got["step_times"] == done["step_times"] and got["step_s"] == done["step_s"]
    assert got["layout"] == done["layout"] and got["predicted_s"] == done["predicted_s"]
    warm = [x for x in lines if x.startswith(("PLAN ", 'STEP {"i": 0'))]
    first = finished_steps(warm, row, args)
    assert "step_s" not in first and first["layout"] == done["layout"]  # a warm-up is no step
