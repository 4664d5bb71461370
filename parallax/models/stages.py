"""A model as an ordered list of stage-able blocks with costs, and contiguous ranges of them.

A pipeline partitioner sees only ``[StageBlock(name, cost), ...]``; a model builds the blocks of
one contiguous ``range`` of that list on a rank. :func:`partition` is the pipeline's balanced split
(:func:`parallax.pipeline.split`), which a model uses when it is given a pipeline size but no
explicit range.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from parallax.pipeline.split import split


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
    """Split ``costs`` into ``num_stages`` contiguous non-empty ranges minimising the largest sum:
    :func:`parallax.pipeline.split` with one chunk per stage (the one partitioner parallax has)."""

    return split(costs, num_stages)
