"""The loader-throughput benchmark runs end to end in its CPU smoke mode."""

import pytest

pytest.importorskip("av")
pytest.importorskip("crc32c")


def test_smoke_measures_both_formats_at_each_worker_count():
    from benchmarks.data.throughput import main

    records = main(["--smoke"])
    assert {(r["format"], r["workers"]) for r in records} == {
        (f, w) for f in ("rlds (jpeg)", "lerobot v3.0 (mp4)") for w in (0, 1)
    }
    assert all(r["samples_per_s"] > 0 for r in records)
