"""Image preprocessing for OpenVLA without PIL: resize, two normalisations, six channels.

OpenVLA's processor resizes the RGB image to the towers' size with PIL bicubic + antialias
(aspect ratio not kept), scales to [0, 1], normalises once per tower (ImageNet statistics for
DINOv2, 0.5 / 0.5 for SigLIP) and stacks the two results into ``(6, H, W)``. Here the resize is
``F.interpolate(mode="bicubic", antialias=True)``, which follows PIL's filter closely; uint8
inputs are rounded back to uint8 after resizing as PIL does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from parallax.models.images import as_chw_float


def preprocess_image(
    image,
    image_size: int,
    means: Sequence[Sequence[float]],
    stds: Sequence[Sequence[float]],
) -> torch.Tensor:
    """One image -> ``(3 * len(means), image_size, image_size)`` float32 pixel values."""
    x, is_uint8 = as_chw_float(image)
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
