"""OpenVLA's image augmentation against a plain per-pixel reference (TensorFlow's
crop_and_resize formula, Python's colorsys for HSV), and its seeding."""

import colorsys

import numpy as np
import pytest

from parallax.data.augment import (
    AugmentConfig,
    Draw,
    augment,
    augment_float,
    center_crop,
    draw,
    sample_generator,
)


def _crop_and_resize(img, box, out_h, out_w):
    """TensorFlow's crop_and_resize (bilinear) for one image, pixel by pixel."""
    h, w, _ = img.shape
    y0, x0, y1, x1 = box
    out = np.zeros((out_h, out_w, 3))
    for i in range(out_h):
        y = y0 * (h - 1) + i * (y1 - y0) * (h - 1) / (out_h - 1)
        top, frac_y = int(np.floor(y)), y - np.floor(y)
        bottom = min(top + 1, h - 1)
        for j in range(out_w):
            x = x0 * (w - 1) + j * (x1 - x0) * (w - 1) / (out_w - 1)
            left, frac_x = int(np.floor(x)), x - np.floor(x)
            right = min(left + 1, w - 1)
            t = img[top, left] + (img[top, right] - img[top, left]) * frac_x
            b = img[bottom, left] + (img[bottom, right] - img[bottom, left]) * frac_x
            out[i, j] = t + (b - t) * frac_y
    return out


def _reference(image, d: Draw):
    """dlimp's augment: floats in [0, 1], each op then a clip, as five separate steps."""
    x = image.astype(np.float64) / 255.0
    x = np.clip(_crop_and_resize(x, d.box, *image.shape[:2]), 0, 1)
    x = np.clip(x + d.brightness, 0, 1)
    mean = x.mean(axis=(0, 1))
    x = np.clip((x - mean) * d.contrast + mean, 0, 1)
    for step in ("saturation", "hue"):
        out = np.empty_like(x)
        for i, j in np.ndindex(*x.shape[:2]):
            hh, ss, vv = colorsys.rgb_to_hsv(*x[i, j])
            if step == "saturation":
                ss = min(max(ss * d.saturation, 0.0), 1.0)
            else:
                hh = (hh + d.hue) % 1.0
            out[i, j] = colorsys.hsv_to_rgb(hh, ss, vv)
        x = np.clip(out, 0, 1)
    return x


def _image(seed=0, h=9, w=11):
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def test_augmentation_matches_the_plain_reference_on_a_fixed_crop():
    image = _image()
    d = Draw(box=(0.03, 0.02, 0.98, 0.97), brightness=0.1, contrast=1.15, saturation=0.85, hue=0.04)
    want = _reference(image, d)
    got = augment_float(image, d).permute(1, 2, 0).numpy()
    np.testing.assert_allclose(got, want, atol=2e-6)
    # uint8 by truncation as dlimp casts; a float rounding may cross an integer: 1 level
    diff = np.abs(augment(image, d).astype(int) - np.floor(want * 255).astype(int))
    assert diff.max() <= 1 and (diff > 0).mean() < 0.02


def test_center_crop_is_the_evaluation_crop():
    image = _image(1, 12, 12)
    side = np.sqrt(0.9)
    box = ((1 - side) / 2,) * 2 + ((1 + side) / 2,) * 2
    want = np.clip(_crop_and_resize(image / 255.0, box, 12, 12), 0, 1)
    diff = np.abs(center_crop(image).astype(int) - np.floor(want * 255.5).astype(int))
    assert diff.max() <= 1 and (diff > 0).mean() < 0.02


def test_draws_are_seeded_by_seed_position_and_camera():
    a = draw(sample_generator(7, 1234), AugmentConfig())
    assert a == draw(sample_generator(7, 1234))
    others = [
        draw(sample_generator(8, 1234)),
        draw(sample_generator(7, 1235)),
        draw(sample_generator(7, 1234, "wrist")),
    ]
    assert all(o != a for o in others)
    for k in range(20):
        d = draw(sample_generator(0, k))
        y0, x0, y1, x1 = d.box
        assert (y1 - y0) * (x1 - x0) == pytest.approx(0.9) and y1 - y0 == pytest.approx(x1 - x0)
        assert y0 >= 0 and y1 <= 1 + 1e-12 and x0 >= 0 and x1 <= 1 + 1e-12
        assert abs(d.brightness) <= 0.2 and 0.8 <= d.contrast <= 1.2
        assert 0.8 <= d.saturation <= 1.2 and abs(d.hue) <= 0.05
    image = _image(2)
    assert np.array_equal(augment(image, a), augment(image, a))
