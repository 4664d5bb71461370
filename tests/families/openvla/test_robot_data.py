"""Training on robot datasets: an RLDS set learns at tp2 dp2, a resume at another layout
continues the same samples, bad data stops every rank with one message before any step on
it, mixtures and [[data]] lists, and predict_action with the run's statistics."""

import json
import re
from pathlib import Path

import numpy as np
import pytest

from parallax.recipe import resolve
from tests.train.test_cli import metrics, single

pytest.importorskip("crc32c")
pytest.importorskip("PIL")

RUN = (
    "--steps",
    "10",
    "--global-batch-size",
    "8",
    "--micro-batch-size",
    "2",
    "--warmup-steps",
    "2",
    "--lr",
    "5e-3",
    "--log-interval",
    "5",
    "--workers",
    "0",
)
COLOURS = np.array([[220, 40, 40], [40, 200, 60], [50, 60, 230], [230, 220, 50]], np.uint8)


def learnable_episodes(n: int, size: int = 16, action_dim: int = 7, seed: int = 0):
    """Episodes whose action follows the task (its instruction and the image's colour)."""
    from benchmarks.data.writers import Ep

    rng = np.random.default_rng(seed)
    targets = rng.uniform(-1, 1, (len(COLOURS), action_dim)).astype(np.float32)
    out = []
    for k in range(n):
        task, length = k % len(COLOURS), 4 + k % 3
        images = np.broadcast_to(COLOURS[task], (length, size, size, 3)).copy()
        noise = rng.normal(0, 1e-4, (length, action_dim)).astype(np.float32)
        out.append(
            Ep(
                images=images,
                wrist=images.copy(),
                states=np.zeros((length, 8), np.float32),
                actions=targets[task] + noise,
                instruction=f"task {task}",
            )
        )
    return out


@pytest.fixture(scope="module")
def rlds(tmp_path_factory) -> Path:
    from benchmarks.data.writers import write_rlds

    root = tmp_path_factory.mktemp("robot")
    return write_rlds(root, "arm", learnable_episodes(12), "jpeg", shards=2)


def _train(tp, dp, out, data, stop_after=None, resume=False, extra=()):
    """cli.run on a pool rank; a UserError comes back as its message."""
    from parallax.testing import context
    from parallax.train import parse_args
    from parallax.train.cli import UserError, resolve_run, run

    ctx = context(tp=tp, dp=dp)
    args = ["--tp", str(tp), "--dp", str(dp), "--out", out, "--data", data, *RUN, *extra]
    cfg = parse_args(args + ["--save-interval", "5"] + (["--resume"] if resume else []))
    try:
        run(resolve_run(cfg), ctx, stop_after=stop_after)
    except UserError as err:
        return str(err)
    return None


@pytest.fixture(scope="module")
def reference(rlds, tmp_path_factory):
    """10 uninterrupted steps at tp2 dp2 on 4 ranks (60 samples: the second epoch starts in step
    8)."""
    from parallax.testing import run_ranks

    out = tmp_path_factory.mktemp("ref")
    assert run_ranks(_train, 4, 2, 2, str(out), f"rlds:{rlds}") == [None] * 4
    return out, metrics(out)


def test_rlds_run_learns_at_tp2_dp2_and_writes_its_statistics(reference, rlds):
    out, rows = reference
    assert [r["step"] for r in rows] == list(range(1, 11))
    first = rows[0]["action_accuracy"]
    last = np.mean([r["action_accuracy"] for r in rows[-3:]])
    assert last > first + 0.15, (first, last)
    assert rows[-1]["loss"] < 0.7 * rows[0]["loss"]
    assert all(r["data_wait_s"] >= 0 for r in rows)
    stats = json.loads((out / "dataset_statistics.json").read_text())
    assert list(stats) == ["arm"] and len(stats["arm"]["action"]["q01"]) == 7
    assert stats["arm"]["num_trajectories"] == 12
    ckpt = json.loads((out / "checkpoints" / "step_00000010" / "meta.json").read_text())
    assert ckpt["data"]["position"] == 10 * 8  # the stream's position, as JSON


def test_resume_mid_epoch_at_another_layout_continues_the_same_samples(reference, rlds, tmp_path):
    from parallax.testing import run_ranks

    _, ref = reference
    out, data = str(tmp_path / "a"), f"rlds:{rlds}"
    # 60 samples: step 5 ends mid-epoch; interrupted at tp1 dp4, resumed at tp2 dp2
    assert run_ranks(_train, 4, 1, 4, out, data, 5) == [None] * 4
    assert run_ranks(_train, 4, 2, 2, out, data, None, True) == [None] * 4
    rows = metrics(Path(out))
    assert [r["step"] for r in rows] == list(range(1, 11))
    assert [r["loss"] for r in rows[5:]] == pytest.approx([r["loss"] for r in ref[5:]], rel=1e-4)


def _bad_rlds(root: Path, problem: str) -> Path:
    from benchmarks.data.writers import feature_bytes, write_rlds

    episodes = learnable_episodes(8)
    if problem == "image":  # two episodes whose frames do not decode: found when read
        for k in (1, 6):
            episodes[k].extra = {
                "steps/observation/image": feature_bytes(
                    [b"not an image"] * len(episodes[k].images)
                )
            }
    folder = write_rlds(root, f"bad_{problem}", episodes, "png", shards=1)
    if problem == "crc":  # found by the scan, before the model is built
        shard = sorted(folder.glob("*.tfrecord-*"))[0]
        blob = bytearray(shard.read_bytes())
        blob[12 + int.from_bytes(blob[:8], "little") + 4 + 40] ^= 1  # inside record 1
        shard.write_bytes(bytes(blob))
    return folder


def test_bad_data_stops_every_rank_with_one_message_before_a_step_on_it(tmp_path):
    from parallax.testing import run_ranks

    crc = _bad_rlds(tmp_path, "crc")
    said = run_ranks(_train, 4, 2, 2, str(tmp_path / "crc_run"), f"rlds:{crc}")
    assert len(set(said)) == 1, said  # every rank, the same message
    assert re.search(r"--data: .*tfrecord-00000-of-00001: record 1 at byte \d+: data CRC", said[0])
    assert not (tmp_path / "crc_run" / "metrics.jsonl").exists()

    image = _bad_rlds(tmp_path, "image")
    out = tmp_path / "image_run"
    said = run_ranks(_train, 4, 1, 4, str(out), f"rlds:{image}")
    assert len(set(said)) == 1, said
    pattern = r"the batch of step (\d+): rank \d: .*tfrecord-00000-of-00001: record \d \(episode"
    found = re.search(pattern + r" \d\): step \d: image 'observation/image' does not", said[0])
    assert found, said[0]
    steps = [r["step"] for r in metrics(out)] if (out / "metrics.jsonl").exists() else []
    assert all(s < int(found.group(1)) for s in steps), (steps, said[0])


def test_bad_evaluation_data_stops_every_rank_with_one_message(rlds, tmp_path):
    """A held-out batch that does not decode on some ranks: every rank stops at that
    evaluation with the same message (none is left waiting in the forward's collectives)."""
    from parallax.testing import run_ranks

    image = _bad_rlds(tmp_path, "image")
    extra = ("--eval-data", f"rlds:{image}", "--eval-interval", "2", "--eval-batches", "4")
    out = tmp_path / "eval_run"
    said = run_ranks(_train, 4, 1, 4, str(out), f"rlds:{rlds}", None, False, extra)
    assert len(set(said)) == 1, said
    pattern = r"the evaluation at step 2, batch \d: rank \d: .*image 'observation/image' does not"
    assert re.search(pattern, said[0]), said[0]
    assert [r["step"] for r in metrics(out)] == [1, 2]  # the steps before it were logged


def test_bad_data_exits_with_status_2(tmp_path, capsys):
    image = _bad_rlds(tmp_path, "image")
    args = ["--data", str(image.parent), "--out", str(tmp_path / "run"), *RUN[:-2]]
    status, _, err = single(capsys, *args, "--workers", "0", "--steps", "2")
    assert status == 2, err[-2000:]
    assert "does not decode" in err and "record" in err, err[-2000:]
    assert "Traceback" not in err


def test_mixture_specs_and_which_data_streams(rlds, tmp_path):
    from benchmarks.data.lerobot_writer import write_lerobot
    from benchmarks.data.writers import make_episodes
    from parallax.data import Mixture
    from parallax.data.mixture import parse_data_spec
    from parallax.families.openvla.data import is_streamed
    from parallax.families.openvla.recipe import OpenVLARecipe
    from parallax.train import parse_args

    so100 = write_lerobot(tmp_path / "so100", make_episodes(3, size=8, action_dim=6), "v3.0")
    spec = f"rlds:{rlds}@0.7,lerobot:{so100}@0.3"
    a, b = parse_data_spec(spec)
    assert (a.format, a.path, a.weight) == ("rlds", str(rlds), 0.7)
    assert (b.format, b.path, b.weight) == ("lerobot", str(so100), 0.3)
    assert [is_streamed(s) for s in (spec, str(rlds.parent), str(so100), "synthetic")] == [
        True,
        True,
        True,
        False,
    ]
    assert not is_streamed(str(tmp_path / "missing"))  # the episode reader says what is missing
    cfg = parse_args(["--data", spec, "--out", str(tmp_path / "run")])
    mix = OpenVLARecipe().data.dataset(cfg.data, cfg)
    assert isinstance(mix, Mixture) and mix.weights == pytest.approx([0.7, 0.3])
    stats = mix.statistics  # each dataset keeps its own, of its own action dimension
    assert {name: len(s["action"]["q01"]) for name, s in stats.items()} == {"arm": 7, "so100": 6}
    assert (tmp_path / "run" / "data_index").is_dir()  # the scans, for the other ranks
    with pytest.raises(ValueError, match="give every dataset of a mixture a weight"):
        OpenVLARecipe().data.dataset(f"rlds:{rlds}@0.7,lerobot:{so100}", cfg)


def test_toml_data_list_and_key_configs(rlds, tmp_path):
    from parallax.families.openvla.recipe import OpenVLARecipe
    from parallax.train import parse_args

    keys = tmp_path / "keys.toml"
    keys.write_text("[arm]\nunnormalized = [5, 6]\n")
    toml = tmp_path / "run.toml"
    toml.write_text(
        f'steps = 3\ndata-config = "{keys}"\nworkers = 2\naugment = false\n'
        f'[[data]]\npath = "rlds:{rlds}"\nweight = 2.0\n'
        f'[[data]]\npath = "{rlds.parent}"\nweight = 1.0\nname = "arm_again"\n'
    )
    cfg = parse_args(["--config", str(toml), "--out", str(tmp_path / "run")])
    assert (cfg.steps, cfg.workers, cfg.augment, cfg.data_config) == (3, 2, False, str(keys))
    assert [d["weight"] for d in cfg.data] == [2.0, 1.0]
    mix = OpenVLARecipe().data.dataset(cfg.data, cfg)
    assert mix.names == ["arm", "arm_again"] and mix.weights == pytest.approx([2 / 3, 1 / 3])
    assert mix.statistics["arm"]["action"]["mask"] == [True] * 5 + [False, False]
    json.dumps(cfg.to_dict())  # checkpoints keep the list as JSON
    for bad, message in (
        ("data = 5\n", "data = 5: expected a string or a table"),
        ("[[data]]\nweight = 1.0\n", r"\[\[data\]\] entries \[0\] need a path"),
    ):
        toml.write_text(bad)
        with pytest.raises(ValueError, match=message):
            resolve(parse_args(["--config", str(toml)]))
    with pytest.raises(ValueError, match="--workers must be >= 0"):
        resolve(parse_args(["--workers", "-1"]))


def test_predict_action_reads_the_runs_statistics_and_crops_the_centre(reference, tmp_path):
    import torch

    from parallax.data.augment import center_crop
    from parallax.families.openvla.config import OpenVLAConfig
    from parallax.families.openvla.model import OpenVLA
    from parallax.families.openvla.preprocess import pixel_values

    out, _ = reference
    model = OpenVLA(OpenVLAConfig.preset("tiny"), seed=0)
    image = np.random.default_rng(0).integers(0, 256, (56, 56, 3), dtype=np.uint8)
    stats = json.loads((out / "dataset_statistics.json").read_text())
    action = model.predict_action(image, "task 1", statistics=out / "dataset_statistics.json")
    assert action.shape == (7,)
    bounds = np.array(stats["arm"]["action"]["q01"]), np.array(stats["arm"]["action"]["q99"])
    assert np.all(action[:6] >= bounds[0][:6] - 1e-6) and np.all(action[:6] <= bounds[1][:6] + 1e-6)
    six = {"so100": {"action": {k: [0.0] * 6 for k in ("q01", "q99", "min", "max", "mean", "std")}}}
    six["so100"]["action"]["mask"] = [True] * 6
    assert model.predict_action(image, "task 1", statistics=six).shape == (6,)
    seven = OpenVLA(dataclasses_replace(model.config, norm_stats=stats), seed=0)
    with pytest.raises(ValueError, match="6-dimensional actions"):
        seven.predict_action(image, "task 1", statistics=six)
    seen = []
    original = OpenVLA.forward

    def spy(self, px, *args, **kwargs):
        seen.append(px.clone())
        return original(self, px, *args, **kwargs)

    OpenVLA.forward = spy
    try:
        model.predict_action(image, "task 1", center_crop=True, use_cache=False)
    finally:
        OpenVLA.forward = original
    want = pixel_values([torch.from_numpy(center_crop(image, 0.9))], model.config)
    torch.testing.assert_close(seen[0], want)


def dataclasses_replace(obj, **changes):
    import dataclasses

    return dataclasses.replace(obj, **changes)
