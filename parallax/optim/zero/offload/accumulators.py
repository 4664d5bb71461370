"""The offloaded optimizer's gradient accumulators: one flat host buffer per dtype (pinned on
GPUs), a view per bucket, and the device-side adds that fill them pass by pass.

Each backward pass's reduced chunk of a bucket (fp32, on the device) is added into the bucket's
accumulator without the host's cores: the accumulator comes up to the device on a fetch stream,
the chunk is added in fp32 on a copies stream and the sum goes back down in the accumulator's
dtype (the first pass just goes down). On separate streams one bucket's copy up runs beside the
previous bucket's copy down, so the link carries both ways at once; on one stream a pass cost
the two copies in turn (OpenVLA-7B under 24 GiB, 16 passes: 19.0 s a step against 16.4 s). On
the CPU the same code adds in place.

**Why the device adds.** On one H200 host (16 cores, ``benchmarks/zero/host_bound.py``) a bf16
add of a 7.5B model's gradient takes 0.75 s, as long as a pass: done by the host's worker it was
the step's bottleneck (9 of 14.4 s at 8 passes). Through the device a pass costs the host's
memory two concurrent copies and its cores nothing. The last pass also takes the sum's squares
for the gradient norm there, sparing the host a read of every accumulator (1.5 s a step for
OpenVLA-7B under 24 GiB, part of it after the backward).

**Beside 90 GB of state.** A 7.5B model's fp32 masters and moments are 90 GB on the host at dp
1; the device keeps no gradient between passes, and the host accumulates in the model's dtype
(15 GB; in fp32 it would be 30 GB more, past a 125 GiB host). The price is one rounding per
pass, of a sum formed in fp32; fp32 models accumulate in fp32.

Buckets ``kept`` on the device (``--gpu-accumulation``, the planner's choice of what fits beside
the run) sum their passes in device memory, in the model's dtype as the host would, and cross
the link once, when the host steps them: less host memory and less traffic a pass.

At most ``IN_FLIGHT`` adds are queued on the copies stream: the host waits for older ones before
it queues another. Without that bound a backward that makes chunks faster than the link carries
them left them all waiting, freed but not reusable, until the allocator ran into a cap and
flushed its cache (OpenVLA-7B under 24 GiB: 104 such retries a step; under 32 GiB at
micro-batch 8: 211, and 23.4 s a step). With the bound the capped rows retry no more
(benchmarks/RESULTS.md, runs 8e51d12eab79 and later).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch.profiler import record_function

from parallax.optim.zero.offload.host_kernels import squares
from parallax.optim.zero.offload.pinned import pinned

IN_FLIGHT = 4  # adds whose copies may be queued at once: enough to keep both directions busy


class Accumulators:
    """Host accumulators of the offloaded buckets ``buckets`` (``chunks[b]`` elements of
    ``dtypes[b]`` each), filled from ``device``."""

    def __init__(
        self,
        buckets: Sequence[int],
        chunks: Sequence[int],
        dtypes: dict[int, torch.dtype],
        device: torch.device,
        kept: Sequence[int] = (),
    ) -> None:
        self.device = device
        self.on_device = device.type == "cuda"
        self.flats: dict[torch.dtype, torch.Tensor] = {}
        self.pinned: list = []  # the page-locked buffers' owners
        self.acc: dict[int, torch.Tensor] = {}
        # ``kept`` buckets sum their passes in device memory (the link carries them once)
        self.kept = {b: torch.zeros(chunks[b], dtype=dtypes[b], device=device) for b in kept}
        for dt in set(dtypes[b] for b in buckets if b not in self.kept):
            mine = [b for b in buckets if dtypes[b] == dt and b not in self.kept]
            numel = sum(chunks[b] for b in mine)
            if self.on_device:  # (page-locked, exactly its size: offload.pinned)
                flat = pinned(numel, dt, self.pinned, zero=True)
            else:
                flat = torch.zeros(numel, dtype=dt)
            self.flats[dt] = flat
            for b, start in zip(mine, itertools.accumulate((chunks[b] for b in mine), initial=0)):
                self.acc[b] = flat[start : start + chunks[b]]  # (bucket/dp,)
        self.copies = torch.cuda.Stream(device) if self.on_device else None
        self.fetches = torch.cuda.Stream(device) if self.on_device else None
        self.down: dict[int, torch.cuda.Event] = {}  # GPUs: bucket -> its last sum came down
        self.queued: deque[torch.cuda.Event] = deque()  # GPUs: the adds not known to be done

    def add(
        self, b: int, grad: torch.Tensor, first: bool, norm: Sequence[slice] | None = None
    ) -> torch.Tensor | None:
        """Add ``grad`` (bucket ``b``'s reduced fp32 chunk, its reduction done on the current
        stream) into its accumulator; ``first``: this step's first pass overwrites it. With
        ``norm`` (the last pass): the sum of squares of those slices of the new sum, as the
        host will read it, a device scalar made beside the add (read it after :meth:`settle`)."""
        if b in self.kept:  # on the current stream: the same fp32 sum, rounded the same way
            kept = self.kept[b]  # (bucket/dp,) device, its dtype
            if first:
                kept.copy_(grad)
            else:
                kept.add_(grad)  # (computed in fp32, as grad + up below)
            return _squares(kept, norm)
        acc = self.acc[b]  # (bucket/dp,) host, its dtype
        if len(self.queued) >= IN_FLIGHT:  # (GPUs) bound what waits for the link
            with record_function("parallax.offload.link_wait"):
                while len(self.queued) >= IN_FLIGHT:
                    self.queued.popleft().synchronize()
        up = None if first else self._fetch(b)  # (bucket/dp,) the accumulator on the device
        with self._on_copies(grad, up):
            total = grad if up is None else grad + up  # (bucket/dp,) fp32
            rounded = total.to(acc.dtype)  # (bucket/dp,) what the host holds
            acc.copy_(rounded, non_blocking=True)
            squares = _squares(rounded, norm)
            if self.copies is not None:  # the next pass's fetch waits for this sum
                self.down[b] = torch.cuda.Event()
                self.down[b].record()
                self.queued.append(self.down[b])
        return squares

    def settle(self) -> None:
        """The current stream waits for every add queued so far (and the squares they made)."""
        if self.copies is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.copies)

    def view(self, b: int) -> torch.Tensor:
        """Bucket ``b``'s sum where it is held: host memory, or the device for a kept one."""
        return self.kept[b] if b in self.kept else self.acc[b]

    def landed(self) -> torch.cuda.Event | None:
        """GPUs: an event after every add queued so far (the host may read those sums once it
        has passed); the CPU: None (the adds are done)."""
        if self.copies is None:
            return None
        event = torch.cuda.Event()
        event.record(self.copies)
        return event

    def _fetch(self, b: int) -> torch.Tensor:
        """Bucket ``b``'s accumulator on the device (on the CPU, the accumulator itself), copied
        up on the fetch stream after its last sum came down."""
        acc = self.acc[b]
        if self.fetches is None:
            return acc
        if b in self.down:
            self.fetches.wait_event(self.down[b])
        with torch.cuda.stream(self.fetches):
            return acc.to(self.device, non_blocking=True)

    @contextmanager
    def _on_copies(self, grad: torch.Tensor, up: torch.Tensor | None) -> Iterator[None]:
        """GPUs: run the block on the copies stream, after the current stream's work and the
        fetch of ``up``."""
        if self.copies is None:
            yield
            return
        self.copies.wait_stream(torch.cuda.current_stream(self.device))
        grad.record_stream(self.copies)  # (allocated on another stream, read here)
        if up is not None:
            self.copies.wait_stream(self.fetches)
            up.record_stream(self.copies)
        with torch.cuda.stream(self.copies):
            yield


def _squares(x: torch.Tensor, pieces: Sequence[slice] | None) -> torch.Tensor | None:
    """The sum of squares of ``x``'s ``pieces`` in fp32, on ``x``'s device (None: not asked)."""
    if pieces is None:
        return None
    if x.device.type == "cpu":  # (a flat fp32 norm drifts on the CPU: host_kernels.squares)
        return torch.tensor(sum(squares(x[p].float()) for p in pieces), dtype=torch.float64)
    total = torch.zeros((), device=x.device)
    for p in pieces:  # GPUs reduce in a tree: fp32 holds
        total += torch.linalg.vector_norm(x[p], dtype=torch.float32).square()
    return total
