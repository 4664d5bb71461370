"""RLDS, LIBERO HDF5 and LeRobot readers against datasets written by the formats' own tools
(benchmarks/data/writers.py): every episode, in order, with its images, actions, states and
instructions; the per-dataset configs; format detection; the converter."""

import json

import numpy as np
import pytest
import torch

from benchmarks.data.lerobot_writer import write_lerobot
from benchmarks.data.writers import make_episodes, write_libero, write_rlds
from parallax.data import BatchLoader, EpisodeDataset, load_dataset
from parallax.data.convert import main as convert
from parallax.data.keys import KeyConfig, load_key_configs, transform_episode
from parallax.data.libero import instruction_from_filename
from parallax.data.mixture import DataSpec, detect_format, open_source

pytest.importorskip("crc32c")
pytest.importorskip("google.protobuf")


def _all_samples(source, cameras=("primary", "wrist")):
    out = []
    for k in range(len(source.episodes)):
        opened = source.open_episode(k)
        out.append(
            [
                source.sample(opened, t, cameras=cameras, state=True)
                for t in range(source.episodes[k].length)
            ]
        )
        opened.close()
    return out


def _check(source, episodes, image_tol=0, transform=lambda a: a, flip=False):
    got = _all_samples(source)
    assert [len(e) for e in got] == [len(e.actions) for e in episodes]
    worst = 0
    for ep, samples in zip(episodes, got):
        actions = transform(ep.actions)
        for t, s in enumerate(samples):
            for key, want in (("image", ep.images[t]), ("wrist_image", ep.wrist[t])):
                assert s[key].shape == want.shape and s[key].dtype == np.uint8
                worst = max(worst, int(np.abs(s[key].astype(int) - want).max()))
            np.testing.assert_allclose(s["action"], actions[t], rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(s["state"], ep.states[t], rtol=1e-6)
            assert s["instruction"] == ep.instruction
    assert worst <= image_tol, worst
    return worst


@pytest.mark.parametrize("fmt,tol", [("png", 0), ("jpeg", 16)])
def test_rlds_reads_every_episode_in_order(tmp_path, fmt, tol):
    # JPEG at quality 95, 4:4:4, of these smooth 16x16 frames stays within 16 levels a pixel
    episodes = make_episodes(5, size=16)
    folder = write_rlds(tmp_path, "my_rlds", episodes, fmt, shards=2)
    for path in (folder, folder.parent):  # the shard folder, or its parent
        source = open_source(f"rlds:{path}")
        assert source.name == "my_rlds" and len(source.shards) == 2
        assert (source.action_dim, source.state_dim, source.image_shape) == (7, 8, (16, 16, 3))
        _check(source, episodes, image_tol=tol)
    assert detect_format(folder.parent) == "rlds"
    stats = source.statistics["my_rlds"]
    actions = np.concatenate([e.actions for e in episodes])
    np.testing.assert_allclose(stats["action"]["q01"], np.quantile(actions, 0.01, 0), rtol=1e-5)
    assert stats["action"]["mask"] == [True] * 6 + [False]
    assert stats["num_trajectories"] == 5 and stats["num_transitions"] == len(actions)


def test_libero_hdf5_rotation_gripper_and_instructions(tmp_path):
    episodes = make_episodes(4, size=12)
    for ep in episodes:  # LIBERO's gripper: -1 open ... +1 close
        ep.actions[:, -1] = np.array([-1.0, 1.0, 0.3, -0.2, 1.0, -1.0, 0.0][: len(ep.actions)])
    tasks = {"pick_up_the_bowl": episodes[:2], "put_the_cup_away": episodes[2:]}
    for ep in episodes[2:]:
        ep.instruction = "put the cup away"
    for ep in episodes[:2]:
        ep.instruction = "pick up the bowl"
    folder = write_libero(tmp_path / "libero_spatial", tasks)
    source = open_source(str(folder))
    assert source.format == "libero" and source.name == "libero_spatial"

    def gripper(a):  # OpenVLA's libero_dataset_transform, written out
        out = a.copy()
        out[:, -1] = 1.0 - np.clip(a[:, -1], 0.0, 1.0)
        return out

    _check(source, episodes, transform=gripper)  # frames upright again, exactly
    assert source.statistics["libero_spatial"]["action"]["max"][-1] == 1.0
    # no problem_info attribute: LIBERO's file-name rule
    write_libero(tmp_path / "regen", {"KITCHEN_SCENE10_put_the_pot_away": episodes[:1]}, False)
    assert open_source(f"libero:{tmp_path / 'regen'}").episodes[0].instruction == (
        "put the pot away"
    )
    assert instruction_from_filename("KITCHEN_SCENE3_turn_on_the_stove_demo.hdf5") == (
        "turn on the stove"
    )
    assert instruction_from_filename("pick_up_the_black_bowl_demo.hdf5") == (
        "pick up the black bowl"
    )


@pytest.mark.parametrize("version", ["v2.1", "v3.0"])
def test_lerobot_video_datasets(tmp_path, version):
    # libx264 crf 0 in yuv444p: the RGB <-> YUV round trip costs at most 3 levels
    episodes = make_episodes(5, size=16)
    root = write_lerobot(tmp_path / f"so100_{version}", episodes, version=version, per_file=2)
    source = open_source(str(root))
    assert source.format == "lerobot" and source.version == version
    assert source.config.primary == "observation.images.top"  # the first camera by default
    assert source.config.state == ("observation.state",) and source.config.wrist is None
    keys = KeyConfig(wrist="observation.images.wrist", state=("observation.state",))
    source = open_source(DataSpec(str(root), "lerobot", config=keys.replace(instruction=None)))
    _check(source, episodes, image_tol=3)


def test_lerobot_image_features_in_parquet(tmp_path):
    episodes = make_episodes(3, size=8)
    root = write_lerobot(tmp_path / "imgs", episodes, version="v3.0", camera_dtype="image")
    keys = KeyConfig(wrist="observation.images.wrist", state="observation.state", instruction=None)
    _check(
        open_source(DataSpec(str(root), "lerobot", config=keys)), episodes
    )  # PNG bytes in the rows: exact


def test_configs_builtin_user_and_transforms(tmp_path):
    path = tmp_path / "keys.toml"
    path.write_text(
        '[my_rlds]\nprimary = "observation/wrist_image"\nstate = "observation/state"\n'
        'transform = "invert"\nunnormalized = [0, 6]\n[[data]]\npath = "x"\n'
    )
    configs = load_key_configs(path)
    episodes = make_episodes(2, size=8)
    folder = write_rlds(tmp_path, "my_rlds", episodes, "png", shards=1)
    source = open_source(str(folder), user_configs=configs)
    opened = source.open_episode(1)
    sample = source.sample(opened, 2)
    assert np.array_equal(sample["image"], episodes[1].wrist[2])
    assert sample["action"][-1] == pytest.approx(1.0 - episodes[1].actions[2, -1])
    assert source.statistics["my_rlds"]["action"]["mask"] == [False] + [True] * 5 + [False]
    # a built-in config by the dataset's name: OpenVLA's LIBERO RLDS sets
    folder = write_rlds(tmp_path, "libero_10_no_noops", episodes, "png", shards=1)
    source = open_source(str(folder))
    assert source.config.transform == "libero" and source.config.wrist == "observation/wrist_image"
    got = source.sample(source.open_episode(0), 1)["action"][-1]
    assert got == pytest.approx(1.0 - np.clip(episodes[0].actions[1, -1], 0, 1))
    # the gripper standardisations, against the loops of OpenVLA's docstrings
    g = np.array([1.0, 0.5, 0.0, 0.02, 0.6, 0.99, 0.97, 0.5], dtype=np.float32)
    a = np.tile(g[:, None], (1, 7))
    got, _, _ = transform_episode(KeyConfig(transform="binarize"), a, None)
    assert got[:, -1].tolist() == [1, 0, 0, 0, 1, 1, 1, 0.5]
    rel = np.array([0, 0, 1, 0, 0, -1, 0], dtype=np.float32)
    got, _, _ = transform_episode(KeyConfig(transform="rel2abs"), np.tile(rel[:, None], 7), None)
    assert got[:, -1].tolist() == [1, 1, 0, 0, 0, 1, 1]
    states = np.cumsum(np.ones((6, 7), np.float32), axis=0)
    acts = np.tile(np.array([0, 1, 1, 0, 0, 1], np.float32)[:, None], (1, 7))
    got, kept, first = transform_episode(KeyConfig(transform="bridge"), acts, states)
    assert first == 1 and len(got) == 4 and np.allclose(got[:, :6], 1.0)
    assert got[:, -1].tolist() == [1, 1, 0, 0] and np.array_equal(kept, states[1:5])


def test_load_dataset_and_batch_loader_read_foreign_formats(tmp_path):
    episodes = make_episodes(3, size=8)
    folder = write_rlds(tmp_path, "ds", episodes, "png", shards=1)
    data = load_dataset(str(folder))
    assert len(data) == sum(len(e.actions) for e in episodes) and data.name == "ds"
    batch = BatchLoader(data, global_batch_size=4, micro_batch_size=2, shuffle=False).next_batch()
    assert torch.equal(batch[0][1]["image"], torch.from_numpy(episodes[0].images[1]))
    assert batch[0][1]["action"].dtype == torch.float32


def test_convert_writes_parallax_episodes(tmp_path):
    episodes = make_episodes(3, size=8)
    write_libero(tmp_path / "suite", {"open_the_drawer": episodes}, problem_info=False)
    out = tmp_path / "converted"
    assert convert(["auto", str(tmp_path / "suite"), str(out), "--image-size", "4"]) == 0
    data = EpisodeDataset(out)
    assert data.name == "suite" and len(data) == sum(len(e.actions) for e in episodes)
    assert data.image_shape == (4, 4, 3)
    assert 0 <= data[0]["action"][-1].item() <= 1  # LIBERO's gripper, standardised
    assert json.loads((out / "index.json").read_text())["episodes"][0]["instruction"] == (
        "open the drawer"
    )
    assert convert(["rlds", str(tmp_path / "nowhere"), str(tmp_path / "o2")]) == 1


def test_scan_index_is_cached_by_files_and_config(tmp_path, monkeypatch):
    episodes = make_episodes(3, size=8)
    folder = write_rlds(tmp_path, "ds", episodes, "png", shards=1)
    cache = tmp_path / "index"
    first = open_source(f"rlds:{folder}", cache_dir=cache)
    assert len(list(cache.glob("rlds-ds-*.json"))) == 1
    from parallax.data.rlds import RLDSSource

    def no_scan(self):
        raise AssertionError("scanned again")

    monkeypatch.setattr(RLDSSource, "scan_episodes", no_scan)
    again = open_source(f"rlds:{folder}", cache_dir=cache)
    assert again.statistics == first.statistics and again.image_shape == first.image_shape
    assert [(e.length, e.where, e.label) for e in again.episodes] == [
        (e.length, list(e.where), e.label) for e in first.episodes
    ]
    sample = again.sample(again.open_episode(2), 1)
    assert np.array_equal(sample["image"], episodes[2].images[1])
    with pytest.raises(AssertionError, match="scanned again"):  # another config: another index
        open_source(
            DataSpec(str(folder), "rlds", config=KeyConfig(primary="observation/image")),
            cache_dir=cache,
        )
