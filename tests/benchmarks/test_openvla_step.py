"""The benchmark driver in one process: configurations that do not fit are skipped with a
reason, the time budget skips what comes after it, a failing configuration becomes an error row
without stopping the others, and the JSON record has exactly the issue's keys."""

import math

import pytest

from benchmarks.openvla_runs import Layout, merge
from benchmarks.openvla_step import main, parse_args, summarise

KEYS = {
    "gpus",
    "framework",
    "layout",
    "global_batch",
    "step_time_s",
    "tokens_per_s_per_gpu",
    "mfu",
    "peak_mem_gib",
    "variant",  # parallax's options (null for the natives), beyond the issue's keys
}  # with run_id, date, commit, hardware added when written


def test_layouts():
    assert Layout.parse("1gpu") == Layout() and Layout.parse("tp2pp2dp2") == Layout(2, 2, 2)
    assert Layout.parse("dp2").name == "dp2" and Layout(tp=2, dp=2).name == "tp2dp2"
    for bad in ("tp", "tp2tp2", "xx2", "tp2 pp2"):
        try:
            Layout.parse(bad)
        except ValueError as err:
            assert "1gpu, tp2" in str(err)
        else:
            raise AssertionError(f"{bad!r} parsed")
    assert Layout(dp=2).supports("torch-fsdp2") and not Layout(tp=2).supports("torch-fsdp2")
    assert Layout().supports("torch-single") and not Layout(tp=2, pp=2).supports("torch-dtensor-tp")


def test_rows_skips_and_errors():
    argv = ["--smoke", "--no-write", "--layouts", "1gpu,dp2", "--steps", "1", "--warmup", "0"]
    rows = main([*argv, "--frameworks", "torch-single,torch-ddp-zero"])
    by = {(r["layout"], r["framework"]): r for r in rows}
    ok = by[("1gpu", "torch-single")]
    assert ok["status"] == "ok" and ok["step s"] > 0 and math.isfinite(ok["loss"])
    assert ok["batch"] == 8
    # --single-batch: the one-GPU rows run on the first 4 samples
    rows = main([*argv, "--frameworks", "torch-single", "--single-batch", "4"])
    assert rows[0]["batch"] == 4 and rows[0]["status"] == "ok"
    assert rows[0]["samples/s"] == pytest.approx(4 / rows[0]["step s"])
    assert ok["x best native"] == 1.0 and ok["MFU"] > 0
    assert by[("dp2", "torch-ddp-zero")]["status"] == "skipped: needs 2 GPUs"
    # a budget of 0 s runs the first configuration only
    rows = main([*argv, "--frameworks", "torch-single", "--time-budget", "0", "--micro-batch", "3"])
    assert rows[0]["status"].startswith("a batch of 8 does not split into micro-batches of 3")
    multi_first = [*argv[:3], "dp2,1gpu", *argv[4:]]
    rows = main([*multi_first, "--frameworks", "torch-single,parallax", "--time-budget", "0"])
    order = [(r["layout"], r["framework"], r["variant"], r["status"]) for r in rows]
    assert order == [  # parallax opt first (multi-GPU, then one GPU), natives, other variants
        ("dp2", "parallax", "opt", "skipped: needs 2 GPUs"),
        ("1gpu", "parallax", "opt", "ok"),
        ("1gpu", "torch-single", "", "skipped: time budget"),
        ("dp2", "parallax", "base", "skipped: needs 2 GPUs"),
        ("1gpu", "parallax", "base", "skipped: time budget"),
        ("dp2", "parallax", "opt+compile", "skipped: needs 2 GPUs"),
        ("1gpu", "parallax", "opt+compile", "skipped: time budget"),
    ]
    # --layouts led by 1gpu: the one-GPU rows first, on fresh memory
    rows = main(
        [*argv, "--frameworks", "parallax", "--parallax-variants", "opt", "--time-budget", "0"]
    )
    order = [(r["layout"], r["status"]) for r in rows]
    assert order == [("1gpu", "ok"), ("dp2", "skipped: needs 2 GPUs")]


def test_record_has_the_issue_keys():
    with pytest.raises(SystemExit):
        parse_args(["--steps", "5"])  # a measurement times at least 10 steps
    with pytest.raises(SystemExit):
        parse_args(["--frameworks", "parallax,torch-ddp"])
    with pytest.raises(SystemExit):
        parse_args(["--parallax-variants", "opt,fast"])
    args = parse_args(["--smoke"])
    merged = merge([{"times": [1.0, 2.0, 3.0], "peak": 1.5, "loss": 2.0}] * 2)
    row, record = summarise(Layout(dp=2), "parallax", {**merged, "micro": 2}, args, 1e12, 28, "opt")
    assert set(record) == KEYS and record["step_time_s"] == 2.0 and record["gpus"] == 2
    assert record["variant"] == row["variant"] == "opt"
    assert record["tokens_per_s_per_gpu"] == 8 * 28 / 2.0 / 2
    _, failed = summarise(Layout(), "torch-single", {"error": "OOM", "micro": 2}, args, 1e12, 28)
    assert set(failed) == KEYS and failed["step_time_s"] is None and failed["mfu"] is None


def test_plan_order_and_row_flops():
    from types import SimpleNamespace

    from benchmarks.openvla_step import plan, row_flops

    args = parse_args(["--smoke"])
    b = SimpleNamespace(args=args, world=2, flops_step=2.0, flops_labelled=1.0)
    order = [(x.name, fw, v) for x, fw, v, skip in plan(b) if skip is None]
    two = ["tp2", "pp2", "dp2"]
    assert order[:3] == [(x, "parallax", "opt") for x in two]  # what the issue asks first
    natives = order[3:7]
    assert {fw for _, fw, _ in natives} == {
        "torch-dtensor-tp",
        "torch-pipelining",
        "torch-ddp-zero",
        "torch-fsdp2",
    } and order[7:9] == [("1gpu", "parallax", "opt"), ("1gpu", "torch-single", None)]
    assert order[9:] == [
        (x, "parallax", v) for v in ("base", "opt+compile") for x in [*two, "1gpu"]
    ]
    assert row_flops(b, "parallax", "opt") == 1.0 and row_flops(b, "parallax", "base") == 2.0
    assert row_flops(b, "torch-fsdp2", None) == 2.0


def test_notes_compare_variants():
    from benchmarks.openvla_step import COLUMNS, ratio_notes

    def row(layout, fw, variant, tokens):
        gpus = 1 if layout == "1gpu" else 2
        values = dict(layout=layout, framework=fw, variant=variant, GPUs=gpus)
        return {**dict.fromkeys(COLUMNS, math.nan), **values, "tokens/s/GPU": tokens}

    rows = [
        row("dp2", "parallax", "opt", 120.0),
        row("dp2", "torch-fsdp2", "", 100.0),
        row("dp2", "parallax", "base", 100.0),
        row("1gpu", "parallax", "opt", 125.0),
    ]
    for r in rows:
        r["batch"] = 32
    notes = ratio_notes(rows)
    assert "best 2-GPU row (dp2 opt) at 1.20x the best native" in notes
    assert "dp2 opt 1.200x" in notes
    assert (
        "parallax opt dp strong scaling, global batch 32 (tokens/s per GPU vs 1gpu): 96.0%" in notes
    )
    assert rows[0]["x best native"] == 1.2
    rows[3]["batch"] = 16  # --single-batch 16: as many samples per GPU as dp2 at 32
    notes = ratio_notes(rows)
    assert (
        "parallax opt dp weak scaling, 16 samples per GPU (tokens/s per GPU vs 1gpu): 96.0%"
        in notes
    )
    rows[3]["batch"] = 8
    assert "dp scaling, global batch 32 vs 8" in ratio_notes(rows)
