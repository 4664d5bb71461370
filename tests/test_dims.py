import itertools

import pytest

from parallax import ParallelDims

LAYOUTS = [(tp, pp, dp) for tp, pp, dp in itertools.product([1, 2, 3, 4], [1, 2, 3], [1, 2, 5])]


@pytest.mark.parametrize("tp,pp,dp", LAYOUTS)
def test_coords_and_rank_are_inverse(tp, pp, dp):
    dims = ParallelDims(tp=tp, pp=pp, dp=dp)
    assert dims.world_size == tp * pp * dp
    seen = set()
    for rank in range(dims.world_size):
        p, d, t = dims.coords(rank)
        assert dims.rank(p, d, t) == rank
        assert rank == (p * dp + d) * tp + t  # tp innermost, then dp, then pp
        seen.add((p, d, t))
    assert len(seen) == dims.world_size


@pytest.mark.parametrize("tp,pp,dp", LAYOUTS)
def test_groups_partition_the_world(tp, pp, dp):
    dims = ParallelDims(tp=tp, pp=pp, dp=dp)
    for groups, size, axis in (
        (dims.tp_groups(), tp, 2),
        (dims.dp_groups(), dp, 1),
        (dims.pp_groups(), pp, 0),
    ):
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(dims.world_size))
        assert all(len(g) == size for g in groups)
        for g in groups:  # members differ only along their own axis, in axis order
            coords = [dims.coords(r) for r in g]
            assert [c[axis] for c in coords] == list(range(size))
            others = {tuple(v for i, v in enumerate(c) if i != axis) for c in coords}
            assert len(others) == 1


def test_tp_groups_are_neighbouring_ranks():
    assert ParallelDims(tp=2, pp=2, dp=2).tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert ParallelDims(tp=2, pp=2, dp=2).pp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize("kwargs", [dict(tp=0), dict(pp=-1), dict(dp=1.5), dict(tp=True)])
def test_invalid_sizes_raise(kwargs):
    with pytest.raises(ValueError, match="positive integer"):
        ParallelDims(**kwargs)


def test_from_world_infers_dp_and_names_the_numbers():
    assert ParallelDims.from_world(8, tp=2, pp=2) == ParallelDims(tp=2, pp=2, dp=2)
    with pytest.raises(ValueError, match=r"world size 8 is not divisible by tp\*pp = 3\*1"):
        ParallelDims.from_world(8, tp=3)
    with pytest.raises(
        ValueError, match=r"tp=2 x pp=2 x dp=4 = 16 ranks does not match world size 8"
    ):
        ParallelDims.from_world(8, tp=2, pp=2, dp=4)


def test_rank_bounds():
    dims = ParallelDims(tp=2, pp=2, dp=2)
    with pytest.raises(ValueError):
        dims.coords(8)
    with pytest.raises(ValueError):
        dims.rank(0, 2, 0)
