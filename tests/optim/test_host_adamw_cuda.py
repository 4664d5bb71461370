"""The one-pass host AdamW as GPU runs build it (compiled for the CPU with ``torch.compile``):
after ``prepare`` the worker's steps compile nothing more, over pieces like the offload's
(Parameters viewed out of a flat master buffer, sums viewed out of a flat accumulator, at offset
0 and elsewhere, many sizes), and they match the eager kernel. (It compiled anew for every piece
in the worker once, 19 s a step.) Skipped without a GPU, the only place the library compiles it;
run with ``python3 -m pytest -q tests/optim/test_host_adamw_cuda.py``.
"""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch.testing import assert_close

from parallax.optim.zero.offload.host_adamw import HostAdamW

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

SIZES = [4096, 1 << 20, 4096, 3 << 20, 1000, 7, 1, 123_457]


def _spans():
    """``(master offset, offset, size)`` of each piece: many sizes, the first at offset 0 (as a
    bucket's first), the rest elsewhere."""
    off = 0
    for n in SIZES * 2:
        yield off, 0 if off == 0 else off + 3, n
        off += n


def _pieces(out: bool):
    flat = torch.randn(2 * sum(SIZES) + 5)  # (n,) fp32 masters
    sums = (torch.randn(2 * sum(SIZES) + 9) * 1e-3).to(torch.float32 if out else torch.bfloat16)
    staging = torch.zeros_like(sums, dtype=torch.bfloat16)
    pieces = []
    for off, g0, n in _spans():
        master = torch.nn.Parameter(flat[off : off + n])
        dest = staging[g0 : g0 + n] if out else None
        pieces.append((master, sums[g0 : g0 + n], dest, 0))
    return pieces


@pytest.mark.parametrize("out", [False, True])
def test_no_compile_after_prepare_and_the_eager_kernels_results(out):
    from torch._dynamo.utils import counters

    threads = max(1, torch.get_num_threads() - 1)
    kernel = HostAdamW(compiled=True)
    assert kernel.prepare([] if out else [torch.bfloat16], [torch.bfloat16] if out else [], threads)
    prepared = counters["stats"]["unique_graphs"]
    mine, ref = _pieces(out), _pieces(out)
    with torch.no_grad():
        for (p, g, *_), (q, h, *_) in zip(mine, ref):
            q.copy_(p)
            h.copy_(g)
    opt = torch.optim.AdamW([p for p, *_ in mine], lr=1e-3, weight_decay=0.1)
    opt_ref = torch.optim.AdamW([p for p, *_ in ref], lr=1e-3, weight_decay=0.1)
    worker = ThreadPoolExecutor(1, initializer=lambda: torch.set_num_threads(threads))
    eager = HostAdamW(compiled=False)
    for _ in range(2):
        worker.submit(torch.no_grad()(kernel.step), opt, mine, 0.7).result()
        eager.step(opt_ref, ref, 0.7)
    worker.shutdown()
    assert counters["stats"]["unique_graphs"] == prepared  # nothing compiled in the worker
    for (p, g, d, _), (q, h, e, _) in zip(mine, ref):
        assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-7)
        assert_close(d if out else g, e if out else h, rtol=1e-2, atol=1e-4)  # (bf16 weights)


def test_the_compiled_kernel_lets_other_threads_run():
    """While the kernel runs, a Python thread beside it (the main thread launching the next
    forward) keeps going: compiled with a Python entry point it held the GIL throughout."""
    import threading
    import time

    kernel = HostAdamW(compiled=True)
    assert kernel.prepare([torch.bfloat16], [], max(1, torch.get_num_threads() - 1))
    n = 1 << 25
    g = torch.zeros(n + 3, dtype=torch.bfloat16)[3:].detach()
    p, m, v = torch.zeros(n + 5)[5:].detach(), torch.zeros(n), torch.zeros(n)
    h = torch.ones(8)
    counts, stop = [0], threading.Event()

    def spin():
        while not stop.is_set():
            counts[0] += 1

    with torch.no_grad():
        kernel.in_place(g, p, m, v, h)  # (first touch of the pages)
        side = threading.Thread(target=spin)
        side.start()
        time.sleep(0.05)
        start, before = time.perf_counter(), counts[0]
        for _ in range(5):
            kernel.in_place(g, p, m, v, h)
        took, during = time.perf_counter() - start, counts[0] - before
        time.sleep(took)
        alone = counts[0] - before - during
        stop.set()
        side.join()
    assert during > 0.3 * alone, (during, alone)  # (held, the thread got about a tenth)


def _split_pieces(out: bool):
    """Pieces of split masters (--host-masters split) as the offload hands them over: the
    weights (brought down) and low halves viewed out of flat buffers, at offset 0 and elsewhere."""
    from parallax.optim.zero.buffers.master_halves import low_half

    total = 2 * sum(SIZES) + 9
    masters = torch.randn(total)  # (n,) fp32
    weights = masters.bfloat16()
    lows = torch.cat([torch.zeros(2, 8, dtype=torch.uint8), low_half(masters)], 1)  # (2, 8 + n)
    sums = (torch.randn(total) * 1e-3).to(torch.float32 if out else torch.bfloat16)
    staging = torch.zeros(total, dtype=torch.bfloat16)
    key = torch.full((total,), float("nan"))
    pieces = []
    for _, lo, n in _spans():
        halves = (weights[lo : lo + n], lows[:, lo + 8 : lo + 8 + n])  # (planes: past 1)
        dest = staging[lo : lo + n] if out else None
        pieces.append((torch.nn.Parameter(key[lo : lo + n]), sums[lo : lo + n], dest, 0, halves))
    return pieces


@pytest.mark.parametrize("out", [False, True])
def test_split_masters_compile_once_and_step_as_eager(out):
    from torch._dynamo.utils import counters

    threads = max(1, torch.get_num_threads() - 1)
    kernel = HostAdamW(compiled=True)
    assert kernel.prepare([], [], threads, ["out" if out else "in_place"])
    prepared = counters["stats"]["unique_graphs"]
    mine, ref = _split_pieces(out), _split_pieces(out)
    with torch.no_grad():
        for a, b in zip(mine, ref):
            for x, y in zip([a[1], *a[4]], [b[1], *b[4]]):
                y.copy_(x)
    opt = torch.optim.AdamW([p[0] for p in mine], lr=1e-3, weight_decay=0.1)
    opt_ref = torch.optim.AdamW([p[0] for p in ref], lr=1e-3, weight_decay=0.1)
    worker = ThreadPoolExecutor(1, initializer=lambda: torch.set_num_threads(threads))
    eager = HostAdamW(compiled=False)
    worker.submit(torch.no_grad()(kernel.step), opt, mine, 0.7).result()
    eager.step(opt_ref, ref, 0.7)
    worker.shutdown()
    assert counters["stats"]["unique_graphs"] == prepared  # nothing compiled in the worker
    from parallax.optim.zero.buffers.master_halves import join

    for a, b in zip(mine, ref):  # (fused apart: fp32 rounding, as the whole masters' kernels)
        new, theirs = (a[2] if out else a[1]), (b[2] if out else b[1])
        assert_close(join(new, a[4][1]), join(theirs, b[4][1]), rtol=1e-5, atol=1e-7)
        assert_close(new.float(), theirs.float(), rtol=2**-7, atol=0)  # (a bf16 ulp)
