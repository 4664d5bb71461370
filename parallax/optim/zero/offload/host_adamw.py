"""``--host-adamw one-pass``: AdamW on the host in one pass over memory, an offloaded bucket's
gradient read in the model's dtype, its fp32 masters and moments updated and the new weights
written in the model's dtype for the upload, all in one loop over the elements.

torch's fused CPU AdamW (``--host-adamw torch``) takes fp32 gradients and writes only the fp32
masters, so the clipped step around it makes three passes: the accumulator up to fp32 into
scratch (6 bytes an element), the fused kernel (28), the masters down to the model's dtype for
the upload (6): 40 bytes an element, and the host's step is bound by memory
(``benchmarks/zero/host_bound.py``). This kernel moves 28: it reads the 2-byte gradient, reads
and writes the 12 bytes of master and moments and writes the 2-byte weight, over the gradient
(the accumulator, which goes up from there). On GPUs it is compiled for the CPU with
``torch.compile`` (inductor's C++ backend, one OpenMP loop); where torch cannot compile it the
step keeps torch's kernel. On the CPU (the tests' runs) it runs as plain torch ops, the same code.

**Compiled for the sizes it meets.** Inductor decides whether a loop runs on several threads
from the sizes of the example it compiles, also when the sizes are dynamic: compiled on a
23-element example, the loop ran on one thread for every size after it (19 s a step for
OpenVLA-7B's host step against 4 with torch's kernel, ``benchmarks/RESULTS.md``). Here the
loop is told to be parallel (inductor's ``cpp.dynamic_threads``: it then takes the calling
thread's count at run time) and is compiled on examples of a million elements, and for each
storage offset the compiler specializes (a view at offset 0 guards apart from one elsewhere,
and equal example values guard as equal), so no step compiles anew
(:meth:`HostAdamW.prepare`). And it is built with a C++ entry point (``cpp_wrapper``), which
lets go of the GIL while the loop runs: inductor's Python entry point holds it, so the main
thread could launch none of the next forward beside the step (a Python thread beside the
kernel ran at a sixth of its speed, ``tests/optim/test_host_adamw_cuda.py``).

The update is torch's AdamW (``amsgrad`` and ``maximize`` off), with the same state (``step``,
``exp_avg``, ``exp_avg_sq``) in the wrapped optimizer, so checkpoints and a later torch step see
no difference; results agree with torch's kernel to fp32 rounding, not bitwise (its scalars are
formed in float64 and it fuses differently).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import torch

Kernel = Callable[..., None]
EXAMPLE = 1 << 20  # elements of the examples compiled on: each thread's share is well past
# inductor's least chunk for a parallel loop (512-4096 elements) on hundreds of cores
OFFSETS = (3, 5, 7)  # the examples' nonzero storage offsets: distinct, past the 0/1 specialization


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


def supports(optimizer_class: type, groups: Sequence[dict]) -> bool:
    """Whether these kernels step ``optimizer_class`` with options ``groups`` (its defaults and
    param groups) as its own ``step()`` would: torch's AdamW without amsgrad, maximize or
    differentiable steps."""
    if optimizer_class is not torch.optim.AdamW:
        return False
    return not any(g.get("amsgrad") or g.get("maximize") or g.get("differentiable") for g in groups)


def check_supported(optimizer_class: type, groups: Sequence[dict]) -> None:
    """``--host-adamw one-pass``'s refusal of an optimizer it would not step as its own
    ``step()`` does (raised alike on every rank, before any collective)."""
    if not supports(optimizer_class, groups):
        raise ValueError(
            f"host_adamw='one-pass' steps torch's AdamW without amsgrad, maximize or "
            f"differentiable steps, not {optimizer_class.__name__} with {list(groups)}"
        )


def compile_options() -> dict[str, bool]:
    """Inductor's options for the kernels: a C++ entry point, which lets go of the GIL while
    the loop runs (the Python one holds it, and the main thread could launch none of the next
    forward's work beside the step), and the loop parallel whatever the example's size, on the
    calling thread's count (a torch without that option gets the large examples alone)."""
    import torch._inductor.config as config  # (loaded when compiling)

    options = {"cpp_wrapper": True}
    if hasattr(config.cpp, "dynamic_threads"):
        options["cpp.dynamic_threads"] = True
    return options


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
        ``in_place`` stepped in place and fp32 ones written out to ``out`` dtypes, for a
        thread that runs ``threads`` (the worker: the compiler guards on the count); whether
        they work. Compiled here, before the model's compile, not in the worker beside it:
        nothing compiles while the steps run."""
        if not self.compiled:
            return True
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            options = compile_options()
            compiled_out = torch.compile(_step_out, dynamic=True, fullgraph=True, options=options)
            compiled_in_place = torch.compile(
                _step_in_place, dynamic=True, fullgraph=True, options=options
            )
            for dtype in in_place:
                for g, p, m, v, _ in examples(dtype, None):
                    compiled_in_place(g, p, m, v, _scalars(1e-3, 0.0, 0.9, 0.9, 1e-8, 1, 1.0))
            for dtype in out:
                for g, p, m, v, o in examples(torch.float32, dtype):
                    compiled_out(g, p, m, v, o, _scalars(1e-3, 0.0, 0.9, 0.9, 1e-8, 1, 1.0))
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
            # plain tensors over the same memory, as compiled for (not a Parameter, whose sizes
            # the compiler takes as fixed, nor a view, whose base it guards on too)
            p, g, m, v = master.detach(), grad.detach(), state["exp_avg"], state["exp_avg_sq"]
            small = master.numel() < 2  # (eager: a compiled loop is built for sizes of 2 up)
            if out is None:
                (_step_in_place if small else self.in_place)(g, p, m, v, h)
            else:
                (_step_out if small else self.out)(g, p, m, v, out.detach(), h)


def _scalars(lr, wd, beta1, beta2, eps, step: float, scale: float) -> torch.Tensor:
    """The kernel's hyperparameters for one piece at ``step`` (bias corrections in float64)."""
    lr, beta1, beta2 = float(lr), float(beta1), float(beta2)
    step_size = lr / (1 - beta1**step)
    inverse_root = 1 / math.sqrt(1 - beta2**step)
    values = [1 - lr * float(wd), 1 - beta1, beta2, 1 - beta2, float(eps), step_size,
              inverse_root, scale]  # fmt: skip
    return torch.tensor(values, dtype=torch.float32)  # (8,)


def examples(dtype: torch.dtype, out: torch.dtype | None):
    """The calls to compile on: a gradient of ``dtype``, fp32 master and fresh moments (and an
    ``out`` buffer), of :data:`EXAMPLE` elements, the gradient, master and ``out`` viewed at
    each combination of offset 0 and a distinct other offset, as the offload's pieces are."""
    n, count = EXAMPLE, 2 if out is None else 3
    dtypes = (dtype, torch.float32, out)[:count]
    for offsets in itertools.product(*[(0, k) for k in OFFSETS[:count]]):
        g, p, *o = (torch.zeros(k + n, dtype=dt)[k:].detach() for k, dt in zip(offsets, dtypes))
        yield g, p, torch.zeros(n), torch.zeros(n), (o[0] if o else None)
