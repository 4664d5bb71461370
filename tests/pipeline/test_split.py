"""Balanced contiguous partition of blocks into pipeline chunks."""

import itertools
import random

import pytest
from torch import nn

from parallax.pipeline import split
from parallax.pipeline.split import param_costs


def _sizes(ranges):
    return [len(r) for r in ranges]


def _brute_force(costs, chunks, pin_first):
    """Smallest bottleneck over every cut (for small cases)."""
    n, best = len(costs), float("inf")
    for cuts in itertools.combinations(range(1, n), chunks - 1):
        bounds = (0, *cuts, n)
        if bounds[1] < pin_first:
            continue
        best = min(best, max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


def test_equal_costs_give_equal_chunks_covering_every_block():
    ranges = split([1] * 32, 4)
    assert ranges == [range(0, 8), range(8, 16), range(16, 24), range(24, 32)]
    assert _sizes(split([1] * 10, 2, chunks_per_rank=2)) in (
        [3, 3, 2, 2],
        [2, 3, 3, 2],
        [3, 2, 2, 3],
        [2, 2, 3, 3],
        [3, 2, 3, 2],
        [2, 3, 2, 3],
    )


def test_matches_brute_force_bottleneck_and_is_contiguous():
    rng = random.Random(0)
    for _ in range(60):
        n = rng.randint(2, 9)
        stages, chunks_per_rank = rng.choice([(1, 1), (2, 1), (2, 2), (3, 1), (4, 1)])
        chunks = stages * chunks_per_rank
        if n < chunks:
            continue
        pin = rng.randint(0, n - chunks + 1)
        costs = [rng.choice([0.5, 1, 2, 5]) for _ in range(n)]
        ranges = split(costs, stages, chunks_per_rank, pin_first=pin)
        assert len(ranges) == chunks and ranges[0].start == 0 and ranges[-1].stop == n
        assert all(
            a.stop == b.start and len(a) > 0 for a, b in zip(ranges, ranges[1:] + [range(n, n + 1)])
        )
        assert ranges[0].stop >= pin
        worst = max(sum(costs[i] for i in r) for r in ranges)
        assert worst == pytest.approx(_brute_force(costs, chunks, pin)), (costs, pin)


def test_pinned_vision_blocks_stay_first_and_take_fewer_language_blocks():
    # 3 "vision + projector" blocks worth 4 language layers in all, then 32 language layers
    costs = [2.0, 1.0, 1.0] + [1.0] * 32
    ranges = split(costs, 4, pin_first=3)
    assert ranges[0].start == 0 and ranges[0].stop >= 3
    language = [len([i for i in r if i >= 3]) for r in ranges]
    assert language == [5, 9, 9, 9]
    assert sum(language) == 32


def test_fewer_blocks_than_chunks_is_a_clear_error():
    with pytest.raises(ValueError, match=r"6 blocks cannot fill 8 chunks \(4 stages x 2 chunks"):
        split([1] * 6, 4, chunks_per_rank=2)
    with pytest.raises(ValueError, match="pin fewer blocks"):
        split([1] * 6, 3, pin_first=5)
    with pytest.raises(ValueError, match="finite and >= 0"):
        split([1, -1, 1], 1)


def test_param_costs_counts_parameters():
    assert param_costs([nn.Linear(4, 3), nn.LayerNorm(3)]) == [15, 6]
