"""Image preprocessing for OpenVLA without PIL: resize, two normalisations, six channels.

OpenVLA's processor resizes the RGB image to the towers' size with PIL bicubic + antialias
(aspect ratio not kept), scales to [0, 1], normalises once per tower (ImageNet statistics for
DINOv2, 0.5 / 0.5 for SigLIP) and stacks the two results into ``(6, H, W)``. Here the resize is
``F.interpolate(mode="bicubic", antialias=True)``, which follows PIL's filter closely; uint8
inputs are rounded back to uint8 after resizing as PIL does.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F


def _as_chw_float(image) -> tuple[torch.Tensor, bool]:
    """``(3, H, W)`` float32 on a 0..255 scale for uint8 input or 0..1 for float input."""
    if hasattr(image, "convert") and not isinstance(image, (np.ndarray, torch.Tensor)):
        image = np.asarray(image.convert("RGB"))  # a PIL image, if the caller has PIL
    t = torch.as_tensor(np.asarray(image) if not isinstance(image, torch.Tensor) else image)
    if t.dtype == torch.uint8:
        if t.dim() != 3 or t.shape[-1] != 3:
            raise ValueError(f"uint8 images must be (H, W, 3), got {tuple(t.shape)}")
        return t.permute(2, 0, 1).float(), True
    if not t.is_floating_point() or t.dim() != 3 or t.shape[0] != 3:
        raise ValueError(
            f"images must be uint8 (H, W, 3) or float (3, H, W) in [0, 1], got {t.dtype} "
            f"{tuple(t.shape)}"
        )
    return t.float(), False


def preprocess_image(
    image,
    image_size: int,
    means: Sequence[Sequence[float]],
    stds: Sequence[Sequence[float]],
) -> torch.Tensor:
    """One image -> ``(3 * len(means), image_size, image_size)`` float32 pixel values."""
    x, is_uint8 = _as_chw_float(image)
    if tuple(x.shape[1:]) != (image_size, image_size):
        x = F.interpolate(
            x[None],
            size=(image_size, image_size),
            mode="bicubic",
            antialias=True,
            align_corners=False,
        )[0]  # (3, S, S)
        x = x.round().clamp(0, 255) if is_uint8 else x.clamp(0, 1)
    if is_uint8:
        x = x / 255.0
    out = []
    for mean, std in zip(means, stds):
        m = torch.tensor(mean, dtype=torch.float32).view(3, 1, 1)
        s = torch.tensor(std, dtype=torch.float32).view(3, 1, 1)
        out.append((x - m) / s)
    return torch.cat(out, dim=0)  # (6, S, S)


def pixel_values(images, config) -> torch.Tensor:
    """A batch ``(b, 6, S, S)`` for an :class:`~parallax.models.OpenVLAConfig` from one image or
    a list of images."""
    if isinstance(images, (list, tuple)):
        return torch.stack([pixel_values(i, config)[0] for i in images])
    px = preprocess_image(images, config.image_size, config.image_mean, config.image_std)
    return px[None]
