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


def test_the_copies_row_takes_both_ways_at_once_where_it_was_measured():
    """One-way copies overlap in the model (the slower counts); a measured two-stream copy
    replaces that guess."""
    phases = {"d2h (pinned, bf16)": (1.0, 2, 10**9), "h2d (pinned, bf16)": (2.0, 2, 10**9)}
    rows = host_bound.table(phases, 1e9, 3, 1)
    assert rows[-2][-1] == pytest.approx(6.0)  # the slower one, times 3 passes
    phases["both ways at once (pinned, bf16, two streams)"] = (2.5, 4, 10**9)
    rows = host_bound.table(phases, 1e9, 3, 1)
    assert rows[-2][-1] == pytest.approx(7.5)
