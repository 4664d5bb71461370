"""Host staging for the offloaded optimizer: one arena of (pinned, on GPUs) host memory per
dtype, handed out as a ring, first in, first out.

Gradients reach the host in bursts: a backward pass reduces one bucket after another, faster
than the host can add them into its accumulators, and then the next forward sends nothing.
The arena lets the device run ahead by up to ``STAGING_BYTES`` of gradients instead of waiting
for the host bucket by bucket; buckets of every size share it (a pool of fixed buffers would
size each one for the largest bucket, an embedding several times the others). Pieces are
released in the order they were taken (one worker thread consumes them in order), so the free
space is always one run from the newest piece to the oldest live one.

A piece given back with a CUDA event (an upload to the device still reading it) is reused only
after that event.
"""

from __future__ import annotations

import threading
from collections import deque

import torch

STAGING_BYTES = 2 * 2**30  # per dtype: about an eighth of a 7B model's bf16 gradient


class Ring:
    """``numel`` elements of ``dtype`` (pinned when ``pin``), handed out first in, first out."""

    def __init__(self, numel: int, dtype: torch.dtype, pin: bool) -> None:
        self.buffer = torch.empty(numel, dtype=dtype, pin_memory=pin)  # (numel,)
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
