"""The synthetic task: deterministic from the seed, consistent with its images, learnable."""

import re

import numpy as np
import pytest
import torch
from torch import nn

from parallax.data import SyntheticTask, collate
from parallax.data.synthetic import COLOURS, SHAPES, expert_action

INSTRUCTION = re.compile(rf"^(pick up|move to) the ({'|'.join(COLOURS)}) ({'|'.join(SHAPES)})$")


def _equal(a, b):
    return (
        torch.equal(a["image"], b["image"])
        and torch.equal(a["action"], b["action"])
        and a["instruction"] == b["instruction"]
    )


def test_same_seed_same_samples_and_statistics():
    a, b = SyntheticTask(seed=3, num_episodes=50), SyntheticTask(seed=3, num_episodes=50)
    order = [7, 0, 249, 7, 120]
    first = [a[i] for i in order]
    assert all(_equal(x, b[i]) for x, i in zip(first, reversed(order[::-1])))
    assert _equal(first[0], first[3])  # access order does not matter
    assert a.statistics == b.statistics
    c = SyntheticTask(seed=4, num_episodes=50)
    assert not torch.equal(a[7]["image"], c[7]["image"])
    assert a.statistics != c.statistics


def test_samples_and_statistics_layout():
    task = SyntheticTask(seed=0, num_episodes=40, image_size=32)
    assert len(task) == 40 * task.config.episode_length
    for i in range(0, len(task), 17):
        s = task[i]
        assert s["image"].shape == (32, 32, 3) and s["image"].dtype == torch.uint8
        assert s["action"].shape == (7,) and s["action"].dtype == torch.float32
        assert INSTRUCTION.match(s["instruction"]), s["instruction"]
        assert set(s["action"][:2].tolist()) <= {-1.0, -0.5, 0.0, 0.5, 1.0}
        assert s["action"][3:6].abs().sum() == 0 and s["action"][6] in (0.0, 1.0)
    ((name, entry),) = task.statistics.items()
    assert name == "parallax_synthetic"
    assert entry["action"]["mask"] == [True] * 6 + [False]
    for key in ("max", "mean", "min", "q01", "q99", "std"):
        assert len(entry["action"][key]) == 7 and entry["proprio"][key] == [0.0] * 7
    assert entry["action"]["q01"][:2] == [-1.0, -1.0] and entry["action"]["q99"][:2] == [1.0, 1.0]
    assert entry["num_trajectories"] == 40 and entry["num_transitions"] == len(task)
    with pytest.raises(ValueError, match="action_levels"):
        SyntheticTask(action_levels=4)


@pytest.mark.parametrize("camera", ["wrist", "static"])
def test_action_is_determined_by_image_and_instruction(camera):
    """A rule that reads only the pixels and the instruction recovers the expert's action:
    the target's box centre (its exact colour), the gripper (image centre for the wrist camera,
    the dark cross for the static one) and the verb. Misses come from pixel rounding at the
    quantisation boundaries."""
    task = SyntheticTask(seed=1, num_episodes=60, camera=camera)
    hits = 0
    for i in range(len(task)):
        s = task[i]
        img, size = s["image"].numpy().astype(int), task.config.image_size
        words = s["instruction"].split()
        colour = next(w for w in words if w in COLOURS)
        ys, xs = np.nonzero((img == np.array(COLOURS[colour])).all(-1))
        target = np.array([xs.min() + xs.max() + 1, ys.min() + ys.max() + 1]) / (2 * size)
        gripper = np.array([0.5, 0.5])
        if camera == "static":
            gy, gx = np.nonzero((img <= 25).all(-1))
            gripper = np.array([gx.min() + gx.max() + 1, gy.min() + gy.max() + 1]) / (2 * size)
        action = expert_action(gripper, target, words[0] == "pick", task.config)
        hits += np.array_equal(action, s["action"].numpy())
    assert hits / len(task) >= 0.9


WORDS = [*COLOURS, *SHAPES, "pick", "move"]


class _Probe(nn.Module):
    """Per-pixel colour features scored against the instruction's words, a softmax over pixels
    (where is the named object?), then an MLP from that place and the words to the action.
    Small, but it has to learn which colours the words mean and what the offset implies."""

    def __init__(self, size: int, hidden: int = 32) -> None:
        super().__init__()
        self.colour = nn.Sequential(
            nn.Conv2d(3, hidden, 1), nn.ReLU(), nn.Conv2d(hidden, hidden, 1)
        )
        self.words = nn.Linear(len(WORDS), hidden)
        self.norm = nn.BatchNorm1d(2)
        self.head = nn.Sequential(nn.Linear(2 + len(WORDS), 64), nn.ReLU(), nn.Linear(64, 12))
        grid = torch.linspace(-1, 1, size)
        self.register_buffer("coords", torch.stack(torch.meshgrid(grid, grid, indexing="xy")))

    def forward(self, image, words):
        score = (self.colour(image) * self.words(words)[:, :, None, None]).sum(1)  # (b, S, S)
        weight = score.flatten(1).softmax(1).view_as(score)  # (b, S, S)
        where = (weight[:, None] * self.coords).sum((-1, -2))  # (b, 2)
        return self.head(torch.cat([self.norm(where), words], 1))  # (b, 12)


def _encode(batch):
    image = batch["image"].permute(0, 3, 1, 2).float() / 255  # (b, 3, S, S)
    words = torch.tensor([[w in s.split() for w in WORDS] for s in batch["instruction"]])
    action = batch["action"]
    labels = torch.stack([(action[:, 0] * 2 + 2), (action[:, 1] * 2 + 2), -action[:, 2]], 1)
    return image, words.float(), labels.round().long()  # x, y in 5 classes; z descend or not


@torch.no_grad()
def _accuracy(probe, image, words, labels):
    probe.eval()
    out = probe(image, words)
    probe.train()
    pred = torch.stack([out[:, :5].argmax(1), out[:, 5:10].argmax(1), out[:, 10:].argmax(1)], 1)
    return (pred == labels).float().mean(0)  # (3,)


def test_a_small_model_learns_the_task_from_image_and_instruction():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: a second thread only adds overhead
    try:
        _learn()
    finally:
        torch.set_num_threads(threads)


def _learn():
    torch.manual_seed(0)
    train = SyntheticTask(seed=0, num_episodes=600, image_size=24)
    test = SyntheticTask(seed=1, num_episodes=100, image_size=24)
    image, words, labels = _encode(collate([train[i] for i in range(len(train))]))
    t_image, t_words, t_labels = _encode(collate([test[i] for i in range(len(test))]))
    probe = _Probe(24)
    opt = torch.optim.Adam(probe.parameters(), lr=1e-2)
    for _ in range(300):
        idx = torch.randint(0, len(image), (64,))
        out = probe(image[idx], words[idx])
        loss = sum(
            nn.functional.cross_entropy(out[:, a:b], labels[idx, k])
            for k, (a, b) in enumerate([(0, 5), (5, 10), (10, 12)])
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
    acc = _accuracy(probe, t_image, t_words, t_labels)
    majority = torch.stack(
        [(t_labels[:, k] == t_labels[:, k].mode().values).float().mean() for k in range(3)]
    )
    assert (acc[:2] > majority[:2] + 0.2).all(), (acc, majority)
    # The instruction matters: other episodes' instructions make the same images much worse.
    shuffled = _accuracy(probe, t_image, t_words.roll(37, 0), t_labels)
    assert (shuffled[:2] < acc[:2] - 0.2).all(), (shuffled, acc)
