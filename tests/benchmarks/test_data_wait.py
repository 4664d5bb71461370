"""The data-wait benchmark runs end to end in its CPU smoke mode: a LIBERO-format dataset
trained on with and without --prefetch, the same losses either way."""

import pytest

pytest.importorskip("h5py")


def test_smoke_measures_the_wait_with_and_without_prefetch(tmp_path):
    from benchmarks.data.wait import main

    records = main(["--smoke", "--sources", "libero", "--root", str(tmp_path)])
    assert [(r["source"], r["prefetch"]) for r in records] == [("libero", 0), ("libero", 1)]
    assert all(r["same_losses"] and r["step_time_s"] > 0 for r in records)
    assert all(0 <= r["data_wait_s"] <= r["max_data_wait_s"] for r in records)
