"""Why the split masters' host step is slower than the whole one on a many-core host: the
one-pass kernel (``parallax/optim/zero/offload/host_adamw.py``) and variants of its split form,
compiled for the CPU as the offload compiles them, timed at several thread counts.

    python -m benchmarks.zero.split_probe [--threads 2 8 15] [--elements 2**27]

Variants (each steps bf16 gradients in place, as a clipped offloaded step does):

- ``whole``: fp32 master, 28 bytes an element;
- ``split``: the shipped split form (bf16 weight + two byte planes of the low half, both
  written as int8), 26 bytes;
- ``split-uint8``: the same with the low byte written as uint8 (the form before: torch 2.11's
  vector library narrows int32 to uint8 one element at a time);
- ``split-int32``: the low half held in an int32 plane (the same arithmetic, 30 bytes, one
  plane fewer);
- ``join-only``: joined from weight and planes, the master written back whole (no split):
  what the split's integer work costs;
- ``split-no-tie``: the split without the tie's nudge (not exact: a probe of the select's cost).

Prints one table of seconds per 1e9 elements and the bandwidth each moved, and appends it to
``benchmarks/RESULTS.md`` (``--smoke``: eager, small, writes nothing).
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.tools.common import append_results, median, print_table, time_it
from parallax.optim.zero.buffers.master_halves import join_planes, signed_low
from parallax.optim.zero.offload.host_adamw import (
    _room_to_compile,
    _scalars,
    _split_in_place,
    _step_in_place,
    _update,
    compile_options,
)


def _split_int32(g, w, low, m, v, h) -> None:
    p = (w.float().view(torch.int32) + low).view(torch.float32)  # (n,) fp32
    _update(g, p, m, v, h)
    g.copy_(p)
    bits = p.view(torch.int32)
    low.copy_(((bits & 0xFFFF) ^ 0x8000) - 0x8000)


def _join_only(g, w, lo, hi, m, v, whole, h) -> None:
    p = join_planes(w, lo, hi)  # (n,) fp32
    _update(g, p, m, v, h)
    g.copy_(p)
    whole.copy_(p)


def _split_no_tie(g, w, lo, hi, m, v, h) -> None:
    p = join_planes(w, lo, hi)  # (n,) fp32
    _update(g, p, m, v, h)
    g.copy_(p)
    bits = p.view(torch.int32)
    low = ((bits & 0xFFFF) ^ 0x8000) - 0x8000
    lo.copy_((((low & 0xFF) ^ 0x80) - 0x80).to(torch.int8))
    hi.copy_((low >> 8).to(torch.int8))


def _split_uint8(g, w, lo, hi, m, v, h) -> None:
    high = w.float().view(torch.int32)
    p = (high + hi.to(torch.int32) * 256 + lo.to(torch.int32)).view(torch.float32)  # (n,) fp32
    _update(g, p, m, v, h)
    g.copy_(p)
    low = signed_low(p)
    lo.copy_((low & 0xFF).to(torch.uint8))
    hi.copy_((low >> 8).to(torch.int8))


def _split_shipped(g, w, lo, hi, m, v, h) -> None:
    _split_in_place(g, w, lo, hi, m, v, h)


def cases(n: int) -> dict[str, tuple]:
    """Each variant's function, arguments (fresh buffers of ``n`` elements) and bytes moved
    an element."""
    f32 = lambda: torch.zeros(n)  # noqa: E731
    bf = lambda: torch.full((n,), 1e-3, dtype=torch.bfloat16)  # noqa: E731
    u8 = lambda: torch.zeros(n, dtype=torch.uint8)  # noqa: E731
    i8 = lambda: torch.zeros(n, dtype=torch.int8)  # noqa: E731
    i32 = lambda: torch.zeros(n, dtype=torch.int32)  # noqa: E731
    w = torch.full((n,), 0.5, dtype=torch.bfloat16)
    return {
        "whole": (_step_in_place, (bf(), f32(), f32(), f32()), 28),
        "split": (_split_shipped, (bf(), w, i8(), i8(), f32(), f32()), 26),
        "split-uint8": (_split_uint8, (bf(), w, u8(), i8(), f32(), f32()), 26),
        "split-int32": (_split_int32, (bf(), w, i32(), f32(), f32()), 30),
        "join-only": (_join_only, (bf(), w, i8(), i8(), f32(), f32(), f32()), 30),
        "split-no-tie": (_split_no_tie, (bf(), w, i8(), i8(), f32(), f32()), 26),
    }


def _seconds(run, tensors: tuple, h: torch.Tensor) -> float:
    """Median seconds of one call of ``run`` on ``tensors``, 3 calls after 1."""
    return median(time_it(lambda: run(*tensors, h), torch.device("cpu"), 1, 3))


COLUMNS = ["variant", "threads", "bytes/elem", "s per 1e9 elem", "GB/s"]


def main(argv: list[str] | None = None) -> list[list]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, nargs="*", default=[2, 8, 15])
    p.add_argument("--elements", type=int, default=2**27)
    p.add_argument("--smoke", action="store_true", help="eager, 2**16 elements; writes nothing")
    args = p.parse_args(argv)
    n, rows = 2**16 if args.smoke else args.elements, []
    h = _scalars(1e-5, 0.0, 0.9, 0.999, 1e-8, 1, 1.0)
    with _room_to_compile():
        for name, (fn, tensors, nbytes) in cases(n).items():
            run = fn if args.smoke else torch.compile(
                fn, dynamic=True, fullgraph=True, options=compile_options()
            )  # fmt: skip
            for t in args.threads:
                torch.set_num_threads(t)
                secs = _seconds(run, tensors, h)
                rows.append(
                    [name, t, nbytes, round(secs / n * 1e9, 4), round(nbytes * n / secs / 1e9, 1)]
                )
    title = "split_probe: the split masters' host AdamW against the whole one, and variants"
    print_table(title, COLUMNS, rows)
    if not args.smoke:
        notes = (
            f"one piece of {n} elements, each variant compiled for the CPU as the offload "
            "compiles it (inductor, C++ entry point, dynamic threads); median of 3 calls after 1"
        )
        append_results(title, COLUMNS, rows, notes)
    return rows


if __name__ == "__main__":
    main()
