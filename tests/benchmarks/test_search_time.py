"""The planner's search-time benchmark runs in its smoke form and writes nothing."""

from benchmarks.tools.common import RESULTS_JSONL, RESULTS_MD


def test_smoke_times_each_case_and_writes_nothing():
    from benchmarks.plan.search_time import main

    before = RESULTS_MD.read_bytes(), RESULTS_JSONL.read_bytes()
    records = main(["--smoke"])
    assert [(r["model"], r["gpus"]) for r in records] == [("tiny", 1), ("tiny", 2)]
    assert all(r["search_s"] > 0 and "tp" in r["first"] for r in records), records
    assert (RESULTS_MD.read_bytes(), RESULTS_JSONL.read_bytes()) == before
