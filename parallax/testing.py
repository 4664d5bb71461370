"""Run a function on N CPU ranks over gloo: the harness behind every multi-rank test.

``run_ranks(fn, world_size, *args)`` calls ``fn(*args)`` on every rank of a pool of worker
processes (one torch thread each) that share a gloo default process group, and returns the
per-rank results in rank order. A rank that raises, or a call that outlives ``timeout``, fails
the call with every rank's traceback and tears the pool down, so a hang fails one test instead
of the suite. Pools are kept per world size and reused across calls: forking from a server that
has already imported torch and initialising gloo once is what keeps the suite fast.

``fn`` must be importable by name (a module-level function). Inside it, :func:`context` returns
a cached :class:`~parallax.ParallelContext` for a layout, so tests do not re-create groups.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from parallax.context import ParallelContext, init_parallel

DEFAULT_TIMEOUT_S = 120.0
_CONTEXTS: dict[tuple[int, int, int | None], ParallelContext] = {}  # per worker process
_POOLS: dict[int, _Pool] = {}  # per test process


class RankError(RuntimeError):
    """One or more ranks failed or did not finish in time."""


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """One intra-op thread in this process for the block, as the pool's ranks run: a
    single-process reference beside them on a shared two-core machine would otherwise contend
    with them (and ran many times slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def assert_adam_close(got: torch.Tensor, want: torch.Tensor, lr: float, msg: str = "") -> None:
    """Weights after a few AdamW steps in two runs whose sums differ only in order.

    Adam divides each element's update by that element's own gradient scale, so an element whose
    gradient is at rounding level (its terms cancel) moves by a fraction of ``lr`` with the order
    of the sums: one element in 10^4 at 1.1e-5 (lr 3e-3) and one of 256 LoRA adapter elements at
    2.5e-5 (lr 2e-3), tp=2 against one process on an AVX-512 CPU. So all but one element in a
    thousand (at least one) agree to 1e-5 absolute and relative, and every one to 5 % of lr; a
    wrong split, reduction or step moves most elements by about ``lr``."""
    assert got.shape == want.shape, f"{msg}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    got, want = got.detach().float(), want.detach().float()
    diff = (got - want).abs()
    loose = diff > 1e-5 + 1e-5 * want.abs()
    allowed = max(1, want.numel() // 1000)
    worst = diff.max().item() if diff.numel() else 0.0
    assert int(loose.sum()) <= allowed, (
        f"{msg}: {int(loose.sum())} of {want.numel()} elements past 1e-5 (largest {worst:.3g})"
    )
    assert worst <= 0.05 * lr, f"{msg}: an element {worst:.3g} off, past 5 % of lr {lr:g}"


def context(tp: int = 1, pp: int = 1, dp: int | None = None) -> ParallelContext:
    """The (cached) context for this layout; call it in the same order on every rank."""
    key = (tp, pp, dp)
    if key not in _CONTEXTS:
        _CONTEXTS[key] = init_parallel(tp=tp, pp=pp, dp=dp, timeout=_PG_TIMEOUT)
    return _CONTEXTS[key]


_PG_TIMEOUT = timedelta(seconds=DEFAULT_TIMEOUT_S)


def _worker(rank: int, world: int, init_file: str, tasks, results, pg_timeout_s: float) -> None:
    global _PG_TIMEOUT
    _PG_TIMEOUT = timedelta(seconds=pg_timeout_s)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world)
    )
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=_PG_TIMEOUT
    )
    while True:
        item = tasks.get()
        if item is None:
            break
        task_id, payload = item
        try:
            fn, args, kwargs = pickle.loads(payload)
            reply = (True, pickle.dumps(fn(*args, **kwargs), protocol=pickle.HIGHEST_PROTOCOL))
        except BaseException:  # noqa: BLE001 - report everything, including SystemExit
            reply = (False, traceback.format_exc())
        results.put((task_id, rank, *reply))
    dist.destroy_process_group()


class _Pool:
    def __init__(self, world_size: int, pg_timeout_s: float) -> None:
        ctx = mp.get_context("forkserver")
        # torch._dynamo too: every torch optimizer imports it (about 2 s a rank otherwise)
        ctx.set_forkserver_preload(["torch", "torch._dynamo", "parallax"])
        self.world_size = world_size
        self.tmpdir = tempfile.TemporaryDirectory(prefix="parallax-ranks-")
        init_file = os.path.join(self.tmpdir.name, "store")
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.results = ctx.Queue()
        self.procs = [
            ctx.Process(
                target=_worker,
                daemon=True,
                args=(r, world_size, init_file, self.tasks[r], self.results, pg_timeout_s),
            )
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()
        self.next_id = 0

    def run(self, fn: Callable, args: tuple, kwargs: dict, timeout: float) -> list[Any]:
        self.next_id += 1
        task_id = self.next_id
        # Plain pickle bytes, not multiprocessing's pickler: torch registers a reducer there that
        # passes tensors as shared-memory file descriptors over a side channel, one more thing
        # that can block or run out of descriptors; bytes only need the queue's pipe.
        payload = pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        for q in self.tasks:
            q.put((task_id, payload))
        out: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(out) + len(errors) < self.world_size:
            remaining = deadline - time.monotonic()
            dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
            if remaining <= 0 or (dead and not errors):
                break
            try:
                tid, rank, ok, value = self.results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                continue
            if tid != task_id:
                continue
            if ok:
                out[rank] = pickle.loads(value)
            else:
                errors[rank] = value
                deadline = min(deadline, time.monotonic() + 5.0)  # let peers report, then stop
        if errors or len(out) < self.world_size:
            missing = [r for r in range(self.world_size) if r not in out and r not in errors]
            self.close()
            lines = [f"{fn.__qualname__} failed on {self.world_size} ranks:"]
            for r in sorted(errors):
                lines.append(f"--- rank {r} raised:\n{errors[r]}")
            if missing:
                lines.append(
                    f"--- ranks {missing} did not finish within {timeout:.0f} s "
                    "(hung or died); the pool was torn down"
                )
            raise RankError("\n".join(lines))
        return [out[r] for r in range(self.world_size)]

    def close(self) -> None:
        for q in self.tasks:
            with contextlib.suppress(OSError, ValueError):
                q.put(None)
        deadline = time.monotonic() + 2.0
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=2.0)
        self.tmpdir.cleanup()
        if _POOLS.get(self.world_size) is self:
            del _POOLS[self.world_size]


def run_ranks(
    fn: Callable, world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT_S, **kwargs: Any
) -> list[Any]:
    """Call ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return results in rank order."""
    pool = _POOLS.get(world_size)
    if pool is None:
        pool = _POOLS[world_size] = _Pool(world_size, pg_timeout_s=timeout)
    return pool.run(fn, args, kwargs, timeout)


def shutdown() -> None:
    """Stop every pool (registered at exit)."""
    for pool in list(_POOLS.values()):
        pool.close()


atexit.register(shutdown)
