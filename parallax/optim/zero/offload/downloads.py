"""Trips down to the host for the offload's worker: each one copied into one of two pinned
landing buffers (per dtype) on a stream, and read from there once its copy is done; the next
trip is issued before this one is read, so it crosses the link while this bucket is stepped.

Only the worker thread issues and reads the copies, in the order it steps the buckets, so two
buffers suffice: the one being read and the one being filled. Two kinds travel so:

- the gradient sums kept on the device (``--gpu-accumulation``, :class:`Downloads`), each once
  complete, on a downloads stream, read into the worker's fp32 scratch;
- the weights of split masters (``--host-masters split``,
  :class:`~parallax.optim.zero.offload.weights_down.WeightsDown`).

On the CPU both are read in place.
"""

from __future__ import annotations

import torch

from parallax.optim.zero.offload.pinned import pinned


class Trips:
    """Landing buffers for device tensors of ``most`` elements a dtype at most, copied on
    ``stream`` (None: the CPU, nothing travels); :meth:`source` says what bucket ``b`` brings."""

    def __init__(self, most: dict[torch.dtype, int], stream: torch.cuda.Stream | None) -> None:
        self.stream, self.on_device = stream, stream is not None and bool(most)
        self.pinned: list = []  # the page-locked buffers' owners
        self.landing: dict[torch.dtype, list[torch.Tensor]] = {}
        if self.on_device:
            for dt, n in most.items():
                self.landing[dt] = [pinned(n, dt, self.pinned) for _ in (0, 1)]
        self.turn: dict[torch.dtype, int] = dict.fromkeys(self.landing, 0)
        self.issued: dict[int, tuple[torch.Tensor, torch.cuda.Event]] = {}

    def source(self, b: int) -> torch.Tensor:
        """Bucket ``b``'s tensor on the device."""
        raise NotImplementedError

    def before(self, b: int) -> None:
        """The stream's wait before bucket ``b``'s copy (none by default)."""

    def buffers(self) -> list[torch.Tensor]:
        return [t for pair in self.landing.values() for t in pair]

    def reset(self) -> None:
        """A new step: a trip issued last step but never read (its bucket had nothing to step)
        is stale; a copy still running into its buffer ends before any new one on the stream."""
        self.issued.clear()

    def take(self, b: int, then: int | None) -> torch.Tensor:
        """Worker: bucket ``b``'s tensor, landed on the host, ``then``'s trip issued meanwhile
        (valid until the next call)."""
        if b not in self.issued:
            self._issue(b)
        if then is not None and then not in self.issued:
            self._issue(then)
        landed, event = self.issued.pop(b)
        event.synchronize()
        return landed

    def _issue(self, b: int) -> None:
        source = self.source(b)  # (bucket/dp,) device
        pair = self.landing[source.dtype]
        landed = pair[self.turn[source.dtype]][: source.numel()]
        self.turn[source.dtype] ^= 1
        self.before(b)
        with torch.cuda.stream(self.stream):
            landed.copy_(source, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        self.issued[b] = (landed, event)


class Downloads(Trips):
    """The ``kept`` sums (bucket -> tensor), each brought down once complete, on a downloads
    stream of ``device``."""

    def __init__(self, kept: dict[int, torch.Tensor], device: torch.device) -> None:
        on_device = device.type == "cuda" and bool(kept)
        most: dict[torch.dtype, int] = {}
        for t in kept.values() if on_device else ():
            most[t.dtype] = max(most.get(t.dtype, 0), t.numel())
        super().__init__(most, torch.cuda.Stream(device) if on_device else None)
        self.kept = kept
        self.sums_done: dict[int, torch.cuda.Event] = {}  # bucket -> its sum is complete

    def source(self, b: int) -> torch.Tensor:
        return self.kept[b]

    def before(self, b: int) -> None:
        self.stream.wait_event(self.sums_done[b])

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
        out.copy_(self.take(b, then))  # the model's dtype -> fp32, on the host
