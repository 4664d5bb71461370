"""AnyRes geometry: tile and token counts against the published table and an independent
restatement of transformers' rules, and the processor's tiles against the canvas they come from."""

import pytest
import torch

from parallax.families.llava_next import anyres
from parallax.families.llava_next.config import LlavaNextConfig
from parallax.families.llava_next.processor import LlavaNextProcessor
from tests.families.llava_next.helpers import ref_best_canvas, ref_unpad, tiny_config

# (W x H) -> (tiles, image tokens) for LLaVA-v1.6 (../shared/models.md 1.2, matched by HF)
PUBLISHED = {
    (336, 336): (3, 1176),
    (224, 224): (3, 1176),
    (640, 480): (5, 2340),
    (800, 600): (5, 2340),
    (1024, 768): (5, 2340),
    (480, 640): (5, 2352),
    (1024, 899): (5, 2634),
    (1280, 720): (5, 1948),
    (1920, 1080): (5, 1948),
    (1024, 1024): (5, 2928),
    (672, 672): (5, 2928),
    (1008, 336): (4, 2328),
    (2000, 100): (4, 868),
}


def _plain_count(size, cfg):
    """Tiles and tokens by building the feature map and cropping it as transformers does."""
    ph, pw = ref_best_canvas(size, cfg.image_grid_pinpoints)
    gh, gw = ph // cfg.tile_size, pw // cfg.tile_size
    side = cfg.tile_side
    kept = ref_unpad(torch.zeros(1, gh * side, gw * side), size)
    return 1 + gh * gw, side * side + kept.shape[1] * (kept.shape[2] + 1)


def test_published_token_counts():
    cfg = LlavaNextConfig.preset("llava-v1.6-vicuna-7b")
    for (w, h), (tiles, tokens) in PUBLISHED.items():
        assert anyres.num_tiles((h, w), cfg.image_grid_pinpoints, 336) == tiles, (w, h)
        assert anyres.num_image_tokens((h, w), cfg.image_grid_pinpoints, 336, 24) == tokens, (w, h)
        assert _plain_count((h, w), cfg) == (tiles, tokens)
    assert cfg.max_tiles == 5 and cfg.max_image_tokens == 2928


@pytest.mark.parametrize("name", ["llava-tiny", "llava-v1.6-vicuna-7b"])
def test_counts_match_a_plain_restatement_over_many_sizes(name):
    cfg = LlavaNextConfig.preset(name)
    step = 1 if name == "llava-tiny" else 37
    top = 4 * cfg.tile_size
    for h in range(1, top, step):
        for w in range(1, top, step * 3 + 1):
            tiles, tokens = _plain_count((h, w), cfg)
            assert anyres.num_tiles((h, w), cfg.image_grid_pinpoints, cfg.tile_size) == tiles
            got = anyres.num_image_tokens(
                (h, w), cfg.image_grid_pinpoints, cfg.tile_size, cfg.tile_side
            )
            assert got == tokens, (h, w)
            assert tokens <= cfg.max_image_tokens and tiles <= cfg.max_tiles


def test_tiny_examples():
    cfg = tiny_config()
    # models.md 3.3: (H, W) = (30, 40) and (60, 20) give 5 and 4 tiles, 24 and 22 tokens
    assert _plain_count((30, 40), cfg) == (5, 24)
    assert _plain_count((60, 20), cfg) == (4, 22)


def test_processor_tiles_cut_the_centred_canvas():
    cfg = tiny_config()
    proc = LlavaNextProcessor(cfg)
    mean, std = (
        torch.tensor(cfg.image_mean).view(3, 1, 1),
        torch.tensor(cfg.image_std).view(3, 1, 1),
    )
    white, black = (1 - mean) / std, (0 - mean) / std
    for h, w in [(30, 40), (60, 20), (20, 80), (56, 56), (13, 50)]:
        image = torch.full((h, w, 3), 255, dtype=torch.uint8)
        tiles, size = proc.preprocess_image(image)
        assert size == (h, w)
        ph, pw = ref_best_canvas((h, w), cfg.image_grid_pinpoints)
        gh, gw = ph // 28, pw // 28
        assert tiles.shape == (1 + gh * gw, 3, 28, 28)
        assert torch.allclose(tiles[0], white.expand(3, 28, 28), atol=1e-5)  # the squashed base
        # the canvas from the tiles, row-major; the image is fitted (short side rounded up,
        # transformers' get_patch_output_size) and centred with the odd pixel after it
        canvas = tiles[1:].view(gh, gw, 3, 28, 28).permute(2, 0, 3, 1, 4).reshape(3, ph, pw)
        if pw / w < ph / h:
            nh, nw = min(-(-h * (pw / w) // 1), ph), pw
        else:
            nh, nw = ph, min(-(-w * (ph / h) // 1), pw)
        nh, nw = int(nh), int(nw)
        top, left = (ph - nh) // 2, (pw - nw) // 2
        inside = torch.zeros(ph, pw, dtype=torch.bool)
        inside[top : top + nh, left : left + nw] = True
        assert torch.allclose(
            canvas[:, inside], white.flatten(1).expand(3, int(inside.sum())), atol=1e-5
        )
        assert torch.allclose(
            canvas[:, ~inside], black.flatten(1).expand(3, int((~inside).sum())), atol=1e-5
        )
