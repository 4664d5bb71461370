"""The streaming loader: every sample once per epoch at any dp, the same global batch at any
dp and worker count, exact resume, mixtures whose frequencies follow their weights."""

import json

import numpy as np
import pytest
import torch

from benchmarks.data.lerobot_writer import write_lerobot
from benchmarks.data.writers import make_episodes, write_rlds
from parallax.data.augment import center_crop, resize
from parallax.data.mixture import load_mixture, parse_data_spec, specs_from_toml
from parallax.data.stats import DatasetError, write_statistics
from parallax.data.stream import StreamLoader

pytest.importorskip("crc32c")


@pytest.fixture(scope="module")
def data_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")
    episodes = make_episodes(9, size=8, lengths=[3, 5, 4, 6, 2, 5, 3, 4, 4])  # 36 samples
    rlds = write_rlds(root, "arm_rlds", episodes, "png", shards=3)
    lerobot = write_lerobot(root / "arm_lerobot", make_episodes(4, size=8, seed=1), "v3.0")
    return {"rlds": rlds, "lerobot": lerobot, "episodes": episodes}


def _global(mix, dp, steps, *, state=None, workers=0, micro=2, batch=12, **kw):
    """Each step's samples over all dp ranks in rank order, and the final state."""
    loaders = [
        StreamLoader(
            mix,
            global_batch_size=batch,
            micro_batch_size=micro,
            dp_rank=r,
            dp_size=dp,
            workers=workers,
            **{"seed": 5, "episodes_per_chunk": 3, **kw},
        )
        for r in range(dp)
    ]
    for loader in loaders:
        if state is not None:
            loader.load_state_dict(json.loads(json.dumps(state)))
    out = []
    for _ in range(steps):
        shares = [loader.next_batch() for loader in loaders]
        for share in shares:
            assert len(share) == loaders[0].num_microbatches
            assert all(len(mb) == micro for mb in share)
        out.append([s for share in shares for mb in share for s in mb])
    states = [loader.state_dict() for loader in loaders]
    assert all(s == states[0] for s in states)
    for loader in loaders:
        loader.close()
    return out, states[0]


def _ids(steps):
    return [(s["dataset"], s["episode"], s["step"]) for step in steps for s in step]


def _content(steps):
    return [
        (s["dataset"], s["instruction"], s["action"].tolist(), s["image"].numpy().tobytes())
        for step in steps
        for s in step
    ]


@pytest.mark.parametrize("dp", [1, 2, 3])
def test_every_sample_once_per_epoch_at_any_dp(data_dirs, dp):
    mix = load_mixture(f"rlds:{data_dirs['rlds']}")
    steps, _ = _global(mix, dp, 6)  # 72 positions = two epochs of 36
    ids = _ids(steps)
    every = sorted(
        (("arm_rlds", k, t)) for k, n in enumerate([3, 5, 4, 6, 2, 5, 3, 4, 4]) for t in range(n)
    )
    assert sorted(ids[:36]) == every and sorted(ids[36:]) == every
    assert ids[:36] != ids[36:]  # each epoch reshuffles
    s = steps[0][0]  # the samples are the written ones
    ep = data_dirs["episodes"][s["episode"]]
    assert torch.equal(s["image"], torch.from_numpy(ep.images[s["step"]]))
    assert torch.equal(s["action"], torch.from_numpy(ep.actions[s["step"]]))


def test_global_batch_is_the_same_at_any_dp_and_worker_count(data_dirs):
    mix = load_mixture(f"rlds:{data_dirs['rlds']}@0.6,lerobot:{data_dirs['lerobot']}@0.4")
    kw = {"images": "train", "image_size": 6}
    ref, _ = _global(mix, 1, 3, **kw)
    assert {s["image"].shape for step in ref for s in step} == {(6, 6, 3)}
    for dp, workers in ((2, 0), (3, 0), (2, 2)):
        got, _ = _global(mix, dp, 3, workers=workers, **kw)
        assert _content(got) == _content(ref), (dp, workers)
    plain, _ = _global(mix, 1, 3, images="none", image_size=6)
    assert _ids(plain) == _ids(ref) and _content(plain) != _content(ref)  # augmented


@pytest.mark.parametrize("save_dp,resume_dp,micro", [(2, 3, 1), (3, 1, 4)])
def test_resume_continues_the_same_sample_sequence(data_dirs, save_dp, resume_dp, micro):
    mix = load_mixture(f"rlds:{data_dirs['rlds']}@0.5,lerobot:{data_dirs['lerobot']}@0.5")
    full, _ = _global(mix, 1, 5, images="train", block_size=16)
    # 3 steps: mid-epoch of both datasets and mid-block of the mixture (36 = 2 x 16 + 4)
    head, state = _global(mix, save_dp, 3, images="train", block_size=16)
    kw = {"micro": micro, "seed": 99, "images": "train", "block_size": 16}  # the saved seed wins
    tail, _ = _global(mix, resume_dp, 2, state=state, **kw)
    assert _content(head + tail) == _content(full)
    other = load_mixture(f"rlds:{data_dirs['rlds']}")
    loader = StreamLoader(other, global_batch_size=12, micro_batch_size=2)
    with pytest.raises(DatasetError, match="resume with the same data"):
        loader.load_state_dict(state)


def test_mixture_frequencies_follow_the_weights_and_the_seed(data_dirs, tmp_path):
    mix = load_mixture(f"rlds:{data_dirs['rlds']}@0.7,lerobot:{data_dirs['lerobot']}@0.3")
    assert mix.names == ["arm_rlds", "arm_lerobot"] and mix.weights == pytest.approx([0.7, 0.3])
    loader = StreamLoader(mix, global_batch_size=8, micro_batch_size=8, seed=1, block_size=100)
    labels = np.array([loader.locate(q)[0] for q in range(1000)])
    for end in (100, 300, 1000):  # within one sample of 0.3 x positions at each block end
        assert abs((labels[:end] == 1).sum() - 0.3 * end) <= 1
    again = StreamLoader(mix, global_batch_size=8, micro_batch_size=8, seed=1, block_size=100)
    other = StreamLoader(mix, global_batch_size=8, micro_batch_size=8, seed=2, block_size=100)
    assert [again.locate(q) for q in range(300)] == [loader.locate(q) for q in range(300)]
    assert [other.locate(q) for q in range(300)] != [loader.locate(q) for q in range(300)]
    batch = loader.next_batch()[0]
    assert [s["dataset"] for s in batch] == [mix.names[d] for d in labels[:8]]
    progress = loader.progress()
    assert sum(p["samples"] for p in progress.values()) == 8
    # each dataset keeps its own statistics, keyed by its name
    write_statistics(tmp_path / "dataset_statistics.json", loader.statistics)
    stats = json.loads((tmp_path / "dataset_statistics.json").read_text())
    assert sorted(stats) == ["arm_lerobot", "arm_rlds"]
    assert (
        stats["arm_rlds"]["num_transitions"] == 36 and len(stats["arm_rlds"]["action"]["q99"]) == 7
    )


def test_specs_toml_and_eval_crop(data_dirs):
    (a, b) = parse_data_spec(f"rlds:{data_dirs['rlds']}@2,{data_dirs['lerobot']}@1")
    assert (a.format, a.weight, b.format, b.weight) == ("rlds", 2.0, None, 1.0)
    specs = specs_from_toml(
        [{"path": f"rlds:{data_dirs['rlds']}", "weight": 3, "name": "renamed"}]
        + [{"path": str(data_dirs["lerobot"]), "weight": 1, "config": {"unnormalized": [0]}}]
    )
    mix = load_mixture(specs)
    assert mix.names == ["renamed", "arm_lerobot"] and mix.weights == pytest.approx([0.75, 0.25])
    assert mix.statistics["arm_lerobot"]["action"]["mask"] == [False] + [True] * 6
    with pytest.raises(DatasetError, match="every dataset of a mixture a weight"):
        load_mixture(f"rlds:{data_dirs['rlds']}@2,{data_dirs['lerobot']}")
    plain = StreamLoader(mix, global_batch_size=4, micro_batch_size=4, image_size=6).next_batch()
    crop = StreamLoader(
        mix, global_batch_size=4, micro_batch_size=4, image_size=6, images="eval"
    ).next_batch()
    for p, c in zip(plain[0], crop[0]):
        assert np.array_equal(c["image"].numpy(), center_crop(resize(p["image"].numpy(), (6, 6))))
