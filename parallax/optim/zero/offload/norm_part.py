"""What an offloaded optimizer's buckets add to the global gradient norm, from the shares their
last passes took on the device (:meth:`~parallax.optim.zero.offload.accumulators.Accumulators.add`)
or, for the inf-norm, from the sums where they are held."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch

from parallax.optim.zero.offload.accumulators import Accumulators


def local_part(
    norm_type: float,
    partials: Mapping[int, float | torch.Tensor],
    sums: Accumulators,
    pieces: Callable[[int], list[slice]],
    dp: int,
) -> float:
    """The sum of the squares (2-norm; ``partials``: bucket -> its dp sum's squares, a device
    scalar or 0.0) or the largest element (inf-norm, of each bucket's counted ``pieces``) of this
    rank's offloaded gradients, averaged over ``dp``."""
    if norm_type not in (2.0, math.inf):
        raise NotImplementedError(
            f"with --offload optimizer the gradient norm is the 2- or inf-norm, not {norm_type}"
        )
    if norm_type == math.inf:
        return max(
            (float(sums.view(b)[p].abs().max()) / dp for b in partials for p in pieces(b)),
            default=0.0,
        )
    sums.settle()  # (the squares were made beside the adds)
    made = [v.to(sums.device, torch.float64) for v in partials.values() if torch.is_tensor(v)]
    total = sum(v for v in partials.values() if not torch.is_tensor(v))
    total += float(torch.stack(made).sum()) if made else 0.0
    return total / dp**2  # the dp sum's squares: the average's
