"""The trip down of split masters' top halves (``--host-masters split``:
:mod:`~parallax.optim.zero.buffers.master_halves`): before the worker steps such a bucket, this
rank's chunk of its weights is copied from the model into a pinned landing buffer
(:class:`~parallax.optim.zero.offload.downloads.Trips`) and joined there with the low halves
the host keeps.

The copies go on the uploads stream: it already follows the backward (``Uploads.start``) and
every earlier upload, and the bucket's own upload, issued after its step, follows its copy down,
so no weight is read while it is written. The next split bucket's copy is issued before this
one is stepped, so it crosses the link meanwhile (2 bytes an element, against the uploads' 2
going the other way). On the CPU the weights are read in place.
"""

from __future__ import annotations

import torch

from parallax.optim.zero.offload.downloads import Trips


class WeightsDown(Trips):
    """Landing buffers for the weights of ``buckets`` (split ones) of ``flat``, brought down on
    ``stream`` (the uploads stream; None on the CPU)."""

    def __init__(self, flat, buckets: list[int], stream: torch.cuda.Stream | None) -> None:
        most = max((flat.layout.buckets[b].chunk for b in buckets), default=0)
        super().__init__({torch.bfloat16: most} if most else {}, stream)
        self.flat = flat

    def source(self, b: int) -> torch.Tensor:
        return self.flat.own_param(b)  # (bucket/dp,) bf16, on the device

    def get(self, b: int, then: int | None) -> torch.Tensor:
        """Worker: bucket ``b``'s weights (this rank's chunk, bf16) on the host, ``then``'s
        trip issued meanwhile."""
        if not self.on_device:
            return self.flat.own_param(b)
        return self.take(b, then)
