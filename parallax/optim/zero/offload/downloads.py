"""The trip down of the gradient sums kept on the device (``--gpu-accumulation``): each kept
bucket's sum, once complete, is copied into one of two pinned landing buffers on a downloads
stream and read from there into the worker's fp32 scratch; the next kept bucket's copy is issued
first, so it crosses the link while this one is stepped.

Only the worker thread issues and reads the copies, in the order it steps the buckets, so two
buffers suffice: the one being read and the one being filled. On the CPU the sums are read in
place.
"""

from __future__ import annotations

import torch

from parallax.optim.zero.offload.pinned import pinned


class Downloads:
    """Landing buffers and the downloads stream for the ``kept`` sums (bucket -> tensor)."""

    def __init__(self, kept: dict[int, torch.Tensor], device: torch.device) -> None:
        self.kept, self.device = kept, device
        self.on_device = device.type == "cuda" and bool(kept)
        self.stream = torch.cuda.Stream(device) if self.on_device else None
        self.landing: dict[torch.dtype, list[torch.Tensor]] = {}
        self.pinned: list = []  # the page-locked buffers' owners
        if self.on_device:
            for dt in {t.dtype for t in kept.values()}:
                most = max(t.numel() for t in kept.values() if t.dtype == dt)
                self.landing[dt] = [pinned(most, dt, self.pinned) for _ in (0, 1)]
        self.turn: dict[torch.dtype, int] = dict.fromkeys(self.landing, 0)
        self.sums_done: dict[int, torch.cuda.Event] = {}  # bucket -> its sum is complete
        self.issued: dict[int, tuple[torch.Tensor, torch.cuda.Event]] = {}

    def buffers(self) -> list[torch.Tensor]:
        return [t for pair in self.landing.values() for t in pair]

    def ready(self, b: int) -> None:
        """Main thread: bucket ``b``'s sum is complete as of the current stream's work."""
        if self.on_device:
            self.sums_done[b] = torch.cuda.Event()
            self.sums_done[b].record()

    def into(self, b: int, out: torch.Tensor, then: int | None) -> None:
        """Worker: bucket ``b``'s sum into ``out`` (fp32), ``then``'s trip issued meanwhile."""
        if not self.on_device:
            out.copy_(self.kept[b])
            return
        if b not in self.issued:
            self._issue(b)
        if then is not None and then not in self.issued:
            self._issue(then)
        landed, event = self.issued.pop(b)
        event.synchronize()
        out.copy_(landed)  # the model's dtype -> fp32, on the host

    def _issue(self, b: int) -> None:
        sum_ = self.kept[b]  # (bucket/dp,) device
        pair = self.landing[sum_.dtype]
        landed = pair[self.turn[sum_.dtype]][: sum_.numel()]
        self.turn[sum_.dtype] ^= 1
        self.stream.wait_event(self.sums_done[b])
        with torch.cuda.stream(self.stream):
            landed.copy_(sum_, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        self.issued[b] = (landed, event)
