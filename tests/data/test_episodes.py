"""The on-disk episode format: export and read back, the converter, and bad datasets."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from parallax.data import (
    BatchLoader,
    DatasetError,
    Episode,
    EpisodeDataset,
    SyntheticTask,
    load_dataset,
    write_dataset,
)
from parallax.data.convert import main as convert


def _same(a, b):
    return (
        torch.equal(a["image"], b["image"])
        and torch.equal(a["action"], b["action"])
        and a["instruction"] == b["instruction"]
    )


def test_exported_synthetic_task_reads_back_identically(tmp_path):
    task = SyntheticTask(seed=2, num_episodes=6, image_size=32)
    out = write_dataset(tmp_path / "ds", task.episodes(), task.name)
    data = load_dataset(str(out))
    assert isinstance(data, EpisodeDataset) and len(data) == len(task)
    assert all(_same(data[i], task[i]) for i in range(len(task)))
    assert data.statistics == task.statistics  # same norm_stats, computed from the files
    index = json.loads((out / "index.json").read_text())
    assert index["format"] == "parallax-episodes" and index["num_episodes"] == 6
    assert index["image_shape"] == [32, 32, 3] and index["action_dim"] == 7
    assert [p.name for p in tmp_path.iterdir()] == ["ds"]  # no temp dirs left
    # the loader reads from disk exactly what it reads from the task
    a = BatchLoader(task, global_batch_size=6, micro_batch_size=3, seed=1).next_batch()
    b = BatchLoader(data, global_batch_size=6, micro_batch_size=3, seed=1).next_batch()
    assert all(_same(x, y) for mx, my in zip(a, b) for x, y in zip(mx, my))


def test_the_documented_command_exports_the_synthetic_task(tmp_path):
    out = tmp_path / "synthetic"
    cmd = [sys.executable, "-m", "parallax.data.convert", "synthetic", str(out)]
    args = ["--episodes", "2", "--image-size", "16", "--seed", "4"]
    root = Path(__file__).resolve().parents[2]  # run this checkout's package
    subprocess.run(cmd + args, check=True, capture_output=True, cwd=root)
    data = EpisodeDataset(out)
    task = SyntheticTask(seed=4, num_episodes=2, image_size=16)
    assert len(data) == len(task) and all(_same(data[i], task[i]) for i in range(len(task)))
    assert convert(["synthetic", str(out)]) == 1  # refuses to overwrite...
    assert (
        convert(["synthetic", str(out), "--episodes", "1", "--overwrite"]) == 0
    )  # ...unless asked
    assert len(EpisodeDataset(out)) == 5


def _source_folder(root):
    rng = np.random.default_rng(0)
    a, b = root / "ep_a", root / "ep_b"
    (a).mkdir(parents=True)
    (b / "images").mkdir(parents=True)
    images_a = rng.integers(0, 256, (3, 20, 24, 3), dtype=np.uint8)
    actions_a = rng.normal(size=(3, 7)).astype(np.float32)
    np.save(a / "images.npy", images_a)
    lines = ["x,y,z,roll,pitch,yaw,gripper"] + [",".join(map(repr, r.tolist())) for r in actions_a]
    (a / "actions.csv").write_text("\n".join(lines) + "\n")
    (a / "instruction.txt").write_text("put the cup in the sink\n")
    images_b = rng.integers(0, 256, (11, 20, 24, 3), dtype=np.uint8)
    for t, frame in enumerate(images_b):  # frame_2 must come before frame_10
        np.save(b / "images" / f"frame_{t}.npy", frame)
    actions_b = rng.normal(size=(11, 7)).astype(np.float32)
    np.save(b / "actions.npy", actions_b)
    (root / "instructions.json").write_text(json.dumps({"ep_b": "open the drawer"}))
    return [
        (images_a, actions_a, "put the cup in the sink"),
        (images_b, actions_b, "open the drawer"),
    ]


def test_converter_writes_a_folder_of_npy_episodes(tmp_path):
    expected = _source_folder(tmp_path / "src")
    assert (
        convert(["folder", str(tmp_path / "src"), str(tmp_path / "out"), "--name", "kitchen"]) == 0
    )
    data = EpisodeDataset(tmp_path / "out")
    assert data.name == "kitchen" and len(data) == 14 and list(data.statistics) == ["kitchen"]
    i = 0
    for images, actions, instruction in expected:
        for t in range(len(images)):
            s = data[i]
            assert np.array_equal(s["image"].numpy(), images[t]), (i, t)
            assert np.allclose(s["action"].numpy(), actions[t]) and s["instruction"] == instruction
            i += 1
    stats = data.statistics["kitchen"]["action"]
    all_actions = np.concatenate([e[1] for e in expected])
    assert np.allclose(stats["q01"], np.quantile(all_actions, 0.01, axis=0), atol=1e-6)
    assert (
        convert(
            ["folder", str(tmp_path / "src"), str(tmp_path / "small"), "--image-size", "10", "12"]
        )
        == 0
    )
    assert EpisodeDataset(tmp_path / "small")[0]["image"].shape == (10, 12, 3)


def test_converter_errors(tmp_path, capsys):
    src = tmp_path / "src" / "ep"
    src.mkdir(parents=True)
    np.save(src / "actions.npy", np.zeros((1, 7), np.float32))
    (src / "instruction.txt").write_text("wave")
    (src / "images").mkdir()
    (src / "images" / "0.png").write_bytes(b"\x89PNG")
    try:
        import PIL  # noqa: F401
    except ImportError:
        assert convert(["folder", str(tmp_path / "src"), str(tmp_path / "out")]) == 1
        assert "needs Pillow (pip install pillow)" in capsys.readouterr().err
    assert convert(["folder", str(tmp_path / "nowhere"), str(tmp_path / "out")]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_write_failure_leaves_nothing_behind(tmp_path):
    def episodes():
        yield Episode(torch.zeros(2, 8, 8, 3, dtype=torch.uint8), torch.zeros(2, 7), "go")
        yield Episode(torch.zeros(2, 9, 8, 3, dtype=torch.uint8), torch.zeros(2, 7), "go")

    with pytest.raises(DatasetError, match=r"image shape \(9, 8, 3\) differs"):
        write_dataset(tmp_path / "ds", episodes(), "bad")
    with pytest.raises(DatasetError, match="no episodes"):
        write_dataset(tmp_path / "ds", iter(()), "empty")
    assert list(tmp_path.iterdir()) == []


def test_bad_dataset_directories_fail_clearly(tmp_path):
    task = SyntheticTask(seed=0, num_episodes=3, image_size=16)
    good = write_dataset(tmp_path / "good", task.episodes(), task.name)

    def broken(name, edit):
        path = tmp_path / name
        write_dataset(path, task.episodes(), task.name)
        edit(path)
        return path

    cases = {
        "no dataset_statistics.json": broken(
            "nostats", lambda p: (p / "dataset_statistics.json").unlink()
        ),
        "no index.json": broken("noindex", lambda p: (p / "index.json").unlink()),
        "episode 1": broken(
            "truncated",
            lambda p: (p / "episodes/episode_000001.safetensors").write_bytes(
                (good / "episodes/episode_000001.safetensors").read_bytes()[:-10]
            ),
        ),
        "is empty": broken("empty", lambda p: _edit_index(p, episodes=[])),
        "expected shapes": broken("length", lambda p: _edit_index(p, length=7)),
    }
    for expected, path in cases.items():
        with pytest.raises(DatasetError, match=expected):
            EpisodeDataset(path)


def _edit_index(path, episodes=None, length=None):
    index = json.loads((path / "index.json").read_text())
    if episodes is not None:
        index["episodes"] = episodes
    if length is not None:
        index["episodes"][0]["length"] = length
    (path / "index.json").write_text(json.dumps(index))


def _episode_folder(root, name, actions):
    ep = root / name
    ep.mkdir(parents=True)
    np.save(ep / "images.npy", np.zeros((len(actions), 8, 8, 3), np.uint8))
    np.save(ep / "actions.npy", np.asarray(actions, np.float32))
    (ep / "instruction.txt").write_text("wave")


def test_converter_checks_the_action_dimension(tmp_path, capsys):
    src, out = tmp_path / "src", tmp_path / "out"
    _episode_folder(src, "ep_0", np.zeros((2, 6)))
    assert convert(["folder", str(src), str(out)]) == 1  # 6 numbers, OpenVLA's 7 expected
    err = capsys.readouterr().err
    assert "ep_0/actions.npy: 6-dimensional actions, but --action-dim is 7" in err, err
    assert "--action-dim 6" in err and not out.exists()
    assert convert(["folder", str(src), str(out), "--action-dim", "6"]) == 0
    assert "6-dimensional actions" in capsys.readouterr().out
    data = EpisodeDataset(out)
    assert data.action_dim == 6 and len(data.statistics["out"]["action"]["q01"]) == 6
    _episode_folder(src, "ep_1", np.zeros((2, 7)))  # one episode of another dimension
    assert convert(["folder", str(src), str(tmp_path / "o2"), "--action-dim", "6"]) == 1
    assert "ep_1/actions.npy: 7-dimensional actions" in capsys.readouterr().err
    # an index and statistics that disagree (edited by hand) fail when the dataset opens
    index = json.loads((out / "index.json").read_text())
    (out / "index.json").write_text(json.dumps({**index, "action_dim": 7}))
    with pytest.raises(DatasetError, match="actions have 7 dimensions.*statistics of 6"):
        EpisodeDataset(out)


def test_converter_names_its_flags_and_shows_the_folder_layout(tmp_path, capsys):
    src = tmp_path / "src"
    _episode_folder(src, "ep_0", np.zeros((2, 7)))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old").write_text("x")
    assert convert(["folder", str(src), str(tmp_path / "out")]) == 1
    assert "pass --overwrite to replace it" in capsys.readouterr().err
    (src / "ep_0" / "actions.npy").unlink()
    (src / "ep_0" / "actions.csv").write_text("1,2,3,4,5,6,7\n1,2,3,4,5,6\n")
    assert convert(["folder", str(src), str(tmp_path / "o")]) == 1
    assert "data row 2 has 6 numbers, the first has 7" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        convert(["folder", "--help"])
    shown = capsys.readouterr().out
    for text in ("instructions.json", "instruction.txt", "actions.csv", "images/", "--action-dim"):
        assert text in shown, shown
