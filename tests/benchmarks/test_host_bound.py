"""benchmarks/zero/host_bound.py's smoke form: every phase timed, and the step's summary rows
add up the phases they name."""

import pytest

from benchmarks.zero import host_bound


def test_the_smoke_run_times_every_phase_and_sums_the_tail():
    rows = host_bound.main(["--smoke", "--threads", "1", "--passes", "4"])
    by_name = {r[0]: r for r in rows}
    for phase in ("accumulate", "upcast into a kept", "norm (parallax", "convert", "adamw fused"):
        assert any(name.startswith(phase) for name in by_name), phase
    assert all(r[-1] > 0 for r in rows[:-2]), rows  # every phase took time
    tail = sum(r[-1] for r in rows if r[0].startswith(host_bound.TAIL))
    assert by_name[rows[-1][0]][-1] == pytest.approx(tail)
    assert by_name["accumulate (bf16 add)"][5] == 4  # a per-pass phase, times --passes
