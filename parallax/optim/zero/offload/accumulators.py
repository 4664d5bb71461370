"""The offloaded optimizer's gradient accumulators: one flat host buffer per dtype (pinned on
GPUs), a view per bucket, and the device-side adds that fill them pass by pass.

Each backward pass's reduced chunk of a bucket (fp32, on the device) is added into the bucket's
accumulator without the host's cores: the accumulator comes up to the device on a fetch stream,
the chunk is added in fp32 on a copies stream and the sum goes back down in the accumulator's
dtype (the first pass just goes down). On separate streams one bucket's copy up runs beside the
previous bucket's copy down, so the link carries both ways at once; on one stream a pass cost
the two copies in turn (OpenVLA-7B under 24 GiB, 16 passes: 19.0 s a step against 16.4 s). On
the CPU the same code adds in place.

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
    ) -> None:
        self.device = device
        self.on_device = device.type == "cuda"
        self.flats: dict[torch.dtype, torch.Tensor] = {}
        self.acc: dict[int, torch.Tensor] = {}
        for dt in set(dtypes.values()):
            mine = [b for b in buckets if dtypes[b] == dt]
            flat = torch.zeros(sum(chunks[b] for b in mine), dtype=dt, pin_memory=self.on_device)
            self.flats[dt] = flat
            for b, start in zip(mine, itertools.accumulate((chunks[b] for b in mine), initial=0)):
                self.acc[b] = flat[start : start + chunks[b]]  # (bucket/dp,)
        self.copies = torch.cuda.Stream(device) if self.on_device else None
        self.fetches = torch.cuda.Stream(device) if self.on_device else None
        self.down: dict[int, torch.cuda.Event] = {}  # GPUs: bucket -> its last sum came down
        self.queued: deque[torch.cuda.Event] = deque()  # GPUs: the adds not known to be done

    def add(self, b: int, grad: torch.Tensor, first: bool) -> None:
        """Add ``grad`` (bucket ``b``'s reduced fp32 chunk, its reduction done on the current
        stream) into its accumulator; ``first``: this step's first pass overwrites it."""
        acc = self.acc[b]  # (bucket/dp,) host, its dtype
        if len(self.queued) >= IN_FLIGHT:  # (GPUs) bound what waits for the link
            with record_function("parallax.offload.link_wait"):
                while len(self.queued) >= IN_FLIGHT:
                    self.queued.popleft().synchronize()
        up = None if first else self._fetch(b)  # (bucket/dp,) the accumulator on the device
        with self._on_copies(grad, up):
            total = grad if up is None else grad + up  # (bucket/dp,) fp32
            acc.copy_(total.to(acc.dtype), non_blocking=True)
            if self.copies is not None:  # the next pass's fetch waits for this sum
                self.down[b] = torch.cuda.Event()
                self.down[b].record()
                self.queued.append(self.down[b])

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
