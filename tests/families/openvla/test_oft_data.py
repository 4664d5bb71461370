"""OpenVLA-OFT's data: LIBERO HDF5 and RLDS episodes give the wrist image and the state beside
the primary image, and chunks of the next K actions by OFT's rule (a T-step episode gives its
first T - K + 1 steps; the clamp to the last action); the key config decides the cameras and
the proprio token; the synthetic task's OFT form; one ``--action-head l1`` run on RLDS."""

import json

import numpy as np
import pytest
import torch

from benchmarks.data.writers import make_episodes, write_libero, write_rlds
from parallax.data import SyntheticTask
from parallax.data.chunks import action_chunk, chunk_lengths
from parallax.data.mixture import load_mixture
from parallax.data.stats import DatasetError
from parallax.data.stream import StreamLoader

pytest.importorskip("crc32c")
LENGTHS = [3, 5, 6, 8]
K = 4


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("oft")
    episodes = make_episodes(4, size=8, lengths=LENGTHS)
    return {
        "episodes": episodes,
        "rlds": write_rlds(root, "arm_rlds", episodes, "png", shards=1),
        "libero": write_libero(root / "libero_arm", {"task": episodes}),
    }


def test_chunk_rule_is_ofts():
    assert chunk_lengths(LENGTHS, K).tolist() == [0, 2, 3, 5]
    assert chunk_lengths(LENGTHS, 1).tolist() == LENGTHS
    actions = np.arange(10, dtype=np.float32).reshape(5, 2)
    assert action_chunk(actions, 1, 4).tolist() == actions[1:5].tolist()
    assert action_chunk(actions, 3, 4)[:, 0].tolist() == [6, 8, 8, 8]  # the last one repeated


def _epoch(spec: str, **kw):
    mix = load_mixture(spec)
    loader = StreamLoader(
        mix, global_batch_size=10, micro_batch_size=5, seed=1, chunk=K,
        cameras=("primary", "wrist"), state=True, **kw,
    )  # fmt: skip
    samples = [s for mb in loader.next_batch() for s in mb]
    loader.close()
    return mix, samples


@pytest.mark.parametrize("fmt", ["rlds", "libero"])
def test_readers_give_wrist_state_and_chunks(data, fmt):
    mix, samples = _epoch(f"{fmt}:{data[fmt]}")
    seen = sorted((s["episode"], s["step"]) for s in samples)
    assert seen == [(e, t) for e, n in enumerate(LENGTHS) for t in range(n - K + 1)]
    for s in samples:
        ep = data["episodes"][s["episode"]]
        t = s["step"]
        want = ep.actions[t : t + K].copy()
        if fmt == "libero":  # its config's gripper: clipped to [0, 1] and inverted
            want[:, -1] = 1.0 - np.clip(want[:, -1], 0.0, 1.0)
        assert s["actions"].shape == (K, 7)
        np.testing.assert_allclose(s["actions"].numpy(), want, rtol=1e-6)
        np.testing.assert_array_equal(s["action"].numpy(), want[0])
        assert torch.equal(s["wrist_image"], torch.from_numpy(ep.wrist[t]))  # upright again
        assert torch.equal(s["image"], torch.from_numpy(ep.images[t]))
        np.testing.assert_allclose(s["state"].numpy(), ep.states[t], rtol=1e-6)
    from parallax.families.openvla.oft.data import data_shape

    assert tuple(vars(data_shape(mix)).values()) == (7, 8, 2)
    assert "proprio" in next(iter(mix.statistics.values()))


def test_key_config_decides_cameras_and_proprio(data, tmp_path):
    from parallax.data.keys import load_key_configs
    from parallax.families.openvla.oft.data import data_shape

    toml = tmp_path / "keys.toml"
    toml.write_text('[arm_rlds]\nformat = "rlds"\nprimary = "observation/image"\nstate = []\n')
    mix = load_mixture(f"rlds:{data['rlds']}", user_configs=load_key_configs(toml))
    assert tuple(vars(data_shape(mix)).values()) == (7, 0, 1)  # no wrist named, no state


def test_too_short_episodes_are_refused(data):
    mix = load_mixture(f"rlds:{data['rlds']}")
    with pytest.raises(DatasetError, match="no episode has 9 steps"):
        StreamLoader(mix, global_batch_size=2, micro_batch_size=2, chunk=9)


def test_synthetic_oft_form():
    base = SyntheticTask(num_episodes=3, episode_length=6, image_size=16)
    task = SyntheticTask(base.config, wrist_image=True, state=True, chunk=4, camera="static")
    assert len(task) == 3 * 3 and set(base[0]) == {"image", "instruction", "action"}
    s = task[4]  # episode 1, step 1
    scene = task.scene(1)
    np.testing.assert_array_equal(s["actions"].numpy(), scene.actions[1:5])
    np.testing.assert_array_equal(s["state"].numpy(), scene.gripper[1].astype(np.float32))
    assert not torch.equal(s["image"], s["wrist_image"])  # static and wrist views
    wrist = base.render(scene, 1, 1).float()  # the wrist camera's view, its own noise apart
    assert (s["wrist_image"].float() - wrist).abs().mean() < 6  # the noise is +-6
    assert (s["image"].float() - wrist).abs().mean() > 12
    assert "proprio" in task.statistics[task.name]
    with pytest.raises(ValueError, match="chunk <= episode_length"):
        SyntheticTask(episode_length=3, chunk=4)


def test_an_oft_run_on_rlds(data, tmp_path):
    from parallax import ParallelContext
    from parallax.train import parse_args
    from parallax.train.cli import resolve_run, run

    out = tmp_path / "run"
    flags = ["--data", f"rlds:{data['rlds']}", "--action-head", "l1", "--action-chunk", str(K)]
    flags += ["--steps", "2", "--global-batch-size", "2", "--micro-batch-size", "2"]
    flags += ["--out", str(out), "--workers", "0", "--save-interval", "2", "--log-interval", "1"]
    run(resolve_run(parse_args(flags)), ParallelContext.local())
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["loss"] > 0 for r in rows)
    meta = json.loads(next((out / "checkpoints").glob("step_*/meta.json")).read_text())
    assert meta["model_config"]["parallax_oft"] == {
        "chunk": K, "action_dim": 7, "proprio_dim": 8, "num_images": 2,
        "film": False, "head_blocks": 2,
    }  # fmt: skip
