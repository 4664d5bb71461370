"""The latest-results tables at the top of RESULTS.md: current with results.jsonl, the newest
record of each configuration, and the log below them left as it was."""

import json

from benchmarks.tools import results_table as rt
from benchmarks.tools.common import RESULTS_JSONL, RESULTS_MD


def test_the_tables_in_results_md_are_what_the_script_writes_now():
    text = RESULTS_MD.read_text()
    want = rt.with_table(text, rt.render(rt.read_records(RESULTS_JSONL)))
    assert text == want, "RESULTS.md is stale: run python -m benchmarks.tools.results_table"


def _rec(run: str, **kw) -> dict:
    return {"run_id": run, "date": f"2026-12-0{run[-1]} 00:00 UTC", "hardware": "1x GPU", **kw}


def test_the_newest_record_of_each_configuration_wins():
    step = {"benchmark": "lora_step", "stack": "parallax", "variant": "opt", "batch": 16}
    records = [
        _rec("r1", **step, micro=16, step_time_s=0.5),
        _rec("r2", **step, micro=8, step_time_s=0.6),  # another micro-batch: another row
        _rec("r3", **step, micro=16, step_time_s=0.4),  # the same configuration, newer
        _rec("r3", **{**step, "hardware": "CPU x86_64 (2 cores)"}, micro=16, step_time_s=9.0),
    ]
    rows = rt.latest(records)["lora_step"]
    assert [(r["run_id"], r["micro"]) for r in rows] == [("r2", 8), ("r3", 16), ("r3", 16)]
    assert rows[-1]["hardware"].startswith("CPU")  # GPU rows first
    lines = rt.table("lora_step", rows, rt.SPECS["lora_step"])
    assert lines[0] == "### lora_step (`python -m benchmarks.step.lora`)"
    assert "| 1x GPU | parallax | opt | 16 | 16 | 0.4 |" in lines[-2]


def test_records_without_a_benchmark_and_unknown_benchmarks():
    old = _rec("r1", gpus=1, framework="parallax", layout="1gpu", global_batch=32, variant="opt")
    assert rt.benchmark_of(old) == "openvla_step"
    new = [_rec("r1", benchmark="new_thing", mode="a", n=2, speed=1.5)]
    spec = rt.spec_of("new_thing", new)
    assert spec.config == ("mode", "n") and [m[1] for m in spec.metrics] == ["speed"]
    failed = _rec("r2", benchmark="lora_step", stack="hf", step_time_s=None)
    assert rt._status(failed, rt.SPECS["lora_step"]).startswith("no measurement")


def test_refresh_rewrites_only_between_the_markers(tmp_path):
    md, jsonl = tmp_path / "RESULTS.md", tmp_path / "results.jsonl"
    log = "\n## a logged run\n\n| x |\n|---|\n| 1 |\n"
    md.write_text(f"# results\n\n{rt.BEGIN}\nold\n{rt.END}\n{log}")
    rec = _rec("r1", benchmark="data_throughput", format="rlds", workers=0, samples_per_s=355.0)
    jsonl.write_text(json.dumps(rec) + "\n")
    assert rt.refresh(jsonl, md) and not rt.refresh(jsonl, md)  # a second call changes nothing
    text = md.read_text()
    assert text.endswith(f"{rt.END}\n{log}") and "old" not in text and "| 355 |" in text
    assert rt.main(["--check", "--jsonl", str(jsonl), "--md", str(md)]) == 0
    jsonl.write_text(jsonl.read_text() + json.dumps({**rec, "samples_per_s": 400.0}) + "\n")
    assert rt.main(["--check", "--jsonl", str(jsonl), "--md", str(md)]) == 1
