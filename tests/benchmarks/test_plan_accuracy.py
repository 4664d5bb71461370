"""The planner-accuracy benchmark's smoke form: every tiny row is planned and run on the CPU,
a memory cap changes the plan, and nothing is written."""

import math

from benchmarks.plan.plan_accuracy import main
from benchmarks.tools.common import RESULTS_JSONL, RESULTS_MD


def _sizes() -> list[int]:
    return [f.stat().st_size if f.exists() else 0 for f in (RESULTS_MD, RESULTS_JSONL)]


def test_smoke_rows_plan_run_and_write_nothing(tmp_path):
    before = _sizes()
    rows = main(["--smoke", "--steps", "1", "--warmup", "0", "--out", str(tmp_path)])
    assert [r["status"] for r in rows] == ["ok"] * len(rows), rows
    for r in rows:
        assert r["predicted_gib"] > 0 and r["predicted_s"] > 0 and math.isfinite(r["measured_s"])
    by_name = {r["name"]: r for r in rows}
    capped, free = by_name["tiny-capped"], by_name["tiny"]
    assert capped["layout"] != free["layout"]  # 12 MiB does not hold the uncapped choice
    assert capped["predicted_gib"] * 2**30 <= 0.012 * 2**30
    assert _sizes() == before
