"""The trip up of the offloaded optimizer's new weights: each stepped bucket's fp32 masters
converted to the model's dtype into pinned staging (:mod:`~parallax.optim.zero.offload.upload_ring`)
and copied into the model (its shard at ZeRO-3) on an uploads stream, one bucket's copy beside
the next bucket's step; on the CPU the masters are written in place.

The worker thread sends; the main thread orders its streams after what was sent: all of it
(``step()`` waiting), or bucket by bucket (the next forward, while the worker still steps).
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch

from parallax.optim.zero.offload.upload_ring import STAGING_BYTES, Ring


def ring_sizes(totals: dict[torch.dtype, int], most: int) -> dict[torch.dtype, int]:
    """Each dtype's ring, in elements: room for the largest bucket chunk (``most``), else
    :data:`STAGING_BYTES`, but no more than the offloaded elements of that dtype (``totals``,
    every offloaded bucket's, whether its sums are on the host or kept on the GPU)."""
    return {dt: max(most, min(n, STAGING_BYTES // dt.itemsize)) for dt, n in totals.items()}


class Uploads:
    """Staging rings (one per dtype of ``totals``, the offloaded elements of each) and the
    uploads stream, on GPUs; ``most``: the largest bucket chunk."""

    def __init__(self, totals: dict[torch.dtype, int], most: int, device: torch.device) -> None:
        self.device = device
        self.on_device = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.on_device else None
        # each ring is made at its first use: a one-pass step writes the weights into the
        # host accumulator and needs none, bar the buckets whose sums the GPU keeps
        self.sizes = ring_sizes(totals, most)
        self.rings: dict[torch.dtype, Ring] = {}  # pinned staging of the weights going up
        self.done: dict[int, torch.cuda.Event] = {}  # GPUs: bucket -> its upload's end

    def buffers(self) -> list[torch.Tensor]:
        return [r.buffer for r in self.rings.values()]

    def _ring(self, dtype: torch.dtype) -> Ring:
        if dtype not in self.rings:
            self.rings[dtype] = Ring(self.sizes[dtype], dtype, pin=True)
        return self.rings[dtype]

    def start(self) -> None:
        """Main thread, before a step's sends: they follow everything on the current stream
        (the weights change only after the whole backward)."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self.done.clear()

    @torch.no_grad()
    def send(self, b: int, mine: torch.Tensor, master: torch.Tensor, seconds: defaultdict) -> None:
        """Worker: bucket ``b``'s ``master`` (fp32, host) into ``mine`` (the model's dtype):
        converted into a piece of the ring on GPUs, then sent as :meth:`send_staged` does."""
        if not self.on_device:
            mine.copy_(master)
            return
        part, ticket = self.stage(mine, None, seconds)
        part.copy_(master)  # fp32 -> the model's dtype, on the host
        self.send_staged(b, mine, part, ticket)

    def stage(
        self, mine: torch.Tensor, over: torch.Tensor | None, seconds: defaultdict
    ) -> tuple[torch.Tensor, list | None]:
        """Worker: where a one-pass step writes a bucket's new weights for ``mine`` (its chunk
        in the model), with the ring's ticket if from there: on the CPU ``mine`` itself; on GPUs
        ``over`` (the accumulator the step reads, pinned, its gradient used up) or, with None,
        a piece of the ring."""
        if not self.on_device:
            return mine, None
        if over is not None:
            return over, None
        start = time.perf_counter()
        part, ticket = self._ring(mine.dtype).take(mine.numel())  # waits while it is full
        seconds["upload_wait"] += time.perf_counter() - start
        return part, ticket

    @torch.no_grad()
    def send_staged(self, b: int, mine: torch.Tensor, staged: torch.Tensor, ticket) -> None:
        """Worker: bucket ``b``'s weights, written by the step into ``staged``
        (:meth:`stage`), into ``mine``; on GPUs the accumulator is rewritten only after the
        next forward waited for this copy (so did the passes' copies down)."""
        if not self.on_device:
            return
        with torch.cuda.stream(self.stream):
            mine.copy_(staged, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        if ticket is not None:
            self.rings[mine.dtype].give(ticket, event)
        self.done[b] = event

    def arrived(self, b: int | None = None) -> None:
        """Main thread: the current stream after bucket ``b``'s upload (``None``: all sent)."""
        if self.stream is None:
            return
        current = torch.cuda.current_stream(self.device)
        if b is None:
            current.wait_stream(self.stream)
        elif b in self.done:
            current.wait_event(self.done[b])
