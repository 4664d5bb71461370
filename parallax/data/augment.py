"""OpenVLA's training-time image augmentation, and its evaluation-time centre crop, in torch.

OpenVLA (through dlimp) turns a uint8 image into floats in [0, 1], applies, in this order,

1. a random resized crop: area ``scale`` = 0.9 of the image, aspect ``ratio`` 1, at a random
   place, resized back to the image's size (TensorFlow's ``crop_and_resize``, bilinear);
2. brightness: add ``delta`` ~ U(-0.2, 0.2);
3. contrast: ``(x - mean) * f + mean`` per channel, ``f`` ~ U(0.8, 1.2);
4. saturation: scale HSV saturation by ``f`` ~ U(0.8, 1.2) (clipped to [0, 1]);
5. hue: shift HSV hue by ``delta`` ~ U(-0.05, 0.05) (modulo 1);

clipping to [0, 1] after each, and truncates ``x * 255`` back to uint8. A model trained so is
evaluated on the centre crop of the same area, resized back (its converter rounds with
``x * 255.5``). Draws come from a generator seeded by ``(seed, global sample position,
camera)``: a resumed run, at any layout or worker count, sees the same crops. (dlimp feeds one
seed to every draw, so its crop offsets along y and x are equal and its jitters correlated;
these draws are independent, the distribution each one has is the same.)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from parallax.seeds import param_seed

ORDER = ("random_resized_crop", "brightness", "contrast", "saturation", "hue")


@dataclass(frozen=True)
class AugmentConfig:
    """The ranges OpenVLA's ``image_augment_kwargs`` use (its defaults)."""

    crop_scale: tuple[float, float] = (0.9, 0.9)
    crop_ratio: tuple[float, float] = (1.0, 1.0)
    brightness: float = 0.2
    contrast: tuple[float, float] = (0.8, 1.2)
    saturation: tuple[float, float] = (0.8, 1.2)
    hue: float = 0.05


@dataclass(frozen=True)
class Draw:
    """One image's random choices: the crop box (normalised y0, x0, y1, x1) and the jitters."""

    box: tuple[float, float, float, float]
    brightness: float
    contrast: float
    saturation: float
    hue: float


def _uniform(gen: torch.Generator, low: float, high: float) -> float:
    return float(low + (high - low) * torch.rand((), generator=gen, dtype=torch.float64))


def draw(gen: torch.Generator, cfg: AugmentConfig = AugmentConfig()) -> Draw:
    scale = _uniform(gen, *cfg.crop_scale)
    ratio = float(np.exp(_uniform(gen, *np.log(cfg.crop_ratio))))
    h = min(max(np.sqrt(scale / ratio), 0.0), 1.0)
    w = min(max(np.sqrt(scale * ratio), 0.0), 1.0)
    y0, x0 = _uniform(gen, 0.0, 1.0 - h), _uniform(gen, 0.0, 1.0 - w)
    return Draw(
        box=(y0, x0, y0 + h, x0 + w),
        brightness=_uniform(gen, -cfg.brightness, cfg.brightness),
        contrast=_uniform(gen, *cfg.contrast),
        saturation=_uniform(gen, *cfg.saturation),
        hue=_uniform(gen, -cfg.hue, cfg.hue),
    )


def sample_generator(seed: int, position: int, camera: str = "primary") -> torch.Generator:
    """The generator of global sample ``position``'s draws for one camera."""
    return torch.Generator().manual_seed(param_seed(seed, f"augment.{position}.{camera}"))


def crop_and_resize(x: torch.Tensor, box, size: tuple[int, int]) -> torch.Tensor:
    """TensorFlow's ``crop_and_resize`` of one (3, H, W) float image: output pixel ``i`` samples
    ``y0 * (H - 1) + i * (y1 - y0) * (H - 1) / (h - 1)`` bilinearly (zeros outside)."""
    _, height, width = x.shape
    y0, x0, y1, x1 = box
    out_h, out_w = size

    def axis(lo, hi, n, full):  # normalised [-1, 1] grid coordinates (align_corners=True)
        if n > 1:
            pix = lo * (full - 1) + torch.arange(n, dtype=torch.float64) * (hi - lo) * (
                full - 1
            ) / (n - 1)
        else:
            pix = torch.full((1,), 0.5 * (lo + hi) * (full - 1), dtype=torch.float64)
        return (2 * pix / max(full - 1, 1) - 1).to(torch.float32)

    gy, gx = axis(y0, y1, out_h, height), axis(x0, x1, out_w, width)
    grid = torch.stack(torch.meshgrid(gx, gy, indexing="xy"), dim=-1)  # (h, w, 2) as (x, y)
    out = F.grid_sample(
        x[None], grid[None], mode="bilinear", padding_mode="zeros", align_corners=True
    )
    return out[0]  # (3, h, w)


def rgb_to_hsv(x: torch.Tensor) -> torch.Tensor:
    """(3, H, W) RGB in [0, 1] -> HSV in [0, 1] (hue as TensorFlow's ``rgb_to_hsv``)."""
    r, g, b = x
    v, which = x.max(0)
    span = v - x.min(0).values
    s = torch.where(v > 0, span / v.clamp_min(1e-12), 0.0)
    safe = span.clamp_min(1e-12)  # where span == 0 the hue is 0 whatever this gives
    h = torch.where(
        which == 0, (g - b) / safe, torch.where(which == 1, (b - r) / safe + 2, (r - g) / safe + 4)
    )
    h = torch.where(span > 0, h / 6, 0.0) % 1.0
    return torch.stack([h, s, v])


def hsv_to_rgb(x: torch.Tensor) -> torch.Tensor:
    """HSV in [0, 1] -> RGB: channel ``n`` in (5, 3, 1) is ``v - v s clip(min(k, 4 - k), 0,
    1)`` with ``k = (n + 6 h) mod 6`` (the six-sector formula written once)."""
    h, s, v = x
    k = (torch.tensor([5.0, 3.0, 1.0])[:, None, None] + 6 * h) % 6  # (3, H, W)
    return v - v * s * torch.minimum(k, 4 - k).clamp(0, 1)


def jitter(x: torch.Tensor, d: Draw) -> torch.Tensor:
    """Steps 2-5 on a (3, H, W) float image in [0, 1], clipping after each. Saturation and hue
    share one HSV round trip: the RGB image between them is in [0, 1] already (its clip does
    nothing) and converting it back to HSV returns the same values, up to float rounding."""
    x = (x + d.brightness).clamp(0, 1)
    mean = x.mean(dim=(1, 2), keepdim=True)
    x = ((x - mean) * d.contrast + mean).clamp(0, 1)
    h, s, v = rgb_to_hsv(x)
    hsv = torch.stack([(h + d.hue) % 1.0, (s * d.saturation).clamp(0, 1), v])
    return hsv_to_rgb(hsv).clamp(0, 1)


def _to_float(image) -> torch.Tensor:
    image = np.asarray(image)
    image = torch.from_numpy(image if image.flags.writeable else image.copy())
    return image.permute(2, 0, 1).to(torch.float32) / 255.0  # (3, H, W)


def augment_float(image, d: Draw) -> torch.Tensor:
    """The augmented (3, H, W) float image in [0, 1] (before the uint8 conversion)."""
    x = _to_float(image)
    x = crop_and_resize(x, d.box, tuple(x.shape[1:])).clamp(0, 1)
    return jitter(x, d)


def augment(image, d: Draw) -> np.ndarray:
    """OpenVLA's training augmentation of one (H, W, 3) uint8 image with draws ``d``."""
    x = augment_float(image, d)
    return (x * 255).to(torch.uint8).permute(1, 2, 0).numpy()  # truncation, as dlimp casts


def center_crop(image, scale: float = 0.9) -> np.ndarray:
    """The evaluation-time crop: the central ``scale`` of the area, resized back."""
    x = _to_float(image)
    side = min(max(float(np.sqrt(scale)), 0.0), 1.0)
    lo = (1 - side) / 2
    x = crop_and_resize(x, (lo, lo, lo + side, lo + side), tuple(x.shape[1:])).clamp(0, 1)
    return (x * 255.5).to(torch.uint8).permute(1, 2, 0).numpy()


def resize(image: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """(H, W, 3) uint8 -> (h, w, 3) uint8, bilinear with antialiasing (OpenVLA resizes with
    TensorFlow's lanczos3; the two differ by a level or two on sharp edges)."""
    if tuple(image.shape[:2]) == tuple(size):
        return image
    image = np.ascontiguousarray(image)
    x = torch.from_numpy(image if image.flags.writeable else image.copy())
    x = x.permute(2, 0, 1)[None].float()
    x = F.interpolate(x, size=size, mode="bilinear", antialias=True, align_corners=False)
    return x[0].round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()
