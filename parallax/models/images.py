"""Images as tensors for any family's preprocessing: PIL, NumPy or torch in, one layout out."""

from __future__ import annotations

import numpy as np
import torch


def as_chw_float(image) -> tuple[torch.Tensor, bool]:
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
