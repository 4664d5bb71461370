"""The loader-throughput benchmark runs end to end in its CPU smoke mode."""

import os

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


@pytest.mark.skipif(
    not hasattr(os, "sched_getscheduler"), reason="the OS has no scheduling policies to keep"
)
def test_the_encoders_leave_the_process_scheduling_alone(tmp_path):
    """SVT-AV1 run by root moves its caller to real-time scheduling, which everything the
    process starts later inherits (ranks spinning at SCHED_FIFO 99 starve the machine): the
    writer puts the policy back. (Run by another user, or with PyAV built without libsvtav1,
    the encoder changes nothing and the test checks only that the writer does not either.)"""
    import numpy as np

    from benchmarks.data.lerobot_writer import encode_video
    from benchmarks.data.throughput import _codec

    before = os.sched_getscheduler(0), os.sched_getparam(0)
    frames = np.random.default_rng(0).integers(0, 256, (4, 16, 16, 3), dtype=np.uint8)
    encode_video(tmp_path / "v.mp4", frames, 10, _codec(), lossy=True)
    assert (os.sched_getscheduler(0), os.sched_getparam(0)) == before
