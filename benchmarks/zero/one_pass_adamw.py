"""Replays the offload worker's calls to the one-pass host AdamW (``--host-adamw one-pass``,
:mod:`parallax.optim.zero.offload.host_adamw`): in a thread of its own with its share of the
cores, on leaf fp32 masters viewed out of one flat buffer and bf16 sums out of another, pieces of
a 7B block's sizes; it times each round and counts dynamo's compiles after ``prepare``
(``PROBE_PINNED=1``: the sums in page-locked memory, as on a GPU run).

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

import torch

from parallax.optim.zero.offload.host_adamw import HostAdamW


def main() -> None:
    """Replay the offload worker's calls: in a thread of its own (its share of the cores), on
    leaf fp32 masters viewed out of one flat buffer and bf16 gradients out of another, pieces of
    a 7B block's sizes; time each round and count dynamo's compiles after ``prepare``."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from torch._dynamo.utils import counters

    from parallax.optim.zero.offload.host_kernels import host_threads
    from parallax.optim.zero.offload.pinned import pinned

    sizes = [4096, 4096 * 4096, 4096 * 4096, 4096 * 1024, 4096 * 1024, 4096 * 4096]
    sizes += [4096, 14336 * 4096, 14336 * 4096, 4096 * 14336] * 1
    blocks, total = int(os.environ.get("PROBE_BLOCKS", "16")), sum(sizes)
    flat = torch.zeros(blocks * total)  # (n,) fp32 masters
    owner: list = []  # PROBE_PINNED=1: the sums in page-locked memory, as on a GPU run
    if os.environ.get("PROBE_PINNED"):
        grads = pinned(blocks * total, torch.bfloat16, owner).fill_(1e-3)  # (n,) sums
    else:
        grads = torch.full((blocks * total,), 1e-3, dtype=torch.bfloat16)  # (n,) sums
    views, off = [], 0
    for _ in range(blocks):
        for n in sizes:
            views.append((flat[off : off + n], grads[off : off + n]))
            off += n
    masters = [torch.nn.Parameter(m) for m, _ in views]  # (leaves, as the offload's pieces)
    inner = torch.optim.AdamW(masters, lr=1e-5, weight_decay=0.1)
    threads = host_threads()
    for compiled in (True, False):
        kernel = HostAdamW(compiled)
        start = time.perf_counter()
        kernel.prepare([torch.bfloat16], [], threads)
        built = time.perf_counter() - start
        prepared = counters["stats"]["unique_graphs"]
        pieces = [(p, g, None, 0) for p, (_, g) in zip(masters, views)]
        worker = ThreadPoolExecutor(1, initializer=lambda: torch.set_num_threads(threads))
        for r in range(3):
            start = time.perf_counter()
            worker.submit(torch.no_grad()(kernel.step), inner, pieces, 1.0).result()
            took = time.perf_counter() - start
            later = counters["stats"]["unique_graphs"] - prepared
            print(f"compiled={compiled} round {r}: {took:.2f} s for {off / 1e9:.2f}e9 elements "
                  f"({took / off * 1e9:.3f} s per 1e9; prepared in {built:.1f} s; "
                  f"graphs compiled since: {later})", flush=True)  # fmt: skip
        worker.shutdown()


if __name__ == "__main__":
    main()
