"""The trip down of split masters' top halves (``--host-masters split``:
:mod:`~parallax.optim.zero.buffers.master_halves`): before the worker steps such a bucket, this
rank's chunk of its weights is copied from the model into one of two pinned landing buffers and
joined there with the low halves the host keeps.

The copies go on the uploads stream: it already follows the backward (``Uploads.start``) and
every earlier upload, and the bucket's own upload, issued after its step, follows its copy down,
so no weight is read while it is written. The next split bucket's copy is issued before this
one is stepped, so it crosses the link meanwhile (2 bytes an element, against the uploads' 2
going the other way). Only the worker issues and reads them, in the order it steps, so two
buffers suffice. On the CPU the weights are read in place.
"""

from __future__ import annotations

import torch

from parallax.optim.zero.offload.pinned import pinned


class WeightsDown:
    """Landing buffers for the weights of ``buckets`` (split ones) of ``flat``, brought down on
    ``stream`` (the uploads stream; None on the CPU)."""

    def __init__(self, flat, buckets: list[int], stream: torch.cuda.Stream | None) -> None:
        self.flat, self.stream = flat, stream
        self.on_device = stream is not None and bool(buckets)
        self.pinned: list = []  # the page-locked buffers' owners
        most = max((flat.layout.buckets[b].chunk for b in buckets), default=0)
        self.landing = (
            [pinned(most, torch.bfloat16, self.pinned) for _ in (0, 1)] if self.on_device else []
        )
        self.turn = 0
        self.issued: dict[int, tuple[torch.Tensor, torch.cuda.Event]] = {}

    def buffers(self) -> list[torch.Tensor]:
        return list(self.landing)

    def reset(self) -> None:
        """A new step: what was brought down before is stale."""
        self.issued.clear()

    def get(self, b: int, then: int | None) -> torch.Tensor:
        """Worker: bucket ``b``'s weights (this rank's chunk, bf16) on the host, ``then``'s
        trip issued meanwhile."""
        if not self.on_device:
            return self.flat.own_param(b)
        if b not in self.issued:
            self._issue(b)
        if then is not None and then not in self.issued:
            self._issue(then)
        landed, event = self.issued.pop(b)
        event.synchronize()
        return landed

    def _issue(self, b: int) -> None:
        mine = self.flat.own_param(b)  # (bucket/dp,) bf16, on the device
        landed = self.landing[self.turn][: mine.numel()]
        self.turn ^= 1
        with torch.cuda.stream(self.stream):
            landed.copy_(mine, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        self.issued[b] = (landed, event)
