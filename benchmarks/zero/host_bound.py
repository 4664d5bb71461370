"""How fast can this host step an offloaded optimizer? The floor under ``--offload optimizer``:
each host phase of :class:`parallax.optim.zero.offload.host_steps.HostSteps` timed alone on
this machine's CPU (and its PCIe link, where a GPU is there), then scaled to a model's
trainable parameters.

    python -m benchmarks.zero.host_bound [--elements 2**28] [--params 7.54e9 --passes 8]
    python -m benchmarks.zero.host_bound --smoke      # small tensors, writes nothing

Per step, an offloaded ZeRO-2/3 rank at dp 1 (:mod:`parallax.optim.zero.offload.host_steps`):
- per backward pass: its reduced gradient goes down to the host accumulator in the model's
  dtype (``d2h``) and, after the first pass, the accumulator comes up to be added to on the
  device (``h2d``), both ways at once; ``accumulate`` is what the same addition costs on the
  host's cores instead (how parallax did it before);
- once per step: makes each bucket's fp32 gradient (``upcast``, into a kept buffer; fresh
  memory shown for comparison), takes its norm (``norm``, under the backward; torch's float64
  norm shown for comparison), steps AdamW on the fp32 masters (``adamw fused`` or
  ``foreach``) and converts the new weights for the upload (``convert``), whose copies run
  beside the next bucket's step.
The table's last rows add these up for ``--params`` and ``--passes``: the copies per step
(which hide under the passes' compute) and the part that cannot hide under the backward when
the gradients are clipped (everything after the last pass: upcast, AdamW, convert).
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.tools.common import append_results, median, print_table, time_it
from parallax.optim.zero.offload.host_adamw import HostAdamW
from parallax.optim.zero.offload.host_kernels import squares

COLUMNS = ["phase", "threads", "bytes/elem", "s per 1e9 elem", "GB/s", "times per step",
           "s per step"]  # fmt: skip
BUCKET = 2**26  # elements per tensor: about one bucket of a 7B model


def timed(fn) -> float:
    """Median seconds of ``fn``, 3 calls after 1 (``benchmarks.tools.common.time_it``)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return median(time_it(fn, device, warmup=1, iters=3))


def adamw_seconds(n: int, fused: bool) -> float:
    """One AdamW step over ``n`` fp32 elements in tensors of ``BUCKET``."""
    sizes = [min(BUCKET, n - s) for s in range(0, n, BUCKET)]
    params = [torch.zeros(k, requires_grad=True) for k in sizes]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    kind = {"fused": True} if fused else {"foreach": True}
    opt = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0, **kind)
    return timed(opt.step)


def _prepared(kernel: HostAdamW, name: str, in_place: list, split: list) -> bool:
    """``kernel.prepare`` for bf16 sums stepped in place, its seconds printed (the compile a
    run pays at its start)."""
    start = time.perf_counter()
    ok = kernel.prepare(in_place, [], torch.get_num_threads(), split)
    print(f"one-pass kernel ({name} masters): prepared in {time.perf_counter() - start:.1f} s, "
          f"{'compiled' if kernel.compiled and ok else 'eager'}")  # fmt: skip
    return ok


def one_pass_seconds(n: int, compiled: bool) -> float | None:
    """The one-pass host AdamW (``--host-adamw one-pass``, ``compiled`` for the CPU
    or eager) over ``n`` elements in weight-matrix pieces: bf16 gradient in, bf16 weights out, in
    place."""
    kernel = HostAdamW(compiled=compiled)
    if not _prepared(kernel, "whole", [torch.bfloat16], []):
        return None
    piece = BUCKET // 16
    masters = [torch.zeros(min(piece, n - s)) for s in range(0, n, piece)]
    grads = [torch.full(m.shape, 1e-3, dtype=torch.bfloat16) for m in masters]
    inner = torch.optim.AdamW([m.requires_grad_() for m in masters], lr=1e-5, weight_decay=0.0)
    pieces = [(m, g, None, 0) for m, g in zip(masters, grads)]
    return timed(lambda: kernel.step(inner, pieces, 1.0))


def split_seconds(n: int, compiled: bool) -> float | None:
    """The same step with split masters (``--host-masters split``): each master read from its
    bf16 weight (brought down) and low half (two byte planes), both written anew; bf16
    gradient in place."""
    from parallax.optim.zero.buffers.flat_buffers import LOW_PAD
    from parallax.optim.zero.buffers.master_halves import low_half

    kernel = HostAdamW(compiled=compiled)
    if not _prepared(kernel, "split", [], ["in_place"]):
        return None
    piece = BUCKET // 16
    sizes = [min(piece, n - s) for s in range(0, n, piece)]
    keys = [torch.zeros(1).expand(k) for k in sizes]  # (the state's keys, as the offload's)
    weights = [torch.full((k,), 0.5, dtype=torch.bfloat16) for k in sizes]
    pad = torch.zeros(2, LOW_PAD, dtype=torch.uint8)  # (the planes' pieces are never at 0 or 1)
    lows = [torch.cat([pad, low_half(w.float())], 1)[:, LOW_PAD:] for w in weights]
    grads = [torch.full((k,), 1e-3, dtype=torch.bfloat16) for k in sizes]
    inner = torch.optim.AdamW(keys, lr=1e-5, weight_decay=0.0)
    pieces = [(k, g, None, 0, (w, lo)) for k, g, w, lo in zip(keys, grads, weights, lows)]
    return timed(lambda: kernel.step(inner, pieces, 1.0))


def gradient_phases(n: int) -> dict[str, tuple[float, int]]:
    """The per-pass and per-bucket gradient work over ``n`` bf16 elements: (seconds, bytes
    moved per element)."""
    acc = torch.zeros(n, dtype=torch.bfloat16)
    part = torch.full((n,), 1e-3, dtype=torch.bfloat16)
    kept = torch.empty(n)  # the worker's scratch buffer

    def norm64():
        for p in acc.split(BUCKET // 16):  # about a weight matrix each
            torch.linalg.vector_norm(p, dtype=torch.float64).item()

    def norm():
        for p in kept.split(BUCKET // 16):
            squares(p)

    return {
        "accumulate (bf16 add)": (timed(lambda: acc.add_(part)), 6),
        "upcast into fresh memory (bf16 to fp32)": (timed(lambda: acc.float()), 6),
        "upcast into a kept buffer (bf16 to fp32)": (timed(lambda: kept.copy_(acc)), 6),
        "norm in float64 from bf16 (before)": (timed(norm64), 2),
        "norm (parallax.optim.host.squares, fp32)": (timed(norm), 4),
        "convert for the upload (fp32 to bf16)": (timed(lambda: acc.copy_(kept)), 6),
    }


def host_phases(n: int, compiled: bool = True) -> dict[str, tuple[float, int]]:
    """Each host-only phase over ``n`` elements: (seconds, bytes moved per element)."""
    out = gradient_phases(n)
    out["adamw fused"] = (adamw_seconds(n, fused=True), 28)
    out["adamw foreach"] = (adamw_seconds(n, fused=False), 28)
    one = one_pass_seconds(n, compiled)
    if one is not None:  # the three phases above in one: bf16 grad in, bf16 weights out
        out["adamw one pass (bf16 in, bf16 out)"] = (one, 28)
    split = split_seconds(n, compiled)
    if split is not None:  # ... the master joined from its weight and low half, split again
        out["adamw one pass, split masters (bf16 weight, low half's byte planes)"] = (split, 26)
    return out


def link_phases(n: int) -> dict[str, tuple[float, int]]:
    """Pinned copies of ``n`` bf16 elements device-to-host, back, and both at once on two
    streams, as the offload's accumulators copy (GPU only)."""
    if not torch.cuda.is_available():
        return {}
    dev, dev2 = (torch.empty(n, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    host, host2 = (torch.empty(n, dtype=torch.bfloat16, pin_memory=True) for _ in range(2))
    d2h = timed(lambda: host.copy_(dev, non_blocking=True))
    h2d = timed(lambda: dev.copy_(host, non_blocking=True))
    down, up = torch.cuda.Stream(), torch.cuda.Stream()

    def both() -> None:
        now = torch.cuda.current_stream()
        for stream, (dst, src) in ((down, (host, dev)), (up, (dev2, host2))):
            stream.wait_stream(now)
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
        now.wait_stream(down)
        now.wait_stream(up)

    return {
        "d2h (pinned, bf16)": (d2h, 2),
        "h2d (pinned, bf16)": (h2d, 2),
        "both ways at once (pinned, bf16, two streams)": (timed(both), 4),
    }


PER_PASS = ("accumulate", "d2h", "h2d", "both ways")
COPIES = ("d2h", "h2d")  # concurrent: the slower one counts, unless both ways were measured
BOTH = "both ways"
TAIL = ("upcast into a kept", "adamw fused", "convert")  # the norm is taken under the backward


def table(phases: dict, params: float, passes: int, threads: int) -> list[list[object]]:
    rows, copies, both, tail = [], 0.0, 0.0, 0.0
    for name, (seconds, width, n) in phases.items():
        per = seconds / n * 1e9
        times = passes if name.startswith(PER_PASS) else 1
        step = per * params / 1e9 * times
        if name.startswith(COPIES):
            copies = max(copies, step)
        elif name.startswith(BOTH):
            both = step
        elif name.startswith(TAIL):
            tail += step
        rows.append([name, threads, width, per, width * n / seconds / 1e9, times, step])
    rows.append(["per step: the copies (hide under the passes)", threads, "-", "-", "-",
                 passes, both or copies])  # fmt: skip
    rows.append(["per step: the tail after the last pass (clipped gradients)", threads, "-", "-",
                 "-", 1, tail])  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> list[list[object]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--elements", type=int, default=2**28, help="elements each phase is timed on")
    p.add_argument("--params", type=float, default=7.54e9, help="trainable parameters to scale to")
    p.add_argument("--passes", type=int, default=8, help="backward passes per step")
    p.add_argument("--threads", type=int, nargs="*", help="torch threads to try (default: as set)")
    p.add_argument("--smoke", action="store_true", help="2**20 elements; writes nothing")
    args = p.parse_args(argv)
    n = 2**20 if args.smoke else args.elements
    rows = []
    for threads in args.threads or [torch.get_num_threads()]:
        torch.set_num_threads(threads)
        got = {**host_phases(n, compiled=not args.smoke), **link_phases(n)}
        phases = {k: (s, w, n) for k, (s, w) in got.items()}
        rows += table(phases, args.params, args.passes, threads)
    title = f"host_bound: an offloaded optimizer's host phases, scaled to {args.params:.3g} params"
    print_table(title, COLUMNS, rows)
    if not args.smoke:
        notes = (
            f"each phase timed alone on {n} elements (median of 3 after 1), scaled linearly; "
            f"per-pass phases times --passes {args.passes}; bytes/elem = bytes read and written "
            "per element (AdamW: fp32 param, grad, two moments read, three written)"
        )
        append_results(title, COLUMNS, rows, notes)
    return rows


if __name__ == "__main__":
    main()
