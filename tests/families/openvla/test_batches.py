"""Raw samples -> training tensors at any action dimension, and a mismatched model refused."""

import dataclasses

import numpy as np
import pytest
import torch

from parallax.data.stats import compute_statistics
from parallax.families.openvla.batches import BatchBuilder
from parallax.families.openvla.config import OpenVLAConfig
from parallax.families.openvla.model import OpenVLA
from parallax.families.openvla.prompt import TinyTokenizer
from parallax.models.tokenizer import IGNORE_INDEX


def _samples(dim: int, n: int = 3) -> tuple[list[dict], dict]:
    rng = np.random.default_rng(dim)
    actions = rng.uniform(-2, 2, (n, dim)).astype(np.float32)
    samples = [
        {
            "image": torch.from_numpy(rng.integers(0, 256, (56, 56, 3), dtype=np.uint8)),
            "instruction": "wave",
            "action": torch.from_numpy(actions[i]),
        }
        for i in range(n)
    ]
    return samples, compute_statistics(actions, 1, f"robot{dim}")


@pytest.mark.parametrize("dim", [1, 6, 7, 9])
def test_a_preset_trains_on_actions_of_any_dimension(dim):
    samples, stats = _samples(dim)
    config = OpenVLAConfig.preset("tiny")
    batch = BatchBuilder(config, stats, TinyTokenizer())(samples)
    labelled = batch["labels"] != IGNORE_INDEX
    assert labelled.sum(1).tolist() == [dim + 1] * len(samples)  # D action tokens and EOS
    ids = batch["input_ids"][labelled].view(len(samples), dim + 1)
    assert (ids[:, :dim] >= 256).all() and (ids[:, dim] == TinyTokenizer.eos_id).all()


def test_predict_action_emits_the_dimension_of_the_statistics():
    samples, stats = _samples(6)
    config = dataclasses.replace(OpenVLAConfig.preset("tiny"), norm_stats=stats)
    action = OpenVLA(config, seed=0).predict_action(samples[0]["image"], "wave")
    assert action.shape == (6,)


def test_a_checkpoint_of_another_action_dimension_is_refused():
    _, stats7 = _samples(7)
    samples, stats6 = _samples(6)
    config = dataclasses.replace(
        OpenVLAConfig.preset("tiny"), norm_stats=stats7, source="ckpt/openvla-robot7"
    )
    with pytest.raises(ValueError) as err:
        BatchBuilder(config, stats6, TinyTokenizer())
    message = str(err.value)
    for part in ("'robot6' has 6-dimensional", "ckpt/openvla-robot7", "7-dimensional", "robot7"):
        assert part in message, message
    both = dataclasses.replace(config, norm_stats={**stats7, **stats6})  # one entry fits
    assert BatchBuilder(both, stats6, TinyTokenizer())(samples)["labels"].shape[0] == 3
