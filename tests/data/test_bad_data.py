"""Bad input: one DatasetError naming the file and the record or episode, before training
where it can be found by the scan, from the step's batch where only decoding finds it."""

import json

import pytest

from benchmarks.data.lerobot_writer import write_lerobot
from benchmarks.data.writers import feature_bytes, make_episodes, write_libero, write_rlds
from parallax.data.mixture import load_mixture, open_source
from parallax.data.stats import DatasetError
from parallax.data.stream import StreamLoader

pytest.importorskip("crc32c")


def _shard(folder):
    return sorted(folder.glob("*.tfrecord-*"))[0]


def test_crc_mismatch_and_truncated_shards(tmp_path):
    folder = write_rlds(tmp_path, "ds", make_episodes(4, size=8), "png", shards=1)
    shard = _shard(folder)
    blob = bytearray(shard.read_bytes())
    first = 12 + int.from_bytes(blob[:8], "little") + 4  # record 1 starts here
    good = bytes(blob)
    blob[first + 40] ^= 0x01
    shard.write_bytes(bytes(blob))
    with pytest.raises(DatasetError, match=rf"{shard.name}: record 1 at byte {first}: data CRC"):
        open_source(f"rlds:{folder}")
    shard.write_bytes(good[:-30])  # cut inside the last record
    with pytest.raises(DatasetError, match=rf"{shard.name}: record 3 .*truncated shard"):
        open_source(f"rlds:{folder}")
    shard.write_bytes(good[:first])  # cut at a record boundary: the declared count catches it
    with pytest.raises(DatasetError, match="truncated shard: dataset_info.json declares 4"):
        open_source(f"rlds:{folder}")


def test_missing_keys(tmp_path):
    episodes = make_episodes(3, size=8)
    episodes[1].extra = {"steps/observation/image": None}
    folder = write_rlds(tmp_path, "ds", episodes, "png", shards=1)
    pattern = r"record 1 \(episode 1\): missing key 'steps/observation/image'"
    with pytest.raises(DatasetError, match=pattern):
        open_source(f"rlds:{folder}")
    write_libero(tmp_path / "lib", {"open_it": episodes[:2]})
    import h5py

    with h5py.File(tmp_path / "lib" / "open_it_demo.hdf5", "a") as f:
        del f["data/demo_1/obs/agentview_rgb"]
    with pytest.raises(DatasetError, match=r"episode 1 \(data/demo_1\): missing key 'obs/agentv"):
        open_source(f"libero:{tmp_path / 'lib'}")


def test_dimensions_that_disagree_between_episodes(tmp_path):
    episodes = make_episodes(3, size=8)
    episodes[2].actions = episodes[2].actions[:, :6]
    write_libero(tmp_path / "lib", {"open_it": episodes})
    with pytest.raises(DatasetError, match=r"episode 2 \(data/demo_2\): action dimension 6 disagr"):
        open_source(f"libero:{tmp_path / 'lib'}")
    episodes = make_episodes(3, size=8)
    episodes[1].states = episodes[1].states[:, :5]
    root = write_lerobot(tmp_path / "lr", episodes, "v2.1")
    with pytest.raises(DatasetError, match=r"episode_000001.parquet: episode 1: state dimension 5"):
        open_source(str(root))


def test_empty_datasets_and_unsupported_versions(tmp_path):
    folder = write_rlds(tmp_path, "ds", make_episodes(2, size=8), "png", shards=1)
    _shard(folder).write_bytes(b"")
    info = json.loads((folder / "dataset_info.json").read_text())
    info["splits"][0]["shardLengths"] = ["0"]
    (folder / "dataset_info.json").write_text(json.dumps(info))
    with pytest.raises(DatasetError, match=f"dataset {folder} is empty"):
        open_source(f"rlds:{folder}")
    write_libero(tmp_path / "lib", {"nothing": []}, problem_info=False)
    with pytest.raises(DatasetError, match="is empty"):
        open_source(f"libero:{tmp_path / 'lib'}")
    root = write_lerobot(tmp_path / "old", make_episodes(2, size=8), "v2.1")
    info = json.loads((root / "meta" / "info.json").read_text())
    (root / "meta" / "info.json").write_text(json.dumps({**info, "codebase_version": "v1.6"}))
    with pytest.raises(DatasetError, match=r"info.json: LeRobot codebase_version 'v1.6' is not"):
        open_source(str(root))
    (tmp_path / "other").mkdir()
    with pytest.raises(DatasetError, match="other is not a dataset this reader knows"):
        open_source(str(tmp_path / "other"))


@pytest.mark.parametrize("workers", [0, 1])
def test_an_image_that_does_not_decode(tmp_path, workers):
    episodes = make_episodes(2, size=8, lengths=[3, 3])
    episodes[1].extra = {"steps/observation/image": feature_bytes([b"not an image"] * 3)}
    folder = write_rlds(tmp_path, "ds", episodes, "png", shards=1)
    mix = load_mixture(f"rlds:{folder}")  # the scan leaves images encoded
    loader = StreamLoader(mix, global_batch_size=6, micro_batch_size=6, workers=workers)
    name = _shard(folder).name
    pattern = rf"{name}: record 1 \(episode 1\): step \d: image 'observation/image' does not"
    with pytest.raises(DatasetError, match=pattern):
        loader.next_batch()
    loader.close()
