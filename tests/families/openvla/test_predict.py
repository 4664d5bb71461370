"""Image preprocessing and greedy action prediction with and without the KV cache."""

import numpy as np
import torch
import torch.nn.functional as F

from parallax.families.openvla.action_tokenizer import unnormalize_actions
from parallax.families.openvla.model import OpenVLA
from parallax.families.openvla.predict import generate
from parallax.families.openvla.preprocess import pixel_values, preprocess_image
from parallax.families.openvla.prompt import prompt_ids
from tests.families.openvla.helpers import (
    NORM_STATS,
    SEED,
    assert_rel_close,
    greedy_margin,
    perturbed_init,
    tiny_config,
)

MEANS = ((0.485, 0.456, 0.406), (0.5, 0.5, 0.5))
STDS = ((0.229, 0.224, 0.225), (0.5, 0.5, 0.5))


def test_preprocess_normalises_twice_into_six_channels():
    img = np.random.default_rng(0).integers(0, 256, (56, 56, 3), dtype=np.uint8)
    px = preprocess_image(img, 56, MEANS, STDS)  # right size: no resize, like PIL's copy
    assert px.shape == (6, 56, 56) and px.dtype == torch.float32
    x = torch.from_numpy(img).permute(2, 0, 1).float() / 255
    for i, (m, s) in enumerate(zip(MEANS, STDS)):
        want = (x - torch.tensor(m).view(3, 1, 1)) / torch.tensor(s).view(3, 1, 1)
        assert_rel_close(px[3 * i : 3 * i + 3], want, rel=1e-6)
    # float (3, H, W) input in [0, 1] gives the same result
    assert_rel_close(preprocess_image(x, 56, MEANS, STDS), px, rel=1e-6)


def test_preprocess_resizes_bicubic_with_antialias_and_rounds_like_uint8():
    img = np.random.default_rng(1).integers(0, 256, (90, 120, 3), dtype=np.uint8)  # not square
    px = preprocess_image(img, 56, MEANS[1:], STDS[1:])
    x = torch.from_numpy(img).permute(2, 0, 1)[None].float()
    r = F.interpolate(x, size=(56, 56), mode="bicubic", antialias=True, align_corners=False)
    want = (r.round().clamp(0, 255)[0] / 255 - 0.5) / 0.5
    assert_rel_close(px, want, rel=1e-6)
    flat = np.full((90, 120, 3), 77, dtype=np.uint8)  # a constant image stays constant
    assert torch.allclose(
        preprocess_image(flat, 56, MEANS[1:], STDS[1:]), torch.tensor((77 / 255 - 0.5) / 0.5)
    )
    batch = pixel_values([img, img], tiny_config())
    assert batch.shape == (2, 6, 56, 56)


def test_predict_action_with_and_without_kv_cache():
    cfg = tiny_config()
    model = OpenVLA(cfg)
    model.init_weights(SEED, perturbed_init)
    img = np.random.default_rng(2).integers(0, 256, (64, 80, 3), dtype=np.uint8)
    ids = torch.tensor([prompt_ids(model.tokenizer, "pick up the red block")])
    px = pixel_values(img, cfg)
    cached = generate(model, px, ids, 7, use_cache=True)
    plain = generate(model, px, ids, 7, use_cache=False)
    # exact: the cached steps compute the same logits in another order (checked to 1e-5
    # below), so the tokens agree wherever no step is a near-tie
    assert greedy_margin(model, px, ids, plain) > 1e-3
    assert torch.equal(cached, plain)
    assert len(set(cached[0].tolist())) > 1  # the check is not vacuous: the tokens vary
    # the cached step logits equal a full recomputation
    from parallax.models.llama import KVCache

    lm, cache = model.language_model, KVCache()
    with torch.no_grad():
        lm.forward_layers(model.embed(px, ids), cache)
        x = lm.forward_layers(lm.embed(cached[:, :1]), cache, start=cache.length(0))
        full = model(px, torch.cat([ids, cached[:, :1]], 1))[:, -1]
        assert_rel_close(lm.head(x)[:, -1], full, msg="cached logits")

    action = model.predict_action(img, "pick up the red block", "toy_dataset")
    want = unnormalize_actions(
        model.action_tokenizer.decode(cached[0].numpy()), NORM_STATS["toy_dataset"]["action"]
    )
    np.testing.assert_allclose(action, want)
    uncached = model.predict_action(
        img, "pick up the red block", use_cache=False
    )  # one dataset: key optional
    np.testing.assert_allclose(uncached, want)
    from_ids = model.predict_action(img, input_ids=ids[0, :-1].tolist())  # the "▁" is appended
    np.testing.assert_allclose(from_ids, want)
