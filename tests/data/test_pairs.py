"""Image-text pairs: folder and tar-shard sources, the synthetic task, and the pair loader's
order (a function of seed and epoch only: the same global batch at any dp), resume and errors."""

import io
import json
import tarfile

import numpy as np
import pytest

from parallax.data.pair_loader import PairLoader
from parallax.data.pairs import PairFolder, write_pair_folder
from parallax.data.stats import DatasetError
from parallax.data.synthetic_pairs import SyntheticPairs
from parallax.data.tar_shards import TarShards, write_tar_shards


def _pairs(n: int) -> list[dict]:
    rng = np.random.default_rng(0)
    return [
        {
            "image": rng.integers(0, 255, size=(4 + i % 3, 5, 3), dtype=np.uint8),
            "caption": f"caption {i}",
            "key": f"{i:06d}",
        }
        for i in range(n)
    ]


def _same(a: dict, b: dict) -> bool:
    return (
        a["key"] == b["key"]
        and a["caption"] == b["caption"]
        and np.array_equal(a["image"], b["image"])
    )


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_folder_reads_back(tmp_path, fmt):
    pairs = _pairs(5)
    source = PairFolder(write_pair_folder(tmp_path / fmt, pairs, fmt))
    assert source.num_shards() == 1 and source.shard_length(0) == 5
    assert all(_same(source.read(0, i), p) for i, p in enumerate(pairs))


def test_folder_errors(tmp_path):
    with pytest.raises(DatasetError, match="no captions.jsonl or captions.csv"):
        PairFolder(tmp_path)
    (tmp_path / "captions.jsonl").write_text('{"image": "a.npy"}\n')
    with pytest.raises(DatasetError, match="row 1: no caption"):
        PairFolder(tmp_path)
    (tmp_path / "captions.jsonl").write_text('{"image": "a.npy", "caption": "x"}\n')
    with pytest.raises(DatasetError, match="a.npy is missing"):
        PairFolder(tmp_path).read(0, 0)


def test_tar_shards_img2dataset_layout(tmp_path):
    pairs = _pairs(7)
    write_tar_shards(tmp_path, pairs, per_shard=3)  # 00000.tar 00001.tar 00002.tar
    # one more shard as img2dataset writes it: JPEG/PNG, a key without caption, sidecars
    pil = pytest.importorskip("PIL.Image")
    buf = io.BytesIO()
    pil.fromarray(np.full((6, 4, 3), 200, dtype=np.uint8)).save(buf, format="PNG")
    with tarfile.open(tmp_path / "00003.tar", "w") as tar:
        for name, data in (
            ("000000100.png", buf.getvalue()),
            ("000000100.txt", b" a grey square \n"),
            ("000000100.json", json.dumps({"url": "x"}).encode()),
            ("000000101.png", buf.getvalue()),  # no .txt: skipped
        ):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    (tmp_path / "00003_stats.json").write_text("{}")
    source = TarShards(tmp_path)
    assert [source.shard_length(s) for s in range(4)] == [3, 3, 1, 1]
    assert source.shard(3).skipped == 1
    got = [source.read(s, i) for s in range(3) for i in range(source.shard_length(s))]
    assert all(_same(g, p) for g, p in zip(got, pairs))
    extra = source.read(3, 0)
    assert extra["caption"] == "a grey square" and extra["image"].shape == (6, 4, 3)
    assert extra["meta"] == {"url": "x"}
    with pytest.raises(DatasetError, match="no tar shards"):
        TarShards(tmp_path / "nowhere")


class Counting:
    """A pair source that records which samples were read (to check rank sharding)."""

    def __init__(self, shard_sizes):
        self.sizes, self.name, self.reads = shard_sizes, "counting", []

    def num_shards(self):
        return len(self.sizes)

    def shard_length(self, shard):
        return self.sizes[shard]

    def read(self, shard, index):
        self.reads.append((shard, index))
        return {"key": (shard, index)}


def _steps(dp: int, steps: int, micro: int = 2, **kw) -> list[list]:
    """The global batches of ``steps`` steps, put together from every dp rank's microbatches."""
    loaders = [
        PairLoader(
            Counting([5, 7, 3, 6]),
            global_batch_size=8,
            micro_batch_size=micro,
            dp_rank=r,
            dp_size=dp,
            window_shards=2,
            seed=3,
            **kw,
        )
        for r in range(dp)
    ]
    out = []
    for _ in range(steps):
        out.append([s["key"] for ldr in loaders for mb in ldr.next_batch() for s in mb])
    return out, loaders


def test_same_global_batch_at_any_dp_and_ranks_read_their_own():
    ref, _ = _steps(1, 6)
    for dp in (2, 4):
        got, loaders = _steps(dp, 6, micro=1)
        assert got == ref
        for r, ldr in enumerate(loaders):  # each rank decoded exactly its own block
            assert ldr.source.reads == [k for step in ref for k in step[r * 8 // dp :][: 8 // dp]]
    # 21 pairs, global batch 8: two steps per epoch (the tail of 5 dropped), no pair twice in
    # an epoch, and a new order each epoch
    epoch0, epoch1 = ref[0] + ref[1], ref[2] + ref[3]
    assert len(set(epoch0)) == len(set(epoch1)) == 16 and epoch0 != epoch1


def test_exact_resume_under_another_dp():
    ref, _ = _steps(1, 7)
    _, loaders = _steps(2, 3)
    state = loaders[0].state_dict()
    assert state == loaders[1].state_dict()
    fresh = PairLoader(
        Counting([5, 7, 3, 6]),
        global_batch_size=8,
        micro_batch_size=4,
        dp_rank=0,
        dp_size=1,
        window_shards=99,
        seed=0,
    )
    fresh.load_state_dict(json.loads(json.dumps(state)))
    rest = [[s["key"] for mb in fresh.next_batch() for s in mb] for _ in range(4)]
    assert rest == ref[3:]


def test_loader_errors():
    with pytest.raises(ValueError, match="not divisible by micro batch size 2 x dp 3"):
        PairLoader(Counting([10]), global_batch_size=8, micro_batch_size=2, dp_size=3)
    small = PairLoader(Counting([3, 2]), global_batch_size=8, micro_batch_size=8)
    with pytest.raises(DatasetError, match="fewer pairs than one global batch of 8"):
        small.next_batch()
    loader = PairLoader(Counting([10]), global_batch_size=2, micro_batch_size=2)
    with pytest.raises(DatasetError, match="for 2 shards"):
        loader.load_state_dict({**loader.state_dict(), "num_shards": 2})


def test_synthetic_pairs():
    train, held_out = SyntheticPairs(seed=1, size=50), SyntheticPairs(seed=1, size=50, split="eval")
    a, b = train.read(0, 7), SyntheticPairs(seed=1, size=50).read(0, 7)
    assert _same(a, b) and a["image"].shape == (32, 32, 3) and a["image"].dtype == np.uint8
    assert not np.array_equal(a["image"], held_out.read(0, 7)["image"])
    names = SyntheticPairs.class_names()
    assert len(names) == 18
    for i in range(20):
        s = train.read(0, i)
        assert names[s["label"]] in s["caption"]  # "a red circle ..." names its class
