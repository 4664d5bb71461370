"""The loader: one global order whatever dp is, exact resume, epoch reshuffle, clear errors."""

import json

import pytest
import torch

from parallax.data import (
    BatchLoader,
    DatasetError,
    SyntheticTask,
    check_batch_sizes,
    collate,
    load_dataset,
)


class _Ids:
    """A dataset whose sample is its own index: the order is visible at a glance."""

    name = "ids"
    statistics: dict = {}

    def __init__(self, n: int) -> None:
        self.n = n
        self.reads: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        self.reads.append(i)
        return i


def _loaders(dataset, dp, **kw):
    return [BatchLoader(dataset, dp_rank=r, dp_size=dp, **kw) for r in range(dp)]


def _global_steps(dataset, dp, steps, state=None, **kw):
    """Each step's samples, concatenated over dp ranks in rank order, microbatch by microbatch."""
    loaders = _loaders(dataset, dp, **kw)
    for loader in loaders:
        if state is not None:
            loader.load_state_dict(json.loads(json.dumps(state)))  # survives JSON
    out = []
    for _ in range(steps):
        batches = [loader.next_batch() for loader in loaders]
        for b in batches:
            assert len(b) == loaders[0].num_microbatches
            assert all(len(mb) == kw["micro_batch_size"] for mb in b)
        out.append([s for b in batches for mb in b for s in mb])
    states = [loader.state_dict() for loader in loaders]
    assert all(s == states[0] for s in states)  # every rank agrees on the position
    return out, states[0]


KW = dict(global_batch_size=8, micro_batch_size=2, seed=5)


def test_global_order_does_not_depend_on_dp_size():
    ref, _ = _global_steps(_Ids(50), 1, 10, **KW)
    for dp in (2, 4):
        got, _ = _global_steps(_Ids(50), dp, 10, **KW)
        assert got == ref
    # each dp rank reads only its own samples
    data = _Ids(50)
    loader = BatchLoader(data, dp_rank=1, dp_size=2, **KW)
    batch = loader.next_batch()
    assert data.reads == [s for mb in batch for s in mb] == ref[0][4:8]


def test_epochs_cover_the_data_once_and_reshuffle():
    steps, _ = _global_steps(_Ids(50), 2, 12, **KW)  # 6 steps per epoch, 2 samples dropped
    first, second = sum(steps[:6], []), sum(steps[6:], [])
    assert len(set(first)) == 48 and len(set(second)) == 48  # no repeats within an epoch
    assert first != second and first != sorted(first)
    same, _ = _global_steps(_Ids(50), 1, 12, **KW)
    other, _ = _global_steps(_Ids(50), 1, 12, **{**KW, "seed": 6})
    assert same == steps and other != steps
    plain, _ = _global_steps(_Ids(50), 1, 2, **{**KW, "shuffle": False})
    assert plain == [list(range(8)), list(range(8, 16))]


@pytest.mark.parametrize("save_dp,resume_dp,resume_micro", [(2, 2, 2), (2, 4, 1), (4, 1, 8)])
def test_resume_continues_at_the_exact_next_sample(save_dp, resume_dp, resume_micro):
    full, _ = _global_steps(_Ids(50), 1, 11, **KW)
    for cut in (3, 6, 7):  # mid-epoch, at the epoch boundary, just after it
        head, state = _global_steps(_Ids(50), save_dp, cut, **KW)
        kw = {**KW, "micro_batch_size": resume_micro, "seed": 123}  # the saved seed wins
        tail, _ = _global_steps(_Ids(50), resume_dp, 11 - cut, state=state, **kw)
        assert head + tail == full, (cut, save_dp, resume_dp)


def test_synthetic_batches_are_raw_samples_and_collate():
    task = SyntheticTask(seed=0, num_episodes=20, image_size=32)
    loader = BatchLoader(task, global_batch_size=8, micro_batch_size=2, dp_rank=1, dp_size=2)
    batch = loader.next_batch()
    assert len(batch) == 2 and len(batch[0]) == 2
    order = loader.order(0)[:8].tolist()
    for got, i in zip([s for mb in batch for s in mb], order[4:8]):
        assert (
            torch.equal(got["image"], task[i]["image"])
            and got["instruction"] == task[i]["instruction"]
        )
    mb = collate(batch[0])
    assert mb["image"].shape == (2, 32, 32, 3) and mb["image"].dtype == torch.uint8
    assert mb["action"].shape == (2, 7) and mb["action"].dtype == torch.float32
    assert mb["instruction"] == [s["instruction"] for s in batch[0]]


def test_bad_batch_sizes_name_the_numbers_and_what_works():
    with pytest.raises(ValueError) as err:
        check_batch_sizes(30, 4, 2)
    msg = str(err.value)
    assert "global batch size 30" in msg and "micro batch size 4 x dp 2 = 8" in msg
    assert "multiple of 8 (24 or 32)" in msg and "divides 15: [1, 3, 5, 15]" in msg
    with pytest.raises(ValueError, match=r"multiple of 4 \(4 or 8\)"):
        check_batch_sizes(6, 1, 4)  # no micro batch size can work: 6 is not divisible by dp 4
    with pytest.raises(ValueError, match="micro batch size must be a positive integer"):
        check_batch_sizes(8, 0, 1)
    with pytest.raises(ValueError, match="dp rank 2 is outside"):
        BatchLoader(_Ids(50), global_batch_size=8, micro_batch_size=2, dp_rank=2, dp_size=2)


def test_dataset_errors(tmp_path):
    with pytest.raises(DatasetError, match="is empty"):
        BatchLoader(_Ids(0), global_batch_size=8, micro_batch_size=2)
    with pytest.raises(DatasetError, match="has only 5 samples, fewer than one global batch of 8"):
        BatchLoader(_Ids(5), global_batch_size=8, micro_batch_size=2)
    with pytest.raises(DatasetError, match="does not exist"):
        load_dataset(str(tmp_path / "nowhere"))
    loader = BatchLoader(_Ids(50), **KW)
    state = {**loader.state_dict(), "dataset_size": 60}
    with pytest.raises(DatasetError, match="60 samples, but 'ids' has 50"):
        loader.load_state_dict(state)
    assert isinstance(load_dataset("synthetic", seed=3, image_size=32), SyntheticTask)
