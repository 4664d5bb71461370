"""Host staging for the offloaded optimizer's uploads: one arena of (pinned, on GPUs) host
memory per dtype, handed out as a ring, first in, first out.

After the host steps a bucket, its new weights are converted to the model's dtype into a piece
of the arena and copied up on the uploads stream while the next bucket is stepped; the piece is
reused once that copy is done (the CUDA event it was given back with). Buckets of every size
share the arena (a pool of fixed buffers would size each one for the largest bucket, an
embedding several times the others). Pieces are released in the order they were taken (one
worker thread takes and gives them), so the free space is always one run from the newest piece
to the oldest live one.
"""

from __future__ import annotations

import threading
from collections import deque

import torch

from parallax.optim.zero.offload.pinned import pinned

STAGING_BYTES = 2**29  # per dtype: a few buckets' uploads in flight


class Ring:
    """``numel`` elements of ``dtype`` (pinned when ``pin``), handed out first in, first out."""

    def __init__(self, numel: int, dtype: torch.dtype, pin: bool) -> None:
        self.pinned: list = []  # the page-locked buffer's owner
        self.buffer = pinned(numel, dtype, self.pinned) if pin else torch.empty(numel, dtype=dtype)
        self.numel = numel
        self.live: deque[list] = deque()  # [start, end, released, event], oldest first
        self.head = 0  # where the next piece starts, unless it wraps to 0
        self.cond = threading.Condition()

    def take(self, n: int) -> tuple[torch.Tensor, list]:
        """A piece of ``n`` elements and its ticket for :meth:`give`; waits while the ring is
        full."""
        if n > self.numel:
            raise ValueError(f"a piece of {n} elements does not fit a ring of {self.numel}")
        size = max(n, 1)  # (an empty piece would make a full ring look empty)
        with self.cond:
            while (start := self._fit(size)) is None:
                if not self._reclaim():
                    self.cond.wait()
            ticket = [start, start + size, False, None]
            self.live.append(ticket)
            self.head = start + size
            return self.buffer[start : start + n], ticket

    def give(self, ticket: list, event: torch.cuda.Event | None = None) -> None:
        """Hand a piece back (after ``event``, when one is given)."""
        with self.cond:
            ticket[2], ticket[3] = True, event
            self.cond.notify_all()

    def _fit(self, n: int) -> int | None:
        """Where ``n`` free elements start: after the newest piece, or wrapped to 0."""
        if not self.live:
            self.head = 0
            return 0
        tail = self.live[0][0]  # the oldest live piece's start
        if self.head > tail:  # live: [tail, head); free: [head, end) and [0, tail)
            if self.head + n <= self.numel:
                return self.head
            return 0 if n <= tail else None
        return self.head if self.head + n <= tail else None  # wrapped: free [head, tail)

    def _reclaim(self) -> bool:
        """Drop the released pieces at the old end (their events done); whether any went."""
        dropped = False
        while self.live and self.live[0][2]:
            event = self.live[0][3]
            if event is not None:
                event.synchronize()
            self.live.popleft()
            dropped = True
        return dropped

    def pieces(self) -> int:
        return len(self.live)
