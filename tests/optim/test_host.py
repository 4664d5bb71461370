"""The offloaded optimizer's host helpers: the fast norm against a float64 sum, the thread share,
and which buckets go to the host."""

import pytest
import torch

from parallax.optim.zero.offload.host_kernels import ROW, host_threads, squares


@pytest.mark.parametrize("n", [0, 1, ROW - 1, ROW, 3 * ROW + 17, 200_003])
def test_squares_equal_a_float64_sum(n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 1e-3
    want = x.double().square().sum().item()
    assert squares(x) == pytest.approx(want, rel=1e-6, abs=1e-300)


def test_squares_of_a_view_read_only_the_view():
    x = torch.arange(4 * ROW, dtype=torch.float32)
    part = x[ROW + 5 : 3 * ROW + 1]
    assert squares(part) == pytest.approx(part.double().square().sum().item(), rel=1e-6)


@pytest.mark.parametrize(("local", "want_at_most"), [("1", 2), ("2", 1), ("64", 1)])
def test_host_threads_share_the_cores_among_local_ranks(monkeypatch, local, want_at_most):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(2)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    assert 1 <= host_threads() <= want_at_most


def test_host_threads_leave_a_core_for_the_gpu_thread(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert host_threads() == 15
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert host_threads() == 7
