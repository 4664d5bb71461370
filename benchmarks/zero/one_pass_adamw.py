"""An alternative host step measured for ``--offload optimizer`` and not adopted: AdamW in one
pass over memory (the bucket's gradient read in the model's dtype, fp32 masters and moments
updated, the new weights written in the model's dtype), against the library's three passes around
torch's fused CPU AdamW (upcast into scratch, fused AdamW, convert for the upload: 40 bytes an
element against 28), compiled for the CPU with ``torch.compile``.

Measured on one H200 host (``benchmarks/RESULTS.md``): alone, 0.40 s per 1e9 elements against
0.52 s for the three passes (``host_bound``); inside the offloaded OpenVLA-7B step, run from the
offload's worker thread, the host step took 19 s a step instead of 4 (``memory_fit``). Not yet
known why; ``python -m benchmarks.zero.one_pass_adamw`` replays the worker's calls (views at
offsets, leaf parameters, a thread of its own; ``PROBE_PINNED=1``: the sums in page-locked memory
as on a GPU) and counts dynamo's recompiles. Replayed on the CPU through the offload itself (a
16-layer bf16 model, ZeRO-3, clipped, its blocks compiled or not) the compiled kernel stayed fast
after one recompile in the worker: what differs on a GPU run is still to find.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence

import torch

Kernel = Callable[..., None]


def _update(g: torch.Tensor, p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, h: torch.Tensor):
    """AdamW on one piece: ``h`` = (1 - lr * weight decay, 1 - beta1, beta2, 1 - beta2, eps,
    step size, 1 / sqrt of the second bias correction, gradient scale), fp32 (8,); one
    division an element (the rest multiplies: the loop stays bound by memory, not by the
    divider)."""
    g32 = g.float() * h[7]  # (n,) fp32: the dp average and the clip coefficient folded in
    p.mul_(h[0])
    m.lerp_(g32, h[1])
    v.mul_(h[2]).add_(g32 * g32 * h[3])
    p.sub_(h[5] * m / (v.sqrt() * h[6] + h[4]))


def _step_out(g, p, m, v, out, h) -> None:
    """Update, then the new weights into ``out`` (another buffer, any dtype)."""
    _update(g, p, m, v, h)
    out.copy_(p)


def _step_in_place(g, p, m, v, h) -> None:
    """Update, then the new weights over the gradient ``g`` (its buffer goes up next)."""
    _update(g, p, m, v, h)
    g.copy_(p)


def supports(inner: torch.optim.Optimizer) -> bool:
    """Whether these kernels step ``inner`` as its own ``step()`` would: torch's AdamW without
    amsgrad, maximize or differentiable steps."""
    if type(inner) is not torch.optim.AdamW:
        return False
    return not any(
        g.get("amsgrad") or g.get("maximize") or g.get("differentiable") for g in inner.param_groups
    )


class HostAdamW:
    """The one-pass step's kernels, eager or compiled for the CPU (``compiled``; compile errors
    turn it off: :attr:`ok` then False and the caller keeps torch's fused kernel)."""

    def __init__(self, compiled: bool) -> None:
        self.compiled, self.ok = compiled, True
        self.out: Kernel = _step_out
        self.in_place: Kernel = _step_in_place

    @torch.no_grad()
    def prepare(self, in_place: Sequence[torch.dtype], out: Sequence[torch.dtype], threads: int):
        """Compile the kernels now, on the calling (main) thread, for gradients of the dtypes
        ``in_place`` stepped in place and fp32 ones written out to ``out`` dtypes, the loop
        built for ``threads`` cores (the worker's share); whether they work. (Compiled here,
        before the model's compile, not in the worker beside it: nothing compiles while the
        steps run.)"""
        if not self.compiled:
            return True
        before = torch.get_num_threads()
        torch.set_num_threads(threads)  # (inductor writes the loop for the current count)
        try:
            compiled_out = torch.compile(_step_out, dynamic=True, fullgraph=True)
            compiled_in_place = torch.compile(_step_in_place, dynamic=True, fullgraph=True)
            h = _scalars(1e-3, 0.0, 0.9, 0.9, 1e-8, 1, 1.0)
            for dtype in in_place:
                compiled_in_place(*_tiny(dtype), h)
            for dtype in out:
                g, p, m, v = _tiny(torch.float32)
                compiled_out(g, p, m, v, torch.empty_like(g, dtype=dtype), h)
        except Exception:  # noqa: BLE001 (no compiler, an unsupported torch: torch's kernel)
            self.ok = False
            return False
        finally:
            torch.set_num_threads(before)
        self.out, self.in_place = compiled_out, compiled_in_place
        return True

    @torch.no_grad()
    def step(
        self,
        inner: torch.optim.Optimizer,
        pieces: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]],
        scale: float,
    ) -> None:
        """Step each ``(master, grad, out, group)`` of ``pieces``: the master (fp32) on its
        gradient times ``scale``, in group ``group`` of ``inner``; the new weights into ``out``,
        or over ``grad`` where ``out`` is None."""
        for master, grad, out, j in pieces:
            group, state = inner.param_groups[j], inner.state[master]
            if not state:  # as torch's AdamW starts a parameter
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(master, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)
            state["step"] += 1
            beta1, beta2 = group["betas"]
            h = _scalars(
                group["lr"], group["weight_decay"], beta1, beta2, group["eps"],
                state["step"].item(), scale,
            )  # fmt: skip
            m, v = state["exp_avg"], state["exp_avg_sq"]
            small = master.numel() < 2  # (eager: a compiled loop is built for sizes of 2 up)
            if out is None:
                (_step_in_place if small else self.in_place)(grad, master, m, v, h)
            else:
                (_step_out if small else self.out)(grad, master, m, v, out, h)


def _scalars(lr, wd, beta1, beta2, eps, step: float, scale: float) -> torch.Tensor:
    """The kernel's hyperparameters for one piece at ``step`` (bias corrections in float64)."""
    lr, beta1, beta2 = float(lr), float(beta1), float(beta2)
    step_size = lr / (1 - beta1**step)
    inverse_root = 1 / math.sqrt(1 - beta2**step)
    values = [1 - lr * float(wd), 1 - beta1, beta2, 1 - beta2, float(eps), step_size,
              inverse_root, scale]  # fmt: skip
    return torch.tensor(values, dtype=torch.float32)  # (8,)


def _tiny(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """A gradient of ``dtype`` and fp32 master and moments, views at an offset as real ones are."""
    g = torch.ones(40, dtype=dtype)[7:30]
    return g, torch.ones(40)[7:30], torch.zeros(40)[7:30], torch.zeros(40)[7:30]


def main() -> None:
    """Replay the offload worker's calls: in a thread of its own (its share of the cores), on
    leaf fp32 masters viewed out of one flat buffer and bf16 gradients out of another, pieces of
    a 7B block's sizes; time each round and count dynamo's recompiles."""
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
        pieces = [(p, g, None, 0) for p, (_, g) in zip(masters, views)]
        worker = ThreadPoolExecutor(1, initializer=lambda: torch.set_num_threads(threads))
        for r in range(3):
            start = time.perf_counter()
            worker.submit(torch.no_grad()(kernel.step), inner, pieces, 1.0).result()
            took = time.perf_counter() - start
            recompiles = dict(counters["stats"])
            print(f"compiled={compiled} round {r}: {took:.2f} s for {off / 1e9:.2f}e9 elements "
                  f"({took / off * 1e9:.3f} s per 1e9; prepared in {built:.1f} s; "
                  f"dynamo stats {recompiles})", flush=True)  # fmt: skip
        worker.shutdown()


if __name__ == "__main__":
    main()
