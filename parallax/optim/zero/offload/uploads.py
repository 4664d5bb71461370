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


class Uploads:
    """Staging rings (one per dtype of ``flats``, the host accumulators' buffers: their sizes
    bound a ring's) and the uploads stream, on GPUs; ``most``: the largest bucket chunk."""

    def __init__(
        self, flats: dict[torch.dtype, torch.Tensor], most: int, device: torch.device
    ) -> None:
        self.device = device
        self.on_device = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.on_device else None
        self.rings = {  # GPUs: pinned staging of the new weights on their way up
            dt: Ring(max(most, min(flat.numel(), STAGING_BYTES // dt.itemsize)), dt, pin=True)
            for dt, flat in (flats.items() if self.on_device else ())
        }
        self.done: dict[int, torch.cuda.Event] = {}  # GPUs: bucket -> its upload's end

    def buffers(self) -> list[torch.Tensor]:
        return [r.buffer for r in self.rings.values()]

    def start(self) -> None:
        """Main thread, before a step's sends: they follow everything on the current stream
        (the weights change only after the whole backward)."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self.done.clear()

    @torch.no_grad()
    def send(self, b: int, mine: torch.Tensor, master: torch.Tensor, seconds: defaultdict) -> None:
        """Worker: bucket ``b``'s ``master`` (fp32, host) into ``mine`` (the model's dtype)."""
        if not self.on_device:
            mine.copy_(master)
            return
        start = time.perf_counter()
        part, ticket = self.rings[mine.dtype].take(mine.numel())  # waits while it is full
        seconds["upload_wait"] += time.perf_counter() - start
        part.copy_(master)  # fp32 -> the model's dtype, on the host
        with torch.cuda.stream(self.stream):
            mine.copy_(part, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
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
