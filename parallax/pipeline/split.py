"""Balanced partition of a list of blocks into contiguous pipeline chunks, by cost.

``split(costs, num_stages, chunks_per_rank)`` cuts ``len(costs)`` blocks into
``num_stages * chunks_per_rank`` contiguous, non-empty chunks; chunk ``i`` is virtual stage ``i``
(on pipeline rank ``i % num_stages``). The cut minimises the most expensive chunk (the pipeline's
pace) and, among such cuts, the sum of squared chunk costs (so the slack is spread evenly).
``pin_first=k`` keeps the first ``k`` blocks (a vision encoder and projector in front of a
language model) on the first chunk, which then takes fewer of the others by cost.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from torch import nn


def param_costs(blocks: Iterable[nn.Module]) -> list[int]:
    """Parameter count of each block: a cost for :func:`split` when FLOPs are not at hand."""
    return [sum(p.numel() for p in block.parameters()) for block in blocks]


def _check(costs: Sequence[float], num_stages: int, chunks_per_rank: int, pin_first: int) -> None:
    for name, value in (("num_stages", num_stages), ("chunks_per_rank", chunks_per_rank)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"split: {name} must be a positive integer, got {value!r}")
    n, chunks = len(costs), num_stages * chunks_per_rank
    if n < chunks:
        raise ValueError(
            f"split: {n} blocks cannot fill {chunks} chunks ({num_stages} stages x "
            f"{chunks_per_rank} chunks per rank); use at most {n} chunks or more blocks"
        )
    if any(not math.isfinite(c) or c < 0 for c in costs):
        raise ValueError(f"split: costs must be finite and >= 0, got {list(costs)}")
    if not 0 <= pin_first <= n:
        raise ValueError(f"split: pin_first={pin_first} is outside [0, {n}]")
    if n - max(pin_first, 1) < chunks - 1:
        raise ValueError(
            f"split: with the first {pin_first} blocks pinned to chunk 0, the other "
            f"{n - pin_first} blocks cannot fill the remaining {chunks - 1} chunks; pin fewer "
            "blocks or use fewer chunks"
        )


def split(
    costs: Sequence[float], num_stages: int, chunks_per_rank: int = 1, pin_first: int = 0
) -> list[range]:
    """Contiguous block ranges, one per chunk (virtual stage), balanced by ``costs``.

    Raises ``ValueError`` when there are fewer blocks than chunks.
    """
    costs = [float(c) for c in costs]
    _check(costs, num_stages, chunks_per_rank, pin_first)
    n, chunks = len(costs), num_stages * chunks_per_rank
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cuts(c: int, j: int) -> range:
        """Where chunk ``c`` (1-based) of a prefix ending at ``j`` may start."""
        return range(0, 1) if c == 1 else range(max(c - 1, pin_first if c == 2 else 0), j)

    def first_ok(j: int) -> bool:
        return j >= max(pin_first, 1)

    # pass 1: the smallest achievable cost of the most expensive chunk
    inf = math.inf
    worst = [[inf] * (n + 1) for _ in range(chunks + 1)]
    worst[0][0] = 0.0
    for c in range(1, chunks + 1):
        for j in range(c, n - (chunks - c) + 1):
            if c == 1 and not first_ok(j):
                continue
            worst[c][j] = min(
                (max(worst[c - 1][i], prefix[j] - prefix[i]) for i in cuts(c, j)), default=inf
            )
    limit = worst[chunks][n] * (1 + 1e-9) + 1e-12
    # pass 2: under that limit, the most even cut (least sum of squares)
    squares = [[inf] * (n + 1) for _ in range(chunks + 1)]
    back = [[0] * (n + 1) for _ in range(chunks + 1)]
    squares[0][0] = 0.0
    for c in range(1, chunks + 1):
        for j in range(c, n - (chunks - c) + 1):
            if c == 1 and not first_ok(j):
                continue
            for i in cuts(c, j):
                chunk = prefix[j] - prefix[i]
                value = squares[c - 1][i] + chunk * chunk
                if chunk <= limit and value < squares[c][j]:
                    squares[c][j], back[c][j] = value, i
    bounds, j = [n], n
    for c in range(chunks, 0, -1):
        j = back[c][j]
        bounds.append(j)
    bounds.reverse()
    return [range(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
