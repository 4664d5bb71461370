"""A model as an ordered list of stage-able blocks with costs, and contiguous ranges of them.

A pipeline partitioner sees only ``[StageBlock(name, cost), ...]``; a model builds the blocks of
one contiguous ``range`` of that list on a rank. :func:`partition` is a simple balanced split
(minimise the most expensive stage) that a model uses when it is given a pipeline size but no
explicit range.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StageBlock:
    """One unit a pipeline stage may hold. ``cost`` is forward FLOPs per sample."""

    name: str
    cost: float


def check_block_range(blocks: range | Sequence[int] | None, num_blocks: int) -> range:
    """``blocks`` as a non-empty contiguous ``range`` inside ``[0, num_blocks)``."""
    if blocks is None:
        return range(num_blocks)
    items = list(blocks)
    if not items or items != list(range(items[0], items[0] + len(items))):
        raise ValueError(f"blocks must be a non-empty contiguous range, got {blocks!r}")
    if items[0] < 0 or items[-1] >= num_blocks:
        raise ValueError(
            f"blocks {items[0]}..{items[-1]} fall outside the model's {num_blocks} blocks "
            f"(0..{num_blocks - 1})"
        )
    return range(items[0], items[-1] + 1)


def partition(costs: Sequence[float], num_stages: int) -> list[range]:
    """Split ``costs`` into ``num_stages`` contiguous non-empty ranges minimising the largest sum.

    Exact (dynamic programming over split points). Among equally balanced splits the later
    stages take the extra blocks, keeping the first stage (which holds the inputs) light.
    """
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise ValueError(
            f"cannot split {n} blocks into {num_stages} pipeline stages: pp must be 1..{n}"
        )
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[k][i]: smallest max-stage cost of the first i blocks in k stages; cut[k][i]: last cut
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds, i = [], n
    for k in range(num_stages, 0, -1):
        bounds.append((cut[k][i], i))
        i = cut[k][i]
    return [range(a, b) for a, b in reversed(bounds)]
