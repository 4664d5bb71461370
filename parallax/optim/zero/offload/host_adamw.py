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

from parallax.optim.zero.buffers.master_halves import join_planes, planes, split_into

Kernel = Callable[..., None]
EXAMPLE = 1 << 20  # elements of the examples compiled on: each thread's share is well past
# inductor's least chunk for a parallel loop (512-4096 elements) on hundreds of cores
OFFSETS = (3, 5, 7, 11, 13)  # the examples' nonzero storage offsets: distinct, past 0/1


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


def _split_out(g, w, lo, hi, m, v, out, h) -> None:
    """Update the master held as bf16 weight ``w`` and the byte planes ``lo``, ``hi`` of its
    low half (:mod:`~parallax.optim.zero.buffers.master_halves`); the new weights into ``out``,
    the new low halves over ``lo`` and ``hi``."""
    p = join_planes(w, lo, hi)  # (n,) fp32
    _update(g, p, m, v, h)
    out.copy_(p)
    split_into(p, lo, hi)


def _split_in_place(g, w, lo, hi, m, v, h) -> None:
    """As :func:`_split_out`, the new weights over the gradient ``g``."""
    p = join_planes(w, lo, hi)  # (n,) fp32
    _update(g, p, m, v, h)
    g.copy_(p)
    split_into(p, lo, hi)


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
    turn it off: :attr:`ok` then False and the caller keeps torch's fused kernel, or with split
    masters the eager kernels)."""

    def __init__(self, compiled: bool) -> None:
        self.compiled, self.ok = compiled, True
        self.out: Kernel = _step_out
        self.in_place: Kernel = _step_in_place
        self.split_out: Kernel = _split_out
        self.split_in_place: Kernel = _split_in_place

    @torch.no_grad()
    def prepare(
        self,
        in_place: Sequence[torch.dtype],
        out: Sequence[torch.dtype],
        threads: int,
        split: Sequence[str] = (),
    ) -> bool:
        """Compile the kernels now, on the calling (main) thread, for gradients of the dtypes
        ``in_place`` stepped in place and fp32 ones written out to ``out`` dtypes, and for split
        masters' steps (``split``: ``"in_place"``, bf16 sums, and ``"out"``, fp32 ones), for a
        thread that runs ``threads`` (the worker: the compiler guards on the count); whether
        they work. Compiled here, before the model's compile, not in the worker beside it:
        nothing compiles while the steps run."""
        if not self.compiled:
            return True
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        h = _scalars(1e-3, 0.0, 0.9, 0.9, 1e-8, 1, 1.0)
        try:
            made = {name: _compiled(fn) for name, fn in KERNELS.items()}
            with _room_to_compile():
                self._compile_examples(made, in_place, out, split, h)
        except Exception:  # noqa: BLE001 (no compiler, an unsupported torch: torch's kernel)
            self.ok = False
            return False
        finally:
            torch.set_num_threads(before)
        for name, fn in made.items():
            setattr(self, name, fn)
        return True

    @staticmethod
    def _compile_examples(made: dict, in_place, out, split, h: torch.Tensor) -> None:
        """Call each compiled kernel of ``made`` on the examples :meth:`prepare` names."""
        for dtype in in_place:
            for args in examples(dtype, None):
                made["in_place"](*args[:4], h)
        for dtype in out:
            for args in examples(torch.float32, dtype):
                made["out"](*args, h)
        for kind in split:
            sums = torch.bfloat16 if kind == "in_place" else torch.float32
            for args in split_examples(sums, kind == "out"):
                made[f"split_{kind}"](*args, h)

    @torch.no_grad()
    def step(self, inner: torch.optim.Optimizer, pieces: Sequence[tuple], scale: float) -> None:
        """Step each ``(master, grad, out, group[, halves])`` of ``pieces``: the master (fp32)
        on its gradient times ``scale``, in group ``group`` of ``inner``; the new weights into
        ``out``, or over ``grad`` where ``out`` is None. With ``halves`` = ``(weight, low)``
        the master is held split (:mod:`~parallax.optim.zero.buffers.master_halves`; ``low``
        (2, n) uint8): read from them and its new low half written over ``low``; ``master``
        only keys the state."""
        for master, grad, out, j, *halves in pieces:
            state = _state(inner, master)
            group = inner.param_groups[j]
            beta1, beta2 = group["betas"]
            h = _scalars(
                group["lr"], group["weight_decay"], beta1, beta2, group["eps"],
                state["step"].item(), scale,
            )  # fmt: skip
            # plain tensors over the same memory, as compiled for (not a Parameter, whose sizes
            # the compiler takes as fixed, nor a view, whose base it guards on too)
            g, m, v = grad.detach(), state["exp_avg"], state["exp_avg_sq"]
            o = None if out is None else out.detach()
            small = master.numel() < 2  # (eager: a compiled loop is built for sizes of 2 up)
            if halves:
                w, low = halves[0]  # (n,) bf16, (2, n) uint8: the low halves' byte planes
                lo, hi = planes(low)  # (n,) int8 each
                w, lo, hi = w.detach(), lo.detach(), hi.detach()
                if o is None:
                    (_split_in_place if small else self.split_in_place)(g, w, lo, hi, m, v, h)
                else:
                    (_split_out if small else self.split_out)(g, w, lo, hi, m, v, o, h)
            elif o is None:
                (_step_in_place if small else self.in_place)(g, master.detach(), m, v, h)
            else:
                (_step_out if small else self.out)(g, master.detach(), m, v, o, h)


KERNELS = {
    "in_place": _step_in_place,
    "out": _step_out,
    "split_in_place": _split_in_place,
    "split_out": _split_out,
}


def _room_to_compile():
    """A context in which the compiler keeps a kernel's every specialization, were there more
    than dynamo's default of 8 a function (after which it runs the rest eagerly, silently): a
    whole master's step that writes elsewhere has 8 examples, a split one's 8, more views
    would double them."""
    import torch._dynamo.config as config  # (loaded when compiling)

    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    return config.patch(**{name: max(getattr(config, name), 64)})


def _compiled(fn: Kernel) -> Kernel:
    return torch.compile(fn, dynamic=True, fullgraph=True, options=compile_options())


def _state(inner: torch.optim.Optimizer, master: torch.Tensor) -> dict:
    """``master``'s AdamW state in ``inner``, started as torch's AdamW starts it (fp32 moments
    of its shape), its step counted."""
    state = inner.state[master]
    if not state:
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = torch.zeros(master.shape)
        state["exp_avg_sq"] = torch.zeros(master.shape)
    state["step"] += 1
    return state


def _scalars(lr, wd, beta1, beta2, eps, step: float, scale: float) -> torch.Tensor:
    """The kernel's hyperparameters for one piece at ``step`` (bias corrections in float64)."""
    lr, beta1, beta2 = float(lr), float(beta1), float(beta2)
    step_size = lr / (1 - beta1**step)
    inverse_root = 1 / math.sqrt(1 - beta2**step)
    values = [1 - lr * float(wd), 1 - beta1, beta2, 1 - beta2, float(eps), step_size,
              inverse_root, scale]  # fmt: skip
    return torch.tensor(values, dtype=torch.float32)  # (8,)


def _views(dtypes: Sequence[torch.dtype]):
    """Tensors of :data:`EXAMPLE` elements of ``dtypes``, viewed at each combination of offset 0
    and a distinct other offset (plain tensors: no base), as the offload's pieces are."""
    n = EXAMPLE
    for offsets in itertools.product(*[(0, k) for k in OFFSETS[: len(dtypes)]]):
        yield [torch.zeros(k + n, dtype=dt)[k:].detach() for k, dt in zip(offsets, dtypes)]


def examples(dtype: torch.dtype, out: torch.dtype | None):
    """The calls to compile on: a gradient of ``dtype``, fp32 master and fresh moments (and an
    ``out`` buffer), the gradient, master and ``out`` at each combination of offsets."""
    for g, p, *o in _views((dtype, torch.float32, out)[: 2 if out is None else 3]):
        yield g, p, torch.zeros(EXAMPLE), torch.zeros(EXAMPLE), (o[0] if o else None)


def split_examples(dtype: torch.dtype, out: bool):
    """The calls of a split master's step to compile on: a gradient of ``dtype``, the bf16
    weight, fresh moments (and a bf16 ``out``) at each combination of offsets, and the low
    halves' byte planes at distinct offsets past 1 (FlatBuffers pads them: never at 0 or 1)."""
    views = (dtype, torch.bfloat16) + ((torch.bfloat16,) if out else ())
    n, (k, j) = EXAMPLE, OFFSETS[-2:]
    for g, w, *o in _views(views):
        lo = torch.zeros(k + n, dtype=torch.int8)[k:].detach()  # (n,) the low bytes
        hi = torch.zeros(j + n, dtype=torch.int8)[j:].detach()  # (n,) the high ones, signed
        yield (g, w, lo, hi, torch.zeros(n), torch.zeros(n), *o)
