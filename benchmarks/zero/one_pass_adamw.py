"""Replays the offload worker's clipped step both ways (``--host-adamw torch`` and
``one-pass``, :mod:`parallax.optim.zero.offload.host_adamw`) in a thread of its own with its share
of the cores, on leaf fp32 masters viewed out of one flat buffer and bf16 sums out of another,
pieces of a 7B block's sizes, a block a bucket, while the main thread runs Python as it does
launching the next forward. Each round prints the worker's seconds, the main thread's progress
against its pace alone, and the compiles since ``prepare`` (``PROBE_PINNED=1``: the sums in
page-locked memory, as on a GPU run).

What it found (2026-12-05): the kernel, compiled on a 23-element example, ran its loop on one
thread for every size (inductor decides from the example's sizes), and each real piece (a
Parameter, a view, sizes the compiler then took as fixed) compiled anew in the worker during the
timed steps: 19 s a step of host time in the training run against 4 with torch's kernel; and
inductor's Python entry point held the GIL while the loop ran, so the main thread stalled beside
it. The library now compiles on large plain examples with the loop parallel at any size and a
C++ entry point (the GIL let go), and steps plain tensors over the same memory: no compile after
``prepare``.

    python -m benchmarks.zero.one_pass_adamw
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from parallax.optim.zero.offload.host_adamw import HostAdamW
from parallax.optim.zero.offload.host_kernels import host_threads
from parallax.optim.zero.offload.pinned import pinned

SIZES = [4096, 4096 * 4096, 4096 * 4096, 4096 * 1024, 4096 * 1024, 4096 * 4096, 4096,
         14336 * 4096, 14336 * 4096, 4096 * 14336]  # fmt: skip


class Buckets:
    """``blocks`` buckets of :data:`SIZES` pieces: fp32 masters (leaf views of one buffer),
    their AdamW, bf16 sums, an fp32 scratch and bf16 staging of a bucket each."""

    def __init__(self, blocks: int, page_locked: bool) -> None:
        self.total = sum(SIZES)
        n = blocks * self.total
        self.flat = torch.zeros(n)  # (n,) fp32 masters
        self.owner: list = []
        if page_locked:
            self.sums = pinned(n, torch.bfloat16, self.owner).fill_(1e-3)  # (n,)
        else:
            self.sums = torch.full((n,), 1e-3, dtype=torch.bfloat16)  # (n,)
        self.scratch = torch.empty(self.total)  # (bucket,) fp32
        self.staging = torch.empty(self.total, dtype=torch.bfloat16)  # (bucket,)
        self.pieces: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        off = 0
        for _ in range(blocks):
            self.pieces.append([])
            for k in SIZES:
                master = torch.nn.Parameter(self.flat[off : off + k])
                self.pieces[-1].append((master, self.sums[off : off + k]))
                off += k
        params = [p for bucket in self.pieces for p, _ in bucket]
        self.inner = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.1, fused=True)

    @torch.no_grad()
    def torch_step(self, b: int, scale: float) -> None:
        """``--host-adamw torch``: the sums up to fp32, torch's fused AdamW, the new weights
        down to bf16 for the upload."""
        start = b * self.total
        self.scratch.copy_(self.sums[start : start + self.total])
        off = 0
        for p, g in self.pieces[b]:
            p.grad = self.scratch[off : off + g.numel()]
            off += g.numel()
        self.inner.grad_scale = torch.full((), 1.0 / scale)
        self.inner.step()
        del self.inner.grad_scale
        self.staging.copy_(self.flat[start : start + self.total])

    def one_pass_step(self, kernel: HostAdamW, b: int, scale: float) -> None:
        """``--host-adamw one-pass``: one loop, the new weights over the sums."""
        kernel.step(self.inner, [(p, g, None, 0) for p, g in self.pieces[b]], scale)


def _alone(worker, step, buckets: int) -> float:
    """Worker seconds of one clipped step of every bucket, the main thread waiting."""
    start = time.perf_counter()
    for j in [worker.submit(step, b) for b in range(buckets)]:
        j.result()
    return time.perf_counter() - start


def _round(worker, step, buckets: int) -> tuple[float, float]:
    """(worker seconds, main thread's pace) of one clipped step of every bucket, the main
    thread meanwhile counting in Python (its pace alone: 1)."""
    count, stop = [0], threading.Event()

    def busy() -> None:
        while not stop.is_set():
            count[0] += 1

    start = time.perf_counter()
    jobs = [worker.submit(step, b) for b in range(buckets)]
    main = threading.Thread(target=busy)
    main.start()
    for j in jobs:
        j.result()
    took = time.perf_counter() - start
    stop.set()
    main.join()
    during, count[0], stop = count[0], 0, threading.Event()
    main = threading.Thread(target=busy)
    main.start()
    time.sleep(took)
    stop.set()
    main.join()
    return took, during / max(count[0], 1)


def main() -> None:
    from torch._dynamo.utils import counters

    blocks = int(os.environ.get("PROBE_BLOCKS", "16"))
    data = Buckets(blocks, bool(os.environ.get("PROBE_PINNED")))
    threads = host_threads()
    kernel = HostAdamW(compiled=True)
    start = time.perf_counter()
    if not kernel.prepare([torch.bfloat16], [], threads):
        print("one-pass: torch cannot compile it here")
    built, prepared = time.perf_counter() - start, counters["stats"]["unique_graphs"]
    worker = ThreadPoolExecutor(1, initializer=lambda: torch.set_num_threads(threads))
    ways = {"torch": lambda b: data.torch_step(b, 0.5),
            "one-pass": lambda b: data.one_pass_step(kernel, b, 0.5)}  # fmt: skip
    n = blocks * data.total
    print(f"{n / 1e9:.2f}e9 elements in {blocks} buckets, {threads} threads; one-pass compiled "
          f"in {built:.1f} s", flush=True)  # fmt: skip
    for r in range(3):
        for name, step in ways.items():
            alone = _alone(worker, step, blocks)
            took, pace = _round(worker, step, blocks)
            later = counters["stats"]["unique_graphs"] - prepared
            print(f"round {r} {name}: alone {alone / n * 1e9:.3f} s per 1e9; beside a busy main "
                  f"thread {took / n * 1e9:.3f} s per 1e9, the main thread at {pace:.2f} of its "
                  f"pace; graphs compiled since prepare: {later}", flush=True)  # fmt: skip
    worker.shutdown()


if __name__ == "__main__":
    main()
