"""The offloaded optimizer's host helpers: the fast norm against a float64 sum, the thread share
(physical cores, this local rank's part, kept on them where that changes who shares a core), and
which buckets go to the host."""

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from parallax.optim.zero.offload import host_kernels
from parallax.optim.zero.offload.host_kernels import (
    ROW,
    host_cpus,
    host_threads,
    keep_on,
    physical_cores,
    squares,
)


@pytest.fixture
def topology(tmp_path, monkeypatch):
    """A fake ``/sys/devices/system/cpu``: ``make(cores, siblings)`` writes ``cores`` physical
    cores of ``siblings`` logical CPUs each, numbered as Linux does (siblings ``cores`` apart);
    without a call, nothing to read."""
    monkeypatch.setattr(host_kernels, "TOPOLOGY", tmp_path)

    def make(cores: int, siblings: int) -> None:
        for cpu in range(cores * siblings):
            where = tmp_path / f"cpu{cpu}" / "topology"
            where.mkdir(parents=True)
            (where / "physical_package_id").write_text("0\n")
            (where / "core_id").write_text(f"{cpu % cores}\n")

    return make


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
def test_host_threads_share_the_cores_among_local_ranks(monkeypatch, topology, local, want_at_most):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(2)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    assert 1 <= host_threads() <= want_at_most


def test_host_threads_leave_a_core_for_the_gpu_thread(monkeypatch, topology):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert host_threads() == 15
    assert host_cpus() == (list(range(15)), False)  # (one rank, no siblings: left as it ran)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert host_threads() == 7


def test_siblings_count_once_and_each_local_rank_keeps_to_its_own_cores(monkeypatch, topology):
    topology(8, 2)  # 8 cores, 16 logical CPUs: CPU k and k + 8 share a core
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert physical_cores(list(range(16))) == list(range(8))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert host_cpus() == (list(range(7)), True)  # siblings: kept on one CPU a core
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    mine = {}
    for rank in ("0", "1"):
        monkeypatch.setenv("LOCAL_RANK", rank)
        mine[rank], keep = host_cpus()
        assert keep and len(mine[rank]) == 3  # 4 cores each, one left to the GPU's thread
    assert not set(mine["0"]) & set(mine["1"])


def test_the_worker_alone_is_kept_on_its_cpus():
    before = os.sched_getaffinity(0)
    with ThreadPoolExecutor(1, initializer=keep_on, initargs=([min(before)],)) as worker:
        inside = worker.submit(os.sched_getaffinity, 0).result()
    assert inside == {min(before)} and os.sched_getaffinity(0) == before
