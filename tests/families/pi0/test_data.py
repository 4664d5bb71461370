"""pi0's ``--data`` on LeRobot (v2.1 video, v3.0 images in the rows) and LIBERO datasets
written by benchmarks/data: microbatches of both variants against a hand computation (chunks,
padding, LeRobot's ``action_is_pad`` past an episode's end, mean/std or quantile normalisation,
images resized with centred padding), the flow-matching draws keyed by (seed, index, visit),
LeRobot's processor files read and written back bit for bit, and a short trainer run (streamed)
that exports them."""

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from benchmarks.data.lerobot_writer import write_lerobot
from benchmarks.data.writers import make_episodes, write_libero
from parallax.data.keys import KeyConfig
from parallax.data.mixture import DataSpec, open_source
from parallax.families.pi0.batches import Pi0Batches
from parallax.families.pi0.checkpoint import save_policy
from parallax.families.pi0.config import Pi0Config
from parallax.families.pi0.predict import load_policy
from parallax.families.pi0.processors import read_statistics
from parallax.families.pi0.robot_data import RobotSamples, lerobot_cameras
from parallax.recipe import resolve
from parallax.run import TrainConfig
from tests.families.pi0.helpers import tiny_model
from tests.train.test_cli import metrics, single

pytest.importorskip("pyarrow")
pytest.importorskip("h5py")
H = 4  # the tiny presets' chunk
TOL = dict(rtol=1e-5, atol=1e-5)  # the statistics are kept in float32


def _episodes(state_dim: int, instruction: str | None = None):
    eps = make_episodes(3, length=6, size=16, state_dim=state_dim)
    for ep in eps:  # 12 x 16 frames: resized to 24 x 32, 4 black rows above and below
        ep.images, ep.wrist = ep.images[:, :12], ep.wrist[:, :12]
        ep.instruction = instruction or ep.instruction
    return eps


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("pi0data")
    lerobot = _episodes(6)
    libero = _episodes(8, "pick")  # LIBERO's state: ee (6) + gripper (2)
    return {
        "v2.1": (write_lerobot(root / "so_v21", lerobot, version="v2.1"), lerobot, 3),
        "v3.0": (
            write_lerobot(root / "so_v30", lerobot, version="v3.0", camera_dtype="image"),
            lerobot,
            0,
        ),
        "libero": (write_libero(root / "libero_spatial", {"pick": libero}), libero, 0),
    }


def _run(model: str, data: Path, out: Path, checkpoint=None):
    """The run, ``data`` by random access (what --eval-data reads) and the collator."""
    run = resolve(TrainConfig.of(model=checkpoint or model, data=str(data), out=str(out)))
    dataset = run.recipe.data.eval_dataset(str(data), run)
    return run, dataset, run.recipe.data.collator(run, dataset)


def _expected(eps, kind: str):
    """Each sample's (actions (H, D), pad (H,), state (S,), first frame): every step, the
    chunk's steps past the end the last action, flagged; and the hand statistics."""
    actions = [ep.actions.copy() for ep in eps]
    if kind == "libero":  # the gripper to 1 = open, 0 = closed
        for a in actions:
            a[:, -1] = 1.0 - np.clip(a[:, -1], 0.0, 1.0)
    samples = []
    for a, ep in zip(actions, eps):
        for t in range(len(a)):
            steps = np.arange(t, t + H)
            last = np.minimum(steps, len(a) - 1)
            samples.append((a[last], steps >= len(a), ep.states[t], ep.images[t]))
    return samples, np.concatenate(actions), np.concatenate([ep.states for ep in eps])


def _normalised(x, all_x, quantiles: bool) -> torch.Tensor:
    x, all_x = np.float64(x), np.float64(all_x)
    if quantiles:
        lo, hi = np.quantile(all_x, 0.01, axis=0), np.quantile(all_x, 0.99, axis=0)
        return torch.tensor(2 * (x - lo) / (hi - lo) - 1)
    return torch.tensor((x - all_x.mean(0)) / (all_x.std(0) + 1e-8))


@pytest.mark.parametrize("kind", ["v2.1", "v3.0", "libero"])
@pytest.mark.parametrize("model", ["pi0-tiny", "pi05-tiny"])
def test_batches_against_a_hand_computation(datasets, kind, model, tmp_path):
    path, eps, image_tol = datasets[kind]
    run, dataset, collate = _run(model, path, tmp_path)
    samples, all_actions, all_states = _expected(eps, kind)
    assert len(dataset) == len(samples) == 6 + 7 + 8  # every step of the 3 episodes
    order = [0, 5, 12, 20, 0]  # episodes' last steps: 1, 1 and 1 real actions of 4
    mb = collate([dataset.read_in_epoch(i, int(r == 4)) for r, i in enumerate(order)])
    pi05 = model.startswith("pi05")
    assert mb["action_pad"].sum(1).tolist() == [0, 3, 3, 3, 0]
    for row, i in enumerate(order):
        actions, pad, state, frame = samples[i]
        assert mb["action_pad"][row].tolist() == pad.tolist()
        want = _normalised(actions, all_actions, pi05)  # (H, 7)
        torch.testing.assert_close(mb["actions"][row, :, :7].double(), want, **TOL)
        assert (mb["actions"][row, :, 7:] == 0).all()  # padded to max_action_dim 8
        want = _normalised(state, all_states, pi05)
        d = len(want)
        torch.testing.assert_close(mb["state"][row, :d].double(), want, **TOL)
        assert (mb["state"][row, d:] == 0).all()
        x = torch.from_numpy(frame).permute(2, 0, 1).float()[None] / 255  # (1, 3, 12, 16)
        inner = F.interpolate(x, size=(24, 32), mode="bilinear", align_corners=False)[0]
        assert (mb["images"][row, 0, :, :4] == -1).all() and (
            mb["images"][row, 0, :, 28:] == -1
        ).all()
        err = (mb["images"][row, 0, :, 4:28] - (inner * 2 - 1)).abs().max().item()
        assert err <= 2 * image_tol / 255 + 1e-6, err
    assert mb["image_masks"].all() and mb["action_dim"] == 7
    assert not torch.equal(mb["noise"][0], mb["noise"][4])  # sample 0 in the next epoch
    _, again, collate = _run(model, path, tmp_path)
    torch.testing.assert_close(collate([again[0]])["noise"][0], mb["noise"][0])


def test_processor_files_round_trip_and_feed_training(datasets, tmp_path):
    path = datasets["v3.0"][0]
    for variant, step in (("pi0", 5), ("pi05", 2)):
        _, dataset, _ = _run(f"{variant}-tiny", path, tmp_path / "out")
        entry = next(iter(dataset.statistics.values()))
        first, second = tmp_path / f"{variant}-a", tmp_path / f"{variant}-b"
        save_policy(tiny_model(variant), first, statistics=entry)
        state = first / f"policy_preprocessor_step_{step}_normalizer_processor.safetensors"
        assert state.is_file()
        assert (first / "policy_postprocessor_step_0_unnormalizer_processor.safetensors").is_file()
        read = read_statistics(first)
        for what in ("action", "proprio"):
            for stat in ("mean", "std", "q01", "q99", "min", "max"):
                assert read[what][stat] == entry[what][stat], (what, stat)
        policy = load_policy(first)
        assert policy.statistics == read  # what predict_action_chunk unnormalises by
        save_policy(policy, second)
        names = sorted(p.name for p in first.iterdir())
        assert names == sorted(p.name for p in second.iterdir())
        for name in names:
            assert (first / name).read_bytes() == (second / name).read_bytes(), name
        # --model FOLDER: its processor statistics normalise the data
        shifted = {**entry, "action": {**entry["action"], "mean": [1.0] * 7}}
        save_policy(policy, tmp_path / f"{variant}-c", statistics=shifted)
        _, data, _ = _run(None, path, tmp_path / "out2", checkpoint=str(tmp_path / f"{variant}-c"))
        assert next(iter(data.statistics.values()))["action"]["mean"] == [1.0] * 7


def test_trainer_run_on_a_lerobot_folder_exports_its_statistics(datasets, tmp_path, capsys):
    path = datasets["v2.1"][0]
    out = tmp_path / "run"
    args = ["--model", "pi0-tiny", "--data", str(path), "--out", str(out), "--steps", "2"]
    args += ["--global-batch-size", "4", "--micro-batch-size", "2", "--export-hf"]
    args += ["--workers", "0"]
    status, _, err = single(capsys, *args)
    assert status == 0, err
    losses = [m["loss"] for m in metrics(out) if "loss" in m]
    assert len(losses) == 2 and np.isfinite(losses).all()
    stats = read_statistics(out / "hf")
    _, all_actions, _ = _expected(datasets["v2.1"][1], "v2.1")
    np.testing.assert_allclose(stats["action"]["mean"], all_actions.mean(0), rtol=1e-5)
    raw = json.loads((out / "hf" / "config.json").read_text())  # the data's widths
    assert raw["output_features"]["action"] == {"type": "ACTION", "shape": [7]}
    state = len(stats["proprio"]["mean"])
    assert raw["input_features"]["observation.state"] == {"type": "STATE", "shape": [state]}


def test_camera_slots_absent_and_extra_cameras(datasets):
    """A LeRobot dataset's cameras fill the slots in order (an ``extra`` key too); slots the
    data leaves empty are absent cameras."""
    path, eps, _ = datasets["v3.0"]
    config = replace(Pi0Config.preset("pi0-tiny"), num_cameras=3)
    stats = None
    for keys, want in (
        (lerobot_cameras(path, 3), ["primary", "wrist"]),
        (lerobot_cameras(path, 1), ["primary"]),
        (
            KeyConfig(
                extra="observation.images.wrist", state="observation.state", instruction=None
            ),
            ["primary", "extra0"],
        ),
    ):
        samples = RobotSamples(open_source(DataSpec(str(path), "lerobot", config=keys)), config)
        assert samples.cameras == want
        sample = samples[1]
        assert np.array_equal(sample["image"], eps[0].images[1])
        if len(want) > 1:  # the second camera, whichever key names it
            assert np.array_equal(sample["wrist_image"], eps[0].wrist[1])
        stats = stats or next(iter(samples.statistics.values()))
        mb = Pi0Batches(config, stats, 0)([sample])
        assert mb["image_masks"][0].tolist() == [True] * len(want) + [False] * (3 - len(want))
        assert (mb["images"][0, len(want) :] == -1).all()


def test_a_samples_visit_is_its_epoch_whatever_the_dp_rank_or_a_resume():
    """The flow-matching draws are keyed by (seed, index, visit): the visit is the epoch of the
    data order, the same for every dp split and after a resume mid-epoch."""
    from parallax.data.loader import BatchLoader
    from parallax.families.pi0.config import PRESETS
    from parallax.families.pi0.data import IndexedSamples, synthetic_task

    data = IndexedSamples(synthetic_task(PRESETS["pi0-tiny"], seed=0, num_episodes=2))  # 10
    kw = dict(global_batch_size=4, micro_batch_size=2, seed=3)

    def keys(loader, steps):
        return [(s["index"], s["visit"]) for _ in range(steps) for mb in loader.next_batch()
                for s in mb]  # fmt: skip

    whole = keys(BatchLoader(data, **kw), 6)  # 2 steps an epoch (the tail dropped): 3 epochs
    assert {v for _, v in whole} == {0, 1, 2} and whole[4:8] != whole[:4]
    split = [BatchLoader(data, dp_rank=r, dp_size=2, **kw) for r in range(2)]
    by_rank = [keys(loader, 6) for loader in split]
    assert [k for s in range(6) for r in range(2) for k in by_rank[r][2 * s : 2 * s + 2]] == whole
    first = BatchLoader(data, **kw)
    keys(first, 3)
    resumed = BatchLoader(data, **kw)
    resumed.load_state_dict(first.state_dict())
    assert keys(resumed, 3) == whole[12:]
