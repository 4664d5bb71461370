"""Euler sampling over the cached prefix equals recomputing the whole prefix at every step
(both variants, float32), and the public ``predict_action_chunk`` takes one sample or a batch,
text or token ids."""

import pytest
import torch

from parallax.families.pi0.batches import Pi0Batches, normalize, unnormalize
from parallax.families.pi0.data import IndexedSamples, synthetic_task
from parallax.families.pi0.evaluate import held_out_error
from parallax.families.pi0.predict import predict_action_chunk, sample_chunk
from tests.families.pi0.helpers import inputs, tiny_model


@pytest.mark.parametrize("variant", ["pi0", "pi05"])
def test_the_prefix_cache_changes_nothing(variant):
    model = tiny_model(variant)
    x = inputs(model.config)
    args = [x[k] for k in ("images", "image_masks", "tokens", "token_mask", "state", "noise")]
    cached = sample_chunk(model, *args, num_steps=3)
    whole = sample_chunk(model, *args, num_steps=3, use_cache=False)
    torch.testing.assert_close(cached, whole, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(cached, x["noise"])  # it moved
    # one Euler step by hand: x + (-1) * v(noise, 1)
    v = model.velocity(*args[:5], x["noise"], torch.ones(2))
    one = sample_chunk(model, *args, num_steps=1)
    torch.testing.assert_close(one, x["noise"] - v.detach(), rtol=1e-5, atol=1e-5)

    # the public API: a batch of text prompts equals its samples one by one; ids work too
    cams = [list(x["images"][i]) for i in range(2)]
    state = torch.randn(2, model.config.max_state_dim)
    texts = ["pick up the cube", "open the drawer"]
    batch = predict_action_chunk(model, cams, texts, state, x["noise"], num_steps=2)
    for i in range(2):
        one = predict_action_chunk(model, cams[i], texts[i], state[i], x["noise"][i], num_steps=2)
        torch.testing.assert_close(one, batch[i], rtol=1e-5, atol=1e-5)
    ids = [[2, 50, 60, 70], [2, 80]]
    by_ids = predict_action_chunk(model, x["images"], ids, state, x["noise"], num_steps=2)
    assert by_ids.shape == (2, model.config.chunk, model.config.max_action_dim)


@pytest.mark.parametrize("variant", ["pi0", "pi05"])
def test_statistics_normalise_the_state_and_denormalise_the_actions(variant):
    model = tiny_model(variant)
    x = inputs(model.config)
    stats = {
        "action": {"mean": [0.5] * 6, "std": [2.0] * 6, "q01": [-3.0] * 6, "q99": [1.0] * 6},
        "proprio": {"mean": [1.0, 2.0], "std": [0.5, 4.0], "q01": [0.0, 0.0], "q99": [2.0, 8.0]},
    }
    raw = torch.tensor([1.5, 4.0])
    state = normalize(raw.numpy(), stats["proprio"], model.config.pi05)
    cams = list(x["images"][0])
    noise = x["noise"][0]
    plain = predict_action_chunk(model, cams, "open the drawer", state, noise, num_steps=2)
    real = predict_action_chunk(
        model, cams, "open the drawer", raw, noise, statistics=stats, num_steps=2
    )
    want = unnormalize(plain.numpy(), stats["action"], model.config.pi05)
    assert real.shape == (model.config.chunk, 6)
    torch.testing.assert_close(real, torch.from_numpy(want), rtol=1e-6, atol=1e-6)


def test_held_out_error_and_its_baseline():
    model = tiny_model("pi0")
    task = synthetic_task(model.config, seed=1, num_episodes=2)
    stats = next(iter(task.statistics.values()))
    data = IndexedSamples(task)
    result = held_out_error(model, data, stats, samples=4, batch=2, num_steps=2)
    mb = Pi0Batches(model.config, stats, 0)([data[i] for i in range(4)])
    mean = torch.tensor(normalize(stats["action"]["mean"], stats["action"], False)).float()
    base = ((mb["actions"][..., :7] - mean) ** 2).mean().item()
    assert result.samples == 4 and abs(result.mean_action - base) < 1e-6
    assert 0 < result.model < float("inf")
    per_dim = ((mb["actions"][..., :7] - mean) ** 2).mean((0, 1))  # (7,)
    torch.testing.assert_close(torch.tensor(result.mean_per_dim).float(), per_dim)
    assert abs(sum(result.model_per_dim) / 7 - result.model) < 1e-9
    rolled = held_out_error(model, data, stats, samples=4, batch=4, num_steps=2, roll="images")
    assert rolled.mean_action == result.mean_action and rolled.model != result.model
